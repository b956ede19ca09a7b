// The Ollama Modelfile keel export writes beside a GGUF model file (model.gguf -> model.Modelfile),
// so that `ollama create NAME -f model.Modelfile` makes the model with the stops it was trained to
// end on:
//   FROM ./model.gguf
//   PARAMETER stop "<|im_end|>"       one per token llama.cpp ends generation on that the model
//                                     emits: the chat template's end of turn, the EOS token
// No TEMPLATE: Ollama's templates are Go templates and a Jinja chat template has no faithful
// translation; Ollama derives one from the file's tokenizer.chat_template instead (the closest of
// the templates it knows), which keel writes into the file.
#pragma once
#include <string>
#include <vector>

namespace keel::checkpoint {

// "dir/model.gguf" -> "dir/model.Modelfile".
std::string ollama_modelfile_path(const std::string& gguf_path);

// The Modelfile's text for the GGUF file `gguf_path` (FROM names it relative to the Modelfile's
// directory, as Ollama resolves it) and its stop strings, in order, duplicates dropped.
std::string ollama_modelfile(const std::string& gguf_path, const std::vector<std::string>& stops);

// Before anything is written: a Modelfile already at ollama_modelfile_path(gguf_path) is replaced
// only if keel wrote it (its first line says so) or with `overwrite`.
void check_modelfile_destination(const std::string& gguf_path, bool overwrite);

}  // namespace keel::checkpoint
