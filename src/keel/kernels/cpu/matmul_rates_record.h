// A machine's measured bf16 and fp32 matmul rates, kept in a file so that every process on it
// decides how bf16 products run (kernels/gemm.h: bf16_products) from the same figures. Timed anew
// by every process, a machine whose two rates sit near the margin could decide one way in one run
// and the other way in the next, and two runs of one recipe would then differ in the last bits of
// every product; the ranks of one job could differ from each other too. Timed once and kept, the
// decision is the machine's. The file is a cache in the usual place, printed with the choice;
// deleting it measures again.
#pragma once
#include <functional>
#include <string>
#include <string_view>
#include <utility>

namespace keel::kernels {

struct RecordedRates {
  double bf16_flops = 0, f32_flops = 0;
  std::string measured_on;  // the day they were timed, YYYY-MM-DD
  bool recorded = false;    // read from the file (false: timed by this process)
  bool kept = false;        // in the file now (read from it, or written to it)
};

// The rates the file at `path` keeps for `machine`; where it keeps none (or is absent, unreadable
// or not a record), measure()'s, added to it. Reading, measuring and writing hold an exclusive lock
// on `path` + ".lock": the ranks of a job starting together on a machine without an entry measure
// once (the others wait, then read it) instead of each timing, slowed by the others, and deciding
// alone; and two machines sharing a home directory do not lose each other's entries. The file is
// rewritten whole under a temporary name and renamed. A file that cannot be locked, read or
// written never fails the caller: it measures.
RecordedRates recorded_rates(const std::string& path, const std::string& machine,
                             const std::function<std::pair<double, double>()>& measure);

// Where the rates are kept: $XDG_CACHE_HOME/keel/matmul-rates.json, else
// $HOME/.cache/keel/matmul-rates.json, else "" (nowhere: every process measures).
std::string matmul_rates_path();

// This CPU's model name, as /proc/cpuinfo gives it; where it has none (Arm), the machine's
// architecture and the CPU's implementer, variant and part numbers ("" when neither is there).
std::string cpu_model_name();
// The same from a /proc/cpuinfo text and uname's machine.
std::string cpu_model_name_from(std::string_view cpuinfo, std::string_view machine);

}  // namespace keel::kernels
