// The prepared-data format: a directory of shards plus manifest.json.
//
//   DIR/manifest.json       format, version, tokenizer hash, template, max_seq_len, packing mode,
//                           and per shard: file name, counts and XXH3 checksum
//   DIR/shard-00000.bin     ...
//   DIR/report.json         what prepare read, kept and skipped (bad records by line number)
//
// A sequence is one training row of at most max_seq_len tokens: with packing, several whole
// documents back to back (their boundaries are kept so attention does not cross them and rotary
// positions restart); with padding, one document. A shard file is written front to back, so a
// writer needs no seeking and holds only the small arrays in memory:
//
//   tokens       uint32[num_tokens]
//   loss mask    uint8[ceil(num_tokens / 8)]   bit t%8 of byte t/8: token t is a prediction target
//   sequences    uint64[num_sequences + 1]     token offset of each sequence (last = num_tokens)
//   documents    uint64[num_documents + 1]     token offset of each document
//   first docs   uint64[num_sequences + 1]     index of each sequence's first document
//   footer       ShardFooter (fixed size, at the very end)
//
// each section starting at a multiple of 8 bytes. Little-endian (the machines keel targets).
// Readers treat the files as untrusted: every count, offset and size is checked before use.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace keel::data {

enum class Packing { pack, pad };
Packing packing_from_name(const std::string& name);  // "pack" | "pad"
std::string packing_name(Packing p);

inline constexpr int kShardFormatVersion = 1;

struct ShardFooter {
  char magic[8];  // "KEELSHD1"
  uint64_t version;
  uint64_t num_tokens, num_sequences, num_documents;
  uint64_t tokens_offset, mask_offset, sequences_offset, documents_offset, first_docs_offset;
  uint64_t footer_checksum;  // XXH3 of the bytes above, so a torn footer is caught first
};

struct ShardInfo {
  std::string file;  // name inside the directory
  int64_t sequences = 0, tokens = 0, documents = 0;
  uint64_t checksum = 0;  // XXH3 of the whole file
};

struct ShardManifest {
  int version = kShardFormatVersion;
  std::string tokenizer_hash;  // 16 hex digits; "" when the data came pre-tokenized
  std::string chat_template;   // "glm4" | "llama3" | "chatml" | "none"
  int64_t max_seq_len = 0;
  Packing packing = Packing::pack;
  int64_t vocab_size = 0;  // every token id is below it
  int32_t pad_id = 0;
  std::string source;  // the JSONL it was prepared from
  uint64_t source_checksum = 0;
  std::vector<ShardInfo> shards;

  int64_t sequences() const;
  int64_t tokens() const;
  int64_t documents() const;
};

std::string manifest_json(const ShardManifest& m);
// keel::Error naming the file and field on anything missing, mistyped or inconsistent.
ShardManifest parse_manifest(const std::string& json, const std::string& origin);
ShardManifest read_manifest(const std::string& dir);
bool is_prepared_dir(const std::string& path);  // a directory holding manifest.json

// Streams one shard file: documents are appended into the open sequence, then the sequence is
// closed; finish() writes the arrays and footer and commits the file atomically.
class ShardWriter {
 public:
  explicit ShardWriter(const std::string& path);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Appends a document to the open sequence; mask[t] != 0 marks token t as a target.
  void add_document(std::span<const uint32_t> tokens, std::span<const uint8_t> mask);
  void end_sequence();  // no-op when the open sequence is empty
  int64_t tokens() const { return int64_t(sequence_offsets_.back()) + open_tokens_; }
  int64_t sequences() const { return int64_t(sequence_offsets_.size()) - 1; }
  ShardInfo finish();  // ends the open sequence, writes and commits

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<uint64_t> sequence_offsets_{0}, document_offsets_{0}, first_docs_{0};
  std::vector<uint8_t> mask_bits_;
  int64_t open_tokens_ = 0;
};

// A memory-mapped shard, validated on open. Views stay valid while the ShardFile lives.
class ShardFile {
 public:
  // `expected` comes from the manifest: counts and checksum must match (verify_checksum reads
  // the whole file once; the loader does it at open so corruption is an error before step 1).
  ShardFile(const std::string& path, const ShardInfo& expected, int64_t max_seq_len, int64_t vocab_size,
            bool verify_checksum = true);
  ~ShardFile();
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;

  int64_t sequences() const { return int64_t(num_sequences_); }
  struct SequenceView {
    std::span<const uint32_t> tokens;
    const uint8_t* mask_bits;  // bit (mask_start + t)
    int64_t mask_start;
    std::span<const uint64_t> document_offsets;  // [first doc .. one past last doc], absolute token offsets
    int64_t token_start;                         // absolute offset of tokens[0]
    bool target(int64_t t) const {
      const int64_t bit = mask_start + t;
      return (mask_bits[bit >> 3] >> (bit & 7)) & 1;
    }
  };
  SequenceView sequence(int64_t s) const;

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  uint64_t num_tokens_ = 0, num_sequences_ = 0, num_documents_ = 0;
  const uint32_t* tokens_ = nullptr;
  const uint8_t* mask_ = nullptr;
  const uint64_t* sequence_offsets_ = nullptr;
  const uint64_t* document_offsets_ = nullptr;
  const uint64_t* first_docs_ = nullptr;
};

// Opens every shard of a prepared directory: a global sequence index across shards.
class PreparedData {
 public:
  explicit PreparedData(const std::string& dir, bool verify_checksums = true);
  const ShardManifest& manifest() const { return manifest_; }
  int64_t sequences() const { return total_sequences_; }
  ShardFile::SequenceView sequence(int64_t global_index) const;
  // Identifies the content (manifest checksums and settings): resumes check it is unchanged.
  std::string fingerprint() const;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  ShardManifest manifest_;
  std::vector<std::unique_ptr<ShardFile>> shards_;
  std::vector<int64_t> first_sequence_;  // prefix sums, size shards+1
  int64_t total_sequences_ = 0;
};

}  // namespace keel::data
