// Preference losses on chosen/rejected pairs (stage = "dpo"), numerically TRL's (trl 1.16):
//
//   logp(y|x) = sum over the answer's tokens of log p(token | everything before it)
//   (SimPO and ORPO: that sum divided by the answer's token count, "average_log_prob")
//   r_c = logp_c - ref_c, r_r = logp_r - ref_r    (ref: the same under the initial weights)
//
//   sigmoid (DPO)  l = -(1-e) log sigmoid(b (r_c - r_r)) - e log sigmoid(-b (r_c - r_r))   e: dpo_label_smoothing
//   hinge          l = relu(1 - b (r_c - r_r))
//   ipo            l = (r_c / n_c - r_r / n_r - 1 / (2b))^2     (TRL's length-normalised IPO)
//   simpo          l = -(1-e) log sigmoid(b (logp_c - logp_r) - gamma) - e log sigmoid(-(...))   (CPO, cpo_alpha = 0)
//   orpo           l = -b log sigmoid(log odds(logp_c) - log odds(logp_r)),  odds(p) = p / (1 - p)
//
// The step's loss is the mean of l over its pairs, plus pref_ftx (ORPO: 1) times the mean over the
// step's micro-batches of each one's mean NLL of its chosen tokens (TRL's "sft" loss_type, ORPO's
// nll_loss). Each pair's two answers are in one micro-batch (data/pair_source.h), so the pair's
// loss and its gradient with respect to logp_c and logp_r are known once that micro-batch is
// scored; the tokens' gradients follow from dl/dlogp (Decoder::forward_backward_weighted): no
// logits are kept, and nothing of the reference model is in memory but its log-probabilities.
//
// Metrics (TRL's names and definitions): rewards/chosen and /rejected (b r_c, b r_r; SimPO and
// ORPO: b logp), rewards/accuracies (the share of pairs with chosen's reward above rejected's),
// rewards/margins, logps/chosen and /rejected, logits/chosen and /rejected (the mean over the
// answers' tokens of the mean logit over the vocabulary, per micro-batch, then averaged over the
// step's micro-batches as TRL's log() averages its per-call values); ORPO adds log_odds_ratio,
// log_odds_chosen and nll_loss.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "keel/report/metrics.h"
#include "keel/recipe/recipe.h"
#include "keel/train/objective.h"

namespace keel::train {

// The reference model's log-probabilities of each pair's answers (summed over the answer's tokens).
struct ReferenceLogps {
  std::vector<double> chosen, rejected;  // [pairs]
};

struct PreferenceLossOptions {
  recipe::PreferenceLoss loss = recipe::PreferenceLoss::Sigmoid;
  double beta = 0.1, ftx = 0, gamma = 0.5, label_smoothing = 0;
  int64_t pairs_per_micro_batch = 1;
  int64_t micro_batches = 1;  // in a step, over all ranks
  int64_t rank = 0, ranks = 1;  // micro-batch i of this rank is the step's (i * ranks + rank)-th
  int64_t seq = 0;
};
PreferenceLossOptions preference_loss_options(const recipe::Recipe& recipe, int64_t rank, int64_t ranks);
// Whether the loss compares with a reference model (SimPO and ORPO do not).
bool needs_reference(recipe::PreferenceLoss loss);

// One pair's log-probabilities and what the loss makes of them.
struct PairScore {
  double logp_c = 0, logp_r = 0;  // summed over the answers' tokens
  int64_t n_c = 0, n_r = 0;       // the answers' tokens
  double ref_c = 0, ref_r = 0;
};
struct PairLoss {
  double loss = 0;
  double dlogp_c = 0, dlogp_r = 0;  // d loss / d logp (the summed ones)
  double reward_c = 0, reward_r = 0;
  double logps_c = 0, logps_r = 0;    // as TRL's logps/* report them
  double log_odds_ratio = 0, log_odds_chosen = 0;  // ORPO
};
PairLoss pair_loss(const PreferenceLossOptions& o, const PairScore& s);

// Scores the rows of a forward pass: each row's answer (its targets from answer_starts[row] on):
// summed log-probability, token count and summed mean logits; and over all its targets (ORPO's
// NLL term: the prompt's too) the summed NLL and the count.
struct RowScore {
  double logp = 0, logit_sum = 0;
  int64_t tokens = 0;
  double all_nll = 0;
  int64_t all_tokens = 0;
};
void score_rows(const model::MicroBatch& batch, const int32_t* answer_starts, const double* nll,
                const double* mean_logit, RowScore* out);

// The metrics from the summed partial_metrics() of a step (or of an evaluation pass).
report::PreferenceMetrics preference_metrics(const PreferenceLossOptions& options, std::span<const double> sums);

class PreferenceObjective final : public Objective, private model::Decoder::TokenWeighting {
 public:
  // `reference` (not owned) may be null for the losses that need none.
  PreferenceObjective(const PreferenceLossOptions& options, const ReferenceLogps* reference);

  void begin_step(const StepTotals& totals) override;
  void micro_batch(model::Decoder& decoder, const model::MicroBatch& batch,
                   const data::PackedMicroBatch& rows) override;
  double partial_loss() const override { return loss_sum_; }
  double step_loss(double summed) const override { return summed; }
  std::span<double> partial_metrics() override { return metrics_; }
  void report(std::span<const double> summed_metrics, report::StepMetrics& m) const override;

 private:
  void weigh(const double* nll, const double* mean_logit, float* weight) override;

  PreferenceLossOptions o_;
  const ReferenceLogps* reference_;
  // Per micro-batch: scores of its rows (reused), and what weigh() needs of the batch.
  std::vector<double> nll_, mean_logit_;
  std::vector<float> weights_;
  std::vector<RowScore> row_scores_;  // [2 * pairs]: the micro-batch's rows scored
  const model::MicroBatch* batch_ = nullptr;
  const data::PackedMicroBatch* rows_ = nullptr;
  int64_t micro_index_ = 0;
  double loss_sum_ = 0;
  std::vector<double> metrics_;  // the sums report() reads, in its order
};

}  // namespace keel::train
