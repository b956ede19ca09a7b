#include "keel/model/gguf_weights.h"

#include <algorithm>
#include <fmt/ranges.h>
#include <set>
#include <unordered_map>

#include "keel/core/error.h"
#include "keel/formats/gguf_dequantize.h"
#include "keel/model/gguf_config.h"
#include "keel/model/gguf_names.h"
#include "keel/model/hf_weights.h"

namespace keel::model {
namespace {

// fp32 values of one tensor into the decoder as its parameter is held (load_hf_weights' cases,
// from fp32): the master in place, a frozen bf16 matrix rounded, QLoRA's base quantized.
void store(Decoder& decoder, const HfTensor& t, const float* values, int64_t first, int64_t n) {
  auto& P = decoder.params();
  switch (P.param(t.param).storage) {
    case ParamStorage::Master:
      decoder.write_weights(t.param, first, values, n);
      break;
    case ParamStorage::Bf16: {
      std::vector<bf16> rounded(static_cast<size_t>(n));
      convert_f32_to_bf16(values, rounded.data(), size_t(n));
      decoder.write_weights(t.param, first, rounded.data(), n);
      break;
    }
    case ParamStorage::FourBit:
      P.store_four_bit(t.param, first, values, n, decoder.options().double_quantization);
      break;
  }
}

}  // namespace

GgufLoadSummary load_gguf_weights(Decoder& decoder, const formats::GgufFile& file, WorkProgress* progress) {
  const ModelConfig& c = decoder.config();
  // A mixture's experts by expert: each one a slice of its layer's GGUF stack (ffn_*_exps).
  const auto tensors = hf_tensors(c, decoder.ids(), ExpertLayout::PerExpert);
  std::unordered_map<std::string, const formats::GgufTensorInfo*> by_name;
  for (const auto& info : file.tensors()) by_name[info.name] = &info;
  GgufLoadSummary summary;
  std::set<std::string> used;
  double total = 0, done = 0;  // weights, in millions
  for (const auto& t : tensors) total += double(t.rows * (t.cols ? t.cols : 1)) / 1e6;
  std::vector<float> values, unpermuted;
  for (const auto& t : tensors) {
    const int64_t cols = t.cols ? t.cols : 1, n = t.rows * cols;
    if (progress) progress->update("loading " + file.path(), done, total, "M weights");
    done += double(n) / 1e6;
    const auto slice = gguf_expert_slice(c, t.name);
    const std::string name = slice ? slice->stack : gguf_tensor_name(c, t.name);
    const auto found = by_name.find(name);
    require(found != by_name.end(), "{}: tensor '{}' (the model's {}) is missing", file.path(), name, t.name);
    const formats::GgufTensorInfo& info = *found->second;
    std::vector<int64_t> expected = t.shape();
    if (slice) expected.insert(expected.begin(), c.moe.experts);  // [experts, rows, cols]
    require(info.shape == expected, "{}: tensor '{}' has shape [{}], the model's {} is [{}]", file.path(), name,
            fmt::join(info.shape, ", "), slice ? "stack of " + t.name : t.name, fmt::join(expected, ", "));
    const auto* traits = formats::ggml_type_traits(info.type);
    require(formats::ggml_can_dequantize(info.type),
            "{}: tensor '{}' is stored as {}: keel dequantizes {} (requantize the model to one of them with "
            "llama.cpp's llama-quantize, e.g. q8_0)",
            file.path(), name, traits ? traits->name : "an unknown type", formats::ggml_dequantizable_types());
    const std::string type = traits->name;
    if (std::find(summary.types.begin(), summary.types.end(), type) == summary.types.end())
      summary.types.push_back(type);
    const int64_t first = t.row_begin * cols;
    const int64_t heads = gguf_permuted_heads(c, t.name);
    // An fp32 master held whole takes the values where they go, as load_hf_weights reads into it:
    // no second copy of the tensor (the embedding is the largest).
    auto& P = decoder.params();
    const bool in_place = heads == 0 && P.param(t.param).storage == ParamStorage::Master && !P.sharded_weights();
    if (!in_place) values.resize(size_t(n));
    float* dequantized = in_place ? P.weight(t.param) + first : values.data();
    // An expert's slice of a stack starts at whole blocks: its rows are whole blocks, as every row is.
    const int64_t skip = slice ? slice->expert * n : 0;
    require(skip % traits->block_size == 0 && n % traits->block_size == 0,
            "{}: tensor '{}': an expert's {} values are not whole {} blocks of {}", file.path(), name, n, type,
            traits->block_size);
    formats::ggml_dequantize(info.type, file.tensor_bytes(info).data() + skip / traits->block_size * traits->type_size,
                             n, dequantized);
    // A stack's pages leave the resident set with its last expert.
    if (!slice || slice->expert == c.moe.experts - 1) file.release_tensor_bytes(info);
    // Gemma: the converter stored each norm as 1 + w (gguf_norm_shift); transformers' GGUF loader
    // subtracts 1 in fp32 (Gemma2TensorProcessor), and so does keel.
    if (const float shift = gguf_norm_shift(c, t.name); shift != 0.0f) {
      for (int64_t i = 0; i < n; ++i) dequantized[i] -= shift;
      ++summary.shifted;
    }
    const float* out = dequantized;
    // Llama: the converter's LlamaModel.permute, undone (transformers' GGUF loader does the same).
    if (heads > 0) {
      unpermuted.resize(size_t(n));
      permute_rows_for_gguf(values.data(), unpermuted.data(), heads, t.rows, cols, /*undo=*/true);
      out = unpermuted.data();
      ++summary.permuted;
    }
    if (!in_place) store(decoder, t, out, first, n);
    used.insert(name);
  }
  for (const auto& info : file.tensors())
    if (!used.count(info.name)) summary.unused.push_back(info.name);
  decoder.params().refresh_bf16_copy();
  return summary;
}

std::vector<std::string> load_model_weights(Decoder& decoder, const std::string& path, WorkProgress* progress) {
  if (!is_gguf_path(path)) return load_hf_weights(decoder, path, progress);
  return load_gguf_weights(decoder, formats::GgufFile(path), progress).unused;
}

}  // namespace keel::model
