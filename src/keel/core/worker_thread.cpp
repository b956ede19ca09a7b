#include "keel/core/worker_thread.h"

#include <utility>

namespace keel {

WorkerThread::WorkerThread() : thread_([this] { loop(); }) {}

WorkerThread::~WorkerThread() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return !pending_; });
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void WorkerThread::run(std::function<void()> job) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return !pending_; });  // at most one job in flight
    job_ = std::move(job);
    pending_ = true;
  }
  cv_.notify_all();
}

void WorkerThread::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return !pending_; });
}

bool WorkerThread::idle() {
  std::lock_guard<std::mutex> lock(mutex_);
  return !pending_;
}

void WorkerThread::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [this] { return pending_ || stopping_; });
    if (!pending_ && stopping_) return;
    std::function<void()> job = std::move(job_);
    lock.unlock();
    job();
    lock.lock();
    pending_ = false;
    cv_.notify_all();
  }
}

}  // namespace keel
