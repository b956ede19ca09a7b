// What both checkpoint layouts share about the files of a step directory: its name, the training
// state's JSON, and how a complete one is published (the rename that makes it visible, then the
// `latest` pointer). Internal to the checkpoint room.
#pragma once
#include <cstdint>
#include <string>

#include "keel/checkpoint/checkpoint.h"

namespace keel::checkpoint {

std::string step_name(int64_t step);  // "step-00000200"
std::string state_json(const TrainingState& s);
void sync_directory(const std::string& dir);
// `tmp` (every file in it fsynced) becomes dir/final_name, then dir/latest names it, then the
// checkpoints beyond keep_last_n are removed. Each step is one rename: a kill at any moment leaves
// either the previous `latest` or the new one, both complete.
void publish_checkpoint(const std::string& dir, const std::string& tmp, const std::string& final_name,
                        int64_t keep_last_n);

}  // namespace keel::checkpoint
