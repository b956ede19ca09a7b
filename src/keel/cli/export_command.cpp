// keel export CHECKPOINT --to DIR [--dtype bf16|fp16|fp32] [--format hf|glm-original]
//                                 [--max-shard-size 5GB] [--set key=value ...]
// keel export CHECKPOINT|MODEL_DIR --to FILE.gguf --format gguf [--outtype f32|f16|bf16|q8_0|q4_0|q4_k_m]
// A training checkpoint (a step-N directory, or a checkpoint_dir: its `latest`) as a Hugging Face
// model directory: config.json, safetensors and the tokenizer files of the run; or, with --format
// gguf, a checkpoint or a model directory as one GGUF file for llama.cpp.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>
#include <memory>

#include "keel/cli/commands.h"
#include "keel/core/error.h"
#include "keel/core/work_progress.h"
#include "keel/checkpoint/export.h"
#include "keel/model/gguf_names.h"
#include "keel/report/memory_report.h"

namespace keel::cli {
namespace {

struct ExportOptions {
  std::string checkpoint, destination, dtype, format, outtype, max_shard_size = "5GB";
  std::vector<std::string> overrides;
  bool overwrite = false, merge = false;
};

std::string_view dtype_label(DType t) { return t == DType::BF16 ? "bf16" : t == DType::F16 ? "fp16" : "fp32"; }

// Every choice the GGUF export made for the user, said.
void print_gguf_export(const checkpoint::ExportRequest& request, const checkpoint::ExportResult& result) {
  const auto& g = *result.gguf;
  const std::string outtype = model::gguf_outtype_name(g.outtype);
  if (!g.outtype_reason.empty())
    fmt::print("keel: --outtype {} (not given: {}{})\n", outtype, g.outtype_reason,
               g.adapter ? "" : "; norms and biases stay f32");
  for (const auto& note : g.notes) fmt::print("keel: note: {}\n", note);
  if (g.adapter) {
    if (!g.f16_fallbacks.empty())
      fmt::print("keel: {} lora_b matrices stored as f16: their rows of r = {} values are not whole blocks of {}, as "
                 "llama.cpp's converter does\n",
                 g.f16_fallbacks.size(), g.lora_rank, outtype);
    if (g.rslora)
      fmt::print("keel: rsLoRA: adapter.lora.alpha written as {:g} (alpha x sqrt(r)), since llama.cpp scales by "
                 "alpha / r and the run's update was scaled by alpha / sqrt(r)\n",
                 g.lora_alpha);
    fmt::print("keel: exported {} (step {}) to {}: a GGUF LoRA adapter, architecture '{}' ({}), rank {}, alpha {:g}, "
               "{} tensors, {} ({:.1f} MB); run it with llama-cli -m BASE.gguf --lora {} (BASE.gguf: keel export "
               "--format gguf of the model the run started from)\n",
               result.step_dir, result.step, request.destination, g.architecture,
               model::family_name(result.config.family), g.lora_rank, g.lora_alpha, g.tensor_count, outtype,
               double(g.file_bytes) / 1e6, request.destination);
    return;
  }
  if (!g.f16_fallbacks.empty())
    fmt::print("keel: {} stored as f16: rows not whole blocks of {} values ({}), as llama.cpp's converter does\n",
               fmt::join(g.f16_fallbacks, ", "), formats::ggml_block_size(g.outtype), outtype);
  if (g.outtype == formats::GgmlType::Q4_K) {
    fmt::print("keel: q4_k_m: llama-quantize's Q4_K_M mix, tensors in its order: matrices Q4_K, norms and vectors f32, "
               "and as llama.cpp chooses:\n");
    for (const auto& [name, why] : g.q4_k_m_exceptions) fmt::print("keel:   {} {}\n", name, why);
  }
  if (g.embedding_rows_dropped > 0)
    fmt::print("keel: token_embd.weight: the {} rows past the tokenizer's tokens dropped, as llama.cpp's converter "
               "does for Gemma 3\n",
               g.embedding_rows_dropped);
  if (!g.skipped.empty())
    fmt::print("keel: not written (buffers, not weights; the converter skips them too): {}\n", fmt::join(g.skipped, ", "));
  const std::string vocabulary =
      g.tokenizer_model == "llama"
          ? fmt::format("SentencePiece vocabulary from tokenizer.model (\"llama\"), {} tokens with scores", g.tokens)
          : fmt::format("{} tokens, {} merges, pre-tokenizer '{}' (llama.cpp's name for it)", g.tokens, g.merges,
                        g.pre_tokenizer);
  fmt::print("keel: tokenizer: {}, {}{}\n", vocabulary, g.chat_template ? "chat template included" : "no chat template",
             g.end_of_turn.empty() ? "" : fmt::format(" (its turns end with '{}', which llama.cpp stops on)", g.end_of_turn));
  fmt::print("keel: exported {}{} to {}: GGUF, architecture '{}' ({}), {} tensors, {} ({:.1f} MB)\n",
             result.step_dir, result.step ? fmt::format(" (step {})", result.step) : "", request.destination,
             g.architecture, model::family_name(result.config.family), g.tensor_count, outtype,
             double(g.file_bytes) / 1e6);
  fmt::print("keel: Ollama Modelfile {} (its stops: the tokens the model ends on; no TEMPLATE: Ollama derives it "
             "from the file's chat template):\n{}",
             g.modelfile, g.modelfile_text);
}

const CommandRegistration kExport{
    "export",
    "Write a training checkpoint as a Hugging Face model directory (config, safetensors, tokenizer), or a "
    "checkpoint or model directory as a GGUF file (llama.cpp)",
    [](CLI::App& cmd) -> CommandAction {
      auto o = std::make_shared<ExportOptions>();
      cmd.add_option("checkpoint", o->checkpoint,
                     "A checkpoint (checkpoint_dir/step-N) or a checkpoint_dir (its latest checkpoint); with --format "
                     "gguf also a Hugging Face model directory")
          ->required();
      cmd.add_option("--to", o->destination, "Output model directory (created if missing); with --format gguf the .gguf file")
          ->required();
      cmd.add_option("--dtype", o->dtype,
                     "bf16 | fp16 | fp32 (default: the dtype of the weights the run started from, as "
                     "output_dir/final)");
      cmd.add_option("--format", o->format,
                     "hf (transformers' classes) | glm-original (ChatGLM names, GLM-4 models only) | gguf (one file "
                     "for llama.cpp); default: the format the model was trained in");
      cmd.add_option("--outtype", o->outtype,
                     "GGUF: f32 | f16 | bf16 | q8_0 | q4_0, as llama.cpp's convert_hf_to_gguf.py names them (norms and "
                     "biases stay f32), or q4_k_m, as llama-quantize makes it of the f32 file; default as the "
                     "converter chooses: bf16 for bf16 weights, else f16; a LoRA adapter: f32 | f16 | bf16 | q8_0, "
                     "default f32");
      cmd.add_option("--max-shard-size", o->max_shard_size,
                     "Largest safetensors file before sharding with model.safetensors.index.json (binary units: "
                     "1 GB = 1 GiB)")
          ->capture_default_str();
      cmd.add_option("--set", o->overrides,
                     "Override a key of the checkpoint's recipe, e.g. --set model_name=DIR when the base model moved "
                     "(repeatable)");
      cmd.add_flag("--merge", o->merge,
                   "A LoRA run's checkpoint: write the full model with the adapter merged into its weights (default: "
                   "the adapter, in PEFT's format)");
      cmd.add_flag("--overwrite", o->overwrite,
                   "Replace a destination that holds files keel did not write (refused by default)");
      // What exists and what does not, so nobody hunts for a switch that is not there.
      cmd.footer(
          "Formats:\n"
          "  Hugging Face model directory (the default; --merge for a LoRA run): config.json, model.safetensors\n"
          "    (sharded past --max-shard-size) and the tokenizer files, as transformers' from_pretrained reads them\n"
          "  PEFT adapter directory (a LoRA run without --merge): adapter_config.json and adapter_model.safetensors\n"
          "  GGUF (--format gguf --to FILE.gguf): one file for llama.cpp, Ollama, LM Studio, as llama.cpp's\n"
          "    convert_hf_to_gguf.py writes it (tokenizer and chat template inside); Llama, Mistral, Qwen2, Qwen3,\n"
          "    Gemma 2, Gemma 3, GLM-4, Qwen3-MoE, Mixtral, GLM-4.5; a LoRA run as a GGUF adapter (llama-cli --lora), or merged\n"
          "    with --merge; beside a model its Ollama Modelfile (FILE.Modelfile: ollama create NAME -f it); --outtype\n"
          "    q4_k_m as llama-quantize makes it; docs/gguf.md\n");
      return [o] {
        checkpoint::ExportRequest request;
        request.overwrite = o->overwrite;
        request.merge = o->merge;
        request.checkpoint = o->checkpoint;
        request.destination = o->destination;
        if (!o->dtype.empty()) request.dtype = checkpoint::export_dtype_from_name(o->dtype);
        if (!o->format.empty()) request.format = checkpoint::export_format_from_name(o->format);
        const bool gguf = request.format == checkpoint::ExportFormat::Gguf;
        require(o->outtype.empty() || gguf, "--outtype applies to --format gguf; for other formats use --dtype");
        require(o->dtype.empty() || !gguf, "--dtype does not apply to --format gguf; use --outtype");
        if (!o->outtype.empty()) request.outtype = model::gguf_outtype_from_name(o->outtype);
        try {
          request.max_shard_bytes = report::parse_memory_size(o->max_shard_size);
        } catch (const Error& e) {
          fail("--max-shard-size: {}", e.what());
        }
        require(request.max_shard_bytes > 0, "--max-shard-size: expected a positive size, found '{}'",
                o->max_shard_size);
        request.recipe_overrides = o->overrides;
        request.progress_log = &std::cout;
        request.live_progress = stdout_is_terminal();
        const auto result = checkpoint::export_checkpoint(request);
        if (result.gguf) {
          print_gguf_export(request, result);
          return 0;
        }
        fmt::print("keel: exported {} (step {}) to {}: {}{}, {} ({})\n", result.step_dir, result.step,
                   request.destination, result.adapter ? "a LoRA adapter (PEFT format) for " : "",
                   result.config.architecture, dtype_label(result.dtype), model::family_name(result.config.family));
        if (result.config.saved_four_bit && !result.adapter)
          fmt::print(
              "keel: the base model is saved in 4 bits by bitsandbytes ({}): merged into its projections as "
              "bitsandbytes' dequantize_4bit gives them, written in full precision\n",
              four_bit_type_name(result.config.saved_four_bit->type));
        if (result.tokenizer_files.empty()) {
          fmt::print("keel: no tokenizer files to copy (the run had no tokenizer directory)\n");
        } else {
          fmt::print("keel: tokenizer files copied: {}\n", fmt::join(result.tokenizer_files, ", "));
        }
        return 0;
      };
    }};

}  // namespace
}  // namespace keel::cli
