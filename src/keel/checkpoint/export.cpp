#include "keel/checkpoint/export.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/formats/safetensors.h"
#include "keel/model/decoder.h"
#include "keel/model/gguf_weights.h"
#include "keel/model/hf_weights.h"
#include "keel/model/peft_adapter.h"
#include "keel/checkpoint/checkpoint.h"
#include "keel/checkpoint/gguf_adapter.h"
#include "keel/checkpoint/gguf_tokenizer.h"
#include "keel/checkpoint/sharded_reader.h"
#include "keel/recipe/model_setup.h"
#include "keel/recipe/run_guard.h"

namespace keel::checkpoint {
namespace {

namespace fs = std::filesystem;

// What transformers' tokenizer and generation classes read from a model directory, besides the
// weights and config.json.
constexpr const char* kTokenizerFiles[] = {"tokenizer.json",
                                           "tokenizer_config.json",
                                           "special_tokens_map.json",
                                           "added_tokens.json",
                                           "tokenizer.model",
                                           "vocab.json",
                                           "merges.txt",
                                           "vocab.txt",
                                           "chat_template.jinja",
                                           "chat_template.json",
                                           "generation_config.json"};

// tokenization_chatglm.py and the like: the remote-code tokenizer tokenizer_config.json's auto_map names.
bool is_tokenizer_code(const std::string& name) {
  return name.rfind("tokenization_", 0) == 0 && name.size() > 3 && name.compare(name.size() - 3, 3, ".py") == 0;
}

bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec;
  return fs::equivalent(a, b, ec);
}

void copy_into(const std::string& source, const std::string& dir, const std::string& name,
               std::vector<std::string>& copied) {
  const std::string target = dir + "/" + name;
  if (!same_file(source, target)) write_file_atomic(target, read_file(source));  // errors name the file
  copied.push_back(name);
}

// Checked before the (long) verification and load; returns whether the directory was created here.
bool prepare_destination(const std::string& dir, const std::string& step_dir) {
  require(!dir.empty(), "--to: expected a destination directory");
  require(!same_file(dir, step_dir), "{}: the destination is the checkpoint itself; export to another directory", dir);
  std::error_code ec;
  const bool existed = fs::exists(dir, ec);
  make_dirs(dir);  // errors name the directory and the reason
  require(::access(dir.c_str(), W_OK | X_OK) == 0, "{}: destination is not writable ({})", dir, std::strerror(errno));
  return !existed;
}

ExportResult export_into(const ExportRequest& request, const std::string& step_dir, const recipe::Recipe& recipe);

// A Hugging Face model directory (config.json beside its weights), not a checkpoint (recipe.toml).
bool is_model_directory(const std::string& dir) {
  return path_exists(dir + "/config.json") && !path_exists(dir + "/recipe.toml");
}

// The dtype of the first matrix in the order the converter reads the files (names sorted): what its
// --outtype auto looks at.
DType first_matrix_dtype(const formats::CheckpointReader& reader) {
  for (const auto& name : reader.names())
    if (reader.get(name).shape.size() >= 2) return reader.dtype_of(name);
  return DType::F32;
}

// What the converter skips of a checkpoint's tensors (buffers, not weights).
bool converter_skips(const std::string& name) {
  for (const char* suffix : {".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq"})
    if (name.ends_with(suffix)) return true;
  return false;
}

// keel export MODEL_DIR --format gguf: any model keel loads, without a training run. The tensors
// stream from the directory's files a piece at a time (in the converter's order), so the export
// holds a few MiB, not a tensor, let alone the model.
ExportResult export_model_dir_as_gguf(const ExportRequest& request) {
  const std::string& dir = request.checkpoint;
  ExportResult result;
  result.step_dir = dir;
  result.config = model::load_model_config(dir + "/config.json");
  const auto reader = formats::CheckpointReader::open_dir(dir);
  std::vector<HfTensorSource> tensors;
  std::vector<std::string> skipped;
  int64_t mtp_tensors = 0;
  for (const auto& name : reader.names()) {
    if (converter_skips(name)) {
      skipped.push_back(name);
      continue;
    }
    if (result.config.next_token_prediction_tensor(name)) {  // not loaded, so not written: the note says so
      ++mtp_tensors;
      continue;
    }
    const std::vector<int64_t> shape = reader.get(name).shape;
    tensors.push_back({name, shape,
                       [&reader, name, shape](int64_t begin, int64_t count, float* dst) {
                         reader.read_f32_part(name, shape, begin, count, dst);
                       },
                       [&reader, name, shape](int64_t begin, int64_t count, const auto& use) {
                         reader.read_stored_part(name, shape, begin, count, use);
                       },
                       reader.dtype_of(name)});
  }
  WorkProgress progress(request.progress_log, request.live_progress);
  GgufModelSource source;
  source.name = fs::path(dir).lexically_normal().filename().string();
  if (source.name.empty()) source.name = fs::path(dir).lexically_normal().parent_path().filename().string();
  source.tokenizer_dir = dir;
  source.config_json = read_file(dir + "/config.json");
  source.weights_dtype = first_matrix_dtype(reader);
  result.dtype = source.weights_dtype;
  result.gguf = write_gguf_model(result.config, std::move(tensors), source, request.destination, request.outtype,
                                 &progress);
  result.gguf->skipped = std::move(skipped);
  if (mtp_tensors > 0)
    result.gguf->notes.push_back(fmt::format(
        "the directory's {} tensors of GLM-4.5's multi-token-prediction layer(s) are not written (llama.cpp's converter "
        "writes them, for speculative drafting): keel loads and trains the model as transformers does, without them",
        mtp_tensors));
  progress.finish();
  return result;
}

model::Family family_of_export(const model::ModelConfig& trained, ExportFormat format) {
  switch (format) {
    case ExportFormat::AsTrained: return trained.family;
    case ExportFormat::Hf: return trained.family == model::Family::GlmOriginal ? model::Family::Glm : trained.family;
    case ExportFormat::GlmOriginal: return model::Family::GlmOriginal;
    case ExportFormat::Gguf: return trained.family;
  }
  return trained.family;
}

}  // namespace

DType export_dtype_from_name(const std::string& name) {
  if (name == "bf16" || name == "bfloat16") return DType::BF16;
  if (name == "fp16" || name == "float16") return DType::F16;
  if (name == "fp32" || name == "float32") return DType::F32;
  fail("--dtype: expected bf16, fp16 or fp32, found '{}'", name);
}

ExportFormat export_format_from_name(const std::string& name) {
  if (name == "hf") return ExportFormat::Hf;
  if (name == "glm-original" || name == "glm_original") return ExportFormat::GlmOriginal;
  if (name == "gguf") return ExportFormat::Gguf;
  fail("--format: expected hf, glm-original or gguf, found '{}'", name);
}

std::vector<std::string> copy_tokenizer_files(const recipe::Recipe& r, const std::string& dir) {
  std::vector<std::string> copied;
  const std::string source = recipe::recipe_tokenizer_path(r);
  std::error_code ec;
  if (!source.empty() && fs::is_directory(source, ec)) {
    for (const char* name : kTokenizerFiles)
      if (path_exists(source + "/" + name)) copy_into(source + "/" + name, dir, name, copied);
    for (const auto& entry : fs::directory_iterator(source, ec)) {
      const std::string name = entry.path().filename().string();
      if (is_tokenizer_code(name) && entry.is_regular_file(ec)) copy_into(entry.path().string(), dir, name, copied);
    }
  } else if (!source.empty() && fs::is_regular_file(source, ec)) {
    const std::string name = fs::path(source).filename().string();
    const bool json = name.size() > 5 && name.compare(name.size() - 5, 5, ".json") == 0;
    copy_into(source, dir, json ? "tokenizer.json" : name, copied);
  }
  // Generation defaults (eos ids, sampling) belong to the model even when the tokenizer came from elsewhere.
  const std::string generation = r.model_name + "/generation_config.json";
  if (!r.model_config && source != r.model_name && path_exists(generation))
    copy_into(generation, dir, "generation_config.json", copied);
  return copied;
}

ExportResult export_checkpoint(const ExportRequest& request) {
  if (request.format == ExportFormat::Gguf) {
    check_gguf_destination(request.destination, request.overwrite);
    if (is_model_directory(request.checkpoint)) return export_model_dir_as_gguf(request);
  }
  const std::string step_dir = checkpoint_step_dir(request.checkpoint);
  const std::string recipe_path = step_dir + "/recipe.toml";
  const recipe::Recipe recipe = recipe::parse_recipe(read_file(recipe_path), recipe_path, request.recipe_overrides);
  // Before anything is written: never over the run's inputs, never over a model keel did not write.
  auto inputs = recipe::recipe_inputs(recipe);
  inputs.push_back({"checkpoint", request.checkpoint});
  recipe::refuse_outputs_over_inputs({{"--to", request.destination}}, inputs);
  if (request.format == ExportFormat::Gguf) return export_into(request, step_dir, recipe);  // one file, atomic
  recipe::refuse_replacing_foreign_model(request.destination, request.overwrite);
  const bool created = prepare_destination(request.destination, step_dir);
  try {
    return export_into(request, step_dir, recipe);
  } catch (...) {
    std::error_code ignored;
    if (created) fs::remove_all(request.destination, ignored);  // nothing of a failed export is left behind
    throw;
  }
}

namespace {

ExportResult export_into(const ExportRequest& request, const std::string& step_dir, const recipe::Recipe& recipe) {
  ExportResult result;
  result.step_dir = step_dir;
  verify_checkpoint(step_dir);
  const TrainingState state = read_checkpoint_state(step_dir);
  result.step = state.step;

  const std::string recipe_path = step_dir + "/recipe.toml";
  require(recipe.model_config || path_exists(recipe.model_name),
          "{}: model_name '{}' does not exist (the model the run started from: its config.json describes the "
          "checkpoint; a relative path is taken from the current directory, give the model's place with --set "
          "model_name=DIR)",
          recipe_path, recipe.model_name);
  const model::ModelConfig trained = recipe::recipe_model_config(recipe);
  result.config = model::config_for_family(trained, family_of_export(trained, request.format));

  // Only the weights are needed: the smallest decoder (no optimizer state, a 1 x 2 batch). The two
  // GLM formats share keel's internal parameter layout, so the checkpoint loads into either. A LoRA
  // run's checkpoint holds its adapter: the decoder has the same one.
  model::DecoderOptions options;
  options.lora = recipe::recipe_lora_spec(recipe);
  require(!request.merge || options.lora.enabled(),
          "--merge: {} is a checkpoint of full fine-tuning (finetuning_type = \"{}\"); there is no adapter to merge",
          step_dir, recipe::choice_name(recipe.finetuning_type));
  if (options.lora.enabled() && !request.merge)
    require(request.format == ExportFormat::AsTrained || request.format == ExportFormat::Gguf,
            "--format: a LoRA checkpoint exports as a PEFT adapter on the model it was trained on (or, with --format "
            "gguf, a GGUF adapter); --format hf or glm-original applies with --merge");
  // A sharded checkpoint exported to HF files streams, piece by piece, into the writer: the decoder
  // is then only the model's names and shapes, holding a sliver of the weights (ZeRO-3 over
  // pretend ranks, this the first), and the peak is one tensor instead of 8 bytes per parameter.
  const bool streamed =
      !options.lora.enabled() && request.format != ExportFormat::Gguf && is_sharded_checkpoint(step_dir);
  if (streamed) {
    model::ParamStore whole;
    model::DecoderParamIds whole_ids;
    model::declare_model_params(result.config, whole, whole_ids);
    recipe::set_zero_stage(options, 3, std::clamp<int64_t>(whole.total() / (int64_t(1) << 16), 2, 1 << 16),
                        model::Precision::F32);
    options.optimizer_state = true;  // ZeRO-3's shape: the sliver's moments, tiny and never read
  }
  model::Decoder decoder(result.config, model::Precision::F32, 1, 2, options);
  result.adapter = options.lora.enabled() && !request.merge;
  require(model_fingerprint(decoder.trainable(), trained.architecture) == state.model_fingerprint,
          "{}: the checkpoint was written for a different model than {} describes now (architecture or sizes "
          "changed)",
          step_dir, recipe.model_config ? recipe_path + " [model_config]" : recipe.model_name + "/config.json");
  if (request.dtype) {
    result.dtype = *request.dtype;
  } else {
    try {
      result.dtype = recipe::recipe_export_dtype(recipe, trained, decoder.ids());
    } catch (const Error& e) {
      fail("{} (the default export dtype is that of the weights the run started from; choose one with --dtype)",
           e.what());
    }
  }
  WorkProgress progress(request.progress_log, request.live_progress);
  if (result.adapter && request.format == ExportFormat::Gguf) {  // llama.cpp's adapter file
    read_checkpoint_weights(step_dir, decoder.adapter());
    const std::string name = fs::path(recipe.output_dir.empty() ? step_dir : recipe.output_dir).filename().string();
    result.gguf = write_gguf_adapter(decoder, name, request.destination, request.outtype, &progress);
    progress.finish();
    return result;
  }
  if (result.adapter) {  // the adapter as the run's final/ holds it: fp32, PEFT's names
    read_checkpoint_weights(step_dir, decoder.adapter());
    model::save_peft_adapter(decoder, request.destination, recipe.model_config ? "" : recipe.model_name,
                             recipe.lora_dropout, request.dtype.value_or(DType::F32));
    result.dtype = request.dtype.value_or(DType::F32);
  } else if (options.lora.enabled()) {  // --merge: W + scaling B A, in the base model's format and dtype
    read_checkpoint_weights(step_dir, decoder.adapter());
    if (recipe.model_config)
      decoder.init_random(uint64_t(recipe.seed));  // the run's base: a new model, from its seed
    else
      model::load_model_weights(decoder, recipe.model_name, &progress);  // a directory or a GGUF file
    model::merge_own_adapter(decoder);
  } else if (streamed) {
    ShardedCheckpoint checkpoint(step_dir);
    const std::vector<model::Param>& layout = decoder.params().params();
    const int64_t total = decoder.params().total();
    std::vector<float> chunk(size_t(std::min<int64_t>(total, int64_t(4) << 20)));  // 16 MB at a time
    model::save_hf_model_streamed(
        decoder, request.destination, result.dtype,
        [&](int64_t begin, int64_t max_count, int64_t* n) {
          *n = std::min({max_count, int64_t(chunk.size()), total - begin});
          checkpoint.read(layout, PieceKind::Weights, chunk.data(), FlatRange{begin, begin + *n});
          return static_cast<const float*>(chunk.data());
        },
        request.max_shard_bytes);
  } else {
    read_checkpoint_weights(step_dir, decoder.params());
  }
  prepare_recipe_gguf_tokenizer(recipe, nullptr);  // a run from a GGUF file: its tokenizer, as the run had it
  if (request.format == ExportFormat::Gguf) {
    const std::string tokenizer = recipe::recipe_tokenizer_path(recipe);
    require(!tokenizer.empty(),
            "{}: the run has no tokenizer, and a GGUF file carries the model's (llama.cpp tokenizes with it); name the "
            "tokenizer directory with --set tokenizer=DIR",
            recipe_path);
    GgufModelSource source;
    source.name = fs::path(recipe.model_config ? step_dir : recipe.model_name).filename().string();
    source.tokenizer_dir = fs::is_directory(tokenizer) ? tokenizer : fs::path(tokenizer).parent_path().string();
    // What keel's HF export writes, which the converter would read.
    source.config_json = model::model_config_json(result.config, result.dtype);
    source.weights_dtype = result.dtype;
    result.gguf = write_gguf_model(decoder.config(), decoder_tensor_sources(decoder), source, request.destination,
                                   request.outtype, &progress);
    progress.finish();
    return result;
  }
  if (!result.adapter && !streamed)
    model::save_hf_model(decoder, request.destination, result.dtype, request.max_shard_bytes, &progress);
  progress.finish();
  result.tokenizer_files = copy_tokenizer_files(recipe, request.destination);
  recipe::write_model_marker(request.destination, fmt::format("keel export of {}", step_dir));
  return result;
}

}  // namespace
}  // namespace keel::checkpoint
