// keel export --format gguf of a LoRA run without --merge: its adapter as one GGUF adapter file,
// as llama.cpp's convert_lora_to_gguf.py writes it from keel's PEFT export of the same run
// (general.type "adapter", adapter.type "lora", adapter.lora.alpha; each adapted matrix W as
// "<W's GGUF name>.lora_a" [r, in] and ".lora_b" [out, r], B's rows permuted where the converter
// permutes W's), so that `llama-cli -m base.gguf --lora adapter.gguf` runs the run's model without
// merging. The base model's file is keel export --format gguf of the model the run started from.
#pragma once
#include <optional>
#include <string>

#include "keel/checkpoint/gguf_export.h"

namespace keel::checkpoint {

// The adapter's outtype when none is given: f32, the converter's default for adapters.
formats::GgmlType default_gguf_adapter_outtype(std::string* reason);

// Writes `decoder`'s adapter (it must have one) to `path` (atomically). outtype: f32, f16, bf16 or
// q8_0 (the converter's choices for adapters); unset for the default. A run that also trained the
// embedding or the LM head (modules_to_save) is refused: a GGUF adapter holds only A/B pairs.
GgufExportResult write_gguf_adapter(const model::Decoder& decoder, const std::string& name, const std::string& path,
                                    std::optional<formats::GgmlType> outtype, WorkProgress* progress = nullptr);

}  // namespace keel::checkpoint
