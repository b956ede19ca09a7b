// One background thread that runs one job at a time: an asynchronous checkpoint save (the
// single-file writer's and each rank's shard writer's). The caller hands a job over once the
// previous one has finished, and can wait for it; the destructor lets the job in flight finish,
// then joins. A job reports its own errors (it must not throw): the writers record theirs.
#pragma once
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

namespace keel {

class WorkerThread {
 public:
  WorkerThread();
  ~WorkerThread();
  WorkerThread(const WorkerThread&) = delete;
  WorkerThread& operator=(const WorkerThread&) = delete;

  // Waits for the job in flight, if any, then starts `job` on the thread.
  void run(std::function<void()> job);
  // Returns once no job is in flight.
  void wait();
  bool idle();

 private:
  void loop();
  std::mutex mutex_;
  std::condition_variable cv_;
  std::function<void()> job_;
  bool pending_ = false, stopping_ = false;
  std::thread thread_;  // last: started once the members it reads exist
};

}  // namespace keel
