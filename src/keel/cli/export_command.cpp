// keel export CHECKPOINT --to DIR [--dtype bf16|fp16|fp32] [--format hf|glm-original]
//                                 [--max-shard-size 5GB] [--set key=value ...]
// A training checkpoint (a step-N directory, or a checkpoint_dir: its `latest`) as a Hugging Face
// model directory: config.json, safetensors and the tokenizer files of the run.
#include <fmt/format.h>

#include <iostream>
#include <memory>

#include "keel/cli/commands.h"
#include "keel/core/error.h"
#include "keel/core/work_progress.h"
#include "keel/checkpoint/export.h"
#include "keel/report/memory_report.h"

namespace keel::cli {
namespace {

struct ExportOptions {
  std::string checkpoint, destination, dtype, format, max_shard_size = "5GB";
  std::vector<std::string> overrides;
  bool overwrite = false, merge = false;
};

std::string_view dtype_label(DType t) { return t == DType::BF16 ? "bf16" : t == DType::F16 ? "fp16" : "fp32"; }

const CommandRegistration kExport{
    "export", "Write a training checkpoint as a Hugging Face model directory (config, safetensors, tokenizer)",
    [](CLI::App& cmd) -> CommandAction {
      auto o = std::make_shared<ExportOptions>();
      cmd.add_option("checkpoint", o->checkpoint,
                     "A checkpoint (checkpoint_dir/step-N) or a checkpoint_dir (its latest checkpoint)")
          ->required();
      cmd.add_option("--to", o->destination, "Output model directory (created if missing)")->required();
      cmd.add_option("--dtype", o->dtype,
                     "bf16 | fp16 | fp32 (default: the dtype of the weights the run started from, as "
                     "output_dir/final)");
      cmd.add_option("--format", o->format,
                     "hf (transformers' classes) | glm-original (ChatGLM names, GLM-4 models only); default: the "
                     "format the model was trained in");
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
          "  GGUF (llama.cpp): not yet; a converter that reads Hugging Face directories (llama.cpp's\n"
          "    convert_hf_to_gguf.py) can take the exported model directory from there\n");
      return [o] {
        checkpoint::ExportRequest request;
        request.overwrite = o->overwrite;
        request.merge = o->merge;
        request.checkpoint = o->checkpoint;
        request.destination = o->destination;
        if (!o->dtype.empty()) request.dtype = checkpoint::export_dtype_from_name(o->dtype);
        if (!o->format.empty()) request.format = checkpoint::export_format_from_name(o->format);
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
