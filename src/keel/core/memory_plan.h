// The memory plan of a training step: every buffer the step needs is declared up front with its
// size and the span of the step timeline in which it holds data, and offsets in one arena are
// assigned so that buffers never alive together share space. The step loop then takes pointers
// into the arena and allocates nothing, and the plan's arena size is what the process uses.
//
// Packing is the offline dynamic-storage-allocation problem (NP-hard in general); the greedy
// "best fit by size with lifetimes" heuristic of Pisarchyk & Lee, "Efficient Memory Management for
// Deep Neural Net Inference" (2020) — also TFLite's arena planner — places the largest buffers
// first, each in the smallest gap left by already placed buffers whose lifetimes overlap it.
// Waste is reported against the lower bound every packing must meet: the largest sum of
// simultaneously live bytes (arena / peak_live - 1, the reference article's fragmentation_threshold).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace keel {

enum class MemoryCategory : uint8_t {
  MasterWeights,      // fp32 weights the optimizer updates
  ComputeWeights,     // bf16 copies of the weights that the GEMMs read
  Gradients,          // fp32 gradients, accumulated over micro-batches
  OptimizerState,     // AdamW first and second moments
  Activations,        // forward results kept for the backward pass
  Workspace,          // scratch of one layer or one operation at a time
  Communication,      // gradient buckets in flight between data-parallel ranks
  Data,               // token batches and lookup tables
  CheckpointStaging,  // the snapshot an asynchronous checkpoint save writes from
  Runtime,            // the program itself: code, libraries, thread stacks, library scratch
  kCount
};
constexpr int kMemoryCategories = int(MemoryCategory::kCount);
std::string_view category_name(MemoryCategory c);  // "master weights", "gradients", ...

struct PlannedBuffer {
  std::string name;
  MemoryCategory category = MemoryCategory::Workspace;
  size_t bytes = 0;          // as requested
  int32_t first_use = 0;     // first and last position on the step timeline where the buffer holds
  int32_t last_use = 0;      //   data, inclusive: two buffers may share bytes iff these do not overlap
  bool in_arena = true;      // false: allocated elsewhere (a library, a table) but counted in totals
  size_t offset = 0;         // into the arena, once packed (multiple of the plan's alignment)
  size_t aligned_bytes = 0;  // bytes rounded up to the alignment: what the buffer occupies
};

class MemoryPlan {
 public:
  static constexpr size_t kCacheLine = 64;
  static constexpr size_t kHugePage = size_t(2) << 20;

  // alignment: a power of two every offset is a multiple of (64: cache lines; 2 MiB: huge pages).
  explicit MemoryPlan(size_t alignment = kCacheLine);

  // Declares a buffer alive from first_use to last_use (inclusive); returns its id. Zero-byte
  // buffers are allowed (they get a valid, unused offset).
  int add(std::string name, MemoryCategory category, size_t bytes, int32_t first_use, int32_t last_use);
  // Declares memory a library or table holds outside the arena, so totals still tell the truth.
  int add_external(std::string name, MemoryCategory category, size_t bytes, int32_t first_use, int32_t last_use);

  // Assigns offsets. Every accessor below that needs them packs first; adding a buffer unpacks.
  void pack() const;

  const std::vector<PlannedBuffer>& buffers() const {
    pack();
    return buffers_;
  }
  const PlannedBuffer& buffer(int id) const { return buffers().at(size_t(id)); }
  size_t offset(int id) const;
  size_t alignment() const { return alignment_; }

  size_t arena_bytes() const;      // the packed arena
  size_t peak_live_bytes() const;  // most arena bytes alive at one position of the timeline
  int32_t peak_position() const;   // where that is (the first such position)
  size_t naive_bytes() const;      // arena bytes if every buffer had its own allocation
  // External memory at its own peak: the most bytes of external buffers alive at one position.
  // (The arena is touched up front, so it is resident at every position; the process peaks
  // where external memory does.)
  size_t external_bytes() const;
  int32_t external_peak_position() const;
  size_t external_bytes_at(int32_t position) const;  // external buffers alive at that position
  size_t total_bytes() const { return arena_bytes() + external_bytes(); }
  double waste() const { return peak_live_bytes() ? double(arena_bytes()) / double(peak_live_bytes()) - 1.0 : 0.0; }

  // Bytes of a category alive at the peak: its arena buffers live at peak_position() plus its
  // external buffers live at external_peak_position(). The categories sum to
  // peak_live_bytes() + external_bytes(), and with the packing waste to total_bytes().
  size_t category_bytes_at_peak(MemoryCategory c) const;
  // Bytes of a category over all its buffers (what it would take without sharing).
  size_t category_bytes(MemoryCategory c) const;

  // A table, one line per category, then live peak, arena, waste and external memory.
  std::string breakdown() const;
  // keel::Error naming `what` and showing the breakdown when the arena exceeds cap_bytes.
  void require_fits(size_t cap_bytes, std::string_view what) const;

 private:
  int add_buffer(std::string name, MemoryCategory category, size_t bytes, int32_t first_use, int32_t last_use,
                 bool in_arena);
  size_t alignment_;
  // Packing results are computed on first demand, so a plan under construction stays cheap.
  mutable std::vector<PlannedBuffer> buffers_;
  mutable bool packed_ = false;
  mutable size_t arena_bytes_ = 0, peak_live_bytes_ = 0, external_peak_bytes_ = 0;
  mutable int32_t peak_position_ = 0, external_peak_position_ = 0;
};

// Human-readable byte counts in binary units: "512 B", "3.25 MiB", "41.07 GiB".
std::string format_bytes(double bytes);

// One anonymous mapping holding a packed plan. Huge pages are requested (MADV_HUGEPAGE) and
// every page is written once up front, so the resident size equals the plan from the start and
// no page fault happens inside the step loop. Contents start zeroed.
class Arena {
 public:
  Arena() = default;
  explicit Arena(size_t bytes);
  ~Arena();
  Arena(Arena&& other) noexcept;
  Arena& operator=(Arena&& other) noexcept;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  size_t mapped_bytes() const { return mapped_; }  // size rounded up to whole huge pages
  template <typename T>
  T* at(size_t offset) const {
    return reinterpret_cast<T*>(data_ + offset);
  }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0, mapped_ = 0;
};

}  // namespace keel
