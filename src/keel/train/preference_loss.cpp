#include "keel/train/preference_loss.h"

#include <algorithm>
#include <cmath>

#include "keel/core/error.h"

namespace keel::train {
namespace {

// log sigmoid(x) and sigmoid(x) without overflow for any x.
double log_sigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }
double sigmoid(double x) { return x >= 0 ? 1 / (1 + std::exp(-x)) : std::exp(x) / (1 + std::exp(x)); }

// The sums behind the metrics, in this order, then four per micro-batch of the step (the logit sums
// and token counts of its chosen and rejected answers), at the micro-batch's place in the whole
// step: data parallel sums every rank's vector, and the metrics are those of one rank with all the
// micro-batches (as the loss is).
enum Sum { kRewardC, kRewardR, kAccurate, kMargin, kLogpC, kLogpR, kLogOddsRatio, kLogOddsChosen, kNll, kSums };
constexpr int kPerMicroBatch = 4;

}  // namespace

bool needs_reference(recipe::PreferenceLoss loss) {
  return loss != recipe::PreferenceLoss::Simpo && loss != recipe::PreferenceLoss::Orpo;
}

PreferenceLossOptions preference_loss_options(const recipe::Recipe& r, int64_t rank, int64_t ranks) {
  return {.loss = r.pref_loss,
          .beta = r.pref_beta,
          .ftx = r.pref_loss == recipe::PreferenceLoss::Orpo ? 1.0 : r.pref_ftx,
          .gamma = r.simpo_gamma,
          .label_smoothing = r.dpo_label_smoothing,
          .pairs_per_micro_batch = r.batch_size,
          .micro_batches = r.gradient_accumulation_steps * ranks,
          .rank = rank,
          .ranks = ranks,
          .seq = r.max_seq_len};
}

PairLoss pair_loss(const PreferenceLossOptions& o, const PairScore& s) {
  using L = recipe::PreferenceLoss;
  const double b = o.beta, e = o.label_smoothing;
  PairLoss out;
  if (o.loss == L::Simpo || o.loss == L::Orpo) {  // average_log_prob: the answers' mean token log-probability
    const double nc = double(std::max<int64_t>(s.n_c, 1)), nr = double(std::max<int64_t>(s.n_r, 1));
    const double pc = s.logp_c / nc, pr = s.logp_r / nr;
    double dpc = 0, dpr = 0;
    if (o.loss == L::Simpo) {
      // CPOTrainer: logits = (pc - pr) - gamma / beta; l = -(1-e) logsig(b logits) - e logsig(-b logits)
      const double x = b * ((pc - pr) - o.gamma / b);
      out.loss = -(1 - e) * log_sigmoid(x) - e * log_sigmoid(-x);
      const double dx = -(1 - e) * sigmoid(-x) + e * sigmoid(x);
      dpc = b * dx;
      dpr = -b * dx;
    } else {
      // ORPOTrainer: log odds = (pc - pr) - (log1p(-exp(pc)) - log1p(-exp(pr))); l = -b logsig(log odds)
      const double odds = (pc - pr) - (std::log1p(-std::exp(pc)) - std::log1p(-std::exp(pr)));
      const double ratio = log_sigmoid(odds);
      out.loss = -b * ratio;
      const double dodds = -b * sigmoid(-odds);
      dpc = dodds / -std::expm1(pc);  // d odds / d pc = 1 / (1 - exp(pc))
      dpr = -dodds / -std::expm1(pr);
      out.log_odds_ratio = ratio;
      out.log_odds_chosen = odds;
    }
    out.dlogp_c = dpc / nc;
    out.dlogp_r = dpr / nr;
    out.reward_c = b * pc;
    out.reward_r = b * pr;
    out.logps_c = pc;
    out.logps_r = pr;
    return out;
  }
  const double rc = s.logp_c - s.ref_c, rr = s.logp_r - s.ref_r, delta = rc - rr;
  switch (o.loss) {
    case L::Sigmoid: {
      const double x = b * delta;
      out.loss = -(1 - e) * log_sigmoid(x) - e * log_sigmoid(-x);
      out.dlogp_c = b * (-(1 - e) * sigmoid(-x) + e * sigmoid(x));
      out.dlogp_r = -out.dlogp_c;
      break;
    }
    case L::Hinge: {
      const double x = 1 - b * delta;
      out.loss = std::max(x, 0.0);
      out.dlogp_c = x > 0 ? -b : 0.0;  // torch's relu has gradient 0 at 0
      out.dlogp_r = -out.dlogp_c;
      break;
    }
    case L::Ipo: {
      const double nc = double(std::max<int64_t>(s.n_c, 1)), nr = double(std::max<int64_t>(s.n_r, 1));
      const double d = rc / nc - rr / nr - 1 / (2 * b);
      out.loss = d * d;
      out.dlogp_c = 2 * d / nc;
      out.dlogp_r = -2 * d / nr;
      break;
    }
    default: fail("pair_loss: unknown preference loss");
  }
  out.reward_c = b * rc;
  out.reward_r = b * rr;
  out.logps_c = s.logp_c;
  out.logps_r = s.logp_r;
  return out;
}

void score_rows(const model::MicroBatch& batch, const int32_t* answer_starts, const double* nll,
                const double* mean_logit, RowScore* out) {
  for (int64_t row = 0; row < batch.batch; ++row) {
    RowScore s;
    const int64_t first = row * batch.seq, answer = first + answer_starts[row] - 1;  // predicts the answer's first token
    for (int64_t t = first, end = first + batch.seq; t < end; ++t) {
      if (batch.targets[t] == -100) continue;
      s.all_nll += nll[t];
      ++s.all_tokens;
      if (t < answer) continue;
      s.logp -= nll[t];
      s.logit_sum += mean_logit[t];
      ++s.tokens;
    }
    out[row] = s;
  }
}

PreferenceObjective::PreferenceObjective(const PreferenceLossOptions& o, const ReferenceLogps* reference)
    : o_(o), reference_(reference) {
  require(reference_ || !needs_reference(o.loss), "preference loss: this loss needs the reference log-probabilities");
  const size_t tokens = size_t(2 * o.pairs_per_micro_batch * o.seq);
  nll_.resize(tokens);
  mean_logit_.resize(tokens);
  weights_.resize(tokens);
  row_scores_.resize(size_t(2 * o.pairs_per_micro_batch));
  metrics_.resize(size_t(kSums + kPerMicroBatch * o.micro_batches));
}

void PreferenceObjective::begin_step(const StepTotals&) {
  loss_sum_ = 0;
  micro_index_ = 0;
  std::fill(metrics_.begin(), metrics_.end(), 0.0);
}

void PreferenceObjective::micro_batch(model::Decoder& decoder, const model::MicroBatch& batch,
                                      const data::PackedMicroBatch& rows) {
  require(batch.batch == 2 * o_.pairs_per_micro_batch && int64_t(rows.pairs.size()) == o_.pairs_per_micro_batch &&
              int64_t(rows.answer_starts.size()) == batch.batch,
          "preference loss: a micro-batch of {} rows, {} pairs (expected {} pairs in twice as many rows)", batch.batch,
          rows.pairs.size(), o_.pairs_per_micro_batch);
  batch_ = &batch;
  rows_ = &rows;
  decoder.forward_backward_weighted(batch, {nll_.data(), mean_logit_.data()}, weights_.data(), *this);
  ++micro_index_;
}

// Called between the micro-batch's scoring and its backward pass: each pair's loss and the weight of
// each answer token's NLL in the gradient (d step loss / d nll = -d l / d logp / pairs in the step).
void PreferenceObjective::weigh(const double* nll, const double* mean_logit, float* weight) {
  const model::MicroBatch& mb = *batch_;
  const int64_t B = o_.pairs_per_micro_batch, T = mb.seq;
  const double pairs_in_step = double(B * o_.micro_batches);
  std::fill(weight, weight + 2 * B * T, 0.0f);
  score_rows(mb, rows_->answer_starts.data(), nll, mean_logit, row_scores_.data());
  double chosen_tokens = 0;  // the NLL term's: every target of the chosen rows
  for (int64_t b = 0; b < B; ++b) {
    const int64_t rows[2] = {b, B + b};
    const RowScore scores[2] = {row_scores_[size_t(b)], row_scores_[size_t(B + b)]};
    chosen_tokens += double(scores[0].all_tokens);
    const int64_t p = rows_->pairs[size_t(b)];
    PairScore s{scores[0].logp, scores[1].logp, scores[0].tokens, scores[1].tokens};
    if (reference_) {
      s.ref_c = reference_->chosen[size_t(p)];
      s.ref_r = reference_->rejected[size_t(p)];
    }
    const PairLoss l = pair_loss(o_, s);
    loss_sum_ += l.loss / pairs_in_step;
    const double d[2] = {l.dlogp_c, l.dlogp_r};
    for (int side = 0; side < 2; ++side) {
      const float w = float(-d[side] / pairs_in_step);  // logp = -sum of the NLLs
      const int64_t first = rows[side] * T;
      for (int64_t t = first + rows_->answer_starts[size_t(rows[side])] - 1; t < first + T; ++t)
        if (mb.targets[t] != -100) weight[t] = w;
    }
    double* sums = metrics_.data();
    sums[kRewardC] += l.reward_c;
    sums[kRewardR] += l.reward_r;
    sums[kAccurate] += l.reward_c > l.reward_r ? 1.0 : 0.0;
    sums[kMargin] += l.reward_c - l.reward_r;
    sums[kLogpC] += l.logps_c;
    sums[kLogpR] += l.logps_r;
    sums[kLogOddsRatio] += l.log_odds_ratio;
    sums[kLogOddsChosen] += l.log_odds_chosen;
    double* logits = sums + kSums + kPerMicroBatch * (micro_index_ * o_.ranks + o_.rank);
    logits[0] += scores[0].logit_sum;
    logits[1] += double(scores[0].tokens);
    logits[2] += scores[1].logit_sum;
    logits[3] += double(scores[1].tokens);
  }
  if (o_.ftx > 0 && chosen_tokens > 0) {
    // pref_ftx (ORPO: 1) x this micro-batch's mean NLL of its chosen tokens, averaged over the step's micro-batches.
    double nll_sum = 0;
    const double scale = o_.ftx / (chosen_tokens * double(o_.micro_batches));
    for (int64_t t = 0; t < B * T; ++t)
      if (mb.targets[t] != -100) {
        nll_sum += nll[t];
        weight[t] += float(scale);
      }
    loss_sum_ += scale * nll_sum;
    metrics_[kNll] += nll_sum / chosen_tokens / double(o_.micro_batches);
  }
}

void PreferenceObjective::report(std::span<const double> summed, report::StepMetrics& m) const {
  m.preference = preference_metrics(o_, summed);
}

report::PreferenceMetrics preference_metrics(const PreferenceLossOptions& o, std::span<const double> sums) {
  require(sums.size() == size_t(kSums + kPerMicroBatch * o.micro_batches), "preference metrics: {} sums for {} micro-batches",
          sums.size(), o.micro_batches);
  const double pairs = double(o.pairs_per_micro_batch * o.micro_batches);
  report::PreferenceMetrics p;
  p.present = true;
  p.rewards_chosen = sums[kRewardC] / pairs;
  p.rewards_rejected = sums[kRewardR] / pairs;
  p.rewards_accuracies = sums[kAccurate] / pairs;
  p.rewards_margins = sums[kMargin] / pairs;
  p.logps_chosen = sums[kLogpC] / pairs;
  p.logps_rejected = sums[kLogpR] / pairs;
  // TRL: each micro-batch's token mean (0 without tokens), averaged over the micro-batches.
  for (int64_t i = 0; i < o.micro_batches; ++i) {
    const double* l = sums.data() + kSums + kPerMicroBatch * i;
    p.logits_chosen += (l[1] > 0 ? l[0] / l[1] : 0.0) / double(o.micro_batches);
    p.logits_rejected += (l[3] > 0 ? l[2] / l[3] : 0.0) / double(o.micro_batches);
  }
  p.orpo = o.loss == recipe::PreferenceLoss::Orpo;
  p.log_odds_ratio = sums[kLogOddsRatio] / pairs;
  p.log_odds_chosen = sums[kLogOddsChosen] / pairs;
  p.nll_loss = sums[kNll];
  return p;
}

}  // namespace keel::train
