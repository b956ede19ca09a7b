// The reference model of DPO without a second model in memory (TRL's precompute_ref_log_probs):
// before step 1 the decoder's initial weights (under LoRA the base model: the adapters start at
// zero) score every pair once, and the log-probabilities are all that is kept of the reference:
// two doubles a pair. They are cached beside the prepared data, keyed by the model's weights, the
// pairs' ids and the precision, so a second run or a resume reuses them instead of a pass.
#pragma once
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

#include "keel/distributed/communicator.h"
#include "keel/model/decoder.h"
#include "keel/train/data_sources.h"
#include "keel/train/preference_loss.h"

namespace keel::train {

// Scores every pair of `source` with the decoder's weights as they are, `pairs_per_pass` pairs a
// forward pass. Each rank scores a share and the shares are summed over the ranks; every rank
// runs the same number of passes (ZeRO-3's gathers are collective).
ReferenceLogps compute_reference_logps(model::Decoder& decoder, const PairSource& source, int64_t pairs_per_pass,
                                       distributed::Communicator& comm);

// The cache file for `key` in `cache_dir`, and reading and writing it (atomically). A file of the
// wrong size or key is not used (nullopt).
std::string reference_logps_path(const std::string& cache_dir, const std::string& key);
std::optional<ReferenceLogps> load_reference_logps(const std::string& path, const std::string& key, int64_t pairs);
void save_reference_logps(const std::string& path, const std::string& key, const ReferenceLogps& logps);

}  // namespace keel::train
