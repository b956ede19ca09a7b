#include "keel/train/sharded_saves.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "keel/core/error.h"
#include "keel/core/stopwatch.h"

namespace keel::train {
namespace {

using Clock = std::chrono::steady_clock;

// A failed rank's error, every rank's gathered on every rank (only after the sum said one failed:
// every rank calls it then). Cut to a fixed size: collectives move fixed sizes.
constexpr int64_t kErrorBytes = 1024;

}  // namespace

std::vector<FlatRange> ShardedSaves::windows_for(const std::vector<FlatRange>& zero_shards, int64_t total, int ranks) {
  if (!zero_shards.empty()) return zero_shards;
  return shard_ranges(total, ranks);
}

ShardedSaves::ShardedSaves(ShardedSaveOptions options, distributed::Communicator& comm, model::ParamStore& trained,
                           std::vector<FlatRange> windows)
    : options_(std::move(options)),
      comm_(comm),
      trained_(trained),
      windows_(std::move(windows)),
      writer_(options_.async, options_.staging_bytes) {
  require(int(windows_.size()) == comm_.size(), "sharded checkpoints: {} windows for {} ranks", windows_.size(),
          comm_.size());
  const FlatRange mine = windows_[size_t(comm_.rank())];
  require(mine.intersect(trained_.master_range()).size() == mine.size() &&
              mine.intersect(trained_.optimizer_range()).size() == mine.size(),
          "sharded checkpoints: rank {} writes [{}, {}) but holds masters [{}, {}) and moments [{}, {})", comm_.rank(),
          mine.begin, mine.end, trained_.master_range().begin, trained_.master_range().end,
          trained_.optimizer_range().begin, trained_.optimizer_range().end);
  writer_.prepare(trained_.params(), mine);
}

double ShardedSaves::save(const checkpoint::TrainingState& state, const std::string& recipe,
                          std::vector<std::string>* notes, bool* saved) {
  const auto t0 = Clock::now();
  if (pending_) {  // at most one save in flight: the previous one agreed on first
    local_error_ = writer_.wait();
    local_done_ = true;
    double slots[kSlots] = {0, 0};
    contribute(slots);
    comm_.allreduce_totals(slots, kSlots);
    agreed(slots, notes);
  }
  ++record_.attempted;
  pending_ = true;
  pending_state_ = state;
  pending_recipe_ = recipe;
  local_done_ = false;
  local_error_.clear();
  const FlatRange mine = windows_[size_t(comm_.rank())];
  const checkpoint::HeldState held{trained_.masters(), trained_.master_range(), trained_.adam_m(), trained_.adam_v(),
                                   trained_.optimizer_range()};
  const std::string tmp = checkpoint::sharded_step_tmp(options_.dir, state.step);
  try {
    writer_.write(tmp, comm_.rank(), comm_.size(), trained_.params(), mine, held);
    if (!options_.async) local_done_ = true;
  } catch (const Error& e) {  // synchronous: this rank's part failed (the others are told below)
    local_done_ = true;
    local_error_ = e.what();
  }
  *saved = true;
  if (!options_.async) {
    double slots[kSlots] = {0, 0};
    contribute(slots);
    comm_.allreduce_totals(slots, kSlots);
    *saved = slots[1] == 0;
    agreed(slots, notes);
  }
  return seconds_since(t0);
}

double ShardedSaves::before_optimizer_step() { return pending_ ? writer_.wait_released() : 0.0; }

void ShardedSaves::contribute(double* slots) {
  if (!pending_) return;
  if (!local_done_ && writer_.finished()) {
    local_error_ = writer_.wait();
    local_done_ = true;
  }
  if (local_done_) slots[local_error_.empty() ? 0 : 1] += 1.0;
}

void ShardedSaves::agreed(const double* slots, std::vector<std::string>* notes) {
  if (!pending_ || slots[0] + slots[1] < double(comm_.size())) return;  // a rank is still writing
  settle(slots, notes);
}

void ShardedSaves::settle(const double* slots, std::vector<std::string>* notes) {
  pending_ = false;
  const std::string tmp = checkpoint::sharded_step_tmp(options_.dir, pending_state_.step);
  const std::string name = fmt::format("{}/step-{:08d}", options_.dir, pending_state_.step);
  std::string failure;
  if (slots[1] > 0) {  // a rank's part failed: every rank says why, rank 0 reports it
    char mine[kErrorBytes] = {};
    std::strncpy(mine, local_error_.c_str(), kErrorBytes - 1);
    std::vector<char> all(size_t(kErrorBytes) * size_t(comm_.size()));
    comm_.allgather(mine, all.data(), kErrorBytes);
    for (int rank = 0; rank < comm_.size(); ++rank) {
      const char* text = all.data() + size_t(rank) * kErrorBytes;
      if (*text) failure += fmt::format("{}rank {}: {}", failure.empty() ? "" : "; ", rank, text);
    }
  } else if (comm_.rank() == 0) {
    try {
      checkpoint::commit_sharded_checkpoint(options_.dir, tmp, windows_, options_.zero_stage, trained_.params(),
                                            pending_state_, pending_recipe_, options_.keep_last_n);
    } catch (const Error& e) {
      failure = e.what();
    }
  }
  if (comm_.rank() != 0) return;
  if (failure.empty()) {
    record_.failed_in_a_row = 0;
    record_.last_saved_step = pending_state_.step;
    return;
  }
  ++record_.failed;
  ++record_.failed_in_a_row;
  std::error_code ignored;
  std::filesystem::remove_all(tmp, ignored);  // every rank has finished with it (the agreement)
  last_failure_ = fmt::format("checkpoint {}: {}", name, failure);
  // A full disk on any rank: the next save gets the room (the state has moved on since this one,
  // so it is not written again), as the single-file layout's rule (checkpoint::make_room).
  std::string room;
  if (checkpoint::is_out_of_space(failure) && checkpoint::make_room(options_.dir, &room))
    notes->push_back("keel: " + room + "; the next save has room");
  require(!fail_on_error, "checkpoint save failed: {}", last_failure_);
  notes->push_back(fmt::format(
      "warning: checkpoint save failed ({}); training continues, next try at the next interval; `latest` still "
      "names the previous checkpoint",
      last_failure_));
}

std::string ShardedSaves::finish(std::vector<std::string>* notes) {
  if (pending_) {
    local_error_ = writer_.wait();
    local_done_ = true;
    double slots[kSlots] = {0, 0};
    contribute(slots);
    comm_.allreduce_totals(slots, kSlots);
    const bool saved_fail = fail_on_error;
    fail_on_error = false;  // the caller decides, as for the single-file layout's last save
    last_failure_.clear();
    agreed(slots, notes);
    fail_on_error = saved_fail;
    if (!last_failure_.empty() && !notes->empty()) notes->pop_back();  // said by the caller instead
    return last_failure_;
  }
  return "";
}

}  // namespace keel::train
