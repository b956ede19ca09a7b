#include "keel/core/memory_plan.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>

#include "keel/core/error.h"
#include "keel/core/threads.h"

namespace keel {

std::string_view category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::MasterWeights: return "master weights";
    case MemoryCategory::ComputeWeights: return "compute weights";
    case MemoryCategory::Gradients: return "gradients";
    case MemoryCategory::OptimizerState: return "optimizer state";
    case MemoryCategory::Activations: return "activations";
    case MemoryCategory::Workspace: return "workspace";
    case MemoryCategory::Communication: return "communication";
    case MemoryCategory::Data: return "data";
    case MemoryCategory::CheckpointStaging: return "checkpoint staging";
    case MemoryCategory::Runtime: return "runtime";
    case MemoryCategory::kCount: break;
  }
  return "?";
}

std::string format_bytes(double bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024.0 && unit < 4) bytes /= 1024.0, ++unit;
  return unit == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.2f} {}", bytes, kUnits[unit]);
}

MemoryPlan::MemoryPlan(size_t alignment) : alignment_(alignment) {
  require(alignment > 0 && (alignment & (alignment - 1)) == 0, "memory plan: alignment {} is not a power of two",
          alignment);
}

int MemoryPlan::add_buffer(std::string name, MemoryCategory category, size_t bytes, int32_t first_use, int32_t last_use,
                           bool in_arena) {
  require(first_use <= last_use, "memory plan: buffer '{}' is last used ({}) before it is first used ({})", name,
          last_use, first_use);
  require(bytes <= (size_t(1) << 56), "memory plan: buffer '{}' of {} bytes is implausibly large", name, bytes);
  PlannedBuffer b;
  b.name = std::move(name);
  b.category = category;
  b.bytes = bytes;
  b.first_use = first_use;
  b.last_use = last_use;
  b.in_arena = in_arena;
  b.aligned_bytes = in_arena ? (bytes + alignment_ - 1) / alignment_ * alignment_ : bytes;
  buffers_.push_back(std::move(b));
  packed_ = false;
  return int(buffers_.size()) - 1;
}

int MemoryPlan::add(std::string name, MemoryCategory category, size_t bytes, int32_t first_use, int32_t last_use) {
  return add_buffer(std::move(name), category, bytes, first_use, last_use, true);
}

int MemoryPlan::add_external(std::string name, MemoryCategory category, size_t bytes, int32_t first_use,
                             int32_t last_use) {
  return add_buffer(std::move(name), category, bytes, first_use, last_use, false);
}

namespace {

bool lifetimes_overlap(const PlannedBuffer& a, const PlannedBuffer& b) {
  return a.first_use <= b.last_use && b.first_use <= a.last_use;
}

// Places buffers in `order`, each at the smallest gap (between already placed buffers whose
// lifetimes overlap its own) that holds it, or above all of them. Returns the arena size.
size_t place_best_fit(std::vector<PlannedBuffer>& buffers, const std::vector<size_t>& order,
                      std::vector<size_t>& offsets) {
  std::vector<size_t> placed;  // ids, sorted by offset
  placed.reserve(order.size());
  size_t arena = 0;
  for (size_t id : order) {
    const auto& b = buffers[id];
    size_t best_offset = 0, best_gap = ~size_t(0), frontier = 0;
    bool found = false;
    for (size_t p : placed) {
      const auto& q = buffers[p];
      if (!lifetimes_overlap(b, q)) continue;
      if (offsets[p] >= frontier) {
        const size_t gap = offsets[p] - frontier;
        if (gap >= b.aligned_bytes && gap < best_gap) best_gap = gap, best_offset = frontier, found = true;
      }
      frontier = std::max(frontier, offsets[p] + q.aligned_bytes);
    }
    offsets[id] = found ? best_offset : frontier;
    arena = std::max(arena, offsets[id] + b.aligned_bytes);
    auto at = std::upper_bound(placed.begin(), placed.end(), offsets[id],
                               [&](size_t off, size_t p) { return off < offsets[p]; });
    placed.insert(at, id);
  }
  return arena;
}

}  // namespace

void MemoryPlan::pack() const {
  if (packed_) return;
  std::vector<size_t> arena_ids;
  for (size_t i = 0; i < buffers_.size(); ++i)
    if (buffers_[i].in_arena && buffers_[i].aligned_bytes > 0) arena_ids.push_back(i);

  // Two greedy orders; the smaller arena wins (ties: the first). Largest first is the classic
  // best-fit-by-size order; longest-lived first keeps the persistent buffers at the bottom so the
  // short-lived ones tile the space above them.
  auto by_size = arena_ids;
  std::stable_sort(by_size.begin(), by_size.end(), [&](size_t a, size_t b) {
    const auto &x = buffers_[a], &y = buffers_[b];
    if (x.aligned_bytes != y.aligned_bytes) return x.aligned_bytes > y.aligned_bytes;
    return x.first_use < y.first_use;
  });
  auto by_lifetime = arena_ids;
  std::stable_sort(by_lifetime.begin(), by_lifetime.end(), [&](size_t a, size_t b) {
    const auto &x = buffers_[a], &y = buffers_[b];
    const int64_t lx = int64_t(x.last_use) - x.first_use, ly = int64_t(y.last_use) - y.first_use;
    if (lx != ly) return lx > ly;
    if (x.aligned_bytes != y.aligned_bytes) return x.aligned_bytes > y.aligned_bytes;
    return x.first_use < y.first_use;
  });
  std::vector<size_t> offsets_a(buffers_.size(), 0), offsets_b(buffers_.size(), 0);
  const size_t arena_a = place_best_fit(buffers_, by_size, offsets_a);
  const size_t arena_b = place_best_fit(buffers_, by_lifetime, offsets_b);
  const auto& offsets = arena_b < arena_a ? offsets_b : offsets_a;
  for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].offset = buffers_[i].in_arena ? offsets[i] : 0;
  arena_bytes_ = std::min(arena_a, arena_b);

  // Peaks of simultaneously live bytes, in the arena and outside it.
  auto sweep = [&](bool in_arena, size_t& peak, int32_t& position) {
    std::vector<std::pair<int64_t, int64_t>> events;  // (position, +bytes at start / -bytes after end)
    for (const auto& b : buffers_) {
      if (b.in_arena != in_arena || b.aligned_bytes == 0) continue;
      events.push_back({b.first_use, int64_t(b.aligned_bytes)});
      events.push_back({int64_t(b.last_use) + 1, -int64_t(b.aligned_bytes)});
    }
    std::sort(events.begin(), events.end());  // at one position, ends (negative) before starts
    int64_t live = 0;
    peak = 0;
    position = events.empty() ? 0 : int32_t(events.front().first);
    for (size_t i = 0; i < events.size(); ++i) {
      live += events[i].second;
      const bool last_at_position = i + 1 == events.size() || events[i + 1].first != events[i].first;
      if (last_at_position && live > int64_t(peak)) {
        peak = size_t(live);
        position = int32_t(events[i].first);
      }
    }
  };
  sweep(true, peak_live_bytes_, peak_position_);
  sweep(false, external_peak_bytes_, external_peak_position_);
  packed_ = true;
}

size_t MemoryPlan::offset(int id) const {
  pack();
  return buffers_.at(size_t(id)).offset;
}

size_t MemoryPlan::arena_bytes() const {
  pack();
  return arena_bytes_;
}

size_t MemoryPlan::peak_live_bytes() const {
  pack();
  return peak_live_bytes_;
}

int32_t MemoryPlan::peak_position() const {
  pack();
  return peak_position_;
}

size_t MemoryPlan::naive_bytes() const {
  size_t total = 0;
  for (const auto& b : buffers_)
    if (b.in_arena) total += b.aligned_bytes;
  return total;
}

size_t MemoryPlan::external_bytes() const {
  pack();
  return external_peak_bytes_;
}

int32_t MemoryPlan::external_peak_position() const {
  pack();
  return external_peak_position_;
}

size_t MemoryPlan::external_bytes_at(int32_t position) const {
  size_t total = 0;
  for (const auto& b : buffers_)
    if (!b.in_arena && b.first_use <= position && position <= b.last_use) total += b.bytes;
  return total;
}

size_t MemoryPlan::category_bytes_at_peak(MemoryCategory c) const {
  pack();
  size_t total = 0;
  for (const auto& b : buffers_) {
    if (b.category != c) continue;
    const int32_t at = b.in_arena ? peak_position_ : external_peak_position_;
    if (b.first_use <= at && at <= b.last_use) total += b.aligned_bytes;
  }
  return total;
}

size_t MemoryPlan::category_bytes(MemoryCategory c) const {
  size_t total = 0;
  for (const auto& b : buffers_)
    if (b.category == c) total += b.in_arena ? b.aligned_bytes : b.bytes;
  return total;
}

std::string MemoryPlan::breakdown() const {
  pack();
  std::string out;
  for (int c = 0; c < kMemoryCategories; ++c) {
    const auto cat = MemoryCategory(c);
    const size_t at_peak = category_bytes_at_peak(cat);
    if (at_peak == 0 && category_bytes(cat) == 0) continue;
    out += fmt::format("  {:<18} {:>12}\n", category_name(cat), format_bytes(double(at_peak)));
  }
  out += fmt::format(
      "  {:<18} {:>12}  (arena {} = peak {} + {:.2f}% packing waste; {} buffers would take {} "
      "unshared)\n",
      "packing waste", format_bytes(double(arena_bytes_ - peak_live_bytes_)), format_bytes(double(arena_bytes_)),
      format_bytes(double(peak_live_bytes_)), 100.0 * waste(), buffers_.size(), format_bytes(double(naive_bytes())));
  out += fmt::format("  {:<18} {:>12}\n", "total", format_bytes(double(total_bytes())));
  return out;
}

void MemoryPlan::require_fits(size_t cap_bytes, std::string_view what) const {
  if (cap_bytes == 0 || arena_bytes() <= cap_bytes) return;
  fail("{}: the memory plan needs a {} arena, more than the {} allowed:\n{}", what, format_bytes(double(arena_bytes())),
       format_bytes(double(cap_bytes)), breakdown());
}

// ---- Arena ----

Arena::Arena(size_t bytes) : size_(bytes) {
  if (bytes == 0) return;
  constexpr size_t kPage = 4096;
  mapped_ = (bytes + MemoryPlan::kHugePage - 1) / MemoryPlan::kHugePage * MemoryPlan::kHugePage;
  // Map one huge page more than needed and trim, so the arena starts on a 2 MiB boundary and the
  // kernel can back all of it with huge pages.
  const size_t reserve = mapped_ + MemoryPlan::kHugePage;
  void* raw = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) fail("cannot map a {} memory arena: {}", format_bytes(double(mapped_)), std::strerror(errno));
  const auto base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (base + MemoryPlan::kHugePage - 1) & ~uintptr_t(MemoryPlan::kHugePage - 1);
  if (aligned > base) munmap(raw, aligned - base);
  const uintptr_t end = base + reserve, used_end = aligned + mapped_;
  if (end > used_end) munmap(reinterpret_cast<void*>(used_end), end - used_end);
  data_ = reinterpret_cast<std::byte*>(aligned);
#ifdef MADV_HUGEPAGE
  madvise(data_, mapped_, MADV_HUGEPAGE);  // advisory: without transparent huge pages, 4 KiB pages
#endif
  // Write every page now: page faults (and the kernel's zeroing) happen here, not in step 1. On all
  // of the process's threads, huge page by huge page: the kernel zeroes each faulting page on the
  // thread that touched it, so one thread took 9.6-11.2 s for 1.2 GB where a VM hands out fresh
  // memory slowly, two threads 5.4 s (2026-12-04, three alternating runs each).
  const int64_t huge_pages = int64_t(mapped_ / MemoryPlan::kHugePage);
  parallel_for(huge_pages, huge_pages > 1, [&](int64_t begin, int64_t end) {
    for (size_t i = size_t(begin) * MemoryPlan::kHugePage; i < size_t(end) * MemoryPlan::kHugePage; i += kPage)
      reinterpret_cast<volatile char*>(data_)[i] = 0;
  });
}

Arena::~Arena() {
  if (data_) munmap(data_, mapped_);
}

Arena::Arena(Arena&& other) noexcept : data_(other.data_), size_(other.size_), mapped_(other.mapped_) {
  other.data_ = nullptr;
  other.size_ = other.mapped_ = 0;
}

Arena& Arena::operator=(Arena&& other) noexcept {
  if (this != &other) {
    if (data_) munmap(data_, mapped_);
    data_ = other.data_;
    size_ = other.size_;
    mapped_ = other.mapped_;
    other.data_ = nullptr;
    other.size_ = other.mapped_ = 0;
  }
  return *this;
}

}  // namespace keel
