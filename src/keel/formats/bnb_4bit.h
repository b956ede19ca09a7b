// Checkpoints transformers saved with bitsandbytes in 4 bits (save_pretrained of a model loaded with
// BitsAndBytesConfig(load_in_4bit=True); config.json's quantization_config: ModelConfig::
// saved_four_bit). Each quantized Linear's weight W (n = rows x cols elements) is stored as
//   W                                   U8 [(n + 1) / 2, 1]: the packed codes (core/four_bit.h)
//   W.absmax                            F32 [ceil(n / 64)], or U8 codes with double quantization
//   W.quant_map                         F32 [16]: the type's code values
//   W.nested_absmax, W.nested_quant_map F32: double quantization's per-256 absmax and its 256 values
//   W.quant_state.bitsandbytes__<type>  U8: JSON {"quant_type", "blocksize", "dtype", "shape",
//                                       "nested_blocksize", "nested_dtype", "nested_offset"}
// (bitsandbytes' QuantState.as_dict(packed=True)). keel reads the codes as they are: the weights it
// trains against are exactly the ones bitsandbytes dequantizes, with no requantization.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "keel/core/four_bit.h"
#include "keel/formats/safetensors.h"

namespace keel::formats {

// Whether tensor `name` is a bitsandbytes 4-bit weight (its quant_state entry is there).
bool is_bnb_4bit(const CheckpointReader& reader, const std::string& name);
// The entries a 4-bit weight `name` keeps beside it in the checkpoint (.absmax, .quant_map, ...),
// those present: what loading it reads besides the codes.
std::vector<std::string> bnb_4bit_parts(const CheckpointReader& reader, const std::string& name);

// Reads the 4-bit weight `name` of the given shape as stored: packed[n / 2] codes and absmax[n / 64]
// (double quantization's codes dequantized as bitsandbytes does: map[code] * absmax2 + offset in
// fp32). n must be a multiple of 64. Errors name the tensor, its file and what differs: the shape,
// quant_type (against `expected`), blocksize, the code map, a missing part.
void read_bnb_4bit(const CheckpointReader& reader, const std::string& name, const std::vector<int64_t>& shape,
                   FourBitType expected, uint8_t* packed, float* absmax);

// The same weight dequantized into fp32 as bitsandbytes' dequantize_4bit gives it in the state's
// dtype (code value x absmax in fp32, then rounded to bf16 or fp16 when that is the dtype): for
// what needs full-precision weights (generation, evaluation, a merged export).
void read_bnb_4bit_dequantized(const CheckpointReader& reader, const std::string& name,
                               const std::vector<int64_t>& shape, FourBitType expected, float* out);

}  // namespace keel::formats
