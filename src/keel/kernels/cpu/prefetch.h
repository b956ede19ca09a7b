// Software prefetch for walks the hardware prefetchers do not follow: a few cache lines of one row,
// then a jump to the next row (a head's slice of [tokens, heads * head_dim], a column block of
// [rows, dim]). Each row then waits on memory in turn; asking for the lines of a row some rows
// ahead keeps several of those waits in flight at once.
#pragma once
#include <cstddef>
#include <cstdint>

namespace keel::kernels {

// How far ahead of the row being read to ask: enough rows to cover a memory access's latency
// with the few lines each row reads, few enough that they are still in L1/L2 when read.
constexpr int64_t kPrefetchRows = 8;

// Asks for the cache lines of [p, p + bytes) to be loaded (a hint: no fault, no effect on results).
inline void prefetch_lines(const void* p, size_t bytes) {
  constexpr size_t kLine = 64;
  const char* c = static_cast<const char*>(p);
  for (size_t offset = 0; offset < bytes; offset += kLine) __builtin_prefetch(c + offset, 0, 3);
}

}  // namespace keel::kernels
