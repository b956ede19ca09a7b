// TensorBoard event files (recipe `report_to = "tensorboard"`, transformers' key): every value of
// metrics.jsonl as a scalar, the resolved recipe as text, under output_dir/runs/.
//
// The format is TensorFlow's: a file of TFRecords (length, masked CRC-32C of the length, an
// `Event` protocol buffer, masked CRC-32C of it), the first record naming the version
// ("brain.Event:2"). keel encodes the few messages it needs by hand (tensorboard.cpp) rather than
// linking protobuf; tests/reference/tensorboard_reference.py reads the files back with
// TensorBoard's own EventAccumulator.
//
// A resumed run starts a new file whose first event after the version is SessionLog START at the
// first step it trains: TensorBoard's readers then drop what an earlier file logged from that step
// on (steps the interrupted run took after its last checkpoint), as metrics.jsonl drops those lines.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "keel/report/metrics.h"

namespace keel::report {

class EventFileWriter {
 public:
  // Creates `dir` if needed and a new file events.out.tfevents.<seconds>.<host>.<pid>.<n> in it.
  explicit EventFileWriter(const std::string& dir);
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  void add_scalar(std::string_view tag, double value, int64_t step);
  // Text as torch's SummaryWriter.add_text writes it: tag "<tag>/text_summary", the text plugin.
  void add_text(std::string_view tag, std::string_view text, int64_t step);
  // SessionLog START at `step`: readers discard earlier files' events from `step` on.
  void add_session_start(int64_t step);
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

// A run's TensorBoard log: the recipe once, each step's metrics, flushed every log interval.
class TensorBoardLog {
 public:
  // `first_step` is the step the run trains first (1, or the checkpoint's step + 1 when resuming).
  TensorBoardLog(const std::string& output_dir, std::string_view recipe_toml, int64_t first_step,
                 int64_t log_interval);
  // Tags: "train/<name>" for each value of metrics.jsonl, "eval/loss" and "eval/perplexity".
  void write(const StepMetrics& m);
  void flush() { events_.flush(); }
  const std::string& path() const { return events_.path(); }

 private:
  EventFileWriter events_;
  int64_t log_interval_;
};

}  // namespace keel::report
