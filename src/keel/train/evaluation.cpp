#include "keel/train/evaluation.h"

#include <algorithm>
#include <cmath>

#include "keel/checkpoint/gguf_tokenizer.h"
#include "keel/core/error.h"
#include "keel/recipe/model_setup.h"

namespace keel::train {

EvalResult evaluate(model::Decoder& decoder, BatchSource& loader) {
  const int64_t n = loader.sequences();
  double loss_sum = 0;
  EvalResult result;
  for (int64_t step = 1, first = 0; first < n; ++step, first += loader.samples_per_step()) {
    // A copy: the rows past the end are masked here without touching the loader's buffers.
    data::PackedMicroBatch mb = loader.step_batches(step)[0];
    for (int64_t b = std::max<int64_t>(0, n - first); b < mb.batch; ++b)
      for (int64_t t = 0; t < mb.seq; ++t) {
        int32_t& target = mb.targets[b * mb.seq + t];
        mb.target_tokens -= target != -100;
        target = -100;
      }
    model::MicroBatch batch{mb.batch,
                            mb.seq,
                            mb.input_ids.data(),
                            mb.targets.data(),
                            mb.positions.data(),
                            loader.packed() ? mb.segments.data() : nullptr};
    loss_sum += decoder.forward_loss(batch);
    result.target_tokens += mb.target_tokens;
  }
  result.loss = result.target_tokens > 0 ? loss_sum / double(result.target_tokens) : 0.0;
  result.perplexity = std::exp(result.loss);
  return result;
}

BatchSourceOptions evaluation_source_options(const recipe::Recipe& r, const model::ModelConfig& config) {
  return BatchSourceOptions{.batch_size = r.batch_size,
                            .seq_len = r.max_seq_len,
                            .micro_batches_per_step = 1,
                            .rank = 0,
                            .ranks = 1,
                            .shuffle = false,  // every eval sequence once, in order
                            .seed = uint64_t(r.seed),
                            .vocab_size = config.vocab_size,
                            .pad_id = model_pad_id(config)};
}

EvalResult evaluate_recipe(const recipe::Recipe& r, std::ostream& log) {
  require(!r.eval_data_path.empty(), "{}: evaluation needs eval_data_path (held-out records)", r.source);
  // One process evaluates the whole model: the recipe's data-parallel sharding (ZeRO) is for
  // training, where every rank holds a part and the others gather it.
  recipe::Recipe whole = r;
  whole.dp_degree = 1;
  whole.zero_stage = 0;
  recipe::ModelSetup setup = recipe::setup_model(whole, /*rank=*/0, &log);
  model::Decoder& decoder = *setup.decoder;
  recipe::require_sequence_fits_model(r, decoder.config());
  checkpoint::prepare_recipe_gguf_tokenizer(r, &log);  // model_name = x.gguf
  auto loader = open_batch_source(r.eval_data_path, r, evaluation_source_options(r, decoder.config()), log);
  return evaluate(decoder, *loader);
}

}  // namespace keel::train
