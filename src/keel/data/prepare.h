// keel prepare: JSONL records -> token ids + loss mask -> packed (or padded) sequences in shards.
//
// Tokenization is done once, in parallel, so training never waits for it. The pipeline streams:
//
//   reader thread ──chunks of lines──▶ N tokenizer workers ──results──▶ this thread: reorder,
//                                                                       pack, write shards
//
// At most a fixed number of chunks are in flight (read but not yet written), so memory is
// bounded by chunk size x in-flight chunks whatever the input size, and results are written in
// input order, so the shards do not depend on the thread count.
//
// Documents: a text record is its tokens with BOS/EOS as the tokenizer's post-processor adds them
// (EOS appended when it adds none), loss on every token; a conversation is rendered by the chat
// template segment by segment, loss on the assistant segments only (unless train_on_prompt);
// a pre-tokenized record keeps its ids and labels. A text document longer than max_seq_len is
// split, when packing, into max_seq_len-token chunks that overlap by one token (so every token
// but the first is predicted exactly once, as Hugging Face's group_texts chunking does); any
// other long document (a conversation, pre-tokenized ids, or any record when padding: one
// example per row) is truncated. Both are counted in the report. Packing is next-fit in input order: a document that does
// not fit in the open sequence closes it. Document boundaries are stored, so the loader restarts
// positions and keeps attention inside each document.
#pragma once
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "keel/data/chat_encoding.h"
#include "keel/data/chat_template.h"
#include "keel/data/record_reader.h"
#include "keel/data/shard_format.h"

namespace keel::data {

class Tokenizer;

struct PrepareOptions {
  bool live_progress = false;  // progress as one live line (a terminal) rather than periodic lines
  std::string data_path;       // .jsonl, .jsonl.gz or .jsonl.zst
  std::string tokenizer_path;  // tokenizer.json, tiktoken file or model directory; "" = pre-tokenized records only
  std::string out_dir;
  int64_t max_seq_len = 2048;
  Packing packing = Packing::pack;
  // auto (the model's own template, else a built-in chosen from the tokenizer's directory or tokens)
  // | model | glm4 | llama3 | chatml | none | a .jinja file
  std::string chat_template = "auto";
  int threads = 0;                     // tokenizer workers; 0 = all cores
  double max_bad_fraction = 0.01;      // more bad records than this fraction of all records fails prepare
  bool train_on_prompt = false;        // loss on every token of conversations, not only the assistant's
  // special-token strings inside messages are matched as the tokens (datasets written that way);
  // by default they are text, and only the template's markers are control tokens
  bool special_tokens_in_messages = false;
  int64_t vocab_size = 0;              // the model's vocabulary: checks ids, and a tokenizer is refused when larger
  int32_t pad_id = -1;                 // -1: the tokenizer's EOS, else 0
  int64_t shard_tokens = int64_t(1) << 26;  // a shard closes after this many tokens (256 MB of ids)
  size_t chunk_bytes = size_t(1) << 20;     // lines handed to a worker at a time
};

struct BadRecord {
  int64_t line;
  std::string reason;
};

struct PrepareReport {
  int64_t lines = 0;                  // lines read, blank ones included
  int64_t blank_lines = 0;            // skipped, counted
  int64_t records = 0;                // non-blank lines
  int64_t bad_records = 0;            // invalid JSON, missing fields, invalid UTF-8, ids out of range
  std::vector<BadRecord> bad_listed;  // the first kMaxListedBadRecords of them, by line number
  int64_t documents = 0;              // kept
  int64_t truncated_documents = 0, truncated_tokens = 0, split_documents = 0;
  int64_t no_target_documents = 0;  // skipped: nothing to learn (e.g. no assistant turn)
  // conversations whose own text held special-token strings (encoded as text, not as the tokens)
  int64_t records_with_special_strings = 0;
  int64_t first_special_string_line = 0;  // the first of them (0: none), and the string found there
  std::string first_special_string;
  int64_t sequences = 0, tokens = 0, shards = 0;
  int64_t input_bytes = 0;  // decompressed
  double seconds = 0;
  double fill() const;  // tokens / (sequences * max_seq_len)
  int64_t max_seq_len = 0;
  std::string chat_template;
};
inline constexpr size_t kMaxListedBadRecords = 10000;

std::string report_json(const PrepareReport& r);

// Runs prepare. Writes the shards, report.json and, last, manifest.json (a directory without a
// manifest is not prepared data). keel::Error when the bad fraction exceeds the threshold
// (report.json is still written, listing them), or on unreadable input or a failing disk.
PrepareReport prepare(const PrepareOptions& options, std::ostream* log = nullptr);

// A hash of the tokenizer files (tokenizer.json / tokenizer.model / tokenizer_config.json of a
// directory, or the file itself), so shards record which tokenizer made them.
std::string tokenizer_hash(const std::string& tokenizer_path);

// What a training recipe says about its data; resolve_training_data turns it into a prepared
// directory. data_path may already be one (returned as is after checks) or a JSONL file, prepared
// once into cache_dir/<hash of content and settings> and reused by later runs.
struct TrainingDataRequest {
  std::string data_path;
  std::string tokenizer_path;  // the model directory, or "" for pre-tokenized data
  int64_t max_seq_len = 2048;
  int64_t vocab_size = 0;  // the model's: shards with larger ids are refused
  Packing packing = Packing::pack;
  std::string chat_template = "auto";
  bool train_on_prompt = false;
  bool special_tokens_in_messages = false;
  std::string cache_dir;  // "" = <directory of data_path>/.keel-cache
  int threads = 0;
  double max_bad_fraction = 0.01;
  int32_t pad_id = -1;
};
std::string resolve_training_data(const TrainingDataRequest& request, std::ostream* log = nullptr);

// What training on `request`'s raw JSONL sees, independent of how the batches are made: a hash of
// the file's content and the settings the documents depend on (tokenizer, template, max_seq_len,
// packing, vocabulary, pad id). Prepared shards and on-the-fly tokenization of the same file give
// the same fingerprint, so a run may resume with either. data_path must be a file.
std::string training_data_fingerprint(const TrainingDataRequest& request);

// The tokenizer that raw records of a training run are encoded with: "" when `path` is a model
// directory without tokenizer files (a scratch or test model: the data must be pre-tokenized).
std::string training_tokenizer_path(const std::string& path);

// The chat template for `name` (glm4 | llama3 | chatml | auto | none): `auto` looks at the
// tokenizer's directory, then at its special tokens; nullopt when none applies.
// `why`, if given, receives how the choice was made, for the log.
std::optional<ChatFormat> chat_format_for(const std::string& name, const std::string& tokenizer_path,
                                          const Tokenizer* tokenizer, std::string* why = nullptr);

// Kept documents back to back, as encode() appends them.
struct EncodedDocuments {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> mask;           // 1: the token is a prediction target
  std::vector<int64_t> document_ends;  // end offset of each document in tokens
  int64_t truncated = 0, truncated_tokens = 0, no_target = 0, split = 0;
  int64_t special_string_records = 0;
  // The first record with special-token strings in its text, and the first such string.
  int64_t first_special_string_line = 0;
  std::string first_special_string;
  void count_special_string(int64_t line, const std::string& s) {
    if (special_string_records++ == 0) {
      first_special_string_line = line;
      first_special_string = s;
    }
  }
};

// One record -> its training document: what prepare writes for it, and what training with
// data_pipeline = "on_the_fly" tokenizes on the training thread (the same code, so the same ids
// and loss mask).
struct DocumentEncoder {
  const Tokenizer* tokenizer = nullptr;  // null: pre-tokenized records only
  std::optional<ChatFormat> format;      // a built-in template, or
  std::shared_ptr<const ChatTemplateEncoder> model_template;  // the model's own (Jinja) template
  int64_t max_seq_len = 0;
  int64_t vocab_size = 0;
  bool train_on_prompt = false;
  bool special_tokens_in_messages = false;  // set before choose_chat_template
  bool split_long_text = false;  // split (rather than truncate) text records longer than max_seq_len
  std::string data_path;

  // The parser for the records this encoder encodes (conversations read whole for a model's
  // own template).
  RecordParser record_parser() const { return RecordParser(model_template != nullptr); }

  // Why records of this kind cannot be encoded with this configuration at all (a text record
  // without a tokenizer, a chat record without a template): "" when they can.
  std::string configuration_error(const Record& r, int64_t line) const;
  // Appends the record as a document to `out` (truncated to max_seq_len, or split into several
  // with split_long_text), or nothing when no
  // token of it is a target (counted in out.no_target). Returns why the record is bad, or "".
  // A configuration error is set in `fatal` instead. `ids` is scratch.
  std::string encode(const Record& r, int64_t line, EncodedDocuments& out, std::vector<int32_t>& ids,
                     std::string& fatal) const;
};

// Chooses how `encoder` renders conversations for chat_template `name` (see PrepareOptions), with
// encoder.tokenizer set: sets encoder.format or encoder.model_template. Returns the name recorded
// in manifests and reports ("model:<checksum of the template>", "chatml", "none", ...); `why`
// receives where the template came from, for the log.
std::string choose_chat_template(DocumentEncoder& encoder, const std::string& name, const std::string& tokenizer_path,
                                 std::string* why = nullptr);

// What the prepared documents' cache key and fingerprint take from chat_template `name`: the name,
// and a template file's checksum (a model directory's template is in tokenizer_hash already).
std::string chat_template_key(const std::string& name);

}  // namespace keel::data
