// What every backend whose memory is the host's has in common (the CPU and reference backends):
// the arena is an mmap, copies are memcpy, and each operation has finished when it returns, so an
// event is complete as soon as it is recorded. Private to kernels/.
#pragma once
#include <atomic>
#include <cstring>

#include "keel/kernels/backend.h"

namespace keel::kernels {

class HostMemoryBackend : public Backend {
 public:
  Arena allocate(size_t bytes) override { return Arena(bytes); }
  void copy_to_device(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_on_device(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  ComputeEvent record_event() override { return {++events_}; }
  void wait_event(const ComputeEvent&) override {}
  void synchronize() override {}

 private:
  std::atomic<uint64_t> events_{0};  // one backend serves every thread of the process
};

}  // namespace keel::kernels
