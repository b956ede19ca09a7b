// Dropout masks as a pure function of (key, element index): element i of a tensor dropped out under
// `key` is kept when the top 32 bits of a SplitMix64 hash of (key, i) fall below (1 - p) * 2^32.
// The backward pass (and gradient checkpointing's recomputation) regenerates the forward pass's
// mask from the same key instead of storing it, and every backend draws the same mask.
#pragma once
#include <cstdint>

namespace keel {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The threshold for keeping an element with probability 1 - p (0 <= p < 1).
inline uint64_t dropout_keep_threshold(double p) { return uint64_t((1.0 - p) * 4294967296.0); }

inline bool dropout_keeps(uint64_t key, uint64_t i, uint64_t threshold) {
  return (splitmix64(key ^ (i * 0xD6E8FEB86659FD93ull)) >> 32) < threshold;
}

// A key for one use of dropout (a module in a micro-batch) from a parent key and the use's number.
inline uint64_t dropout_subkey(uint64_t key, uint64_t use) { return splitmix64(key + 0x632BE59BD9B4E019ull * (use + 1)); }

}  // namespace keel
