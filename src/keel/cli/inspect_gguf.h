// keel inspect FILE.gguf: what a GGUF file holds (the metadata, arrays shortened, and the tensors
// with their types, shapes and sizes), as gguf-py's gguf-dump shows it, read by keel's own reader
// (formats/gguf_reader.h), which checks the whole file on the way. With stats, each tensor's values
// dequantized (formats/gguf_dequantize.h) and summarised: min, max, mean, RMS and any NaN or inf,
// which is how a broken conversion or quantization shows.
#pragma once
#include <string>

namespace keel::cli {

void inspect_gguf(const std::string& path, int64_t tensor_limit, bool stats);

}  // namespace keel::cli
