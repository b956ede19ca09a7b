#include "keel/train/preference_stage.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "keel/core/checksum.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/train/reference_logps.h"

namespace keel::train {
namespace fs = std::filesystem;
namespace {

// The weight files of a model directory (or the adapter's), in name order, by content.
std::string directory_weights_key(const std::string& dir) {
  if (!dir.empty() && fs::is_regular_file(dir)) return checksum_hex(file_checksum(dir));  // a GGUF file
  if (dir.empty() || !fs::is_directory(dir)) return "-";
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.ends_with(".safetensors") || name == "config.json" || name == "adapter_config.json")
      files.push_back(name);
  }
  std::sort(files.begin(), files.end());
  std::string key;
  for (const auto& f : files) key += f + ":" + checksum_hex(file_checksum(dir + "/" + f)) + ";";
  return key;
}

std::string cache_dir_of(const recipe::Recipe& r) {
  if (!r.cache_dir.empty()) return r.cache_dir;
  const fs::path parent = fs::path(r.data_path).parent_path();
  return (parent.empty() ? fs::path(".") : parent).string() + "/.keel-cache";
}

}  // namespace

std::string reference_model_key(const recipe::Recipe& r) {
  // A new model's weights follow from its config and the seed; a loaded one's from its files.
  const std::string model =
      r.model_config ? fmt::format("scratch:{}:{}", checksum_hex(checksum(recipe::recipe_to_toml(r))), r.seed)
                     : directory_weights_key(r.model_name);
  return fmt::format("{}|{}|{}|{}|{}|{}|{}", model, directory_weights_key(r.adapter_name_or_path),
                     recipe::choice_name(r.dtype), r.quantization_bit, recipe::choice_name(r.quantization_type), r.backend,
                     r.max_seq_len);
}

std::string reference_cache_key(const std::string& model_key, const PairSource& pairs) {
  return checksum_hex(checksum(model_key + "|" + checksum_hex(pairs.pairs().checksum())));
}

PreferenceStage::PreferenceStage(const recipe::Recipe& r, const BatchSourceOptions& o, const BatchSourceOptions& eo,
                                 int rank, int ranks, std::ostream& log)
    : r_(r), rank_(rank), ranks_(ranks), log_(log) {
  train_owned_ = open_pair_source(r.data_path, r, o, log);
  train_ = train_owned_.get();
  if (!r.eval_data_path.empty()) eval_ = open_pair_source(r.eval_data_path, r, eo, log);
}

std::unique_ptr<BatchSource> PreferenceStage::take_source() {
  require(train_owned_ != nullptr, "preference stage: the training pairs were taken already");
  return std::move(train_owned_);
}

void PreferenceStage::prepare_reference(model::Decoder& decoder, distributed::Communicator& comm) {
  if (!needs_reference(r_.pref_loss)) return;
  struct Part {
    const PairSource* source;
    ReferenceLogps* out;
    const char* name;
  };
  const std::string dir = cache_dir_of(r_);
  const std::string model_key = reference_model_key(r_);  // reads every weight file once: both sets share it
  for (const Part& part : {Part{train_, &reference_, "training"}, Part{eval_.get(), &eval_reference_, "held-out"}}) {
    if (!part.source) continue;
    const std::string key = reference_cache_key(model_key, *part.source);
    const std::string path = reference_logps_path(dir, key);
    if (auto cached = load_reference_logps(path, key, part.source->pairs().size())) {
      *part.out = std::move(*cached);
      fmt::print(log_, "keel: reference log-probabilities of the {} pairs from {} (computed by an earlier run)\n",
                 part.name, path);
      continue;
    }
    const auto t0 = std::chrono::steady_clock::now();
    *part.out = compute_reference_logps(decoder, *part.source, r_.batch_size, comm);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rank_ == 0) {
      make_dirs(dir);
      save_reference_logps(path, key, *part.out);
    }
    fmt::print(log_,
               "keel: reference log-probabilities of {} {} pairs computed by the initial weights in {:.1f} s (one "
               "forward pass; no reference model is kept), cached in {}\n",
               part.source->pairs().size(), part.name, s, path);
  }
}

std::unique_ptr<Objective> PreferenceStage::make_objective() const {
  return std::make_unique<PreferenceObjective>(preference_loss_options(r_, rank_, ranks_),
                                               needs_reference(r_.pref_loss) ? &reference_ : nullptr);
}

void PreferenceStage::evaluate(model::Decoder& decoder, report::StepMetrics& m) const {
  require(eval_ != nullptr, "preference stage: no held-out pairs to evaluate");
  const int64_t n = eval_->pairs().size(), B = r_.batch_size;
  data::PackedMicroBatch mb = eval_->make_pair_batch(B);
  const size_t tokens = size_t(mb.batch * mb.seq);
  std::vector<double> nll(tokens), mean_logit(tokens);
  std::vector<RowScore> rows(size_t(2 * B));
  std::vector<int64_t> which(static_cast<size_t>(B), 0);
  PreferenceLossOptions o = preference_loss_options(r_, 0, 1);
  // As TRL's evaluation: each batch's means (its pairs, its answers' tokens), averaged over the batches;
  // the loss over every pair.
  report::PreferenceMetrics p;
  p.present = true;
  p.orpo = o.loss == recipe::PreferenceLoss::Orpo;
  double loss_sum = 0;
  int64_t batches = 0;
  for (int64_t first = 0; first < n; first += B, ++batches) {
    const int64_t count = std::min(B, n - first);
    for (int64_t b = 0; b < B; ++b) which[size_t(b)] = first + std::min(b, count - 1);
    eval_->fill(which, mb);
    const model::MicroBatch batch{mb.batch, mb.seq, mb.input_ids.data(), mb.targets.data(), mb.positions.data(),
                                  nullptr};
    decoder.forward_score(batch, {nll.data(), mean_logit.data()});
    score_rows(batch, mb.answer_starts.data(), nll.data(), mean_logit.data(), rows.data());
    double sums[11] = {}, logit_tokens[2] = {}, nll_tokens = 0;
    for (int64_t b = 0; b < count; ++b) {
      const RowScore& c = rows[size_t(b)];
      const RowScore& rj = rows[size_t(B + b)];
      PairScore s{c.logp, rj.logp, c.tokens, rj.tokens};
      if (needs_reference(o.loss)) {
        s.ref_c = eval_reference_.chosen[size_t(first + b)];
        s.ref_r = eval_reference_.rejected[size_t(first + b)];
      }
      const PairLoss l = pair_loss(o, s);
      const double v[] = {l.reward_c, l.reward_r, l.reward_c > l.reward_r ? 1.0 : 0.0, l.reward_c - l.reward_r,
                          l.logps_c, l.logps_r, c.logit_sum, rj.logit_sum, l.log_odds_ratio, l.log_odds_chosen,
                          c.all_nll};
      for (int k = 0; k < 11; ++k) sums[k] += v[k];
      logit_tokens[0] += double(c.tokens);
      logit_tokens[1] += double(rj.tokens);
      nll_tokens += double(c.all_tokens);
      loss_sum += l.loss;
    }
    const double c = double(count);
    p.rewards_chosen += sums[0] / c;
    p.rewards_rejected += sums[1] / c;
    p.rewards_accuracies += sums[2] / c;
    p.rewards_margins += sums[3] / c;
    p.logps_chosen += sums[4] / c;
    p.logps_rejected += sums[5] / c;
    p.logits_chosen += logit_tokens[0] > 0 ? sums[6] / logit_tokens[0] : 0.0;
    p.logits_rejected += logit_tokens[1] > 0 ? sums[7] / logit_tokens[1] : 0.0;
    p.log_odds_ratio += sums[8] / c;
    p.log_odds_chosen += sums[9] / c;
    const double batch_nll = nll_tokens > 0 ? sums[10] / nll_tokens : 0.0;
    p.nll_loss += batch_nll;
    if (o.ftx > 0) loss_sum += o.ftx * batch_nll * c;  // the batch's NLL term, weighted as its pairs
  }
  const double k = double(std::max<int64_t>(batches, 1));
  for (double* v : {&p.rewards_chosen, &p.rewards_rejected, &p.rewards_accuracies, &p.rewards_margins, &p.logps_chosen,
                    &p.logps_rejected, &p.logits_chosen, &p.logits_rejected, &p.log_odds_ratio, &p.log_odds_chosen,
                    &p.nll_loss})
    *v /= k;
  m.eval_loss = loss_sum / double(n);
  m.eval_perplexity = -1;  // no perplexity for a preference loss
  m.eval_preference = p;
}

std::string PreferenceStage::describe() const {
  std::string s = fmt::format("stage dpo: pref_loss = \"{}\", pref_beta = {}", recipe::choice_name(r_.pref_loss),
                              r_.pref_beta);
  if (r_.pref_loss == recipe::PreferenceLoss::Simpo) s += fmt::format(", simpo_gamma = {}", r_.simpo_gamma);
  if (r_.dpo_label_smoothing > 0) s += fmt::format(", dpo_label_smoothing = {}", r_.dpo_label_smoothing);
  if (r_.pref_ftx > 0) s += fmt::format(", pref_ftx = {}", r_.pref_ftx);
  s += fmt::format("; {} pairs, batch_size = {} pairs ({} rows: chosen answers, then rejected)", train_->pairs().size(),
                   r_.batch_size, 2 * r_.batch_size);
  s += needs_reference(r_.pref_loss) ? "; the reference is the initial weights' log-probabilities"
                                     : "; no reference model (this loss needs none)";
  return s;
}

}  // namespace keel::train
