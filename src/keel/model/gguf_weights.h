// A decoder's weights from a GGUF file: each tensor of the family's Hugging Face checkpoint
// (hf_tensors) found under its llama.cpp name (gguf_names.h), dequantized to fp32 as gguf-py
// computes it (formats/gguf_dequantize.h), the converter's Q/K row permutation undone (Llama),
// then stored as load_hf_weights stores a checkpoint's tensor (fp32 master, frozen bf16, QLoRA's
// 4 bits). One tensor is dequantized at a time, and the file's pages of each are dropped once it
// is read, so the peak is the model as keel holds it plus one tensor, not the file besides.
#pragma once
#include <string>
#include <vector>

#include "keel/core/work_progress.h"
#include "keel/formats/gguf_reader.h"
#include "keel/model/decoder.h"

namespace keel::model {

struct GgufLoadSummary {
  std::vector<std::string> unused;       // tensors of the file the model does not use
  std::vector<std::string> types;        // the ggml types dequantized, in order of first use ("Q8_0", ...)
  int64_t permuted = 0;                  // tensors whose Q/K permutation was undone
  int64_t shifted = 0;                   // Gemma's norms, stored as 1 + w, read back as w
};

// Loads every weight of `decoder` (whose config is gguf_model_config(file)). A tensor missing, of
// another shape, or of a type keel does not dequantize is a keel::Error naming the file, the
// tensor and what was expected.
GgufLoadSummary load_gguf_weights(Decoder& decoder, const formats::GgufFile& file, WorkProgress* progress = nullptr);

// The weights of `path`, a Hugging Face model directory (load_hf_weights) or a GGUF file; the
// tensors of it the model does not use.
std::vector<std::string> load_model_weights(Decoder& decoder, const std::string& path,
                                            WorkProgress* progress = nullptr);

}  // namespace keel::model
