#include "keel/core/json_text.h"
#include "keel/data/shard_format.h"

#include <fcntl.h>
#include <simdjson.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>

#include "keel/core/checksum.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::data {

Packing packing_from_name(const std::string& name) {
  if (name == "pack") return Packing::pack;
  if (name == "pad") return Packing::pad;
  fail("unknown packing mode '{}': expected pack or pad", name);
}

std::string packing_name(Packing p) { return p == Packing::pack ? "pack" : "pad"; }

int64_t ShardManifest::sequences() const {
  int64_t n = 0;
  for (const auto& s : shards) n += s.sequences;
  return n;
}
int64_t ShardManifest::tokens() const {
  int64_t n = 0;
  for (const auto& s : shards) n += s.tokens;
  return n;
}
int64_t ShardManifest::documents() const {
  int64_t n = 0;
  for (const auto& s : shards) n += s.documents;
  return n;
}

namespace {

constexpr char kMagic[8] = {'K', 'E', 'E', 'L', 'S', 'H', 'D', '1'};

uint64_t align8(uint64_t n) { return (n + 7) & ~uint64_t(7); }

// The section layout implied by the counts; the footer must state exactly this.
struct Layout {
  uint64_t tokens, mask, sequences, documents, first_docs, footer, size;
};
Layout layout_for(uint64_t tokens, uint64_t sequences, uint64_t documents) {
  Layout l{};
  l.tokens = 0;
  l.mask = align8(tokens * 4);
  l.sequences = l.mask + align8((tokens + 7) / 8);
  l.documents = l.sequences + (sequences + 1) * 8;
  l.first_docs = l.documents + (documents + 1) * 8;
  l.footer = l.first_docs + (sequences + 1) * 8;
  l.size = l.footer + sizeof(ShardFooter);
  return l;
}

uint64_t footer_checksum(const ShardFooter& f) { return XXH3_64bits(&f, offsetof(ShardFooter, footer_checksum)); }

}  // namespace

std::string manifest_json(const ShardManifest& m) {
  std::string shards;
  for (size_t i = 0; i < m.shards.size(); ++i) {
    const auto& s = m.shards[i];
    shards += fmt::format(
        "{}    {{\"file\": {}, \"sequences\": {}, \"tokens\": {}, \"documents\": {}, \"checksum\": \"{}\"}}",
        i ? ",\n" : "", json_quoted(s.file), s.sequences, s.tokens, s.documents, checksum_hex(s.checksum));
  }
  return fmt::format(
      "{{\n  \"format\": \"keel-shards\",\n  \"version\": {},\n  \"tokenizer_hash\": {},\n  \"chat_template\": {},\n"
      "  \"max_seq_len\": {},\n  \"packing\": \"{}\",\n  \"vocab_size\": {},\n  \"pad_id\": {},\n  \"source\": {},\n"
      "  \"source_checksum\": \"{}\",\n  \"sequences\": {},\n  \"tokens\": {},\n  \"documents\": {},\n"
      "  \"shards\": [\n{}\n  ]\n}}\n",
      m.version, json_quoted(m.tokenizer_hash), json_quoted(m.chat_template), m.max_seq_len, packing_name(m.packing),
      m.vocab_size, m.pad_id, json_quoted(m.source), checksum_hex(m.source_checksum), m.sequences(), m.tokens(),
      m.documents(), shards);
}

namespace {

uint64_t parse_hex(std::string_view s, const std::string& origin, const char* field) {
  const auto v = checksum_from_hex(s);
  require(v.has_value(), "{}: field '{}' must be 16 lowercase hex digits, got '{}'", origin, field, s);
  return *v;
}

}  // namespace

ShardManifest parse_manifest(const std::string& json, const std::string& origin) {
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  const auto err = parser.parse(json).get(doc);
  require(err == simdjson::SUCCESS, "{}: invalid JSON ({})", origin, simdjson::error_message(err));
  auto str = [&](const char* key) -> std::string {
    std::string_view v{};
    require(doc[key].get_string().get(v) == simdjson::SUCCESS, "{}: missing or non-string field '{}'", origin, key);
    return std::string(v);
  };
  auto num = [&](simdjson::dom::element e, const char* key, const std::string& where) -> int64_t {
    int64_t v = 0;
    require(e[key].get_int64().get(v) == simdjson::SUCCESS, "{}: missing or non-integer field '{}'{}", origin, key,
            where);
    require(v >= 0, "{}: field '{}'{} is negative", origin, key, where);
    return v;
  };
  require(str("format") == "keel-shards", "{}: field 'format' must be \"keel-shards\"", origin);
  ShardManifest m;
  m.version = int(num(doc, "version", ""));
  require(m.version == kShardFormatVersion, "{}: format version {} is not supported (this keel reads version {})",
          origin, m.version, kShardFormatVersion);
  m.tokenizer_hash = str("tokenizer_hash");
  m.chat_template = str("chat_template");
  m.max_seq_len = num(doc, "max_seq_len", "");
  require(m.max_seq_len >= 2 && m.max_seq_len <= (int64_t(1) << 24), "{}: max_seq_len {} is out of range", origin,
          m.max_seq_len);
  const std::string packing = str("packing");
  require(packing == "pack" || packing == "pad", "{}: field 'packing' must be \"pack\" or \"pad\"", origin);
  m.packing = packing_from_name(packing);
  m.vocab_size = num(doc, "vocab_size", "");
  require(m.vocab_size > 0 && m.vocab_size <= (int64_t(1) << 31), "{}: vocab_size {} is out of range", origin,
          m.vocab_size);
  m.pad_id = int32_t(std::min<int64_t>(num(doc, "pad_id", ""), INT32_MAX));
  m.source = str("source");
  m.source_checksum = parse_hex(str("source_checksum"), origin, "source_checksum");
  simdjson::dom::array shards;
  require(doc["shards"].get_array().get(shards) == simdjson::SUCCESS, "{}: missing or non-array field 'shards'",
          origin);
  size_t i = 0;
  for (auto e : shards) {
    const std::string where = fmt::format(" of shards[{}]", i);
    ShardInfo s;
    std::string_view file, sum;
    require(e["file"].get_string().get(file) == simdjson::SUCCESS, "{}: missing field 'file'{}", origin, where);
    // A file name, never a path: a manifest must not point outside its directory.
    require(!file.empty() && file.find('/') == std::string_view::npos && file != "." && file != "..",
            "{}: shards[{}].file '{}' must be a plain file name", origin, i, file);
    s.file = std::string(file);
    s.sequences = num(e, "sequences", where);
    s.tokens = num(e, "tokens", where);
    s.documents = num(e, "documents", where);
    require(e["checksum"].get_string().get(sum) == simdjson::SUCCESS, "{}: missing field 'checksum'{}", origin, where);
    s.checksum = parse_hex(sum, origin, "checksum");
    m.shards.push_back(std::move(s));
    ++i;
  }
  int64_t declared;
  if (doc["sequences"].get_int64().get(declared) == simdjson::SUCCESS)
    require(declared == m.sequences(), "{}: 'sequences' = {} but the shards hold {}", origin, declared, m.sequences());
  return m;
}

ShardManifest read_manifest(const std::string& dir) {
  const std::string path = dir + "/manifest.json";
  return parse_manifest(read_file(path, size_t(64) << 20), path);
}

bool is_prepared_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && path_exists(path + "/manifest.json");
}

// ---------------------------------------------------------------------------------------------
// Writer

struct ShardWriter::Impl {
  explicit Impl(const std::string& path) : file(path), state(XXH3_createState()) {
    require(state != nullptr, "{}: out of memory for a checksum state", path);
    XXH3_64bits_reset(state);
    buffer.reserve(kBuffer);
  }
  ~Impl() { XXH3_freeState(state); }
  void write(const void* data, size_t size) {
    const auto* p = static_cast<const char*>(data);
    XXH3_64bits_update(state, p, size);
    written += size;
    if (buffer.size() + size > kBuffer) flush();
    if (size >= kBuffer)
      file.write(p, size);
    else
      buffer.insert(buffer.end(), p, p + size);
  }
  void flush() {
    if (!buffer.empty()) file.write(buffer.data(), buffer.size());
    buffer.clear();
  }
  void pad_to_8() {
    static const char zeros[8] = {};
    if (written % 8) write(zeros, 8 - written % 8);
  }
  static constexpr size_t kBuffer = size_t(1) << 20;
  AtomicFileWriter file;
  XXH3_state_t* state;
  std::vector<char> buffer;
  uint64_t written = 0;
};

ShardWriter::ShardWriter(const std::string& path) : impl_(std::make_unique<Impl>(path)) {}
ShardWriter::~ShardWriter() = default;

void ShardWriter::add_document(std::span<const uint32_t> tokens, std::span<const uint8_t> mask) {
  require(!tokens.empty() && mask.size() == tokens.size(), "{}: a document needs tokens and one mask entry each",
          impl_->file.path());
  impl_->write(tokens.data(), tokens.size_bytes());
  const uint64_t start = sequence_offsets_.back() + uint64_t(open_tokens_);
  mask_bits_.resize((start + tokens.size() + 7) / 8, 0);
  for (size_t t = 0; t < mask.size(); ++t)
    if (mask[t]) mask_bits_[(start + t) >> 3] |= uint8_t(1u << ((start + t) & 7));
  open_tokens_ += int64_t(tokens.size());
  document_offsets_.push_back(start + tokens.size());
}

void ShardWriter::end_sequence() {
  if (open_tokens_ == 0) return;
  sequence_offsets_.push_back(sequence_offsets_.back() + uint64_t(open_tokens_));
  first_docs_.push_back(document_offsets_.size() - 1);
  open_tokens_ = 0;
}

ShardInfo ShardWriter::finish() {
  end_sequence();
  const uint64_t tokens = sequence_offsets_.back(), sequences = sequence_offsets_.size() - 1,
                 documents = document_offsets_.size() - 1;
  const Layout l = layout_for(tokens, sequences, documents);
  impl_->pad_to_8();
  mask_bits_.resize((tokens + 7) / 8, 0);
  impl_->write(mask_bits_.data(), mask_bits_.size());
  impl_->pad_to_8();
  impl_->write(sequence_offsets_.data(), sequence_offsets_.size() * 8);
  impl_->write(document_offsets_.data(), document_offsets_.size() * 8);
  impl_->write(first_docs_.data(), first_docs_.size() * 8);
  require(impl_->written == l.footer, "{}: internal layout mismatch", impl_->file.path());
  ShardFooter f{};
  std::memcpy(f.magic, kMagic, 8);
  f.version = kShardFormatVersion;
  f.num_tokens = tokens;
  f.num_sequences = sequences;
  f.num_documents = documents;
  f.tokens_offset = l.tokens;
  f.mask_offset = l.mask;
  f.sequences_offset = l.sequences;
  f.documents_offset = l.documents;
  f.first_docs_offset = l.first_docs;
  f.footer_checksum = footer_checksum(f);
  impl_->write(&f, sizeof(f));
  impl_->flush();
  const uint64_t sum = XXH3_64bits_digest(impl_->state);
  impl_->file.commit();
  ShardInfo info;
  const std::string& path = impl_->file.path();
  info.file = path.substr(path.rfind('/') + 1);
  info.sequences = int64_t(sequences);
  info.tokens = int64_t(tokens);
  info.documents = int64_t(documents);
  info.checksum = sum;
  return info;
}

// ---------------------------------------------------------------------------------------------
// Reader

ShardFile::ShardFile(const std::string& path, const ShardInfo& expected, int64_t max_seq_len, int64_t vocab_size,
                     bool verify_checksum)
    : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  require(fd >= 0, "{}: cannot open shard ({})", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail("{}: cannot stat shard ({})", path, std::strerror(errno));
  }
  size_ = size_t(st.st_size);
  if (size_ < sizeof(ShardFooter)) {
    ::close(fd);
    fail("{}: {} bytes is too small for a shard (truncated?)", path, size_);
  }
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  require(p != MAP_FAILED, "{}: cannot memory-map shard ({})", path, std::strerror(errno));
  data_ = static_cast<const uint8_t*>(p);
  try {
    ShardFooter f;
    std::memcpy(&f, data_ + size_ - sizeof(f), sizeof(f));
    require(std::memcmp(f.magic, kMagic, 8) == 0, "{}: not a keel shard (bad magic in the footer)", path);
    require(f.footer_checksum == footer_checksum(f), "{}: the footer is corrupt (checksum mismatch)", path);
    require(f.version == kShardFormatVersion, "{}: shard version {} is not supported", path, f.version);
    // Counts are bounded by the file size before any arithmetic, so the layout cannot overflow.
    require(f.num_tokens <= size_ / 4 && f.num_sequences <= size_ / 8 && f.num_documents <= size_ / 8,
            "{}: the footer's counts do not fit in {} bytes", path, size_);
    const Layout l = layout_for(f.num_tokens, f.num_sequences, f.num_documents);
    require(l.size == size_ && f.tokens_offset == l.tokens && f.mask_offset == l.mask &&
                f.sequences_offset == l.sequences && f.documents_offset == l.documents &&
                f.first_docs_offset == l.first_docs,
            "{}: the sections do not match the footer's counts ({} bytes, expected {})", path, size_, l.size);
    require(int64_t(f.num_tokens) == expected.tokens && int64_t(f.num_sequences) == expected.sequences &&
                int64_t(f.num_documents) == expected.documents,
            "{}: holds {} sequences, {} tokens, {} documents but the manifest says {}, {}, {}", path, f.num_sequences,
            f.num_tokens, f.num_documents, expected.sequences, expected.tokens, expected.documents);
    if (verify_checksum) {
      const uint64_t sum = checksum(data_, size_);
      require(sum == expected.checksum, "{}: checksum {} does not match the manifest's {} (the file is corrupt)", path,
              checksum_hex(sum), checksum_hex(expected.checksum));
    }
    num_tokens_ = f.num_tokens;
    num_sequences_ = f.num_sequences;
    num_documents_ = f.num_documents;
    tokens_ = reinterpret_cast<const uint32_t*>(data_ + l.tokens);
    mask_ = data_ + l.mask;
    sequence_offsets_ = reinterpret_cast<const uint64_t*>(data_ + l.sequences);
    document_offsets_ = reinterpret_cast<const uint64_t*>(data_ + l.documents);
    first_docs_ = reinterpret_cast<const uint64_t*>(data_ + l.first_docs);
    // The index: every offset in range, increasing, sequences made of whole documents.
    require(sequence_offsets_[0] == 0 && sequence_offsets_[num_sequences_] == num_tokens_,
            "{}: sequence offsets do not span the tokens", path);
    require(document_offsets_[0] == 0 && document_offsets_[num_documents_] == num_tokens_,
            "{}: document offsets do not span the tokens", path);
    require(first_docs_[0] == 0 && first_docs_[num_sequences_] == num_documents_,
            "{}: sequence-to-document index does not span the documents", path);
    for (uint64_t d = 0; d < num_documents_; ++d)
      require(document_offsets_[d] < document_offsets_[d + 1], "{}: document {} is empty or out of order", path, d);
    for (uint64_t s = 0; s < num_sequences_; ++s) {
      const uint64_t a = sequence_offsets_[s], b = sequence_offsets_[s + 1];
      require(a < b && b - a <= uint64_t(max_seq_len), "{}: sequence {} has {} tokens (expected 1..{})", path, s,
              int64_t(b - a), max_seq_len);
      require(first_docs_[s] < first_docs_[s + 1] && document_offsets_[first_docs_[s]] == a,
              "{}: sequence {} does not start at a document boundary", path, s);
    }
    {  // always, even without checksums: an id past the vocabulary would index outside the embedding
      uint32_t largest = 0;
      for (uint64_t t = 0; t < num_tokens_; ++t) largest = std::max(largest, tokens_[t]);
      require(num_tokens_ == 0 || int64_t(largest) < vocab_size, "{}: token id {} is outside the vocabulary ({})", path,
              largest, vocab_size);
    }
  } catch (...) {
    ::munmap(const_cast<uint8_t*>(data_), size_);
    throw;
  }
}

ShardFile::~ShardFile() { ::munmap(const_cast<uint8_t*>(data_), size_); }

ShardFile::SequenceView ShardFile::sequence(int64_t s) const {
  const uint64_t a = sequence_offsets_[s], b = sequence_offsets_[s + 1];
  SequenceView v;
  v.tokens = {tokens_ + a, size_t(b - a)};
  v.mask_bits = mask_;
  v.mask_start = int64_t(a);
  v.document_offsets = {document_offsets_ + first_docs_[s], size_t(first_docs_[s + 1] - first_docs_[s] + 1)};
  v.token_start = int64_t(a);
  return v;
}

PreparedData::PreparedData(const std::string& dir, bool verify_checksums) : dir_(dir), manifest_(read_manifest(dir)) {
  first_sequence_.push_back(0);
  for (const auto& info : manifest_.shards) {
    shards_.push_back(std::make_unique<ShardFile>(dir + "/" + info.file, info, manifest_.max_seq_len,
                                                  manifest_.vocab_size, verify_checksums));
    first_sequence_.push_back(first_sequence_.back() + shards_.back()->sequences());
  }
  total_sequences_ = first_sequence_.back();
  require(total_sequences_ > 0, "{}/manifest.json: the prepared data holds no sequences", dir);
}

ShardFile::SequenceView PreparedData::sequence(int64_t g) const {
  require(g >= 0 && g < total_sequences_, "{}: sequence {} out of range (0..{})", dir_, g, total_sequences_);
  const auto it = std::upper_bound(first_sequence_.begin(), first_sequence_.end(), g);
  const size_t shard = size_t(it - first_sequence_.begin()) - 1;
  return shards_[shard]->sequence(g - first_sequence_[shard]);
}

std::string PreparedData::fingerprint() const {
  std::string key = fmt::format("{}|{}|{}|{}|{}", manifest_.tokenizer_hash, manifest_.chat_template,
                                manifest_.max_seq_len, packing_name(manifest_.packing), manifest_.vocab_size);
  for (const auto& s : manifest_.shards) {
    key += '|';
    key += checksum_hex(s.checksum);
  }
  return checksum_hex(checksum(key));
}

}  // namespace keel::data
