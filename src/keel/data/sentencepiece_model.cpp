#include "keel/data/sentencepiece_model.h"

#include <cstring>

#include "keel/core/error.h"

namespace keel::data {
namespace {

// Protocol buffers' wire format: each field is a varint key (number << 3 | wire type), then a
// varint (0), 8 bytes (1), a varint length and that many bytes (2), or 4 bytes (5). Groups (3, 4)
// are in no field of ModelProto.
class WireReader {
 public:
  WireReader(std::string_view bytes, size_t base, const std::string& path) : bytes_(bytes), base_(base), path_(path) {}

  bool done() const { return at_ == bytes_.size(); }
  size_t offset() const { return base_ + at_; }

  uint64_t varint() {
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      require(at_ < bytes_.size(), "{}: byte {}: a varint runs past the end of its message (not a SentencePiece "
              "model, or a truncated one)", path_, offset());
      const uint8_t byte = uint8_t(bytes_[at_++]);
      value |= uint64_t(byte & 0x7f) << shift;
      if (!(byte & 0x80)) return value;
    }
    fail("{}: byte {}: a varint longer than 10 bytes (not a SentencePiece model)", path_, offset());
  }

  std::string_view take(uint64_t n) {
    require(n <= bytes_.size() - at_, "{}: byte {}: a field of {} bytes runs past the end of its message ({} left; "
            "not a SentencePiece model, or a truncated one)", path_, offset(), n, bytes_.size() - at_);
    const std::string_view out = bytes_.substr(at_, size_t(n));
    at_ += size_t(n);
    return out;
  }

  // The field's payload for wire type 2 (length-delimited); skips the others.
  std::string_view field(uint32_t wire) {
    switch (wire) {
      case 0: varint(); return {};
      case 1: return take(8);
      case 2: return take(varint());
      case 5: return take(4);
      default: break;
    }
    fail("{}: byte {}: wire type {} (a protobuf group or no protobuf at all): not a SentencePiece model", path_,
         offset(), wire);
  }

 private:
  std::string_view bytes_;
  size_t base_ = 0, at_ = 0;
  const std::string& path_;
};

SentencePiece read_piece(std::string_view bytes, size_t base, const std::string& path, size_t id) {
  WireReader r(bytes, base, path);
  SentencePiece p;
  while (!r.done()) {
    const uint64_t key = r.varint();
    const uint64_t number = key >> 3;
    const uint32_t wire = uint32_t(key & 7);
    if (number == 1 && wire == 2) {
      p.piece = std::string(r.field(wire));
    } else if (number == 2 && wire == 5) {
      const std::string_view b = r.field(wire);
      std::memcpy(&p.score, b.data(), sizeof(float));  // little-endian, as protobuf's fixed32
    } else if (number == 3 && wire == 0) {
      const size_t at = r.offset();
      const uint64_t type = r.varint();
      require(type >= 1 && type <= 6, "{}: byte {}: piece {} ('{}'): type {}, expected 1 to 6 (NORMAL, UNKNOWN, "
              "CONTROL, USER_DEFINED, UNUSED, BYTE)", path, at, id, p.piece, type);
      p.type = SentencePieceType(int32_t(type));
    } else {
      r.field(wire);  // a field keel does not read (or a known number with another wire type: skipped as protobuf does)
    }
  }
  return p;
}

}  // namespace

bool looks_like_sentencepiece_model(std::string_view bytes) {
  return !bytes.empty() && uint8_t(bytes[0]) == ((1 << 3) | 2);
}

std::vector<SentencePiece> read_sentencepiece_model(std::string_view bytes, const std::string& path) {
  WireReader r(bytes, 0, path);
  std::vector<SentencePiece> pieces;
  while (!r.done()) {
    const uint64_t key = r.varint();
    const uint32_t wire = uint32_t(key & 7);
    const size_t at = r.offset();
    const std::string_view payload = r.field(wire);
    if ((key >> 3) == 1 && wire == 2) {
      const size_t base = at + (r.offset() - at - payload.size());  // past the length varint
      pieces.push_back(read_piece(payload, base, path, pieces.size()));
    }
  }
  require(!pieces.empty(), "{}: a SentencePiece model without pieces (expected a tokenizer.model written by "
          "sentencepiece)", path);
  return pieces;
}

}  // namespace keel::data
