// What `keel plan` prints of a training run's memory plan (plan/training_plan.h builds it): the
// model and run, the per-rank breakdown by category and what each category holds, a verdict against
// the device memory and memory_pool_size and, when it does not fit, what to change (each
// alternative planned with the same planner).
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "keel/plan/training_plan.h"
#include "keel/recipe/recipe.h"

namespace keel::report {

using plan::RunShape;

struct PlanRequest {
  int64_t dp = 0;                  // 0: the recipe's dp_degree
  int zero_stage = -1;             // 0, 1 or 2; -1: the recipe's zero_stage
  size_t device_memory_bytes = 0;  // per rank; 0: no device check
};

// The report `keel plan` prints: the model and run, the per-rank breakdown by category and the
// total, whether it fits the device memory and memory_pool_size, and when it does not, the
// micro-batch, gradient checkpointing, ZeRO-1 and sequence-length changes that make it fit (each
// planned with the same planner).
struct MemoryReport {
  std::string text;
  // Whether the configured run fits the device memory and memory_pool_size; nullopt when neither
  // is given (nothing to check). `keel plan` exits 3 when this is false.
  std::optional<bool> fits;
};
MemoryReport memory_report(const recipe::Recipe& recipe, const PlanRequest& request);

// The plan of the configured run as one JSON object: total, arena, live peak, waste, bytes outside
// the arena, and bytes per category at the peak (for scripts and benchmarks).
// "fits" is true, false or null as MemoryReport::fits.
MemoryReport memory_report_json(const recipe::Recipe& recipe, const PlanRequest& request);

// "64GB", "64 GiB", "512MiB", "1.5TB", "64" (GiB): memory sizes in binary units, as device memory is
// quoted (a "64 GB" card holds 64 GiB). keel::Error for anything else.
size_t parse_memory_size(std::string_view text);

}  // namespace keel::report
