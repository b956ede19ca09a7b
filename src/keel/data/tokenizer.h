// Tokenizer: text -> token ids -> bytes, for byte-level BPE tokenizers from tokenizer.json
// (hf_tokenizer_json.h) and tiktoken rank files (tiktoken.h); load_tokenizer() picks the format.
//
// Encoding runs the Hugging Face pipeline, which tiktoken's is a special case of:
//   1. added tokens (special tokens such as <|endoftext|>) are cut out of the text first and map
//      straight to their ids;
//   2. each remaining segment is normalized (NFC/NFKC/...), then cut into pieces by the
//      pre-tokenizer (regex splits);
//   3. each piece is encoded by byte-level BPE;
//   4. with add_special_tokens, the post-processor's template adds BOS/EOS around the ids.
// A Tokenizer is immutable once built: one instance encodes from any number of threads.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "keel/data/bpe.h"
#include "keel/data/control_strings.h"
#include "keel/data/pretokenizer.h"

namespace keel::data {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool normalized = false;   // matched in the normalized text rather than the raw text
  bool lstrip = false;       // also swallows the whitespace before it
  bool rstrip = false;       // also swallows the whitespace after it
  bool single_word = false;  // matched only when not inside a word
};

enum class NormalizationForm { nfc, nfd, nfkc, nfkd };

// One step of tokenizer.json's normalizer, applied to each stretch of text between added tokens.
struct NormalizerStep {
  enum class Kind {
    unicode,  // `form`
    prepend,  // `text` before a non-empty string (SentencePiece's leading "\u2581")
    replace,  // every `text` (or every match of `regex`) by `content` (" " -> "\u2581")
    strip,    // whitespace off the start (`left`) and the end (`right`)
    lowercase,
  };
  Kind kind = Kind::unicode;
  NormalizationForm form = NormalizationForm::nfc;
  std::string text, content;
  std::shared_ptr<const PretokenizerRegex> regex;  // replace with a Regex pattern
  bool left = false, right = false;
};

// One step of tokenizer.json's decoder chain, applied to the tokens' strings in order (Hugging
// Face's decode_chain). Byte-level tokenizers have none: their tokens are the bytes.
struct DecoderStep {
  enum class Kind {
    replace,        // every `text` by `content` in each token ("\u2581" -> " ")
    byte_fallback,  // runs of "<0xXX>" tokens -> their bytes (U+FFFD each when not valid UTF-8)
    fuse,           // all tokens into one
    strip,          // up to `start` leading and `stop` trailing `text` characters off each token
    metaspace,      // `text` -> ' ' in each token; in the first, dropped (`start` = 1: it was prepended)
    bpe_suffix,     // `text` (an end-of-word suffix) -> ' ' in each token, dropped in the last
    word_piece,     // a token after the first: leading `text` dropped, else ' ' before it; `start` = 1:
                    // then Hugging Face's cleanup (" ." -> ".", " n't" -> "n't", ...)
  };
  Kind kind = Kind::replace;
  std::string text, content;
  size_t start = 0, stop = 0;
};

// Hugging Face's SplitDelimiterBehavior: what happens to the matches of a split pattern.
enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

struct PreTokenizerStep {
  enum class Kind {
    split,         // cut each piece by `regex` (or `literal`), per `behavior` and `invert`
    prefix_space,  // ByteLevel's add_prefix_space: a piece not starting with ' ' gets one
    metaspace,     // SentencePiece's: ' ' -> `literal`, prepended per `prepend`, then split before it
  };
  enum class Prepend { always, first, never };  // metaspace: first = only at the start of the input
  Prepend prepend = Prepend::always;
  bool split_on_literal = true;  // metaspace: cut before each `literal`
  Kind kind = Kind::split;
  std::shared_ptr<const PretokenizerRegex> regex;
  std::string literal;  // used when regex is null
  SplitBehavior behavior = SplitBehavior::isolated;
  bool invert = false;
};

// Everything a loader gathers; the Tokenizer constructor checks it and builds the lookup tables.
struct TokenizerParts {
  std::string origin;  // the file it came from, for messages
  BytePairModel model;
  std::vector<AddedToken> added_tokens;
  std::vector<NormalizerStep> normalizers;  // applied in order
  std::vector<DecoderStep> decoders;        // empty: a token decodes to its bytes
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<int32_t> template_prefix;  // post-processor ids before the text (BOS)
  std::vector<int32_t> template_suffix;  // and after it (EOS)
  bool byte_level_names = false;         // token names use the byte-to-unicode spelling (tokenizer.json)
  std::optional<int32_t> bos_id;
  std::optional<int32_t> eos_id;
};

struct EncodeOptions {
  bool add_special_tokens = false;    // apply the post-processor template (BOS/EOS)
  bool split_special_tokens = false;  // treat special tokens in the text as plain text
  bool no_added_tokens = false;       // treat every added token (special or not) as plain text
};

class Tokenizer {
 public:
  explicit Tokenizer(TokenizerParts parts);

  // keel::Error when `text` is not valid UTF-8 (naming the byte offset).
  std::vector<int32_t> encode(std::string_view text, EncodeOptions options = {}) const;
  void encode(std::string_view text, std::vector<int32_t>& out, EncodeOptions options = {}) const;
  // As encode, and true when the ids appended spell `text` exactly: their token_surface()s, in
  // order, are its bytes (no normalizer changed one, no added token took whitespace, nothing in
  // the pipeline adds or rewrites bytes), so a token's offsets are the running sum of its
  // surfaces' lengths. False does not mean they do not, only that it is not known.
  bool encode_spelled(std::string_view text, std::vector<int32_t>& out, EncodeOptions options = {}) const;
  // The bytes the ids stand for (UTF-8 when the ids came from encode; a prefix of a token
  // sequence may end inside a character). keel::Error for an id outside the vocabulary.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // A token by its name: the content of an added token, else the vocabulary spelling
  // (byte-level for tokenizer.json, raw bytes for tiktoken files).
  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::string id_to_token(int32_t id) const;  // keel::Error for an unknown id
  int32_t vocab_size() const { return vocab_size_; }
  bool is_special(int32_t id) const;
  bool is_added(int32_t id) const { return added_token(id) != nullptr; }
  // The text a token stands for where it sits in the input, for mapping tokens back to input
  // offsets: an added token's content; a vocabulary token's bytes, with SentencePiece's "\u2581"
  // read as a space and "<0xXX>" as its byte (a byte of a character, alone, may be invalid UTF-8).
  // Points into the tokenizer, or into `scratch` when the spelling had to be rewritten.
  std::string_view token_surface(int32_t id, std::string& scratch) const {
    // Inline for the common case (asked for every token when mapping a conversation's offsets).
    if (surfaces_are_token_bytes() && !added_token(id)) return parts_.model.token_bytes(id);
    return rewritten_surface(id, scratch);
  }
  // An id's length in the text where the ids spell it (encode_spelled): an added token's content,
  // else the token's bytes. From a table over the model's ids, since mapping a conversation's
  // tokens to offsets asks it for each token (16 instructions a token against 25 asking
  // added_token() and the model); an id past them is an added token or nothing.
  size_t spelled_length(int32_t id) const {
    if (size_t(id) < spelled_lengths_.size()) return spelled_lengths_[size_t(id)];
    const AddedToken* t = added_token(id);
    return t ? t->content.size() : 0;
  }
  // Whether a vocabulary token's surface is its bytes as stored (no decoder rewrites spellings).
  bool surfaces_are_token_bytes() const { return parts_.decoders.empty(); }
  // The text after the normalizer's Unicode steps (NFC, NFKC, ...), the ones that move characters.
  std::string normalize_unicode(std::string_view text) const;
  std::optional<int32_t> bos_id() const { return parts_.bos_id; }
  std::optional<int32_t> eos_id() const { return parts_.eos_id; }
  // For loaders that learn BOS/EOS from a second file (tokenizer_config.json); before sharing.
  void set_bos_eos(std::optional<int32_t> bos, std::optional<int32_t> eos);
  const std::vector<AddedToken>& added_tokens() const { return parts_.added_tokens; }
  // The special added tokens' strings: what a conversation's own text is scanned for (they are
  // encoded there as text unless the recipe says otherwise).
  const ControlStrings& special_strings() const { return special_strings_; }
  const BytePairModel& model() const { return parts_.model; }
  const std::string& origin() const { return parts_.origin; }

 private:
  struct AddedMatch {
    size_t begin, end;  // bytes consumed from the text (with lstrip/rstrip whitespace)
    int32_t id;
  };
  std::optional<AddedMatch> find_added(std::string_view text, size_t from, bool normalized_pass,
                                       const EncodeOptions& options) const;
  // spelled (nullable): cleared when a byte of the text is not spelled as it is (encode_spelled).
  void encode_checked(std::string_view text, std::vector<int32_t>& out, const EncodeOptions& options,
                      bool* spelled) const;
  void encode_segment(std::string_view segment, bool normalized_pass, bool at_start, std::vector<int32_t>& out,
                      const EncodeOptions& options, bool* spelled) const;
  // at_start: `text` begins the input (Metaspace's prepend_scheme "first").
  void encode_normalized(std::string_view text, bool at_start, std::vector<int32_t>& out) const;
  std::string decode_chain(std::span<const int32_t> ids, bool skip_special_tokens) const;
  std::string_view rewritten_surface(int32_t id, std::string& scratch) const;  // token_surface's other cases
  // The added token with this id, or null.
  const AddedToken* added_token(int32_t id) const {
    const int64_t at = int64_t(id) - added_min_id_;
    if (at < 0 || at >= int64_t(added_by_id_.size()) || added_by_id_[size_t(at)] < 0) return nullptr;
    return &parts_.added_tokens[size_t(added_by_id_[size_t(at)])];
  }

  TokenizerParts parts_;
  ControlStrings special_strings_;
  int32_t vocab_size_ = 0;
  std::vector<uint32_t> spelled_lengths_;  // spelled_length() of the model's ids
  bool fast_split_ = false;  // pre-tokenizer is a single isolating regex: stream its pieces
  bool spells_as_is_ = false;  // nothing but the text itself can keep ids from spelling it
  // SentencePiece-style BPE without a pre-tokenizer (Llama 2, Gemma) sees each text as one piece.
  // A merge across the start of a word (a marker "\u2581" after other text) makes a token with the
  // marker inside; when the vocabulary has none but a few (Gemma 3 has ">\u2581</"), the piece may be
  // cut before each word except where one of those few spells the text across the cut: the same
  // ids, and BPE works on words (and its cache hits) instead of on whole documents.
  std::string word_marker_;
  struct InnerMarkerToken {
    std::string text;
    size_t marker_at;  // where a marker after other text starts in it
  };
  std::vector<InnerMarkerToken> inner_marker_tokens_;
  bool has_normalized_added_ = false;
  // Added tokens by first byte, longest first: leftmost-longest matching as Hugging Face does.
  std::vector<std::vector<uint32_t>> added_by_first_byte_;
  // Added tokens by id, a table over [added_min_id_, added_min_id_ + size): decoding and mapping
  // tokens to offsets ask for every token, and a hash lookup each was a tenth of a chat template's
  // encoding. Added ids are few and adjacent (the top of the vocabulary), so the table is small.
  int32_t added_min_id_ = 0;
  std::vector<int32_t> added_by_id_;  // index into added_tokens, -1: not an added token
  std::unordered_map<std::string, int32_t> added_by_content_;
};

// Loads a tokenizer from a tokenizer.json file, a tiktoken rank file (`pattern` names its
// pre-tokenizer; empty = inferred from the vocabulary size) or a model directory holding either
// (tokenizer.json preferred; tokenizer.model is GLM-4's tiktoken file).
Tokenizer load_tokenizer(const std::string& path, std::string_view pattern = {});

}  // namespace keel::data
