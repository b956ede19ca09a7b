// Prepared data: a shard manifest (manifest.json, parse_manifest, whose accepted manifests must
// survive manifest_json) or a shard file (ShardFile), picked by the first byte. For a shard, the
// next 24 bytes are the counts the manifest would expect (sequences, tokens, documents) and the
// rest is the file; the footer's own checksum and the file's checksum are computed to match, so
// fuzzed counts and offsets reach the bounds checks instead of stopping at a checksum. Every
// sequence of a shard that opens is read through, token by token and mask bit by mask bit.
#include <xxhash.h>

#include <cstddef>
#include <cstring>

#include "fuzz_support.h"
#include "keel/data/shard_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  if (size == 0) return 0;
  const int which = data[0] % 2;
  try {
    if (which == 0) {
      const std::string json(reinterpret_cast<const char*>(data) + 1, size - 1);
      data::ShardManifest m = data::parse_manifest(json, "manifest.json");
      const std::string again = data::manifest_json(m);
      try {
        if (data::manifest_json(data::parse_manifest(again, "rewritten manifest.json")) != again)
          fuzz::property_failed("manifest_json is not stable", again);
      } catch (const Error& e) {
        fuzz::property_failed("an accepted manifest is refused once rewritten", again + "\n" + e.what());
      }
      return 0;
    }
    if (size < 25) return 0;
    data::ShardInfo expected;
    int64_t counts[3];
    std::memcpy(counts, data + 1, sizeof counts);
    expected.sequences = counts[0], expected.tokens = counts[1], expected.documents = counts[2];
    std::string file(reinterpret_cast<const char*>(data) + 25, size - 25);
    if (file.size() >= sizeof(data::ShardFooter)) {
      data::ShardFooter f;
      std::memcpy(&f, file.data() + file.size() - sizeof f, sizeof f);
      f.footer_checksum = XXH3_64bits(&f, offsetof(data::ShardFooter, footer_checksum));
      std::memcpy(file.data() + file.size() - sizeof f, &f, sizeof f);
    }
    expected.checksum = XXH3_64bits(file.data(), file.size());  // as the manifest would have it
    static const std::string path = fuzz::scratch_dir() + "/shard-00000.bin";
    fuzz::write_bytes(path, file);
    constexpr int64_t kMaxSeqLen = 64, kVocab = 1000;
    // verify_checksum = true, as the loader opens shards by default: the whole file is read and
    // every token id checked against the vocabulary. (With false, token ids are not checked at all:
    // see the note in the hardening report.)
    data::ShardFile shard(path, expected, kMaxSeqLen, kVocab, /*verify_checksum=*/true);
    uint64_t sum = 0;
    for (int64_t s = 0; s < shard.sequences(); ++s) {
      const auto v = shard.sequence(s);
      if (int64_t(v.tokens.size()) > kMaxSeqLen) fuzz::property_failed("a sequence longer than max_seq_len");
      for (size_t t = 0; t < v.tokens.size(); ++t) {
        if (v.tokens[t] >= kVocab) fuzz::property_failed("a token id outside the vocabulary");
        sum += v.tokens[t] + v.target(int64_t(t));
      }
      for (uint64_t d : v.document_offsets) sum += d;
    }
    (void)sum;
  } catch (const Error&) {}
  return 0;
}
