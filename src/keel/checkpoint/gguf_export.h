// keel export --format gguf: a model as one GGUF file for llama.cpp (and Ollama, LM Studio,
// llamafile on top of it), written as llama.cpp's own convert_hf_to_gguf.py writes it from the
// Hugging Face directory keel's HF export would make: the same metadata keys and values (naming
// aside), the same tensor names, order, shapes and bytes, the tokenizer and chat template inside.
// The file format is formats/gguf_writer.h, the families' names gguf_names.h, the vocabulary
// data/llama_cpp_vocab.h. --outtype q4_k_m writes what llama-quantize makes of the f32 file
// (model/gguf_q4_k_m.h).
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "keel/core/dtype.h"
#include "keel/core/work_progress.h"
#include "keel/formats/gguf_quants.h"
#include "keel/formats/gguf_writer.h"
#include "keel/model/decoder.h"

namespace keel::checkpoint {

struct GgufModelSource {
  std::string name;            // general.name: the model's directory name
  std::string tokenizer_dir;   // tokenizer.json, tokenizer_config.json, chat template files
  std::string config_json;     // the config.json the converter would read (special ids, head_dim)
  DType weights_dtype = DType::F32;  // of the matrices the converter would read: decides the default outtype
};

struct GgufExportResult {
  std::string architecture;
  bool adapter = false;                     // a LoRA adapter file (gguf_adapter.h), not a model
  int64_t lora_rank = 0;                    // the adapter's r and the adapter.lora.alpha written
  double lora_alpha = 0;
  bool rslora = false;                      // alpha written as scaling x r (llama.cpp scales by alpha / r)
  formats::GgmlType outtype = formats::GgmlType::F16;
  std::string outtype_reason;               // why, when keel chose it
  std::vector<std::string> f16_fallbacks;   // matrices whose rows are not whole blocks: F16, as the converter
  // --outtype q4_k_m: the tensors not stored as Q4_K (norms and vectors aside), with llama.cpp's reason.
  std::vector<std::pair<std::string, std::string>> q4_k_m_exceptions;  // (name, "Q6_K: the output")
  int64_t embedding_rows_dropped = 0;        // Gemma 3: rows past the tokenizer's, dropped as the converter
  std::vector<std::string> skipped;          // buffers of the source that are not weights (rotary inv_freq)
  // Where llama.cpp will run the file otherwise than the model was trained, said (a difference it
  // would make from the first token is refused instead: check_llama_cpp_runs_as_trained).
  std::vector<std::string> notes;
  std::string tokenizer_model;              // tokenizer.ggml.model: "gpt2" (BPE) or "llama" (SentencePiece)
  std::string pre_tokenizer;                // tokenizer.ggml.pre
  int64_t tokens = 0, merges = 0;
  bool chat_template = false;
  std::string end_of_turn;                  // the template's end-of-turn token, which llama.cpp stops on
  std::string eos;                          // the EOS token's text ("" without one)
  std::string modelfile, modelfile_text;    // the Ollama Modelfile written beside a model (ollama_modelfile.h)
  size_t tensor_count = 0;
  uint64_t file_bytes = 0;
};

// llama.cpp runs some hyperparameters from its own tables rather than from the file. Where that
// would change every token for this model (Gemma 3's attention scale, its layers' pattern of
// sliding windows) this is a keel::Error saying why; where it changes only long contexts (a
// sliding window on an architecture llama.cpp runs without one) the returned notes say so. Gemma 2
// likewise: its scale and window pattern from llama.cpp's table, both soft caps always, a tied head.
std::vector<std::string> check_llama_cpp_runs_as_trained(const model::ModelConfig& config, const std::string& arch);

// The converter's default (--outtype auto): bf16 weights give bf16, anything else f16.
formats::GgmlType default_gguf_outtype(DType weights_dtype, std::string* reason);

// A tensor under its Hugging Face name, read as fp32 a piece at a time when the file gets to it
// (read(begin, count, dst): its values [begin, begin + count), row-major), so a model directory is
// streamed piece by piece, never held whole, nor even a tensor.
struct HfTensorSource {
  using Read = std::function<void(int64_t begin, int64_t count, float* dst)>;
  std::string name;
  std::vector<int64_t> shape;
  Read read;
  // Optional: the values' bytes as the source stores them, in `stored_dtype` (a checkpoint's
  // mapping). Where the file keeps that type and the values are not permuted or shifted, the
  // writer copies them as they are (formats::GgufTensor::stored).
  formats::GgufStoredBytes stored;
  DType stored_dtype = DType::F32;
};

// A decoder's weights (fp32 views), in hf_tensors' names.
std::vector<HfTensorSource> decoder_tensor_sources(const model::Decoder& decoder);

// One tensor's values as the file holds them, asked for in whole rows (formats::GgufFill), from
// its source's: rows x cols (cols 1 for a bias) permuted for ggml's RoPE where heads > 0
// (model::gguf_permuted_heads), read a head at a time; `shift` added to each value
// (model::gguf_norm_shift), in f16 arithmetic where the checkpoint is f16 (the converter adds in
// the checkpoint's dtype there; bf16 it widens first).
formats::GgufFill gguf_file_values(HfTensorSource::Read read, int64_t heads, int64_t rows, int64_t cols, float shift,
                                   bool f16_arithmetic);

// Writes the model `config` describes, its tensors from `tensors`, to `path` (atomically), and the
// Ollama Modelfile beside it (its stops: the end of turn and EOS). outtype: unset for the default.
// Tensors llama.cpp has no name for are an error naming them.
GgufExportResult write_gguf_model(const model::ModelConfig& config, std::vector<HfTensorSource> tensors,
                                  const GgufModelSource& source, const std::string& path,
                                  std::optional<formats::GgmlType> outtype, WorkProgress* progress = nullptr);

// Before anything is read: `path` must end in .gguf, its directory exist, and a file already there
// must be a GGUF keel wrote (it says so in general.quantized_by) unless `overwrite`; likewise the
// Modelfile beside it (ollama_modelfile.h).
void check_gguf_destination(const std::string& path, bool overwrite);

// The value of general.quantized_by in the files keel writes, by which it knows them again.
inline constexpr const char* kGgufWriterName = "keel";

}  // namespace keel::checkpoint
