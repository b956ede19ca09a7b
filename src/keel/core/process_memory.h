// What the process holds in memory, as the kernel counts it (/proc/self/status): the resident set
// now (VmRSS) and its high-water mark (VmHWM), to report next to the memory plan.
#pragma once
#include <cstddef>

namespace keel {

// Resident set size high-water mark of this process in bytes (VmHWM); 0 where /proc is missing.
size_t peak_resident_bytes();
// Resident set size now in bytes (VmRSS); 0 where /proc is missing.
size_t resident_bytes();
// Physical memory of the machine in bytes (0 if unknown).
size_t physical_memory_bytes();

}  // namespace keel
