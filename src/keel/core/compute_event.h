// A point in a compute backend's stream of work (kernels/backend.h records them). It lives in
// core because the data-parallel runtime carries one with each ready gradient to its collective:
// a device communicator waits for it before reading the gradient, without including the
// backend. On the CPU backends every operation has finished when it returns, so their events are
// complete when recorded.
#pragma once
#include <cstdint>

namespace keel {

struct ComputeEvent {
  uint64_t sequence = 0;  // events of one backend are ordered by it; 0: before any work
};

}  // namespace keel
