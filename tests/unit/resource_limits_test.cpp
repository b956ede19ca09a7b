// Inputs that claim absurd sizes get a clear keel::Error before any large allocation: a
// safetensors header claiming a 2^60-byte tensor, a JSONL line of 10 GB, a vocabulary of 2^31
// tokens, a recipe asking for 10^9 steps, a config.json with hidden_size 2^40, a "config file" of
// 10 GB. Large files are sparse (ftruncate): nothing big is written or read.
//
// "Before any large allocation" is checked with the kernel's peak-RSS counter: /proc/self/clear_refs
// resets VmHWM to the current RSS, and the peak after the call must stay within a few MiB of it.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/data/hf_tokenizer_json.h"
#include "keel/data/prepare.h"
#include "keel/data/tiktoken.h"
#include "keel/data/token_records.h"
#include "keel/model/config.h"
#include "keel/formats/safetensors.h"
#include "keel/recipe/recipe.h"
#include "test_support.h"

namespace {

using keel::testing::expect_keel_error;
using keel::testing::TempDir;

constexpr int64_t kMiB = int64_t(1) << 20;

int64_t proc_status_kib(const char* key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(key) + ":";
  while (std::getline(status, line)) {
    if (line.rfind(prefix, 0) == 0) return std::stoll(line.substr(prefix.size()));
  }
  return -1;
}

// Peak resident memory added while `fn` runs, in bytes; -1 where the peak cannot be reset.
int64_t peak_rss_growth(const std::function<void()>& fn) {
  int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  const bool reset = fd >= 0 && ::write(fd, "5", 1) == 1;
  if (fd >= 0) ::close(fd);
  const int64_t before = proc_status_kib("VmRSS");
  fn();
  const int64_t peak = proc_status_kib("VmHWM");
  return reset && before >= 0 && peak >= 0 ? (peak - before) * 1024 : -1;
}

// `fn` throws keel::Error containing every part, within `seconds`, and without its peak memory
// growing by more than `max_growth` bytes.
void expect_cheap_error(const std::function<void()>& fn, std::initializer_list<std::string> parts,
                        int64_t max_growth = 64 * kMiB, double seconds = 5.0) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t growth = peak_rss_growth([&] { expect_keel_error(fn, parts); });
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(elapsed, seconds) << "the error came only after " << elapsed << " s";
  if (growth >= 0) {
    EXPECT_LT(growth, max_growth) << "peak RSS grew by " << growth / kMiB << " MiB before the error";
  }
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// A file of `size` bytes that starts with `head` and is a hole after it (reads as NUL bytes).
void write_sparse(const std::string& path, const std::string& head, int64_t size) {
  write_text(path, head);
  ASSERT_EQ(::truncate(path.c_str(), off_t(size)), 0) << "cannot make a sparse file of " << size << " bytes";
}

std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[size_t(i)] = char(uint64_t(header.size()) >> (8 * i));
  return file + header + data;
}

}  // namespace

// --- safetensors ---------------------------------------------------------------------------------

TEST(ResourceLimits, SafetensorsTensorOf2To60Bytes) {
  TempDir dir;
  // 2^28 x 2^30 F32 elements = 2^60 bytes, claimed by a 64-byte file.
  write_text(dir / "model.safetensors",
             safetensors_bytes(
                 R"({"w":{"dtype":"F32","shape":[268435456,1073741824],"data_offsets":[0,1152921504606846976]}})",
                 std::string(64, '\0')));
  expect_cheap_error([&] { keel::formats::SafetensorsFile::open(dir / "model.safetensors"); },
                     {"model.safetensors", "tensor 'w'", "data_offsets within the 64-byte data section"});
  expect_cheap_error([&] { keel::formats::CheckpointReader::open_dir(dir.path()); }, {"tensor 'w'"});
  // The same size with offsets that fit: the byte count must match the shape exactly.
  write_text(dir / "model.safetensors",
             safetensors_bytes(R"({"w":{"dtype":"F32","shape":[268435456,1073741824],"data_offsets":[0,64]}})",
                               std::string(64, '\0')));
  expect_cheap_error([&] { keel::formats::SafetensorsFile::open(dir / "model.safetensors"); },
                     {"tensor 'w'", "expected 1152921504606846976 bytes"});
  // Element counts that overflow 64 bits cannot wrap around to a small size.
  write_text(
      dir / "model.safetensors",
      safetensors_bytes(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,64]}})",
                        std::string(64, '\0')));
  expect_cheap_error([&] { keel::formats::SafetensorsFile::open(dir / "model.safetensors"); },
                     {"tensor 'w'", "more elements than fit in 64 bits"});
}

TEST(ResourceLimits, SafetensorsHeaderLength) {
  TempDir dir;
  // A header length of 2^60 in a 100-byte file.
  std::string file = safetensors_bytes("{}", std::string(90, ' '));
  for (int i = 0; i < 8; ++i) file[size_t(i)] = char((uint64_t(1) << 60) >> (8 * i));
  write_text(dir / "a.safetensors", file);
  expect_cheap_error([&] { keel::formats::SafetensorsFile::open(dir / "a.safetensors"); },
                     {"a.safetensors", "header length of at most 92 bytes"});
  // A 150 MB header in a (sparse) 200 MB file: over the 100 MB limit the reference reader has too.
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[size_t(i)] = char(uint64_t(150 * kMiB) >> (8 * i));
  write_sparse(dir / "b.safetensors", head + "{", 200 * kMiB);
  expect_cheap_error([&] { keel::formats::SafetensorsFile::open(dir / "b.safetensors"); },
                     {"b.safetensors", "header length of at most 104857600 bytes"});
}

TEST(ResourceLimits, SafetensorsIndexOf10GB) {
  TempDir dir;
  write_sparse(dir / "model.safetensors.index.json", "{\"weight_map\": {", 10 * 1024 * kMiB);
  expect_cheap_error([&] { keel::formats::CheckpointReader::open_dir(dir.path()); },
                     {"model.safetensors.index.json", "expected a file of at most"});
}

// --- JSONL records -------------------------------------------------------------------------------

TEST(ResourceLimits, JsonlLineOf10GB) {
  TempDir dir;
  const std::string path = dir / "train.jsonl";
  write_sparse(path, "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [1", 10 * 1024 * kMiB);
  // The reader maps the file and looks for the line's end no further than the 64 MiB limit:
  // those mapped pages are the only memory it touches.
  expect_cheap_error([&] { keel::data::read_token_records(path, 100); }, {path + ":2", "line longer than 64 MiB"},
                     160 * kMiB);
}

TEST(ResourceLimits, JsonlLongLineEndingInTheFile) {
  // A 100 MiB last line with no newline: refused at the limit, not after scanning to the end.
  TempDir dir;
  const std::string path = dir / "train.jsonl";
  write_sparse(path, "{\"input_ids\": [1", 100 * kMiB);
  expect_cheap_error([&] { keel::data::read_token_records(path, 100); }, {path + ":1", "line longer than 64 MiB"},
                     160 * kMiB);
}

TEST(ResourceLimits, PrepareSkipsAndReportsALineOver64MiB) {
  // keel prepare streams: a 400 MiB line (a hole of NUL bytes, no newline until the next record)
  // is held only up to the 64 MiB limit, read past in small pieces, and reported as a bad record
  // with its line number.
  TempDir dir;
  const std::string path = dir / "train.jsonl";
  write_sparse(path, "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [1", 400 * kMiB);
  {
    std::ofstream tail(path, std::ios::binary | std::ios::app);
    tail << "\n{\"input_ids\": [4, 5, 6]}\n";
  }
  keel::data::PrepareOptions o;
  o.data_path = path;
  o.out_dir = dir / "out";
  o.vocab_size = 100;
  o.max_seq_len = 8;
  o.max_bad_fraction = 0.5;
  keel::data::PrepareReport report;
  const int64_t growth = peak_rss_growth([&] { report = keel::data::prepare(o); });
  EXPECT_EQ(report.records, 3);
  EXPECT_EQ(report.bad_records, 1);
  ASSERT_EQ(report.bad_listed.size(), 1u);
  EXPECT_EQ(report.bad_listed[0].line, 2);
  EXPECT_NE(report.bad_listed[0].reason.find("above the 64 MiB limit"), std::string::npos)
      << report.bad_listed[0].reason;
  EXPECT_EQ(report.documents, 2);  // the lines around it are kept
  if (growth >= 0) {
    EXPECT_LT(growth, 100 * kMiB) << "peak RSS grew by " << growth / kMiB << " MiB";
  }
}

// --- tokenizers ----------------------------------------------------------------------------------

TEST(ResourceLimits, TokenizerVocabularyOf2To31Tokens) {
  // A vocabulary whose ids claim 2^31 entries: ids index dense tables, so they must stay within
  // the number of entries the file actually has.
  const std::string rest = R"(, "decoder": {"type": "ByteLevel"}})";
  expect_cheap_error(
      [&] {
        keel::data::hf_tokenizer_from_json(
            R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 2147483647}, "merges": []})" + rest, "tokenizer.json");
      },
      {"tokenizer.json", "2147483647"});
  expect_cheap_error(
      [&] {
        keel::data::hf_tokenizer_from_json(
            R"({"added_tokens": [{"id": 2147483648, "content": "<s>", "special": true}], "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []})" +
                rest,
            "tokenizer.json");
      },
      {"tokenizer.json", "added_tokens[0]"});
  // tiktoken: a rank of 2^31 in a two-line file is a gap, refused before sizing anything by it.
  expect_cheap_error([] { keel::data::parse_tiktoken_ranks("YQ== 0\nYg== 2147483648\n", "ranks.tiktoken"); },
                     {"ranks.tiktoken:2", "2147483648"});
}

TEST(ResourceLimits, TokenizerAddedTokenAtTheTopOfTheIdRange) {
  // An added token with id 2^31 - 1 would make the vocabulary 2^31 ids (and overflow int32).
  const std::string json =
      R"({"added_tokens": [{"id": 2147483647, "content": "<s>", "special": true}], "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "decoder": {"type": "ByteLevel"}})";
  expect_cheap_error([&] { keel::data::hf_tokenizer_from_json(json, "tokenizer.json"); },
                     {"tokenizer.json", "added_tokens[0]", "2147483647"});
  // One below: a vocabulary of 2^31 - 1 ids, nothing allocated for them (ids above the model's
  // vocabulary are refused later, when data is prepared for a model).
  std::string below = json;
  below.replace(below.find("2147483647"), 10, "2147483646");
  const int64_t growth = peak_rss_growth([&] {
    try {
      EXPECT_EQ(keel::data::hf_tokenizer_from_json(below, "tokenizer.json").vocab_size(), 2147483647);
    } catch (const keel::Error&) {  // refusing it is fine too
    }
  });
  if (growth >= 0) {
    EXPECT_LT(growth, 64 * kMiB);
  }
}

TEST(ResourceLimits, TokenizerModelTokenAtTheTopOfTheIdRange) {
  // A vocabulary token with id 2^31 - 2 would size the model's id-indexed tables (and the offsets
  // a conversation's tokens are mapped through) to 2^31 entries, 16 GB: refused by name, before
  // anything is allocated for it, as ids beyond the vocabulary's size are.
  const std::string json =
      R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 2147483646}, "merges": []}, "decoder": {"type": "ByteLevel"}})";
  expect_cheap_error([&] { keel::data::hf_tokenizer_from_json(json, "tokenizer.json"); },
                     {"tokenizer.json", "model.vocab", "2147483646", "outside"});
}

// --- recipes -------------------------------------------------------------------------------------

TEST(ResourceLimits, RecipeStepsAndIntervals) {
  const std::string base = R"(data_path = "train.jsonl"
[model_config]
vocab_size = 64
hidden_size = 32
intermediate_size = 64
num_layers = 1
num_heads = 2
)";
  // 10^9 steps with a log line each is accepted: nothing is sized by the step count.
  keel::recipe::Recipe r;
  const int64_t growth = peak_rss_growth(
      [&] { r = keel::recipe::parse_recipe("max_steps = 1000000000\nlog_interval = 1\n" + base, "recipe.toml"); });
  EXPECT_EQ(r.max_steps, 1000000000);
  if (growth >= 0) {
    EXPECT_LT(growth, 16 * kMiB);
  }
  expect_cheap_error([&] { keel::recipe::parse_recipe("max_steps = 1000000001\n" + base, "recipe.toml"); },
                     {"recipe.toml:1", "max_steps", "[0, 1e9]"});
  expect_cheap_error([&] { keel::recipe::parse_recipe("max_steps = 10\nlog_interval = 10000000000\n" + base, "r.toml"); },
                     {"r.toml", "at most 1e9"});
  expect_cheap_error([&] { keel::recipe::parse_recipe("num_epochs = 100000000\n" + base, "r.toml"); },
                     {"num_epochs", "[0, 1e6]"});
  expect_cheap_error([&] { keel::recipe::parse_recipe("max_steps = 10\nmax_seq_len = 1073741824\n" + base, "r.toml"); },
                     {"max_seq_len", "[2, 1048576]"});
  expect_cheap_error([&] { keel::recipe::parse_recipe("max_steps = 10\nbucket_size_mb = 1e12\n" + base, "r.toml"); },
                     {"bucket_size_mb"});
}

TEST(ResourceLimits, RecipeFileOf10GB) {
  TempDir dir;
  write_sparse(dir / "recipe.toml", "max_steps = 1\n# ", 10 * 1024 * kMiB);
  expect_cheap_error([&] { keel::recipe::load_recipe(dir / "recipe.toml"); },
                     {"recipe.toml", "expected a file of at most"});
}

// --- config.json ---------------------------------------------------------------------------------

TEST(ResourceLimits, ModelConfigAbsurdSizes) {
  auto config = [](const std::string& key, const std::string& value) {
    std::string json = R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2)";
    const size_t at = json.find("\"" + key + "\"");
    if (at != std::string::npos) {
      const size_t colon = json.find(':', at), end = json.find_first_of(",}", colon);
      json.replace(colon + 1, end - colon - 1, " " + value);
    } else {
      json += ", \"" + key + "\": " + value;
    }
    return json + "}";
  };
  EXPECT_NO_THROW(keel::model::parse_model_config(config("hidden_size", "64"), "config.json"));
  expect_cheap_error([&] { keel::model::parse_model_config(config("hidden_size", "1099511627776"), "config.json"); },
                     {"config.json", "hidden_size", "1099511627776"});
  expect_cheap_error([&] { keel::model::parse_model_config(config("vocab_size", "2147483648"), "config.json"); },
                     {"config.json", "vocab_size"});
  expect_cheap_error([&] { keel::model::parse_model_config(config("num_hidden_layers", "1000000000"), "config.json"); },
                     {"config.json", "num_hidden_layers"});
  expect_cheap_error([&] { keel::model::parse_model_config(config("intermediate_size", "1e15"), "config.json"); },
                     {"config.json", "intermediate_size"});
  expect_cheap_error([&] { keel::model::parse_model_config(config("head_dim", "1048576"), "config.json"); },
                     {"config.json", "head_dim"});
  expect_cheap_error(
      [&] { keel::model::parse_model_config(config("max_position_embeddings", "1e300"), "config.json"); },
      {"config.json", "max_position_embeddings"});
  expect_cheap_error(
      [&] { keel::model::parse_model_config(config("vocab_size", "18446744073709551615"), "config.json"); },
      {"config.json", "vocab_size"});
  // The largest sizes validate() accepts: parameter counts stay within int64 (no overflow).
  keel::model::ModelConfig c = keel::model::parse_model_config(
      R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 2147483647, "hidden_size": 1048575,
          "intermediate_size": 4194303, "num_hidden_layers": 9999, "num_attention_heads": 256, "head_dim": 16382})",
      "config.json");
  EXPECT_GT(c.total_parameters(), 0);
  EXPECT_GT(c.matmul_parameters(), 0);
}

TEST(ResourceLimits, ConfigFileOf10GB) {
  TempDir dir;
  write_sparse(dir / "config.json", "{\"architectures\": [", 10 * 1024 * kMiB);
  expect_cheap_error([&] { keel::model::load_model_config(dir / "config.json"); },
                     {"config.json", "expected a file of at most 16777216 bytes"});
}

TEST(ResourceLimits, ReadFileLimit) {
  TempDir dir;
  write_text(dir / "small", std::string(100, 'x'));
  EXPECT_EQ(keel::read_file(dir / "small", 100).size(), 100u);
  expect_cheap_error([&] { keel::read_file(dir / "small", 99); }, {"small", "at most 99 bytes, found 100"});
  // Files that report no size (/proc) are limited while reading.
  expect_cheap_error([&] { keel::read_file("/proc/self/maps", 10); }, {"/proc/self/maps", "at most 10 bytes"});
}
