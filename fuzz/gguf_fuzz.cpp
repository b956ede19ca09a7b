// A GGUF file read by keel's reader (formats/gguf_reader.h), as `keel inspect x.gguf` reads a file
// someone downloaded, and read on as a model to train (model_name = "x.gguf"): its config from the
// metadata (model/gguf_config.h) and its tokenizer as Hugging Face files, parsed back
// (checkpoint/gguf_tokenizer.h, data/llama_cpp_vocab_hf.h). Input: the file's bytes. Properties:
// an accepted file's tensors lie inside it, at the alignment, without overlapping, and hold whole
// blocks of their type; the config and tokenizer are built or refused with a keel::Error.
#include <algorithm>

#include "fuzz_support.h"
#include "keel/checkpoint/gguf_tokenizer.h"
#include "keel/data/hf_tokenizer_json.h"
#include "keel/data/llama_cpp_vocab_hf.h"
#include "keel/formats/gguf_reader.h"
#include "keel/model/gguf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  try {
    const formats::GgufFile file(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.gguf");
    uint64_t end = 0;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (const auto& t : file.tensors()) {
      const auto* traits = formats::ggml_type_traits(t.type);
      if (!traits) fuzz::property_failed("a tensor of an unknown type was accepted", t.name);
      if (t.elements() % traits->block_size != 0 ||
          t.nbytes != uint64_t(t.elements() / traits->block_size) * uint64_t(traits->type_size))
        fuzz::property_failed("a tensor's byte count is not whole blocks of its type", t.name);
      if (t.offset % file.alignment() != 0) fuzz::property_failed("a tensor off the alignment", t.name);
      const auto bytes = file.tensor_bytes(t);
      if (bytes.data() < data || bytes.data() + bytes.size() > data + size)
        fuzz::property_failed("a tensor's bytes outside the file", t.name);
      ranges.emplace_back(t.offset, t.offset + t.nbytes);
      end = std::max(end, t.offset + t.nbytes);
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i)
      if (ranges[i - 1].second > ranges[i].first) fuzz::property_failed("two tensors overlap");
    if (!file.tensors().empty() && file.data_offset() + end > size) fuzz::property_failed("data past the end");
    try {
      model::gguf_model_config(file);
    } catch (const Error&) {}
    const auto files = data::hf_tokenizer_files(checkpoint::read_gguf_vocab(file), file.path(),
                                                checkpoint::gguf_architecture_of(file));
    data::hf_tokenizer_from_json(files.tokenizer_json, file.path(), files.tokenizer_config_json);
  } catch (const Error&) {}
  return 0;
}
