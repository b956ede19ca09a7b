#include "keel/train/trainer.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <chrono>
#include <cmath>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/data/batch_builder.h"
#include "keel/data/token_records.h"
#include "keel/model/hf_weights.h"
#include "keel/train/lr_schedule.h"
#include "keel/train/metrics.h"
#include "keel/train/model_setup.h"
#include "keel/train/optimizer.h"

namespace keel::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

int64_t resolve_max_steps(const Recipe& r, int64_t records) {
  if (r.max_steps > 0) return r.max_steps;
  const int64_t per_step = r.batch_size * r.gradient_accumulation_steps;
  return std::max<int64_t>(1, (r.num_epochs * records + per_step - 1) / per_step);
}

}  // namespace

TrainSummary run_training(const Recipe& r, std::ostream& log) {
  require(r.dp_degree == 1,
          "{}: dp_degree = {} needs data parallel over MPI, which is not in this version yet; use dp_degree = 1",
          r.source, r.dp_degree);
  for (const auto& w : inactive_key_warnings(r)) fmt::print(log, "note: {}\n", w);

  ModelSetup setup = setup_model(r);
  model::Decoder& decoder = *setup.decoder;
  const auto& config = decoder.config();
  for (const auto& name : setup.unused_tensors)
    fmt::print(log, "warning: tensor '{}' in {} is not used by the {} architecture\n", name, r.model_name,
               config.architecture);

  const auto records = data::read_token_records(r.data_path, config.vocab_size);
  const int64_t max_steps = resolve_max_steps(r, records.size());
  const int32_t pad_id = config.pad_token_id >= 0 && config.pad_token_id < config.vocab_size
                             ? int32_t(config.pad_token_id) : 0;
  data::SampleOrder order(records.size(), r.shuffle, uint64_t(r.seed));
  std::vector<data::MicroBatchData> micro(r.gradient_accumulation_steps,
                                          data::make_micro_batch_buffers(r.batch_size, r.max_seq_len));

  AdamW optimizer(decoder.params(), {r.adam_beta1, r.adam_beta2, r.adam_epsilon, r.weight_decay});
  LrSchedule schedule{r.lr_scheduler, r.learning_rate, r.warmup_steps, max_steps};
  make_dirs(r.output_dir);
  MetricsWriter metrics(r.output_dir + "/metrics.jsonl");

  fmt::print(log, "keel: {} ({} layers, hidden {}, {:.1f}M parameters), {} records from {}, {} steps of {}x{}x{} tokens, {}\n",
             config.architecture, config.num_layers, config.hidden_size, config.total_parameters() / 1e6,
             records.size(), r.data_path, max_steps, r.gradient_accumulation_steps, r.batch_size, r.max_seq_len,
             r.dtype);

  TrainSummary summary;
  const auto run_start = Clock::now();
  int64_t total_tokens = 0;
  for (int64_t step = 1; step <= max_steps; ++step) {
    StepMetrics m;
    m.step = step;
    const auto t0 = Clock::now();
    // Gather the whole step's micro-batches first: the loss is normalised by the target tokens of
    // the whole step (transformers' gradient-accumulation fix), which must be known up front.
    const int64_t first = (step - 1) * r.gradient_accumulation_steps * r.batch_size;
    for (int64_t i = 0; i < r.gradient_accumulation_steps; ++i) {
      data::fill_micro_batch(records, order, first + i * r.batch_size, pad_id, micro[i]);
      m.tokens += micro[i].input_tokens;
      m.target_tokens += micro[i].target_tokens;
    }
    m.data_s = seconds_since(t0);

    const auto t1 = Clock::now();
    decoder.params().zero_grads();
    const double grad_scale = m.target_tokens > 0 ? 1.0 / double(m.target_tokens) : 0.0;
    double loss_sum = 0.0;
    for (auto& mb : micro) {
      model::MicroBatch batch{mb.batch, mb.seq, mb.input_ids.data(), mb.targets.data(), mb.positions.data(), nullptr};
      loss_sum += decoder.forward_backward(batch, grad_scale);
    }
    m.compute_s = seconds_since(t1);
    m.loss = m.target_tokens > 0 ? loss_sum / double(m.target_tokens) : 0.0;

    const auto t2 = Clock::now();
    m.grad_norm = gradient_norm(decoder.params());
    require(std::isfinite(m.loss) && std::isfinite(m.grad_norm),
            "step {}: the loss ({}) or gradient norm ({}) is not finite; stopping before the weights are corrupted",
            step, m.loss, m.grad_norm);
    clip_gradients(decoder.params(), m.grad_norm, r.max_grad_norm);
    m.lr = schedule.lr_for_step(step);
    optimizer.step(m.lr, step);
    m.optimizer_s = seconds_since(t2);

    m.step_time_s = seconds_since(t0);
    m.tokens_per_s = double(m.tokens) / std::max(m.step_time_s, 1e-9);
    total_tokens += m.tokens;
    metrics.write(m);
    if (step % r.log_interval == 0 || step == max_steps)
      fmt::print(log, "step {}/{}  loss {:.4f}  lr {:.3e}  grad_norm {:.3f}  {:.0f} tokens/s\n", step, max_steps,
                 m.loss, m.lr, m.grad_norm, m.tokens_per_s);
    summary.final_loss = m.loss;
    summary.steps = step;
  }
  summary.seconds = seconds_since(run_start);
  summary.tokens_per_s = double(total_tokens) / std::max(summary.seconds, 1e-9);

  const std::string final_dir = r.output_dir + "/final";
  model::save_hf_model(decoder, final_dir, setup.export_dtype);
  fmt::print(log, "keel: {} steps in {:.1f} s ({:.0f} tokens/s), final loss {:.4f}; model written to {}\n",
             summary.steps, summary.seconds, summary.tokens_per_s, summary.final_loss, final_dir);
  return summary;
}

}  // namespace keel::train
