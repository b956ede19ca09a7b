#include "keel/train/data_sources.h"

namespace keel::train {

int32_t model_pad_id(const model::ModelConfig& config) {
  return config.pad_token_id >= 0 && config.pad_token_id < config.vocab_size ? int32_t(config.pad_token_id) : 0;
}

data::BatchSourceRequest batch_source_request(const recipe::Recipe& r, const std::string& path,
                                              const BatchSourceOptions& o) {
  data::BatchSourceRequest request;
  data::TrainingDataRequest& q = request.data;
  q.data_path = path;
  q.tokenizer_path = recipe::recipe_tokenizer_path(r);
  q.max_seq_len = r.max_seq_len;
  q.vocab_size = o.vocab_size;
  q.pad_id = o.pad_id;
  q.packing = r.packing == recipe::Packing::Pack ? data::Packing::pack : data::Packing::pad;
  q.chat_template = r.chat_template;
  q.train_on_prompt = r.train_on_prompt;
  q.special_tokens_in_messages = r.special_tokens_in_messages;
  q.cache_dir = r.cache_dir;
  q.max_bad_fraction = r.max_bad_fraction;
  request.on_the_fly = r.data_pipeline == recipe::DataPipeline::OnTheFly;
  request.num_workers = int(r.num_workers);
  request.prefetch_factor = int(r.prefetch_factor);
  return request;
}

std::unique_ptr<BatchSource> open_batch_source(const std::string& path, const recipe::Recipe& r,
                                               const BatchSourceOptions& o, std::ostream& log) {
  return data::open_batch_source(batch_source_request(r, path, o), o, log);
}

std::unique_ptr<PairSource> open_pair_source(const std::string& path, const recipe::Recipe& r,
                                             const BatchSourceOptions& o, std::ostream& log) {
  return data::open_pair_source(batch_source_request(r, path, o).data, r.pref_loss == recipe::PreferenceLoss::Orpo, o,
                                log);
}

}  // namespace keel::train
