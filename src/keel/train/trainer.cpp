#include "keel/train/trainer.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <span>

#include "keel/core/error.h"
#include "keel/core/stopwatch.h"
#include "keel/core/file_io.h"
#include "keel/core/process_memory.h"
#include "keel/data/batch_builder.h"
#include "keel/data/tokenizer.h"
#include "keel/train/data_sources.h"
#include "keel/distributed/communicator.h"
#include "keel/core/threads.h"
#include "keel/distributed/shard_reader.h"
#include "keel/kernels/backend.h"
#include "keel/kernels/bf16_widening.h"
#include "keel/model/experts.h"
#include "keel/model/hf_weights.h"
#include "keel/model/peft_adapter.h"
#include "keel/core/checksum.h"
#include "keel/checkpoint/checkpoint.h"
#include "keel/train/evaluation.h"
#include "keel/train/experts_banner.h"
#include "keel/checkpoint/export.h"
#include "keel/checkpoint/gguf_tokenizer.h"
#include "keel/train/grad_sync.h"
#include "keel/train/interrupt.h"
#include "keel/train/sync_overlap.h"
#include "keel/report/loss_plot.h"
#include "keel/plan/training_plan.h"
#include "keel/train/lr_schedule.h"
#include "keel/train/next_token_loss.h"
#include "keel/train/preference_stage.h"
#include "keel/train/resume_policy.h"
#include "keel/train/sharded_saves.h"
#include "keel/train/training_step.h"
#include "keel/report/metrics.h"
#include "keel/report/tensorboard.h"
#include "keel/recipe/model_setup.h"
#include "keel/train/optimizer.h"
#include "keel/recipe/run_guard.h"
#include "keel/report/progress.h"

namespace keel::train {
namespace {

using Clock = std::chrono::steady_clock;

int64_t resolve_max_steps(const recipe::Recipe& r, int64_t records) {
  if (r.max_steps > 0) return r.max_steps;
  const int64_t per_step = r.batch_size * r.gradient_accumulation_steps;
  return std::max<int64_t>(1, (r.num_epochs * records + per_step - 1) / per_step);
}

// The T of a layer's attention FLOPs, 12·T·d per token. PaLM's convention counts every key of the
// sequence: twice the keys a causal query sees on average. A sliding window keeps the convention:
// twice the keys each query sees on average (its window, or fewer near the start).
double attention_keys(const model::ModelConfig& c, int64_t layer, int64_t seq) {
  const int64_t window = c.window_of(layer);
  if (window <= 0 || window >= seq) return double(seq);
  const double full = double(window) * double(seq - window + 1);     // queries window-1.. see `window` keys
  const double ramp = double(window - 1) * double(window) / 2.0;     // queries 0..window-2 see i + 1
  return 2.0 * (full + ramp) / double(seq);
}

// FLOPs of one trained token: 6 per matmul parameter (forward + backward) plus attention's
// 12·L·T·d (scores and weighted values, forward and backward), the usual MFU convention. Frozen
// weights (LoRA) cost 4: forward and the input gradient, no weight gradient; the adapter's
// matrices are trained weights (6 each).
double flops_per_token(const model::Decoder& d, int64_t seq) {
  const model::ModelConfig& c = d.config();
  double attention = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) attention += 12.0 * attention_keys(c, l, seq) * double(c.q_size());
  if (!d.has_adapter()) return 6.0 * double(c.matmul_parameters()) + attention;
  return 4.0 * double(c.matmul_parameters()) + 6.0 * double(d.adapter().total()) + attention;
}

class Trainer {
 public:
  Trainer(const recipe::Recipe& r, std::ostream& log, const TrainOptions& options, distributed::Communicator& comm)
      : r_(r),
        log_(log),
        options_(options),
        comm_(comm),
        setup_(recipe::setup_model(r, comm.rank(), &log, options.terminal)),
        decoder_(*setup_.decoder),
        config_(decoder_.config()) {
    recipe::require_sequence_fits_model(r, config_);
    checkpoint::prepare_recipe_gguf_tokenizer(r, comm_.rank() == 0 ? &log_ : nullptr);  // model_name = x.gguf
    for (const auto& name : setup_.unused_tensors)
      fmt::print(log_, "warning: tensor '{}' in {} is not used by the {} architecture\n", name, r.model_name,
                 config_.architecture);
    pad_id_ = model_pad_id(config_);
    BatchSourceOptions source{.batch_size = r.batch_size,
                              .seq_len = r.max_seq_len,
                              .micro_batches_per_step = r.gradient_accumulation_steps,
                              .rank = int(comm_.rank()),
                              .ranks = int(comm_.size()),
                              .shuffle = r.shuffle,
                              .seed = uint64_t(r.seed),
                              .vocab_size = config_.vocab_size,
                              .pad_id = pad_id_};
    if (r.stage == recipe::Stage::Dpo) {
      preference_ = std::make_unique<PreferenceStage>(r, source, evaluation_source_options(r, config_),
                                                      comm_.rank(), comm_.size(), log_);
      loader_ = preference_->take_source();
    } else {
      loader_ = open_batch_source(r.data_path, r, source, log_);
      if (!r.eval_data_path.empty())
        eval_loader_ = open_batch_source(r.eval_data_path, r, evaluation_source_options(r, config_), log_);
    }
    max_steps_ = resolve_max_steps(r, loader_->sequences());
    optimizer_ = std::make_unique<AdamW>(decoder_.backend(), decoder_.trainable(),
                                         AdamWConfig{r.adam_beta1, r.adam_beta2, r.adam_epsilon, r.weight_decay});
    if (comm_.size() > 1) {
      const OverlapDecision overlap = decide_overlap(r.overlap_grad_sync, host_cores(int(comm_.size())));
      fmt::print(log_, "keel: {}\n", overlap.reason);
      if (r.zero_stage >= 3)  // the same decision: the gathers need the communication thread's core too
        fmt::print(log_, "keel: ZeRO-3 weight gathers {}\n",
                   overlap.overlap ? "overlap the position before the one that reads them"
                                   : "run where the weights are read (not overlapped: overlap_grad_sync)");
      // ZeRO-1/2: the decoder holds this rank's shard of the moments (and under ZeRO-2 of the
      // gradients); grad_sync.h says what each stage reduces when.
      sync_ = std::make_unique<GradSync>(decoder_, comm_,
                                         GradSyncOptions{.zero_stage = int(r.zero_stage),
                                                         .bucket_bytes = int64_t(r.bucket_size_mb * double(1 << 20)),
                                                         .overlap = overlap.overlap,
                                                         .deterministic = r.deterministic_reduce});
    }
    schedule_ = LrSchedule{r.lr_scheduler, r.learning_rate, r.warmup_steps, max_steps_};
    state_.seed = uint64_t(r.seed);
    state_.recipe_hash = checkpoint::fingerprint_of(recipe::recipe_to_toml(r));
    state_.model_fingerprint = checkpoint::model_fingerprint(decoder_.trainable(), config_.architecture);
    state_.data_fingerprint = loader_->fingerprint();
    state_.compat_fingerprint = compat_fingerprint(r);
    if (r.dtype == recipe::Precision::Bf16)
      state_.bf16_products = kernels::widens_bf16_products(decoder_.backend()) ? "widened" : "native";
    if (!r.checkpoint_dir.empty() && comm_.rank() == 0) {  // rank 0 writes the replicated state
      refuse_mixing_runs(r.checkpoint_dir, options, log_);
      if (int removed = checkpoint::clean_incomplete_checkpoints(r.checkpoint_dir))
        fmt::print(log_, "keel: removed {} incomplete checkpoint(s) left in {} by an interrupted save or deletion\n",
                   removed, r.checkpoint_dir);
      if (!recipe::sharded_checkpoints(r, comm_.size())) {
        if (comm_.size() > 1)  // the layout is a choice: said, as the sharded one is
          fmt::print(log_,
                     "keel: checkpoints in one file written by rank 0 (checkpoint_layout = \"single_file\"): the "
                     "other ranks send it their shards{}\n",
                     r.async_save ? ", which an asynchronous save gathers whole on rank 0" : "");
        checkpoints_ = std::make_unique<checkpoint::CheckpointWriter>(r.checkpoint_dir, r.keep_last_n, r.async_save);
        // A ZeRO-1 save gathers the moments into a snapshot only when it is asynchronous; a
        // synchronous one writes them as they arrive.
        checkpoints_->prepare(decoder_.trainable(), /*snapshot=*/!zero_shards().empty() && r.async_save);
      }
    }
    if (!r.checkpoint_dir.empty() && recipe::sharded_checkpoints(r, comm_.size())) start_sharded_saves();
    if (preference_) {
      // The reference is the initial weights: scored before a resume replaces them.
      preference_->prepare_reference(decoder_, comm_);
      objective_ = preference_->make_objective();
    }
    resume(options.resume);
    // ZeRO-1/2 with sharded masters: the weights the step reads come from every rank's loaded shard.
    if (sync_) sync_->weights_loaded();
    // The step itself (training_step.h), over the pieces set up above.
    step_ = std::make_unique<TrainingStep>(decoder_, *objective_, *optimizer_, schedule_, comm_, sync_.get(),
                                           TrainingStepOptions{.seed = uint64_t(r.seed),
                                                               .max_grad_norm = r.max_grad_norm,
                                                               .skip_nonfinite_steps = r.skip_nonfinite_steps});
  }

  TrainResult run() {
    if (already_complete_) {
      // Nothing to train: the run's files (summary.json, final/) stay as the finished run left them.
      fmt::print(log_,
                 "keel: already complete at step {} (max_steps = {}); nothing changed. To train further, "
                 "resume with a larger max_steps (--set max_steps=N)\n",
                 state_.step, max_steps_);
      return TrainResult{};
    }
    make_dirs(r_.output_dir);
    // Only rank 0 writes files: every rank holds the same replicated state.
    std::unique_ptr<report::MetricsWriter> metrics;
    if (comm_.rank() == 0)
      metrics = std::make_unique<report::MetricsWriter>(r_.output_dir + "/metrics.jsonl", state_.step);
    std::unique_ptr<report::TensorBoardLog> tensorboard;
    if (comm_.rank() == 0 && recipe::reports_to_tensorboard(r_)) {
      tensorboard = std::make_unique<report::TensorBoardLog>(r_.output_dir, recipe::recipe_to_toml(r_), state_.step + 1,
                                                             r_.log_interval);
      fmt::print(log_, "keel: TensorBoard events in {} (report_to = \"{}\"){}\n", tensorboard->path(), r_.report_to,
                 state_.step > 0 ? fmt::format("; steps from {} on replace what an earlier run logged there",
                                               state_.step + 1)
                                 : "");
    }
    report::Progress progress(log_, max_steps_, r_.log_interval, options_.terminal);
    print_banner();

    InterruptGuard interrupt;
    TrainResult result;
    const auto start = Clock::now();
    for (int64_t step = state_.step + 1; step <= max_steps_; ++step) {
      report::StepMetrics m = train_step(step);
      m.peak_memory_bytes = int64_t(peak_resident_bytes());  // a read of /proc: allocates nothing
      state_.step = step;
      state_.samples_consumed = step * loader_->samples_per_step();
      const bool interrupted = (interrupt_agreed_ || step == options_.stop_after_step) && step < max_steps_;
      const bool checkpoint_due =
          !r_.checkpoint_dir.empty() &&
          (interrupted || step == max_steps_ || (r_.save_interval > 0 && step % r_.save_interval == 0));
      // ZeRO-1/2 with overlap: the weights' gather runs into the next step's forward pass; what reads
      // them outside a step waits for it (exposed communication of this step).
      if (sync_ && (eval_due(step) || checkpoint_due || interrupted || step == max_steps_))
        m.grad_sync_s += sync_->settle_weights();
      if (eval_due(step)) {
        evaluate_into(m);
        if (options_.on_evaluate && comm_.rank() == 0) options_.on_evaluate(step, m.eval_loss, m.eval_perplexity);
      }
      if (checkpoint_due) {
        comm_.set_wait_context(save_wait_context(step));  // cleared by the next step's first collective
        const bool saved = sharded_ ? save_sharded(m, progress) : save_checkpoint(checkpoints_.get(), m, progress);
        if (saved && options_.on_save) options_.on_save(step, r_.checkpoint_dir);
      }
      for (const auto& note : std::exchange(checkpoint_notes_, {})) progress.message(note);
      // No checkpoint_dir: an interrupted run's work is kept in output_dir/interrupted/ all the same.
      std::string saved_to;
      if (interrupted && r_.checkpoint_dir.empty()) saved_to = save_interrupted(m, progress);
      if (!saved_to.empty() && options_.on_save) options_.on_save(step, saved_to);
      if (metrics) metrics->write(m);
      if (tensorboard) tensorboard->write(m);
      if (options_.on_log && comm_.rank() == 0 &&
          (step % r_.log_interval == 0 || step == max_steps_ || interrupted))
        options_.on_log(m);
      result.summary.add_step(m);
      progress.step(m, seconds_since(start));
      if (interrupted) {
        result.interrupted = true;
        result.interrupt_signal = InterruptGuard::signal_number();  // 0 for --stop-after
        progress.message(fmt::format(
            "keel: interrupted after step {} of {}; {}", step, max_steps_,
            checkpoints_ || sharded_ ? fmt::format("resume with: {} --resume auto", train_command())
            : saved_to.empty()
                ? std::string("nothing saved: writing the checkpoint failed (above)")
                : fmt::format("saved to {}; resume with: {} --resume {}", saved_to, train_command(), saved_to)));
        break;
      }
    }
    progress.finish();
    if (sharded_) {
      const std::string failure = sharded_->finish(&checkpoint_notes_);
      for (const auto& note : std::exchange(checkpoint_notes_, {})) fmt::print(log_, "{}\n", note);
      require(failure.empty() || !r_.fail_on_save_error, "the last checkpoint save failed: {}", failure);
      if (!failure.empty()) fmt::print(log_, "warning: the last checkpoint save failed: {}\n", failure);
    }
    if (checkpoints_) {
      const std::string failure = checkpoints_->wait();
      require(failure.empty() || !r_.fail_on_save_error, "the last checkpoint save failed: {}", failure);
      if (!failure.empty()) fmt::print(log_, "warning: the last checkpoint save failed: {}\n", failure);
      for (const auto& note : checkpoints_->take_notes()) fmt::print(log_, "keel: {}\n", note);
    }
    finish(result);
    if (checkpoints_) require_saves_succeeded(checkpoints_->record());
    if (sharded_) require_saves_succeeded(sharded_->record());
    return result;
  }

 private:
  // The model's weights in MB as this rank holds them (its ZeRO-3 shard) or as a replica would:
  // fp32 masters and, under LoRA, the frozen bf16 matrices or 4-bit codes with their absmax values.
  double base_bytes(bool held) const {
    const model::ParamStore& p = decoder_.params();
    const double masters = double(held ? p.master_range().size() : p.total());
    const double matrices = double(held ? p.compute_only_range().size() : p.compute_only_total());
    const double four_bit = double(held ? p.four_bit_range().size() : p.four_bit_total());
    return 4e-6 * masters + 2e-6 * matrices + (0.5e-6 + 4e-6 / double(kFourBitBlockSize)) * four_bit;
  }

  // What this run is, said once before step 1: the model and data, the step's shape, what trains,
  // the head's chunk, threads and backend, and what ZeRO shards.
  void print_banner() {
    fmt::print(log_, "keel: {} ({} layers, hidden {}, {:.1f}M parameters), {} {} from {}\n", config_.architecture,
               config_.num_layers, config_.hidden_size, double(config_.total_parameters()) / 1e6, loader_->sequences(),
               preference_ ? "pairs" : "records", r_.data_path);
    const int64_t recomputed = decoder_.recomputed_blocks();
    const bool kept_last = r_.gradient_checkpointing_layers == 0 && recomputed == config_.num_layers - 1;
    fmt::print(
        log_, "keel: {} steps of {} x {} x {} tokens (accumulation x batch x sequence), {}{}\n", max_steps_,
        r_.gradient_accumulation_steps, r_.batch_size, r_.max_seq_len, recipe::choice_name(r_.dtype),
        r_.use_gradient_checkpointing
            ? fmt::format(", gradient checkpointing ({} of {} blocks recompute{})", recomputed, config_.num_layers,
                          kept_last ? "; keel's choice: the last keeps its activations, which the memory plan "
                                      "says costs nothing more (gradient_checkpointing_layers sets it)"
                                    : "")
            : "");
    if (preference_) fmt::print(log_, "keel: {}\n", preference_->describe());
    if (decoder_.has_adapter()) print_lora();
    print_padding_row();
    print_experts_routing(log_, decoder_);
    {
      // The logits buffer is the step's largest scratch: its size is a choice keel makes (or the recipe).
      const int64_t chunk = decoder_.lm_head_chunk();
      const double mib = double(chunk * config_.vocab_size) * (decoder_.precision() == model::Precision::BF16 ? 6 : 4) /
                         double(1 << 20);
      fmt::print(log_, "keel: LM head and loss over {} tokens at a time ({:.0f} MiB of logits; {})\n", chunk, mib,
                 r_.lm_head_chunk_tokens > 0 ? "lm_head_chunk_tokens" : "keel's choice, lm_head_chunk_tokens sets it");
    }
    fmt::print(log_, "keel: {} thread(s) per rank, {}\n", max_threads(),
               decoder_.backend().description(decoder_.precision() == model::Precision::BF16));
    if (!zero_shards().empty()) {
      const double shard = double(decoder_.trainable().optimizer_range().size()),
                   whole = double(decoder_.trainable().total());
      // bf16 full fine-tuning shards the fp32 masters with the moments (Decoder::resident_gathers).
      const bool masters = decoder_.resident_gathers();
      const std::string masters_note =
          masters ? fmt::format(
                        "; the weights the step reads (bf16 matrices; norms and the embedding in fp32) whole, "
                        "all-gathered after each optimizer step in {} spans",
                        decoder_.weight_gathers().size())
                  : "";
      if (r_.zero_stage == 1)
        fmt::print(log_,
                   "keel: ZeRO-1: AdamW moments{} sharded over {} ranks, {:.2f} MB per rank instead of {:.2f} MB{}\n",
                   masters ? " and fp32 masters" : "", comm_.size(), (masters ? 12e-6 : 8e-6) * shard,
                   (masters ? 12e-6 : 8e-6) * whole, masters_note);
      else if (r_.zero_stage >= 3 && decoder_.has_adapter())
        fmt::print(log_,
                   "keel: ZeRO-3: the frozen base weights sharded over {} ranks, {:.2f} MB per rank instead of {:.2f} "
                   "MB, in {} gathers per step (how they overlap: above); the adapter's AdamW moments and gradients "
                   "sharded as in ZeRO-2\n",
                   comm_.size(), base_bytes(true), base_bytes(false), decoder_.weight_gathers().size());
      else if (r_.zero_stage >= 3)
        fmt::print(log_,
                   "keel: ZeRO-3: fp32 weights, AdamW moments and gradients sharded over {} ranks, {:.2f} MB per rank "
                   "instead of {:.2f} MB; {} weight gathers per step (how they overlap: above)\n",
                   comm_.size(), 16e-6 * shard, 16e-6 * whole, decoder_.weight_gathers().size());
      else
        fmt::print(log_,
                   "keel: ZeRO-2: AdamW moments{} and gradients sharded over {} ranks, {:.2f} MB per rank instead of "
                   "{:.2f} MB; the backward pass stages {} groups of gradients, reduce-scattered every micro-batch{}\n",
                   masters ? ", fp32 masters" : "", comm_.size(), (masters ? 16e-6 : 12e-6) * shard,
                   (masters ? 16e-6 : 12e-6) * whole, decoder_.grad_groups().size(), masters_note);
    }
    if (decoder_.casts_per_position())
      fmt::print(log_,
                 "keel: ZeRO-3 with one rank: nothing to shard, so no whole bf16 copy of the weights either; the bf16 "
                 "weights cast per position ({} casts per step), {:.2f} MB at the peak instead of {:.2f} MB\n",
                 decoder_.weight_gathers().size(),
                 1e-6 * double(decoder_.memory_plan().category_bytes_at_peak(MemoryCategory::ComputeWeights)),
                 2e-6 * double(decoder_.params().total()));
  }

  // The embedding's padding row (ModelConfig::embedding_padding_idx), said when the embedding trains:
  // the pad token's lookups give it no gradient, as in every transformers-based trainer.
  void print_padding_row() {
    const bool embedding_trains = !decoder_.has_adapter() || decoder_.trained_embedding() >= 0;
    if (!embedding_trains || config_.pad_token_id < 0) return;
    const int64_t row = config_.embedding_padding_idx();
    if (row < 0) {
      fmt::print(log_, "keel: pad_token_id {} is {}: its embedding row trains from its lookups like any other\n",
                 config_.pad_token_id,
                 config_.pad_token_id >= config_.vocab_size ? "outside the vocabulary" : "not a padding_idx in this format");
      return;
    }
    std::string text;
    try {  // the token's text where the run has a tokenizer; the id alone otherwise
      const std::string path = recipe::recipe_tokenizer_path(r_);
      if (!path.empty()) text = fmt::format(" '{}'", data::load_tokenizer(path).id_to_token(int32_t(row)));
    } catch (const std::exception&) {
    }
    fmt::print(log_,
               "keel: the embedding row of pad token{} (id {}, pad_token_id) gets no gradient from its lookups, as "
               "transformers' nn.Embedding(padding_idx=pad_token_id){}\n",
               text, row, config_.tie_word_embeddings ? "; as the tied LM head it still trains" : "");
  }

  // What LoRA trains, said once: the modules, the scaling, and the share of the model that trains.
  void print_lora() {
    const model::LoraSpec& spec = decoder_.options().lora;
    std::vector<std::string> names;
    for (const auto& m : decoder_.lora_modules())
      if (std::find(names.begin(), names.end(), m.name) == names.end()) names.push_back(m.name);
    const double trained = double(decoder_.adapter().total()), base = double(config_.total_parameters());
    fmt::print(log_,
               "keel: LoRA rank {}, alpha {} (scaling {:.4g}{}) on {} modules ({}); {} trainable parameters ({:.3f}% "
               "of {:.1f}M), the model's weights frozen; adapter {}\n",
               spec.rank, spec.alpha, spec.scaling(), spec.rslora ? ", rsLoRA" : "", decoder_.lora_modules().size(),
               fmt::join(names, ", "), int64_t(trained), 100.0 * trained / base, base / 1e6,
               r_.adapter_name_or_path.empty() ? fmt::format("initialised as PEFT does (seed {})", r_.seed)
                                               : "loaded from " + r_.adapter_name_or_path);
    print_experts_lora(log_, decoder_);
    if (!decoder_.saved_modules().names.empty())
      fmt::print(log_, "keel: additional_target: {} trained fully beside the adapters (copies of the originals)\n",
                 fmt::join(decoder_.saved_modules().names, ", "));
    const model::ParamStore& frozen = decoder_.params();
    if (frozen.four_bit_total() > 0) {
      int64_t matrices = 0;
      for (const auto& p : frozen.params()) matrices += p.storage == model::ParamStorage::FourBit;
      std::string type(four_bit_type_name(frozen.four_bit_type()));
      std::transform(type.begin(), type.end(), type.begin(), [](unsigned char ch) { return char(std::toupper(ch)); });
      const std::string source =
          config_.saved_four_bit
              ? fmt::format("the codes as bitsandbytes saved them in {}, not requantized", r_.model_name)
              : "quantized at load";
      fmt::print(log_,
                 "keel: QLoRA: {} projection matrices ({:.1f}M weights) held as {} ({}), {:.2f} GB instead of {:.2f} "
                 "GB in bf16 (double quantization {}); dequantized a tile at a time inside their GEMMs\n",
                 matrices, double(frozen.four_bit_total()) / 1e6, type, source,
                 double(frozen.four_bit_total()) * (0.5 + 4.0 / 64) / 1e9, double(frozen.four_bit_total()) * 2 / 1e9,
                 decoder_.options().double_quantization ? "on" : "off");
      print_experts_four_bit(log_, decoder_, type);
    }
  }

  // The checkpoint --resume names, loaded and checked against this run (train/resume_policy.h).
  void resume(const std::string& request) {
    const Resumed resumed =
        resume_run(r_, {request, options_.resume_with_new_data}, decoder_.trainable(), state_, max_steps_, schedule_, log_);
    if (!resumed.resumed) return;
    state_.step = resumed.state.step;
    state_.samples_consumed = resumed.state.samples_consumed;
    already_complete_ = resumed.already_complete;
  }

  // `keel train RECIPE [--set ...]` as this run was started, for the resume commands keel prints.
  std::string train_command() const {
    std::string command = "keel train " + r_.source;
    for (const auto& o : options_.overrides) command += " --set " + o;
    return command;
  }

  // Interrupted without a checkpoint_dir: one synchronous checkpoint into output_dir/interrupted
  // (every rank takes part, as in any save). Returns that directory on rank 0 when the save
  // succeeded, "" otherwise.
  std::string save_interrupted(report::StepMetrics& m, report::Progress& progress) {
    const std::string dir = r_.output_dir + "/interrupted";
    std::unique_ptr<checkpoint::CheckpointWriter> writer;
    if (comm_.rank() == 0) {
      checkpoint::remove_checkpoints(dir);  // an earlier interruption's: this one supersedes it
      writer = std::make_unique<checkpoint::CheckpointWriter>(dir, /*keep_last_n=*/1, /*async=*/false);
      writer->prepare(decoder_.trainable(), /*snapshot=*/false);
    }
    const bool saved = save_checkpoint(writer.get(), m, progress);
    return saved && writer ? dir : "";
  }

  // Rank 0 writes the checkpoint through `writer`. Under ZeRO-1 every rank takes part: the others
  // send rank 0 their shards of the moments, which it writes as they arrive (synchronous saves) or
  // gathers into the snapshot an asynchronous save writes from. Returns whether rank 0's save went
  // through (or was queued, when asynchronous).
  bool save_checkpoint(checkpoint::CheckpointWriter* writer, report::StepMetrics& m, report::Progress& progress) {
    if (!writer) {
      if (!zero_shards().empty()) send_moments();
      return false;
    }
    const std::string failure = writer->take_failure();
    if (!failure.empty()) {
      require(!r_.fail_on_save_error, "checkpoint save failed: {}", failure);
      progress.message(fmt::format("warning: the previous checkpoint save failed ({}); retrying now", failure));
    }
    model::ParamStore& params = decoder_.trainable();
    // ZeRO: the other ranks' moments as they arrive, streams 0 (m) and 1 (v); under ZeRO-3 their
    // weights first (streams 1, 2 the moments).
    const bool sharded = params.sharded_weights();
    const int moments_from = sharded ? 1 : 0;
    std::optional<distributed::ShardReader> shards;  // drains on the way out if the write fails
    if (!zero_shards().empty()) {
      std::vector<const float*> local{params.adam_m(), params.adam_v()};
      if (sharded) local.insert(local.begin(), params.masters());
      shards.emplace(comm_, zero_shards(), std::move(local));
    }
    try {
      checkpoint::SaveStats stats;
      if (!shards) {
        stats = writer->save(params, state_, recipe::recipe_to_toml(r_));
      } else if (r_.async_save && writer == checkpoints_.get()) {
        stats = writer->save_snapshot(params.params(), params.total(), state_, recipe::recipe_to_toml(r_),
                                      [&](float* weights, float* first, float* second) {
                                        if (sharded)
                                          shards->read_all(0, weights);
                                        else
                                          std::copy_n(params.weights(), params.total(), weights);
                                        shards->read_all(moments_from, first);
                                        shards->read_all(moments_from + 1, second);
                                      });
      } else {
        stats = writer->save_streamed(
            params.params(), sharded ? nullptr : params.weights(),
            [&](int which, int64_t begin, int64_t max_count, int64_t* n) {
              return shards->read(which == 2 ? 0 : which + moments_from, begin, max_count, n);
            },
            state_, recipe::recipe_to_toml(r_));
      }
      if (shards) shards->drain();
      m.checkpoint_s = stats.blocked_s;
      m.step_time_s += m.checkpoint_s;
      for (const auto& note : writer->take_notes()) progress.message("keel: " + note);
      return true;
    } catch (const Error& e) {
      if (shards) shards->drain();  // the other ranks are still sending: let them finish
      require(!r_.fail_on_save_error, "checkpoint save failed: {}", e.what());
      progress.message(
          fmt::format("warning: checkpoint save failed ({}); training continues, next try at the next "
                      "interval",
                      e.what()));
    }
    return false;
  }

  // A run whose checkpoints all failed, or whose last kFailedSavesAtEnd did, must not exit 0 as
  // if its work were safe (the final model is written first: it is kept whatever happens here).
  static constexpr int64_t kFailedSavesAtEnd = 3;
  void require_saves_succeeded(const checkpoint::SaveRecord& s) {
    if (s.attempted == 0 || (s.failed < s.attempted && s.failed_in_a_row < kFailedSavesAtEnd)) return;
    const std::string newest =
        s.last_saved_step < 0 ? "none was written" : fmt::format("the newest is of step {}", s.last_saved_step);
    fmt::print(log_, "keel: {} of {} checkpoint saves failed, the last {} in a row; {}\n", s.failed, s.attempted,
               s.failed_in_a_row, newest);
    fail(
        "{} of {} checkpoint saves into {} failed (the last {} in a row; {}): the run's state is not safe to "
        "resume from. Free space or choose another checkpoint_dir",
        s.failed, s.attempted, r_.checkpoint_dir, s.failed_in_a_row, newest);
  }

  // For the timeout error of the waits after a save: the other ranks wait while rank 0 writes.
  std::string save_wait_context(int64_t step) const {
    if (comm_.size() == 1) return "";
    if (sharded_)
      return fmt::format(
          "The wait followed the checkpoint of step {}, whose shards every rank writes{}: a save slower than "
          "comm_timeout_s ends the job like this; raise comm_timeout_s{}",
          step, r_.async_save ? " (asynchronously, but first waiting for the previous save)" : "",
          r_.async_save ? " or save_interval" : " or set async_save = true");
    std::string s = fmt::format(
        "The wait followed the checkpoint of step {}, which rank 0 writes while the other "
        "ranks wait",
        step);
    if (r_.async_save)
      s += zero_shards().empty() ? " (asynchronously, but first for the previous save to finish)"
                                 : " (asynchronously, but the ZeRO-1 gather first waits for the previous save)";
    return s + ": a save slower than comm_timeout_s ends the job like this; raise comm_timeout_s" +
           (r_.async_save ? " or save_interval" : " or set async_save = true");
  }

  // A step's micro-batches and what every rank agreed on before it: the global step's token
  // counts (the loss is normalised by the target tokens of the whole step, transformers'
  // gradient-accumulation fix, so they must be known before the backward pass) and whether an
  // interrupt was requested during the step before (every rank must stop after the same step: a
  // signal may reach them at different moments).
  struct StepInput {
    int64_t step = 0;
    std::span<const data::PackedMicroBatch> micro;  // the loader's, valid until its next call
    double target_tokens = 0, tokens = 0;
    bool interrupt = false;
    double data_s = 0, peer_wait_s = 0;  // waiting for the loader, and for the other ranks
  };

  // Fetches `step`'s micro-batches and agrees on them in one collective. The step's global batch
  // is the same samples whatever the world size: micro-batch i of rank r is the step's
  // (i * ranks + r)-th, so dp=N equals dp=1 with N times the accumulation.
  StepInput agree_on_step(int64_t step) {
    StepInput in;
    in.step = step;
    in.micro = loader_->step_batches(step);  // prefetched in the background
    // Then the sharded checkpoint's agreement (ShardedSaves::kSlots): which ranks' parts are durable.
    double totals[3 + ShardedSaves::kSlots] = {0, 0, InterruptGuard::requested() ? 1.0 : 0.0};
    if (sharded_) sharded_->contribute(totals + 3);
    for (const auto& mb : in.micro) {
      totals[0] += double(mb.target_tokens);
      totals[1] += double(mb.input_tokens);
    }
    in.data_s = loader_->last_wait_seconds();
    const auto t = Clock::now();
    if (comm_.size() > 1) comm_.allreduce_totals(totals, sharded_ ? 3 + ShardedSaves::kSlots : 3);
    comm_.set_wait_context("");
    if (sharded_) sharded_->agreed(totals + 3, &checkpoint_notes_);
    in.peer_wait_s = comm_.size() > 1 ? seconds_since(t) : 0.0;
    in.target_tokens = totals[0];
    in.tokens = totals[1];
    in.interrupt = totals[2] > 0;
    return in;
  }

  // ZeRO, every rank but 0: its shard of m, then of v (the order distributed::ShardReader reads in);
  // under ZeRO-3 its shard of the weights first.
  void send_moments() {
    model::ParamStore& params = decoder_.trainable();
    const int64_t n = zero_shards()[size_t(comm_.rank())].size();  // what ShardReader expects of this rank
    require(n == params.optimizer_range().size(), "ZeRO-1: this rank's shard ({}) is not its optimizer range ({})", n,
            params.optimizer_range().size());
    if (params.sharded_weights()) comm_.send_to_root(params.masters(), n);
    comm_.send_to_root(params.adam_m(), n);
    comm_.send_to_root(params.adam_v(), n);
  }

  // The sharded layout (checkpoint/sharded_writer.h): every rank writes its part. Said once, with
  // why, as every choice keel makes for the user.
  void start_sharded_saves() {
    model::ParamStore& trained = decoder_.trainable();
    const auto windows = ShardedSaves::windows_for(zero_shards(), trained.total(), int(comm_.size()));
    const int64_t staging = int64_t(r_.checkpoint_staging_mb * double(1 << 20));
    sharded_ = std::make_unique<ShardedSaves>(ShardedSaveOptions{.dir = r_.checkpoint_dir,
                                                                 .keep_last_n = r_.keep_last_n,
                                                                 .async = r_.async_save,
                                                                 .staging_bytes = staging,
                                                                 .zero_stage = int(r_.zero_stage)},
                                              comm_, trained, windows);
    sharded_->fail_on_error = r_.fail_on_save_error;
    const FlatRange mine = windows[size_t(comm_.rank())];
    fmt::print(log_,
               "keel: checkpoints sharded ({}): each of the {} rank(s) writes the weights, m and v of its {} "
               "({:.2f} MB on rank 0) to step-N/shard-R-of-{}.bin in parallel; rank 0 writes manifest.json once every "
               "rank's part is durable\n",
               r_.checkpoint_layout == recipe::CheckpointLayout::Auto ? "checkpoint_layout = \"auto\": dp_degree > 1"
                                                                   : "checkpoint_layout = \"sharded\"",
               comm_.size(), zero_shards().empty() ? "1/dp of the replicated state" : "ZeRO shard", 12e-6 * double(mine.size()),
               comm_.size());
    if (r_.async_save)
      fmt::print(log_,
                 "keel: asynchronous saves stage at most {:.0f} MiB per rank (checkpoint_staging_mb; {:.2f} MiB "
                 "allocated on rank 0); the rest is written from the live state, and a step waits only if the writer "
                 "still reads it at the next optimizer step (checkpoint_s in metrics.jsonl)\n",
                 r_.checkpoint_staging_mb, double(std::min<int64_t>(staging, 12 * mine.size())) / double(1 << 20));
  }

  // Every rank writes its part (ShardedSaves); the agreement and rank 0's publishing follow at once
  // (synchronous) or ride on later steps' agreements (asynchronous).
  bool save_sharded(report::StepMetrics& m, report::Progress& progress) {
    std::vector<std::string> notes;
    bool saved = false;
    const double blocked = sharded_->save(state_, recipe::recipe_to_toml(r_), &notes, &saved);
    m.checkpoint_s += blocked;
    m.step_time_s += blocked;
    for (const auto& note : notes) progress.message(note);
    return saved;
  }

  bool eval_due(int64_t step) const {
    if (!eval_loader_ && !(preference_ && preference_->evaluates())) return false;
    return step == max_steps_ || (r_.eval_interval > 0 && step % r_.eval_interval == 0);
  }

  void evaluate_into(report::StepMetrics& m) {
    if (preference_) {
      preference_->evaluate(decoder_, m);
      last_eval_ = EvalResult{m.eval_loss, m.eval_perplexity, 0};
      return;
    }
    const EvalResult e = evaluate(decoder_, *eval_loader_);
    m.eval_loss = e.loss;
    m.eval_perplexity = e.perplexity;
    last_eval_ = e;
  }

  // One step: its data agreed on (or taken from the agreement made at the end of the step before),
  // the step itself (training_step.h), and between its phases what is the run's: the wait for an
  // asynchronous save still reading the state, and the next step's agreement.
  report::StepMetrics train_step(int64_t step) {
    report::StepMetrics m;
    const auto t0 = Clock::now();
    // Agreed on at the end of the step before (see below), or now for a run's first step; that
    // agreement counts in this step's time, as it did when it was this step's first collective.
    const bool agreed_ahead = ahead_ && ahead_->step == step;
    const StepInput in = agreed_ahead ? *ahead_ : agree_on_step(step);
    const double agreed_earlier_s = agreed_ahead ? ahead_seconds_ : 0.0;
    ahead_.reset();
    ahead_seconds_ = 0;
    m.data_s = in.data_s;
    m.peer_wait_s = in.peer_wait_s;
    m.grad_sync_s += m.peer_wait_s;
    step_->compute_gradients({step, in.micro, loader_->packed(), {in.target_tokens, in.tokens}}, m);

    // An asynchronous sharded save still reading the state the optimizer is about to change: the
    // only place a step waits for the checkpoint writer (checkpoint time, not optimizer time).
    if (sharded_) m.checkpoint_s += sharded_->before_optimizer_step();
    step_->update(m);
    // The next step is agreed on now, before the weights' gather starts: its collective queued
    // behind the gather would wait for all of it, where the next forward pass waits only for the
    // weights it reads (ZeRO-1/2 with overlap, train/grad_sync.h). It also says whether to stop.
    interrupt_agreed_ = false;
    if (step < max_steps_) {
      const auto t_ahead = Clock::now();
      ahead_ = agree_on_step(step + 1);
      interrupt_agreed_ = ahead_->interrupt;
      ahead_seconds_ = seconds_since(t_ahead);
    }
    step_->share_weights(m);
    m.step_time_s = seconds_since(t0) - ahead_seconds_ + agreed_earlier_s;
    m.tokens_per_s = double(m.tokens) / std::max(m.step_time_s, 1e-9);
    return m;
  }

  void finish(TrainResult& result) {
    report::RunSummary& s = result.summary;
    if (last_eval_) {
      s.eval_loss = last_eval_->loss;
      s.eval_perplexity = last_eval_->perplexity;
    }
    // The run's result is written before the peak is read: the run's peak includes the save, as the
    // plan does.
    if (!result.interrupted) save_final_model();
    s.peak_memory_bytes = int64_t(peak_resident_bytes());
    const plan::RunShape shape = plan::run_shape(r_);
    s.planned_memory_bytes =
        int64_t(plan::training_peak_bytes(r_, config_, plan::training_memory_plan(r_, config_, shape)));
    // Every rank measures at once, with the threads it trains with, and the job's peak is their sum.
    std::vector<double> peaks(size_t(comm_.size()), 0.0);
    peaks[size_t(comm_.rank())] =
        decoder_.backend().matmul_peak_flops(decoder_.precision() == model::Precision::BF16);
    comm_.allreduce_totals(peaks.data(), int64_t(peaks.size()));
    s.matmul_peak_flops_per_rank = peaks;
    s.matmul_peak_flops = 0;
    for (double p : peaks) s.matmul_peak_flops += p;
    s.finalize(flops_per_token(decoder_, r_.max_seq_len));
    s.ranks = int(comm_.size());
    if (comm_.rank() != 0) return;
    write_file_atomic(r_.output_dir + "/summary.json", report::summary_json(s));
    const std::string plot = report::write_loss_plot(r_.output_dir);
    fmt::print(log_, "\n{}", report::summary_table(s));
    if (result.interrupted) {  // a partial model is not the run's result: the checkpoint is
      fmt::print(log_, "keel: stopped early; metrics in {}/metrics.jsonl, summary.json, {}\n", r_.output_dir, plot);
      return;
    }
    fmt::print(log_, "keel: {} written to {}; metrics in {}/metrics.jsonl, summary.json, {}\n",
               decoder_.has_adapter() ? "LoRA adapter (PEFT format)" : "model", r_.output_dir + "/final", r_.output_dir,
               plot);
  }

  // The final model (or adapter) into <output_dir>/final, on rank 0. Every rank calls it: under
  // ZeRO-3 no rank holds the model, and the others send their shards of it to rank 0, which writes
  // each tensor as its pieces arrive (distributed::ShardReader): no rank ever holds the whole model,
  // where DeepSpeed's stage3_gather_16bit_weights_on_model_save gathers it on rank 0.
  void save_final_model() {
    const std::string final_dir = r_.output_dir + "/final";
    model::ParamStore& params = decoder_.params();
    if (params.sharded_weights() && !decoder_.has_adapter()) {  // LoRA's sharded base is not saved
      if (comm_.rank() != 0) {
        comm_.send_to_root(params.masters(), zero_shards()[size_t(comm_.rank())].size());
        return;
      }
      distributed::ShardReader shards(comm_, zero_shards(), {params.masters()});  // drains if the write throws
      model::save_hf_model_streamed(
          decoder_, final_dir, setup_.export_dtype,
          [&shards](int64_t begin, int64_t max_count, int64_t* n) { return shards.read(0, begin, max_count, n); });
      shards.drain();
    } else if (comm_.rank() != 0) {
      return;
    } else if (decoder_.has_adapter()) {  // the adapter in fp32, as PEFT keeps and saves it
      model::save_peft_adapter(decoder_, final_dir, r_.model_config ? "" : r_.model_name, r_.lora_dropout, DType::F32);
    } else {
      model::save_hf_model(decoder_, final_dir, setup_.export_dtype);
    }
    const auto tokenizer_files = checkpoint::copy_tokenizer_files(r_, final_dir);
    const bool has_tokenizer = std::any_of(tokenizer_files.begin(), tokenizer_files.end(), [](const std::string& f) {
      return f == "tokenizer.json" || f == "tokenizer.model" || f == "vocab.json";
    });
    if (!has_tokenizer)  // said now, not discovered when generation fails
      fmt::print(log_,
                 "warning: {}/ has no tokenizer: the recipe names none and model_name has none (the data was "
                 "pre-tokenized). `keel generate --model {}` will need --tokenizer; set `tokenizer` in the recipe "
                 "to ship one with the model\n",
                 final_dir, final_dir);
    recipe::write_model_marker(final_dir, "keel train: the run's final model");
  }

  const recipe::Recipe& r_;
  std::ostream& log_;
  TrainOptions options_;
  distributed::Communicator& comm_;
  recipe::ModelSetup setup_;
  model::Decoder& decoder_;
  const model::ModelConfig& config_;
  std::unique_ptr<GradSync> sync_;  // data parallel's gradient path (dp > 1); holds hooks into decoder_
  // ZeRO: each rank's part of the flat parameters (the sync's); empty otherwise.
  const std::vector<FlatRange>& zero_shards() const {
    static const std::vector<FlatRange> none;
    return sync_ ? sync_->shards() : none;
  }
  std::unique_ptr<BatchSource> loader_, eval_loader_;
  std::unique_ptr<PreferenceStage> preference_;  // stage = "dpo"
  // What each step optimises (objective.h): next-token loss, or the preference stage's loss.
  std::unique_ptr<Objective> objective_ = std::make_unique<NextTokenLoss>();
  int64_t max_steps_ = 0;
  int32_t pad_id_ = 0;
  std::unique_ptr<AdamW> optimizer_;
  LrSchedule schedule_;
  std::optional<EvalResult> last_eval_;
  checkpoint::TrainingState state_;
  bool already_complete_ = false;  // resumed from a checkpoint at max_steps
  bool interrupt_agreed_ = false;  // a rank saw an interrupt request during the step (train_step)
  std::optional<StepInput> ahead_;  // the next step's, agreed at the end of the step before
  double ahead_seconds_ = 0;        // what agreeing on ahead_ took
  std::unique_ptr<checkpoint::CheckpointWriter> checkpoints_;  // the single-file layout (rank 0)
  std::unique_ptr<ShardedSaves> sharded_;                      // the sharded layout (every rank)
  std::vector<std::string> checkpoint_notes_;  // what the sharded saves' agreements have to say
  std::unique_ptr<TrainingStep> step_;  // holds references to the decoder, objective_, optimizer_, schedule_, sync_
};

}  // namespace

namespace {

// Every rank must run the same recipe: compare a checksum of the resolved recipe across ranks.
void check_same_recipe(const recipe::Recipe& r, distributed::Communicator& comm) {
  const uint64_t mine = checksum(recipe::recipe_to_toml(r));
  std::vector<uint64_t> all(size_t(comm.size()));
  comm.allgather(&mine, all.data(), sizeof(mine));
  for (int rank = 0; rank < comm.size(); ++rank)
    if (all[size_t(rank)] != all[0])
      comm.abort(
          fmt::format("rank {} runs a different recipe than rank 0 (resolved recipes differ); every rank must "
                      "be started with the same recipe and --set overrides",
                      rank));
}

// A stream that discards what is written: ranks other than 0 stay quiet.
struct NullStream : std::ostream {
  NullStream() : std::ostream(nullptr) {}
};

}  // namespace

TrainResult run_training(const recipe::Recipe& r, std::ostream& log, const TrainOptions& options) {
  recipe::require_training_length(r);
  auto comm = distributed::make_communicator(r.comm_timeout_s);
  require(r.dp_degree == comm->size(),
          "{}: dp_degree = {} but the job has {} process(es); launch with `mpirun -np {}` (or `keel launch -n {}`), "
          "or set dp_degree = {}",
          r.source, r.dp_degree, comm->size(), r.dp_degree, r.dp_degree, comm->size());
  if (comm->size() > 1) check_same_recipe(r, *comm);
  NullStream quiet;
  std::ostream& out = comm->rank() == 0 ? log : quiet;
  for (const auto& w : recipe::inactive_key_warnings(r)) fmt::print(out, "note: {}\n", w);
  if (comm->size() > 1) fmt::print(out, "keel: data parallel over {} ranks ({})\n", comm->size(), comm->name());
  try {
    recipe::refuse_outputs_over_inputs(recipe::recipe_outputs(r), recipe::recipe_inputs(r));
    // Rank 0 writes every file of the run, so it owns the directories: a second run into them fails
    // at once instead of mixing checkpoints, metrics and summaries with this one.
    std::optional<recipe::DirectoryLock> output_lock, checkpoint_lock;
    if (comm->rank() == 0) {
      output_lock.emplace(r.output_dir, "output_dir");
      if (!r.checkpoint_dir.empty()) checkpoint_lock.emplace(r.checkpoint_dir, "checkpoint_dir");
    }
    keep_checkpoint_products(r, options, out);
    Trainer trainer(r, out, options, *comm);
    return trainer.run();
  } catch (const Error& e) {
    if (comm->size() > 1) comm->abort(fmt::format("rank {}: {}", comm->rank(), e.what()));
    throw;
  }
}

}  // namespace keel::train
