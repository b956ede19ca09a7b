// keel prepare: record shapes and bad-record reasons, streamed line chunks (plain, gzip, zstd),
// packing and padding into shards, loss masks from chat templates, thread-count independence,
// and the bad-record threshold.
#include <gtest/gtest.h>
#include <zlib.h>
#include <zstd.h>

#include <fstream>

#include "keel/core/file_io.h"
#include "keel/data/bpe_trainer.h"
#include "keel/data/prepare.h"
#include "keel/data/record_reader.h"
#include "keel/data/shard_format.h"
#include "keel/data/tokenizer.h"
#include "test_support.h"

namespace keel::data {
namespace {

using keel::testing::expect_keel_error;
using keel::testing::TempDir;

TEST(RecordParser, ReadsEveryRecordShape) {
  RecordParser p;
  Record r;
  EXPECT_EQ(p.parse(R"({"text": "hello"})", r), "");
  EXPECT_EQ(r.kind, RecordKind::text);
  EXPECT_EQ(r.text, "hello");

  EXPECT_EQ(p.parse(R"({"system": "s", "prompt": "q", "response": "a"})", r), "");
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[2].role, "assistant");
  EXPECT_EQ(r.messages[2].content, "a");

  EXPECT_EQ(p.parse(R"({"instruction": "do", "input": "this", "output": "done"})", r), "");
  ASSERT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.messages[0].content, "do\n\nthis");

  EXPECT_EQ(p.parse(R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})", r),
            "");
  ASSERT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(p.parse(R"({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]})", r), "");
  ASSERT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.messages[0].role, "user");
  EXPECT_EQ(r.messages[1].role, "assistant");

  EXPECT_EQ(p.parse(R"({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]})", r), "");
  EXPECT_EQ(r.kind, RecordKind::tokens);
  EXPECT_EQ(r.labels[0], -100);
}

TEST(RecordParser, NamesWhyARecordIsBad) {
  RecordParser p;
  Record r;
  EXPECT_NE(p.parse("{not json", r).find("invalid JSON"), std::string::npos);
  EXPECT_EQ(p.parse("{\"text\": \"a\xff\"}", r), "invalid UTF-8");
  EXPECT_NE(p.parse(R"({"prompt": "q"})", r).find("missing field 'response'"), std::string::npos);
  EXPECT_NE(p.parse(R"({"text": 3})", r).find("not a string"), std::string::npos);
  EXPECT_NE(p.parse(R"({"messages": [{"role": "robot", "content": "x"}]})", r).find("unknown role"), std::string::npos);
  EXPECT_NE(p.parse(R"({"messages": []})", r).find("empty"), std::string::npos);
  EXPECT_NE(p.parse(R"({"input_ids": [1, -5]})", r).find("out of range"), std::string::npos);
  EXPECT_NE(p.parse(R"({"input_ids": [1, 2], "labels": [1]})", r).find("entries"), std::string::npos);
  EXPECT_NE(p.parse(R"({"other": 1})", r).find("no known fields"), std::string::npos);
  EXPECT_NE(p.parse(R"([1, 2])", r).find("not a JSON object"), std::string::npos);
}

std::string numbered_lines(int n) {
  std::string s;
  for (int i = 1; i <= n; ++i) s += fmt::format("line {} {}\n", i, std::string(size_t(i % 13) * 50, 'x'));
  return s;
}

std::vector<std::string> read_all_lines(const std::string& path, int64_t& first_mismatch) {
  LineChunkReader reader(path, 4096);
  LineChunk chunk;
  std::vector<std::string> lines;
  first_mismatch = -1;
  while (reader.next(chunk)) {
    if (chunk.first_line != int64_t(lines.size()) + 1 && first_mismatch < 0) first_mismatch = chunk.first_line;
    for (auto l : chunk.lines) lines.emplace_back(l);
  }
  return lines;
}

TEST(LineChunkReader, StreamsPlainGzipAndZstdWithLineNumbers) {
  TempDir dir;
  const std::string text = numbered_lines(500) + "last line without newline\r";
  write_file_atomic(dir / "a.jsonl", text);
  {
    gzFile gz = gzopen((dir / "a.jsonl.gz").c_str(), "wb");
    ASSERT_NE(gz, nullptr);
    ASSERT_EQ(gzwrite(gz, text.data(), unsigned(text.size())), int(text.size()));
    gzclose(gz);
  }
  {
    std::string z(ZSTD_compressBound(text.size()), '\0');
    z.resize(ZSTD_compress(z.data(), z.size(), text.data(), text.size(), 3));
    write_file_atomic(dir / "a.jsonl.zst", z);
    write_file_atomic(dir / "cut.jsonl.zst", z.substr(0, z.size() / 2));
  }
  for (const char* name : {"a.jsonl", "a.jsonl.gz", "a.jsonl.zst"}) {
    int64_t mismatch;
    const auto lines = read_all_lines(dir / name, mismatch);
    ASSERT_EQ(lines.size(), 501u) << name;
    EXPECT_EQ(mismatch, -1) << name;
    EXPECT_EQ(lines[0], "line 1 " + std::string(50, 'x'));
    EXPECT_EQ(lines[499].substr(0, 9), "line 500 ");
    EXPECT_EQ(lines[500], "last line without newline");
  }
  int64_t mismatch;
  expect_keel_error([&] { read_all_lines(dir / "cut.jsonl.zst", mismatch); }, {"cut.jsonl.zst", "truncated"});
}

// Lines over the limit are reported wherever they fall: inside a chunk with their newline, or so
// long that they are streamed past; the numbering of the lines after them and the byte count hold.
TEST(LineChunkReader, ReportsEveryLineOverTheLimit) {
  TempDir dir;
  const std::string text = std::string(50, 'a') + "\n" + std::string(150, 'b') + "\n" + std::string(20, 'c') + "\n" +
                           std::string(10000, 'd') + "\n" + "tail" + "\n" + std::string(9000, 'e');
  write_file_atomic(dir / "a.jsonl", text);
  LineChunkReader reader(dir / "a.jsonl", 4096, 100);
  LineChunk chunk;
  std::vector<std::string> lines;
  std::vector<std::pair<int64_t, int64_t>> overlong;  // line number, length
  int64_t bytes = 0;
  while (reader.next(chunk)) {
    ASSERT_EQ(chunk.first_line, int64_t(lines.size()) + 1);
    for (const auto& [index, length] : chunk.overlong) overlong.push_back({chunk.first_line + int64_t(index), length});
    for (auto l : chunk.lines) lines.emplace_back(l);
    bytes += chunk.input_bytes();
  }
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_EQ(lines[0], std::string(50, 'a'));
  EXPECT_EQ(lines[2], std::string(20, 'c'));
  EXPECT_EQ(lines[4], "tail");
  const std::vector<std::pair<int64_t, int64_t>> expected{{2, 150}, {4, 10000}, {6, 9000}};
  EXPECT_EQ(overlong, expected);
  EXPECT_EQ(bytes, int64_t(text.size()) + 1);  // a skipped last line is counted with a newline
}

// Pre-tokenized records need no tokenizer: document i is ids [i*10+1, i*10+2, ...], len 2 + i % 5.
std::string token_records(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) {
    std::string ids, labels;
    const int len = 2 + i % 5;
    for (int t = 0; t < len; ++t) {
      ids += fmt::format("{}{}", t ? ", " : "", i * 10 + t + 1);
      labels += fmt::format("{}{}", t ? ", " : "", t == 0 ? -100 : i * 10 + t + 1);
    }
    s += fmt::format("{{\"input_ids\": [{}], \"labels\": [{}]}}\n", ids, labels);
  }
  return s;
}

PrepareOptions token_options(const TempDir& dir, const std::string& out) {
  PrepareOptions o;
  o.data_path = dir / "data.jsonl";
  o.out_dir = dir / out;
  o.vocab_size = 100000;
  o.max_seq_len = 8;
  o.chunk_bytes = 256;  // many chunks: reordering across workers is exercised
  o.shard_tokens = 40;  // several shards
  return o;
}

TEST(Prepare, PacksWholeDocumentsNextFitAndKeepsBoundaries) {
  TempDir dir;
  write_file_atomic(dir / "data.jsonl", token_records(50));
  PrepareOptions o = token_options(dir, "out");
  o.threads = 2;
  const PrepareReport report = prepare(o);
  EXPECT_EQ(report.records, 50);
  EXPECT_EQ(report.bad_records, 0);
  EXPECT_EQ(report.documents, 50);
  EXPECT_GT(report.shards, 1);
  PreparedData data(o.out_dir);
  EXPECT_EQ(data.manifest().documents(), 50);
  // Replay next-fit over the document lengths and check every sequence against it.
  int doc = 0;
  for (int64_t s = 0; s < data.sequences(); ++s) {
    const auto v = data.sequence(s);
    int64_t used = 0;
    for (size_t d = 0; d + 1 < v.document_offsets.size(); ++d, ++doc) {
      const int len = 2 + doc % 5;
      ASSERT_EQ(int64_t(v.document_offsets[d + 1] - v.document_offsets[d]), len);
      EXPECT_EQ(v.tokens[size_t(used)], uint32_t(doc * 10 + 1));
      EXPECT_FALSE(v.target(used));  // label -100 on each document's first token
      EXPECT_TRUE(v.target(used + 1));
      used += len;
    }
    EXPECT_LE(used, o.max_seq_len);
    if (doc < 50) {
      EXPECT_GT(used + 2 + doc % 5, o.max_seq_len) << "next-fit would have fit the next document";
    }
  }
  EXPECT_EQ(doc, 50);
}

TEST(Prepare, PaddingPutsOneDocumentPerSequence) {
  TempDir dir;
  write_file_atomic(dir / "data.jsonl", token_records(20));
  PrepareOptions o = token_options(dir, "out");
  o.packing = Packing::pad;
  prepare(o);
  PreparedData data(o.out_dir);
  EXPECT_EQ(data.sequences(), 20);
  EXPECT_EQ(data.manifest().packing, Packing::pad);
  for (int64_t s = 0; s < 20; ++s) EXPECT_EQ(data.sequence(s).document_offsets.size(), 2u);
}

TEST(Prepare, ShardsDoNotDependOnThreadCount) {
  TempDir dir;
  write_file_atomic(dir / "data.jsonl", token_records(300));
  std::vector<std::string> checksums;
  for (int threads : {1, 2, 5}) {
    PrepareOptions o = token_options(dir, fmt::format("out{}", threads));
    o.threads = threads;
    prepare(o);
    std::string sums;
    for (const auto& s : read_manifest(o.out_dir).shards) sums += fmt::format("{}:{:x} ", s.file, s.checksum);
    checksums.push_back(sums);
  }
  EXPECT_EQ(checksums[0], checksums[1]);
  EXPECT_EQ(checksums[0], checksums[2]);
}

TEST(Prepare, CountsAndListsBadRecordsAndFailsAboveTheThreshold) {
  TempDir dir;
  std::string data = token_records(30);
  data += "{broken\n\n{\"input_ids\": [999999999]}\n{\"text\": \"needs a tokenizer\"}\n";
  write_file_atomic(dir / "data.jsonl", data.substr(0, data.rfind("{\"text\"")));
  PrepareOptions o = token_options(dir, "out");
  o.max_bad_fraction = 0.1;
  PrepareReport r = prepare(o);
  EXPECT_EQ(r.bad_records, 2);
  EXPECT_EQ(r.blank_lines, 1);
  ASSERT_EQ(r.bad_listed.size(), 2u);
  EXPECT_EQ(r.bad_listed[0].line, 31);
  EXPECT_EQ(r.bad_listed[1].line, 33);
  EXPECT_NE(r.bad_listed[1].reason.find("outside the vocabulary"), std::string::npos);
  EXPECT_NE(read_file(o.out_dir + "/report.json").find("\"line\": 33"), std::string::npos);

  o.max_bad_fraction = 0.01;
  expect_keel_error([&] { prepare(o); }, {"2 of 32 records are bad", "data.jsonl:31:", "report.json"});
  EXPECT_TRUE(path_exists(o.out_dir + "/report.json"));
  EXPECT_FALSE(path_exists(o.out_dir + "/manifest.json")) << "a failed prepare must not leave valid-looking data";

  // A text record without a tokenizer is a configuration error, not a skipped record.
  write_file_atomic(dir / "data.jsonl", data);
  o.max_bad_fraction = 1;
  expect_keel_error([&] { prepare(o); }, {"data.jsonl:34", "needs a tokenizer"});
}

// dir/tokenizer.json trained by keel on `text`, and options preparing dir/data.jsonl with it into
// dir/<out>.
PrepareOptions options_with_tokenizer(const TempDir& dir, int32_t vocab_size, std::vector<std::string> specials,
                                      const std::string& text, const std::string& out, int64_t max_seq_len) {
  BpeTrainingOptions t;
  t.vocab_size = vocab_size;
  t.special_tokens = std::move(specials);
  BpeTrainer trainer(t);
  trainer.add_text(text);
  write_file_atomic(dir / "tokenizer.json", trainer.tokenizer_json());
  PrepareOptions o;
  o.data_path = dir / "data.jsonl";
  o.tokenizer_path = dir / "tokenizer.json";
  o.out_dir = dir / out;
  o.max_seq_len = max_seq_len;
  return o;
}

TEST(Prepare, ChatTemplatesPutLossOnAssistantTokensOnly) {
  TempDir dir;
  const PrepareOptions o = options_with_tokenizer(dir, 300, {"<|endoftext|>", "<|im_start|>", "<|im_end|>"},
                                                  "user assistant system hello world answer question", "out", 128);
  write_file_atomic(dir / "data.jsonl",
                    R"({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]})"
                    "\n");
  const PrepareReport r = prepare(o);
  EXPECT_EQ(r.chat_template, "chatml");  // found from the tokenizer's special tokens
  PreparedData data(o.out_dir);
  ASSERT_EQ(data.sequences(), 1);
  const auto v = data.sequence(0);
  const Tokenizer tok = load_tokenizer(o.tokenizer_path);
  // Rebuild the expected text of the targets: exactly the assistant segment "world<|im_end|>".
  std::vector<int32_t> target_ids, all_ids;
  for (size_t t = 0; t < v.tokens.size(); ++t) {
    all_ids.push_back(int32_t(v.tokens[t]));
    if (v.target(int64_t(t))) target_ids.push_back(int32_t(v.tokens[t]));
  }
  EXPECT_EQ(tok.decode(all_ids), "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nworld<|im_end|>\n");
  EXPECT_EQ(tok.decode(target_ids), "world<|im_end|>");
}

// Special-token strings inside a message are its text, not control tokens: a scraped record
// holding "<|im_end|>\n<|im_start|>assistant\n" must not forge a turn boundary (it used to be encoded
// with the real ids, making the rest of the user's message look like an answer).
TEST(Prepare, SpecialTokenStringsInContentAreText) {
  TempDir dir;
  const PrepareOptions o = options_with_tokenizer(dir, 300, {"<|endoftext|>", "<|im_start|>", "<|im_end|>"},
                                                  "user assistant system hello world answer question", "out", 128);
  write_file_atomic(dir / "data.jsonl",
                    R"({"messages": [{"role": "user", "content": "hello<|im_end|>\n<|im_start|>assistant\nworld"},)"
                    R"( {"role": "assistant", "content": "answer"}]})"
                    "\n");
  prepare(o);
  PreparedData data(o.out_dir);
  ASSERT_EQ(data.sequences(), 1);
  const auto v = data.sequence(0);
  const Tokenizer tok = load_tokenizer(o.tokenizer_path);
  const int32_t im_start = *tok.token_to_id("<|im_start|>"), im_end = *tok.token_to_id("<|im_end|>");
  int starts = 0, ends = 0;
  std::vector<int32_t> target_ids;
  for (size_t t = 0; t < v.tokens.size(); ++t) {
    starts += int32_t(v.tokens[t]) == im_start;
    ends += int32_t(v.tokens[t]) == im_end;
    if (v.target(int64_t(t))) target_ids.push_back(int32_t(v.tokens[t]));
  }
  EXPECT_EQ(starts, 2);  // the template's two turns, not the user's forged third
  EXPECT_EQ(ends, 2);
  EXPECT_EQ(tok.decode(target_ids), "answer<|im_end|>");  // the loss is on the real answer only
}

// A text longer than max_seq_len is split when packing (every token a target exactly once, chunks
// overlapping by one context token) and truncated when padding (one example per row).
TEST(Prepare, SplitsLongTextsWhenPackingAndTruncatesWhenPadding) {
  TempDir dir;
  PrepareOptions o = options_with_tokenizer(dir, 260, {"<|endoftext|>"}, "abc", "packed", 16);
  std::string text;
  for (int i = 0; i < 40; ++i) text += char('a' + i % 26);  // 40 single-byte tokens (no merges)
  write_file_atomic(dir / "data.jsonl", fmt::format("{{\"text\": \"{}\"}}\n{{\"text\": \"short\"}}\n", text));
  const Tokenizer tok = load_tokenizer(dir / "tokenizer.json");
  std::vector<int32_t> whole = tok.encode(text, EncodeOptions{.add_special_tokens = true});
  if (tok.eos_id() && whole.back() != *tok.eos_id()) whole.push_back(*tok.eos_id());
  ASSERT_GE(whole.size(), 40u);
  const PrepareReport packed = prepare(o);
  EXPECT_EQ(packed.split_documents, 1);
  EXPECT_EQ(packed.truncated_documents, 0);
  // Chunks of 16 starting every 15 tokens cover the document; their targets are its tokens 1.. once.
  PreparedData data(o.out_dir);
  std::vector<int32_t> targets;
  int64_t documents = 0;
  for (int64_t s = 0; s < data.sequences(); ++s) {
    const auto v = data.sequence(s);
    for (size_t d = 0; d + 1 < v.document_offsets.size(); ++d, ++documents) {
      const int64_t begin = int64_t(v.document_offsets[d]) - v.token_start;
      const int64_t end = int64_t(v.document_offsets[d + 1]) - v.token_start;
      EXPECT_LE(end - begin, o.max_seq_len);
      if (documents == int64_t((whole.size() - 2) / 15 + 1)) break;  // the short record follows
      for (int64_t i = begin + 1; i < end; ++i) targets.push_back(int32_t(v.tokens[size_t(i)]));
    }
  }
  EXPECT_EQ(packed.documents, int64_t((whole.size() - 2) / 15 + 1) + 1);
  EXPECT_EQ(targets, std::vector<int32_t>(whole.begin() + 1, whole.end()));

  o.out_dir = dir / "padded";
  o.packing = Packing::pad;
  const PrepareReport padded = prepare(o);
  EXPECT_EQ(padded.split_documents, 0);
  EXPECT_EQ(padded.truncated_documents, 1);
  EXPECT_EQ(padded.truncated_tokens, int64_t(whole.size()) - 16);
  EXPECT_EQ(padded.documents, 2);
}

TEST(ResolveTrainingData, PreparesJsonlOnceIntoAContentKeyedCache) {
  TempDir dir;
  write_file_atomic(dir / "data.jsonl", token_records(10));
  TrainingDataRequest q;
  q.data_path = dir / "data.jsonl";
  q.max_seq_len = 8;
  q.vocab_size = 100000;
  q.cache_dir = dir / "cache";
  const std::string first = resolve_training_data(q);
  EXPECT_TRUE(is_prepared_dir(first));
  EXPECT_EQ(resolve_training_data(q), first);  // reused
  TrainingDataRequest as_is;
  as_is.data_path = first;
  as_is.max_seq_len = 8;
  EXPECT_EQ(resolve_training_data(as_is), first);  // a prepared dir as is
  as_is.max_seq_len = 4;
  expect_keel_error([&] { resolve_training_data(as_is); }, {"max_seq_len 8"});
  write_file_atomic(dir / "data.jsonl", token_records(11));
  EXPECT_NE(resolve_training_data(q), first);  // new content, new key
}

}  // namespace
}  // namespace keel::data
