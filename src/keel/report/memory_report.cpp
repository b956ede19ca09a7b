#include "keel/report/memory_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include "keel/core/error.h"
#include "keel/model/decoder.h"
#include "keel/kernels/bf16_widening.h"
#include "keel/recipe/model_setup.h"

namespace keel::report {

size_t parse_memory_size(std::string_view text) {
  std::string s;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) s += char(std::toupper(static_cast<unsigned char>(c)));
  size_t digits = 0;
  while (digits < s.size() && (std::isdigit(static_cast<unsigned char>(s[digits])) || s[digits] == '.')) ++digits;
  std::string unit = s.substr(digits);
  double value = 0;
  bool ok = digits > 0;
  if (ok) {
    try {
      size_t used = 0;
      value = std::stod(s.substr(0, digits), &used);
      ok = used == digits && value >= 0 && std::isfinite(value);
    } catch (const std::exception&) {
      ok = false;
    }
  }
  if (unit.size() == 3 && unit[1] == 'I') unit.erase(1, 1);  // GiB -> GB: binary either way
  if (unit.size() == 2 && unit[1] == 'B') unit.pop_back();   // GB -> G
  static const std::pair<const char*, int> kUnits[] = {{"", 30}, {"B", 0}, {"K", 10}, {"M", 20}, {"G", 30}, {"T", 40}};
  for (const auto& [name, shift] : kUnits)
    if (ok && unit == name) return size_t(value * double(uint64_t(1) << shift));
  fail(
      "memory size '{}': expected a number with an optional unit B, KB, MB, GB or TB (binary: 1 GB = 1 GiB), "
      "e.g. 64GB",
      text);
}

namespace {

size_t gib(double n) { return size_t(n * double(size_t(1) << 30)); }

// A plan fits when its total is within the device memory and its arena within memory_pool_size
// (each limit 0: not checked).
bool within_limits(size_t total, size_t arena, size_t device, size_t pool) {
  return (device == 0 || total <= device) && (pool == 0 || arena <= pool);
}

struct Candidate {
  RunShape shape;
  std::vector<std::string> changes;  // what differs from the configured run, in words
  int cost = 0;                      // preference: lower changes less of the run
  bool shortens_sequences = false;   // max_seq_len changes what the model sees: only when nothing else fits
  size_t total = 0, arena = 0;
  bool fits = false;
};

// A position of the step timeline in words.
std::string position_name(const model::StepTimeline& t, int32_t p) {
  if (p <= 0) return "setup (weights loading)";
  if (p < t.head()) return fmt::format("forward of block {}", p - t.forward(0));
  if (p == t.head()) return "LM head and loss";
  if (p < t.optimizer()) return fmt::format("backward of block {}", t.head() + t.layers - p);
  return "optimizer step";
}

// recomputed: the blocks that recompute (recomputed_blocks), of `layers`.
std::string shape_summary(const RunShape& s, int64_t recomputed, int64_t layers) {
  const std::string checkpointing = !s.gradient_checkpointing ? "off"
                                    : recomputed == layers
                                        ? "on"
                                        : fmt::format("on for the first {} blocks{}", recomputed,
                                                      s.checkpointing_layers == 0 ? " (keel's choice)" : "");
  return fmt::format("micro-batch {} x {} tokens{}, accumulation {}, dp {}, ZeRO-{}, gradient checkpointing {}",
                     s.batch_size, s.max_seq_len,
                     s.preference_pairs ? fmt::format(" ({} preference pairs)", s.batch_size / 2) : "",
                     s.gradient_accumulation_steps, s.dp, s.zero_stage, checkpointing);
}

// The per-category lines of the report, with what each holds.
std::string breakdown_lines(const MemoryPlan& plan, const RunShape& shape, bool bf16, int64_t recomputed,
                            int64_t layers) {
  const bool sharded = shape.zero_stage >= 1 && shape.dp > 1;
  const std::string shard = sharded ? fmt::format(", 1/{} shard (ZeRO-{})", shape.dp, shape.zero_stage) : "";
  // LoRA, QLoRA and sharded masters (ZeRO-3, and bf16 ZeRO-1/2: recipe::set_zero_stage decides) show
  // in the plan's buffers (model/decoder_plan.cpp names them).
  bool lora = false, masters_sharded = false, casts = false, sharded_staging = false;
  std::string four_bit;  // "NF4" or "FP4" when the projections are held in 4 bits
  std::string matrices = "projections";  // " and experts" on a mixture of experts
  for (const auto& b : plan.buffers()) {
    if (b.name.find(".experts.") != std::string::npos) matrices = "projections and experts";
    lora = lora || b.name == "lora.weights";
    casts = casts || b.name.rfind("weights.bf16.cast", 0) == 0;  // ZeRO-3 with one rank
    masters_sharded = masters_sharded || b.name.rfind("weights (1/", 0) == 0;
    sharded_staging = sharded_staging || b.name.rfind("checkpoint staging (async sharded", 0) == 0;
    if (b.name.rfind("weights.nf4", 0) == 0) four_bit = "NF4";
    if (b.name.rfind("weights.fp4", 0) == 0) four_bit = "FP4";
  }
  const bool zero3 = sharded && shape.zero_stage >= 3;
  auto note = [&](MemoryCategory c) -> std::string {
    switch (c) {
      case MemoryCategory::MasterWeights:
        if (zero3 && lora)
          return (bf16 ? "fp32: the frozen norms and biases" : "fp32: the frozen model") + shard +
                 ", the adapter whole";
        if (masters_sharded) return "fp32 master" + shard;
        if (lora) return bf16 ? "fp32: the adapter, the frozen norms and biases" : "fp32: the model (frozen) and the adapter";
        return bf16 ? "fp32 master, whole on every rank" : "fp32 (the compute copy too)";
      case MemoryCategory::ComputeWeights:
        if (!four_bit.empty() && zero3)
          return fmt::format(
              "frozen {} in {} (4-bit codes + absmax){}, and the embedding/LM head{}, "
              "each gathered for this position and the next; the adapter's bf16 copy",
              matrices, four_bit, shard, bf16 ? " in bf16" : "");
        if (!four_bit.empty())
          return fmt::format("frozen {} in {} (4-bit codes + absmax), embedding/LM head and adapter in bf16", matrices,
                             four_bit);
        if (lora && zero3)
          return "the weights gathered for this position and the next" +
                 std::string(bf16 ? ", the frozen bf16 matrices" + shard + ", the adapter's bf16 copy" : "");
        if (lora) return "frozen matrices in bf16 alone (no fp32 masters), the adapter's bf16 copy";
        if (zero3)
          return bf16 ? "the weights gathered for this position and the next: the GEMMs' in bf16, norms, biases and "
                        "the embedding in fp32"
                      : "the weights gathered for this position and the next (fp32)";
        if (masters_sharded)
          return "whole, gathered after each optimizer step: the GEMMs' in bf16, norms, biases and the embedding in "
                 "fp32";
        if (casts) return "the GEMMs' bf16 cast from the masters for this position and the next (ZeRO-3, one rank)";
        return "bf16 copy the GEMMs read";
      case MemoryCategory::Gradients:
        if (sharded && shape.zero_stage >= 2)
          return fmt::format("fp32{}: 1/{} shard accumulated, plus the staging of the groups being written or reduced",
                             lora ? ", the adapter's" : "", shape.dp);
        return lora ? "fp32, the adapter's only (frozen weights have none)" : "fp32, accumulated over micro-batches";
      case MemoryCategory::OptimizerState:
        return std::string(lora ? "AdamW m and v of the adapter, fp32" : "AdamW m and v, fp32") +
               (sharded ? shard : std::string());
      case MemoryCategory::Activations:
        if (!shape.gradient_checkpointing) return "every block's intermediates, kept for backward";
        if (recomputed == layers) return "block inputs + one recomputed block (checkpointing)";
        return fmt::format(
            "block inputs + one recomputed block (checkpointing, the first {}) + the other blocks' intermediates",
            recomputed);
      case MemoryCategory::Workspace: return "gradient scratch, logits chunk (shared by lifetime)";
      case MemoryCategory::Communication: return "MPI and the buckets' reduction scratch (reduced in place)";
      case MemoryCategory::Data: return "the weight file pages of the tensor loading, micro-batches, rotary table";
      case MemoryCategory::CheckpointStaging:
        if (sharded_staging)
          return std::string("this rank's part of an async sharded save, at most checkpoint_staging_mb") +
                 (masters_sharded && !lora ? "; rank 0: one piece of another rank's weights for the final model" : "");
        if (masters_sharded && !lora)
          return "rank 0: one piece of another rank's shard at a time (the final save, a checkpoint), or the async "
                 "save's snapshot";
        return "async save snapshot (weights, m, v), or ZeRO's receive buffer";
      case MemoryCategory::Runtime: return "code, libraries, threads, library scratch (measured)";
      case MemoryCategory::kCount: break;
    }
    return "";
  };
  std::string out;
  for (int i = 0; i < kMemoryCategories; ++i) {
    const auto c = MemoryCategory(i);
    const size_t bytes = plan.category_bytes_at_peak(c);
    if (bytes == 0 && plan.category_bytes(c) == 0) continue;
    out += fmt::format("  {:<20}{:>12}   {}\n", category_name(c), format_bytes(double(bytes)), note(c));
  }
  out += fmt::format("  {:<20}{:>12}   arena {} / live peak {} - 1 = {:.2f}% (fragmentation_threshold)\n",
                     "packing waste", format_bytes(double(plan.arena_bytes() - plan.peak_live_bytes())),
                     format_bytes(double(plan.arena_bytes())), format_bytes(double(plan.peak_live_bytes())),
                     100.0 * plan.waste());
  out += fmt::format("  {:<20}{:>12}   arena {} (one mapping, planned before step 1) + {} outside it\n", "total",
                     format_bytes(double(plan.total_bytes())), format_bytes(double(plan.arena_bytes())),
                     format_bytes(double(plan.external_bytes())));
  return out;
}

}  // namespace

namespace {

RunShape requested_shape(const recipe::Recipe& r, const PlanRequest& request) {
  RunShape shape = keel::plan::run_shape(r);
  if (request.dp > 0) shape.dp = request.dp;
  if (request.zero_stage >= 0) shape.zero_stage = request.zero_stage;
  require(shape.zero_stage >= 0 && shape.zero_stage <= 3, "ZeRO stage {}: keel plans stages 0 to 3", shape.zero_stage);
  return shape;
}

}  // namespace

MemoryReport memory_report_json(const recipe::Recipe& r, const PlanRequest& request) {
  const auto config = recipe::recipe_model_config(r);
  recipe::require_sequence_fits_model(r, config);
  const auto plan = keel::plan::training_memory_plan(r, config, requested_shape(r, request));
  MemoryReport report;
  const size_t device = request.device_memory_bytes;
  const size_t pool = gib(r.memory_pool_size);
  if (device != 0 || pool != 0) report.fits = within_limits(plan.total_bytes(), plan.arena_bytes(), device, pool);
  std::string categories;
  for (int i = 0; i < kMemoryCategories; ++i) {
    const auto c = MemoryCategory(i);
    categories +=
        fmt::format("{}\"{}\": {}", categories.empty() ? "" : ", ", category_name(c), plan.category_bytes_at_peak(c));
  }
  // Position 0 is the setup (weights loading); from position 1 on, the training steps.
  size_t training_external = 0;
  for (int32_t p = 1; p <= model::StepTimeline{int32_t(config.num_layers)}.last(); ++p)
    training_external = std::max(training_external, plan.external_bytes_at(p));
  report.text = fmt::format(
      "{{\"total_bytes\": {}, \"arena_bytes\": {}, \"peak_live_bytes\": {}, \"waste\": {:.6f}, "
      "\"external_bytes\": {}, \"setup_bytes\": {}, \"training_bytes\": {}, \"fits\": {}, "
      "\"categories\": {{{}}}}}\n",
      plan.total_bytes(), plan.arena_bytes(), plan.peak_live_bytes(), plan.waste(), plan.external_bytes(),
      plan.arena_bytes() + plan.external_bytes_at(0), plan.arena_bytes() + training_external,
      report.fits ? (*report.fits ? "true" : "false") : "null", categories);
  return report;
}

namespace {

// What the report says of the configured run: the model, the run, the per-category breakdown.
std::string configured_run_lines(const recipe::Recipe& r, const model::ModelConfig& config, const RunShape& shape,
                                 bool bf16, int64_t recomputed) {
  const auto plan = keel::plan::training_memory_plan(r, config, shape);
  std::string out;
  out += fmt::format("keel plan: {}\n", r.source);
  const double parameters = double(config.total_parameters());
  out += fmt::format(
      "model: {} ({}), {} layers, hidden {}, {} heads ({} kv), intermediate {}, vocab {}: {} "
      "parameters\n",
      config.architecture, model::family_name(config.family), config.num_layers, config.hidden_size, config.num_heads,
      config.num_kv_heads, config.intermediate_size, config.vocab_size,
      parameters >= 1e9 ? fmt::format("{:.2f}B", parameters / 1e9) : fmt::format("{:.2f}M", parameters / 1e6));
  out += fmt::format("run: {}, {}\n", recipe::choice_name(r.dtype), shape_summary(shape, recomputed, config.num_layers));
  const model::DecoderOptions options = keel::plan::planned_decoder_options(r, config, shape);
  if (shape.zero_stage >= 1 && shape.dp == 1)
    out += options.cast_per_position
               ? "note: ZeRO-3 with dp 1 shards nothing, but keeps no whole bf16 copy of the weights: each position "
                 "casts its own\n"
               : fmt::format("note: ZeRO-{} with dp 1 shards nothing\n", shape.zero_stage);
  // Where bf16 products widen to fp32 (this CPU, kernels/gemm.h: bf16_products) the plan holds
  // their fp32 tiles and copies: say so, and why, as keel train does.
  if (auto& backend = model::backend_of(options); bf16 && kernels::widens_bf16_products(backend))
    out += fmt::format("note: {}; the plan counts their fp32 copies\n", backend.description(true));
  const model::StepTimeline timeline{int32_t(config.num_layers)};
  const auto arena_peak = position_name(timeline, plan.peak_position());
  const auto other_peak = position_name(timeline, plan.external_peak_position());
  out += arena_peak == other_peak
             ? fmt::format("\nper-rank memory at its peak, during the {}:\n", arena_peak)
             : fmt::format("\nper-rank memory at its peak: the arena's during the {}, the rest's during the {}:\n",
                           arena_peak, other_peak);
  out += breakdown_lines(plan, shape, bf16, recomputed, config.num_layers);
  out += "  (not planned: the training records held in memory, 8 bytes per token)\n";
  // A directory holding config.json alone plans the weights' loading (its use: planning a download),
  // but keel train initialises that model at random, mapping no file: say what that run peaks at.
  bool random = false;
  if (const size_t peak = keel::plan::training_peak_bytes(r, config, plan, &random); random)
    out += fmt::format(
        "  (model_name holds no weights: keel train initialises it at random and maps no weight file, {} less "
        "during the setup; that run peaks at {})\n",
        format_bytes(double(keel::plan::largest_weight_tensor_bytes(r.model_name, config))), format_bytes(double(peak)));
  out += "\n";
  return out;
}

// Every combination of ZeRO-1, synchronous saves, gradient checkpointing, smaller micro-batches
// (the accumulation grows so the global batch stays) and shorter sequences that differs from the
// configured run, with its changes in words and a cost (lower changes less of the run); not yet
// planned.
std::vector<Candidate> alternatives(const recipe::Recipe& r, const RunShape& shape) {
  std::vector<int> zero_options{shape.zero_stage};
  if (shape.dp > 1)
    for (int stage = shape.zero_stage + 1; stage <= 3; ++stage) zero_options.push_back(stage);
  else if (shape.zero_stage < 3 && recipe::bf16_full_fine_tuning(r))
    zero_options.push_back(3);  // one rank: no whole bf16 copy, each position casts its own
  std::vector<bool> checkpointing_options{shape.gradient_checkpointing};
  if (!shape.gradient_checkpointing) checkpointing_options.push_back(true);
  // Rows per micro-batch; a preference pair is two rows that stay together (batch_size counts pairs).
  const int64_t rows_per_sample = r.stage == recipe::Stage::Dpo ? 2 : 1;
  std::vector<int64_t> batches{shape.batch_size};
  for (int64_t b = shape.batch_size / rows_per_sample; b % 2 == 0;) batches.push_back((b /= 2) * rows_per_sample);
  if (batches.back() != rows_per_sample) batches.push_back(rows_per_sample);
  std::vector<int64_t> seqs{shape.max_seq_len};
  for (int64_t s = shape.max_seq_len; s % 2 == 0 && s / 2 >= 256;) seqs.push_back(s /= 2);
  std::vector<bool> async_options{r.async_save && !r.checkpoint_dir.empty()};
  if (async_options[0]) async_options.push_back(false);
  std::vector<Candidate> candidates;
  for (int zero : zero_options)
    for (bool ckpt : checkpointing_options)
      for (bool async_save : async_options)
        for (size_t bi = 0; bi < batches.size(); ++bi)
          for (size_t si = 0; si < seqs.size(); ++si) {
            Candidate c{shape, {}, 0};
            if (zero != shape.zero_stage) {
              c.shape.zero_stage = zero;
              c.changes.push_back(fmt::format("--zero {}", zero));
              // The same math: a reduce-scatter + all-gather instead of an all-reduce; stage 2
              // reduces every micro-batch; stage 3 gathers each block's weights twice per micro-batch.
              // With one rank stage 3 is only a cast pass over each position's masters.
              c.cost += shape.dp > 1 ? zero : 1;
            }
            if (async_save != async_options[0]) {
              c.shape.async_checkpoint = false;
              c.changes.push_back("async_save = false");
              c.cost += 1;  // training pauses while a checkpoint is written, every save_interval steps
            }
            if (ckpt != shape.gradient_checkpointing) {
              c.shape.gradient_checkpointing = ckpt;
              c.changes.push_back("use_gradient_checkpointing = true");
              c.cost += 2;  // one more forward pass per step (about a third more compute)
            }
            if (bi > 0) {
              c.shape.batch_size = batches[bi];
              c.shape.gradient_accumulation_steps =
                  shape.gradient_accumulation_steps * shape.batch_size / batches[bi];  // same global batch
              c.changes.push_back(fmt::format("batch_size = {} (accumulation {})", c.shape.batch_size / rows_per_sample,
                                              c.shape.gradient_accumulation_steps));
              c.cost += 3 + int(bi);  // smaller GEMMs run less efficiently
            }
            if (si > 0) {
              c.shape.max_seq_len = seqs[si];
              c.changes.push_back(fmt::format("max_seq_len = {}", seqs[si]));
              c.shortens_sequences = true;
              c.cost += 8 + 2 * int(si);  // changes what the model sees: last resort
            }
            if (!c.changes.empty()) candidates.push_back(std::move(c));
          }
  return candidates;
}

// The planned alternatives in words: the best setting of each knob alone, then the recommended
// change (the fewest changes that fit, the mildest first), or, when nothing fits, why.
// lora: the run trains LoRA adapters; four_bit: on 4-bit base weights (QLoRA).
std::string advice_lines(const std::vector<Candidate>& candidates, const model::ModelConfig& config, bool bf16,
                         bool lora, bool four_bit) {
  std::string out = "\nwhat to change (each planned with the same planner):\n";
  out += fmt::format("  {:>12}  {:<5} {}\n", "per rank", "fits", "change");
  auto line = [&](const Candidate& c) {
    out += fmt::format("  {:>12}  {:<5} {}\n", format_bytes(double(c.total)), c.fits ? "yes" : "no",
                       fmt::join(c.changes, " + "));
  };
  // One change at a time: the mildest setting of each knob that fits, or its strongest.
  for (const char* knob : {"--zero", "async_save", "use_gradient_checkpointing", "batch_size", "max_seq_len"}) {
    const Candidate* best = nullptr;
    for (const auto& c : candidates) {
      if (c.changes.size() != 1 || c.changes[0].find(knob) == std::string::npos) continue;
      if (!best || (c.fits && (!best->fits || c.cost < best->cost)) ||
          (!c.fits && !best->fits && c.total < best->total))
        best = &c;
    }
    if (best) line(*best);
  }
  // The recommendation keeps the sequences whole if any candidate can (truncating the data is not
  // a memory setting); then the fewest changes, then the mildest.
  const Candidate* recommended = nullptr;
  auto preferred = [](const Candidate& a, const Candidate& b) {
    if (a.shortens_sequences != b.shortens_sequences) return !a.shortens_sequences;
    if (a.changes.size() != b.changes.size()) return a.changes.size() < b.changes.size();
    return a.cost < b.cost;
  };
  for (const auto& c : candidates)
    if (c.fits && (!recommended || preferred(c, *recommended))) recommended = &c;
  const Candidate* smallest = &candidates.front();
  for (const auto& c : candidates)
    if (c.total < smallest->total) smallest = &c;
  if (recommended) {
    if (recommended->changes.size() > 1) line(*recommended);
    out += fmt::format("\nrecommended: {} -> {} per rank\n", fmt::join(recommended->changes, " + "),
                       format_bytes(double(recommended->total)));
    return out;
  }
  line(*smallest);
  // Nothing fits: say what no activation setting can fix.
  const size_t elements = size_t(config.total_parameters());
  if (smallest->shape.zero_stage >= 3 && !lora) {
    // ZeRO-3 shards the whole model state (fp32 weights, gradients, AdamW m and v: 16 bytes a
    // parameter); what more ranks do not shrink is one sequence's activations, the weights gathered
    // for two positions and the largest tensor while loading.
    const size_t state = elements * 16 / size_t(smallest->shape.dp);
    const size_t rest = smallest->total > state ? smallest->total - state : 0;
    out += fmt::format(
        "\nnothing above fits. The smallest ({}) still needs {} per rank: the model state {} ({}) and about {} "
        "that more ranks do not shrink (activations, the weights gathered for two positions, the largest tensor "
        "while loading). More ranks, more memory per rank or a smaller model are needed.\n",
        fmt::join(smallest->changes.empty() ? std::vector<std::string>{"as given"} : smallest->changes, " + "),
        format_bytes(double(smallest->total)),
        smallest->shape.dp > 1 ? fmt::format("sharded over {} ranks", smallest->shape.dp) : "on its one rank",
        format_bytes(double(state)), format_bytes(double(rest)));
    return out;
  }
  if (lora) {  // the frozen base dominates: whole on every rank below ZeRO-3, sharded by it
    out += fmt::format(
        "\nnothing above fits. The smallest ({}) still needs {} per rank: LoRA's frozen base weights ({} a "
        "parameter{}), the activations and the adapter's state. More memory per rank{} or a smaller model are "
        "needed.\n",
        fmt::join(smallest->changes.empty() ? std::vector<std::string>{"as given"} : smallest->changes, " + "),
        format_bytes(double(smallest->total)),
        four_bit ? "half a byte"
        : bf16   ? "2 bytes"
                 : "4 bytes",
        smallest->shape.zero_stage >= 3 ? ", sharded over the ranks" : ", whole on every rank",
        smallest->shape.zero_stage >= 3 ? ", more ranks" : ", ZeRO-3 (--zero 3, which shards them)");
    return out;
  }
  // What ZeRO-2 leaves whole, at least: in bf16 the weights the step reads (their bf16 copy; the
  // fp32 masters are sharded; the embedding's fp32 lookup copy comes on top), in fp32 the weights.
  const size_t floor = elements * (bf16 ? 2 : 4);
  out += fmt::format(
      "\nnothing above fits. The smallest ({}) still needs {} per rank; even with ZeRO-2 over any "
      "number of ranks the replicated weights ({}) alone take at least {}. More memory per rank, "
      "ZeRO-3 (--zero 3, which shards the weights too) or a smaller model are needed.\n",
      fmt::join(smallest->changes, " + "), format_bytes(double(smallest->total)),
      bf16 ? "the bf16 copy the GEMMs read" : "fp32", format_bytes(double(floor)));
  return out;
}

// The fewest blocks that can recompute (checkpointing_layers, from the first) with `c` still
// fitting, given that it fits with `c.shape` as it is: each block that keeps its intermediates
// adds them to the peak, so memory falls as more blocks recompute and a bisection finds the
// boundary; the plan at the answer is evaluated, so it is known to fit. With try_off, returns 0
// with checkpointing off when that fits; `c` becomes the fitting candidate found.
template <typename Evaluate>
int64_t fewest_recomputed_blocks(Candidate& c, int64_t layers, bool try_off, const Evaluate& evaluate) {
  if (try_off) {
    Candidate off = c;
    off.shape.gradient_checkpointing = false;
    off.shape.checkpointing_layers = 0;
    evaluate(off);
    if (off.fits) {
      c = off;
      return 0;
    }
  }
  int64_t fails = 0, fits = c.shape.checkpointing_layers == 0 ? layers : c.shape.checkpointing_layers;
  Candidate best = c;
  while (fits - fails > 1) {
    Candidate mid = c;
    mid.shape.checkpointing_layers = (fails + fits) / 2;
    evaluate(mid);
    (mid.fits ? fits : fails) = mid.shape.checkpointing_layers;
    if (mid.fits) best = mid;
  }
  c = best;
  return fits;
}

// The text of memory_report; sets `fits` when a limit was given.
std::string memory_report_text(const recipe::Recipe& r, const PlanRequest& request, std::optional<bool>& fits) {
  const auto config = recipe::recipe_model_config(r);
  recipe::require_sequence_fits_model(r, config);
  const bool bf16 = recipe::recipe_precision(r) == model::Precision::BF16;
  const RunShape shape = requested_shape(r, request);
  const size_t device = request.device_memory_bytes;
  const size_t pool = gib(r.memory_pool_size);
  auto evaluate = [&](Candidate& c) {
    const auto plan = keel::plan::training_memory_plan(r, config, c.shape);
    c.total = plan.total_bytes();
    c.arena = plan.arena_bytes();
    c.fits = within_limits(c.total, c.arena, device, pool);
  };

  const int64_t recomputed = keel::plan::recomputed_blocks(r, config, shape);
  std::string out = configured_run_lines(r, config, shape, bf16, recomputed);
  Candidate configured{shape, {}, 0};
  evaluate(configured);
  if (device == 0 && pool == 0) {
    out += "fits: not checked (give --device-memory, or memory_pool_size in the recipe)\n";
    return out;
  }
  fits = configured.fits;
  std::vector<std::string> limits;
  if (device) limits.push_back(fmt::format("{} of device memory per rank", format_bytes(double(device))));
  if (pool) limits.push_back(fmt::format("memory_pool_size {} for the arena", format_bytes(double(pool))));
  const std::string limit_text = fmt::format("{}", fmt::join(limits, " and "));
  const int64_t layers = config.num_layers;
  if (configured.fits) {
    out += fmt::format("fits: yes, within {}", limit_text);
    if (device) out += fmt::format(" ({} to spare)", format_bytes(double(device - configured.total)));
    out += "\n";
    // Checkpointing spends compute for memory: say when less of it fits.
    if (shape.gradient_checkpointing) {
      Candidate fewer = configured;
      const int64_t fewest = fewest_recomputed_blocks(fewer, layers, true, evaluate);
      if (fewest == 0)
        out += fmt::format("fits without checkpointing too: use_gradient_checkpointing = false -> {} per rank\n",
                           format_bytes(double(fewer.total)));
      else if (fewest < recomputed)
        out += fmt::format(
            "fits with fewer blocks recomputed too: gradient_checkpointing_layers = {} ({} of {} blocks recompute) "
            "-> {} per rank\n",
            fewest, fewest, layers, format_bytes(double(fewer.total)));
      // One rank in bf16 full fine-tuning: ZeRO-3 drops the whole bf16 copy, which can buy more.
      if (fewest > 0 && shape.dp == 1 && shape.zero_stage < 3 && recipe::bf16_full_fine_tuning(r)) {
        Candidate cast = configured;
        cast.shape.zero_stage = 3;
        evaluate(cast);
        const int64_t with_casts = cast.fits ? fewest_recomputed_blocks(cast, layers, true, evaluate) : layers;
        if (cast.fits && with_casts == 0)
          out += fmt::format(
              "with --zero 3 (one rank: the bf16 weights cast per position) it fits without checkpointing: "
              "use_gradient_checkpointing = false -> {} per rank\n",
              format_bytes(double(cast.total)));
        else if (cast.fits && with_casts < std::min(fewest, recomputed))
          out += fmt::format(
              "with --zero 3 (one rank: the bf16 weights cast per position) fewer still: gradient_checkpointing_layers "
              "= {} ({} of {} blocks recompute) -> {} per rank\n",
              with_casts, with_casts, layers, format_bytes(double(cast.total)));
      }
    }
    return out;
  }
  out += fmt::format("fits: NO: needs {} per rank (arena {}), over {}\n", format_bytes(double(configured.total)),
                     format_bytes(double(configured.arena)), limit_text);
  std::vector<Candidate> candidates = alternatives(r, shape);
  for (auto& c : candidates) {
    evaluate(c);
    // Turning checkpointing on: as few blocks recompute as fit (the change names how many).
    if (c.fits && c.shape.gradient_checkpointing && !shape.gradient_checkpointing) {
      const int64_t fewest = fewest_recomputed_blocks(c, layers, false, evaluate);
      for (auto& change : c.changes)
        if (change.starts_with("use_gradient_checkpointing") && fewest > 0 && fewest < layers)
          change += fmt::format(", gradient_checkpointing_layers = {}", fewest);
    }
  }
  return out +
         advice_lines(candidates, config, bf16, r.finetuning_type == recipe::Finetuning::Lora, r.quantization_bit == 4);
}

}  // namespace

MemoryReport memory_report(const recipe::Recipe& r, const PlanRequest& request) {
  MemoryReport report;
  report.text = memory_report_text(r, request, report.fits);
  return report;
}

}  // namespace keel::report
