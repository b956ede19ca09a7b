#include "keel/checkpoint/gguf_adapter.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <vector>

#include "keel/model/gguf_names.h"
#include "keel/core/error.h"
#include "keel/formats/gguf_writer.h"

namespace keel::checkpoint {

using formats::GgmlType;

GgmlType default_gguf_adapter_outtype(std::string* reason) {
  if (reason) *reason = "f32 for an adapter, as llama.cpp's convert_lora_to_gguf.py";
  return GgmlType::F32;
}

GgufExportResult write_gguf_adapter(const model::Decoder& decoder, const std::string& name, const std::string& path,
                                    std::optional<GgmlType> outtype, WorkProgress* progress) {
  require(decoder.has_adapter(), "write_gguf_adapter: the model has no LoRA adapter");
  const model::ModelConfig& c = decoder.config();
  const model::LoraSpec& spec = decoder.options().lora;
  require(decoder.trained_embedding() < 0 && decoder.trained_lm_head() < 0,
          "--format gguf: the run trained the embedding or the LM head in full (modules_to_save), which a GGUF "
          "adapter cannot hold (only A/B pairs; llama.cpp's converter refuses them too); export with --merge for one "
          "GGUF model file");
  for (const auto& m : decoder.lora_modules())
    require(!m.on_experts(),
            "--format gguf: the run adapted the experts ({}), whose per-expert pairs keel's GGUF adapter writer does not "
            "lay out yet (llama.cpp would need them stacked as 3-D lora_a [experts, r, in] and lora_b [experts, out, r] "
            "tensors of blk.N.ffn_{{gate,up,down}}_exps, which its build_lora_mm_id applies to each token's routed "
            "experts); export with --merge for one GGUF model file (the adapter merged into every expert)",
            m.path);
  GgufExportResult result;
  result.adapter = true;
  result.architecture = model::gguf_architecture(c);
  result.notes = check_llama_cpp_runs_as_trained(c, result.architecture);
  result.outtype = outtype ? *outtype : default_gguf_adapter_outtype(&result.outtype_reason);
  require(result.outtype != GgmlType::Q4_0 && result.outtype != GgmlType::Q4_K,
          "--outtype {}: adapters are written as llama.cpp's convert_lora_to_gguf.py writes them, in f32, f16, bf16 "
          "or q8_0 (for {}, export the merged model with --merge)",
          model::gguf_outtype_name(result.outtype), model::gguf_outtype_name(result.outtype));
  // llama.cpp scales an adapter by alpha / r. With rsLoRA the update is scaled by alpha / sqrt(r),
  // so the file's alpha is that scaling times r: the same product in llama.cpp as in training
  // (the converter writes lora_alpha as it stands, which would be wrong for rsLoRA).
  result.lora_rank = spec.rank;
  result.lora_alpha = spec.rslora ? spec.scaling() * double(spec.rank) : spec.alpha;
  result.rslora = spec.rslora;

  formats::GgufMetadata kv;
  kv.add_string("general.architecture", result.architecture);
  kv.add_string("general.type", "adapter");
  kv.add_string("adapter.type", "lora");
  kv.add_string("general.name", name);
  kv.add_string("general.quantized_by", kGgufWriterName);
  kv.add_float32("adapter.lora.alpha", float(result.lora_alpha));
  kv.add_uint32("general.quantization_version", model::kGgmlQuantizationVersion);

  // In the order keel's PEFT file holds them (the converter's order: the file's), A then B.
  const model::ParamStore& adapter = decoder.adapter();
  std::vector<formats::GgufTensor> tensors;
  for (const auto& m : decoder.lora_modules()) {
    const std::string weight = m.path + ".weight";
    const std::string base = model::gguf_tensor_name(c, weight);
    const int64_t heads = model::gguf_permuted_heads(c, weight);
    for (const bool a : {true, false}) {
      const int id = a ? m.a : m.b;
      formats::GgufTensor g;
      g.name = base + (a ? ".lora_a" : ".lora_b");
      g.shape = adapter.param(id).shape;
      bool fallback = false;
      g.type = model::gguf_tensor_type(g.name, g.shape, result.outtype, &fallback);
      if (fallback) result.f16_fallbacks.push_back(g.name);
      const float* src = adapter.weight(id);
      auto read = [src](int64_t begin, int64_t count, float* dst) {
        std::memcpy(dst, src + begin, size_t(count) * sizeof(float));
      };
      // W's rows are permuted for ggml's RoPE (gguf_permuted_heads); W + s B A keeps that order
      // when B's rows are permuted alike (A's are the input's columns, which do not move).
      g.fill = gguf_file_values(read, a ? 0 : heads, g.shape[0], g.shape[1], 0.0f, false);
      tensors.push_back(std::move(g));
    }
  }
  result.tensor_count = tensors.size();
  formats::write_gguf(path, kv, tensors, progress);
  std::error_code ec;
  result.file_bytes = std::filesystem::file_size(path, ec);
  return result;
}

}  // namespace keel::checkpoint
