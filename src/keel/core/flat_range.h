// A range of elements of a flat buffer, and the split of such a buffer into contiguous shards, one
// per data-parallel rank (ZeRO-1: each rank owns the optimizer state of its shard). Shared by the
// parameter store (which part of the optimizer state it holds) and the communicators (which part of
// a reduce-scatter or all-gather each rank owns).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace keel {

struct FlatRange {
  int64_t begin = 0, end = 0;  // [begin, end) in elements
  int64_t size() const { return end - begin; }
  bool contains(int64_t i) const { return i >= begin && i < end; }
  FlatRange intersect(FlatRange o) const {
    const int64_t b = std::max(begin, o.begin), e = std::min(end, o.end);
    return b < e ? FlatRange{b, e} : FlatRange{b, b};
  }
};

// `shards` contiguous ranges covering [0, total), in rank order, as equal as `align`-element
// boundaries allow (the first ones take the remainder, so shard 0 is never smaller than another).
inline std::vector<FlatRange> shard_ranges(int64_t total, int shards, int64_t align = 16) {
  const int64_t units = (total + align - 1) / align;
  std::vector<FlatRange> out;
  int64_t begin = 0;
  for (int r = 0; r < shards; ++r) {
    const int64_t take = units / shards + (r < units % shards ? 1 : 0);
    const int64_t end = std::min(total, begin + take * align);
    out.push_back({begin, end});
    begin = end;
  }
  return out;
}

}  // namespace keel
