// keel generate --model DIR --prompt TEXT [--chat] [sampling options]
// Loads an HF model directory (and its tokenizer), then streams the continuation to stdout.
#include <fmt/format.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>

#include "keel/checkpoint/gguf_tokenizer.h"
#include "keel/cli/commands.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/data/chat_encoding.h"
#include "keel/data/chat_template.h"
#include "keel/data/model_chat_template.h"
#include "keel/data/prepare.h"
#include "keel/data/tokenizer.h"
#include "keel/kernels/backend.h"
#include "keel/model/generator.h"
#include "keel/model/gguf_config.h"
#include "keel/model/gguf_weights.h"
#include "keel/model/hf_weights.h"
#include "keel/model/peft_adapter.h"

namespace keel::cli {
namespace {

struct GenerateOptions {
  std::string model, adapter, prompt, prompt_ids, tokenizer, chat_template, system, backend = "cpu";
  std::string weights = "fp32";
  bool chat = false, show_ids = false;
  model::SamplingOptions sampling;
};

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (...) {
      used = 0;
    }
    require(used > 0 && item.find_first_not_of(' ', used) == std::string::npos && v >= 0 && v < (1ll << 31),
            "--prompt-ids: '{}' is not a token id (expected comma-separated non-negative integers)", item);
    ids.push_back(int32_t(v));
  }
  require(!ids.empty(), "--prompt-ids is empty");
  return ids;
}

// A temporary directory, removed with its files when the command ends.
struct GgufTokenizerDir {
  std::string path;
  void make() {
    path = (std::filesystem::temp_directory_path() / fmt::format("keel-gguf-tokenizer-{}", ::getpid())).string();
  }
  ~GgufTokenizerDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

int run_generate(GenerateOptions& o) {
  require(o.prompt.empty() != o.prompt_ids.empty(), "give exactly one of --prompt TEXT or --prompt-ids 1,2,3");
  // A LoRA run's final/ is an adapter: its base model is the one adapter_config.json names.
  if (o.adapter.empty() && model::is_peft_adapter_dir(o.model) && !path_exists(o.model + "/config.json")) {
    const std::string base = model::read_peft_adapter_config(o.model).base_model;
    require(!base.empty(),
            "{}: a LoRA adapter without base_model_name_or_path; give the base model with --model and "
            "the adapter with --adapter",
            o.model);
    if (o.tokenizer.empty() && path_exists(o.model + "/tokenizer.json")) o.tokenizer = o.model;
    o.adapter = o.model;
    o.model = base;
    fmt::print(stderr, "keel: {} is a LoRA adapter; generating with its base model {}\n", o.adapter, o.model);
  }
  // A GGUF file: its config from the metadata, its tokenizer (unless --tokenizer names one) written
  // as Hugging Face files into a directory of this process's, for the chat template's lookup too.
  const bool gguf = model::is_gguf_path(o.model);
  GgufTokenizerDir gguf_tokenizer_dir;
  if (gguf && o.tokenizer.empty() && !o.prompt.empty()) {
    gguf_tokenizer_dir.make();
    checkpoint::write_gguf_tokenizer_dir(o.model, gguf_tokenizer_dir.path, nullptr);
    o.tokenizer = gguf_tokenizer_dir.path;
  }
  auto config = gguf ? model::gguf_model_config(formats::GgufFile(o.model))
                     : model::load_model_config(o.model + "/config.json");
  if (config.saved_four_bit)
    fmt::print(stderr,
               "keel: {} is saved in 4 bits by bitsandbytes ({}): generating with its projections as "
               "bitsandbytes' dequantize_4bit gives them, in fp32\n",
               o.model, four_bit_type_name(config.saved_four_bit->type));
  std::unique_ptr<data::Tokenizer> tokenizer;
  if (!o.prompt.empty() || !o.tokenizer.empty())
    tokenizer = std::make_unique<data::Tokenizer>(data::load_tokenizer(o.tokenizer.empty() ? o.model : o.tokenizer));
  std::vector<int32_t> prompt;
  if (!o.prompt.empty()) {
    std::vector<data::ChatMessage> messages;
    // The template as training chooses it (data::choose_chat_template): the model's own, else a
    // built-in, or the one --chat-template names.
    data::DocumentEncoder chat;
    if (o.chat) {
      if (!o.system.empty()) messages.push_back({"system", o.system});
      messages.push_back({"user", o.prompt});
      chat.tokenizer = tokenizer.get();
      const std::string tokenizer_path = o.tokenizer.empty() ? o.model : o.tokenizer;
      std::string why;
      const std::string name =
          data::choose_chat_template(chat, o.chat_template.empty() ? "auto" : o.chat_template, tokenizer_path, &why);
      require(chat.model_template || chat.format, "{}: --chat needs a chat template ({})", tokenizer_path, why);
      fmt::print(stderr, "keel: chat template {} ({})\n", name, why);
    }
    if (chat.model_template) {
      const data::ChatTemplateEncoder& encoder = *chat.model_template;
      data::ChatInput input = data::chat_input_from_messages(messages);
      input.add_generation_prompt = true;
      prompt = encoder.encode(input).ids;
      // The turn's end as training learned it, which EOS may not be.
      if (auto end = data::end_of_turn_id(encoder, *tokenizer)) o.sampling.stop_ids.push_back(*end);
    } else if (chat.format) {
      prompt = tokenizer->encode(data::render_chat_text(*chat.format, messages, true));
      for (const auto& stop : data::chat_stop_tokens(*chat.format))
        if (auto id = tokenizer->token_to_id(stop)) o.sampling.stop_ids.push_back(*id);
    } else {
      prompt = tokenizer->encode(o.prompt);
    }
  } else {
    prompt = parse_ids(o.prompt_ids);
  }
  for (int64_t eos : config.eos_token_ids) o.sampling.stop_ids.push_back(eos);
  if (tokenizer && tokenizer->eos_id()) o.sampling.stop_ids.push_back(*tokenizer->eos_id());

  // Past max_position_embeddings the model continues on positions it never saw: garbage, silently.
  require(int64_t(prompt.size()) + o.sampling.max_new_tokens <= config.max_position_embeddings,
          "{}/config.json: the prompt ({} tokens) + --max-new-tokens ({}) exceed the model's {} positions "
          "(max_position_embeddings); shorten the prompt or lower --max-new-tokens",
          o.model, prompt.size(), o.sampling.max_new_tokens, config.max_position_embeddings);
  model::DecoderOptions decoder_options;
  decoder_options.backend = &kernels::backend_named(o.backend);
  model::Decoder decoder(config, model::Precision::F32, 1, 2, decoder_options);
  model::load_model_weights(decoder, o.model);  // a directory or a GGUF file
  if (!o.adapter.empty()) {
    const int64_t merged = model::merge_peft_adapter(decoder, o.adapter);
    fmt::print(stderr, "keel: LoRA adapter {} merged into the weights ({} modules)\n", o.adapter, merged);
  }
  const auto weights = o.weights == "bf16" ? model::GenerationWeights::Bf16 : model::GenerationWeights::F32;
  model::Generator generator(decoder, int64_t(prompt.size()) + o.sampling.max_new_tokens + 1, weights);
  fmt::print(stderr, "keel: generating with {} weights{}\n", o.weights,
             weights == model::GenerationWeights::Bf16 ? " (each projection rounded to bf16; sums in fp32)" : "");
  std::vector<int32_t> pending;  // ids whose bytes may end inside a UTF-8 character
  generator.generate(prompt, o.sampling, [&](int32_t id) {
    if (o.show_ids || !tokenizer) {
      fmt::print("{} ", id);
    } else if (!tokenizer->is_special(id)) {
      pending.push_back(id);
      const std::string text = tokenizer->decode(pending);
      if (!text.empty() && static_cast<unsigned char>(text.back()) < 0x80) {  // ends on a whole character
        fmt::print("{}", text);
        pending.clear();
      }
    }
    std::fflush(stdout);
  });
  if (!pending.empty()) fmt::print("{}", tokenizer->decode(pending));
  fmt::print("\n");
  return 0;
}

const CommandRegistration kGenerate{
    "generate", "Generate text from an HF model directory (greedy or sampled, with a KV cache)",
    [](CLI::App& cmd) -> CommandAction {
      auto o = std::make_shared<GenerateOptions>();
      cmd.add_option("--model", o->model, "HF model directory (config.json, safetensors, tokenizer) or GGUF file")
          ->required();
      cmd.add_option("--prompt", o->prompt, "Prompt text (tokenized with the model's tokenizer)");
      cmd.add_option("--prompt-ids", o->prompt_ids, "Prompt as comma-separated token ids instead of text");
      cmd.add_option("--tokenizer", o->tokenizer, "tokenizer.json or tiktoken file (default: the model's)");
      cmd.add_option("--adapter", o->adapter, "A LoRA adapter directory in PEFT's format, merged into the model");
      cmd.add_option("--backend", o->backend, "Where generation computes: cpu or reference (as the recipe key)")
          ->capture_default_str();
      cmd.add_flag("--chat", o->chat, "Wrap the prompt in the model's chat template as a user turn");
      cmd.add_option("--chat-template", o->chat_template,
                     "model (the model's own Jinja template) | a .jinja file | glm4 | llama3 | chatml (default: the "
                     "model's own when it has one, else a built-in chosen from the model)");
      cmd.add_option("--system", o->system, "System message for --chat");
      cmd.add_option("--max-new-tokens", o->sampling.max_new_tokens, "Tokens to generate")->capture_default_str();
      cmd.add_option("--min-new-tokens", o->sampling.min_new_tokens,
                     "Tokens to generate before EOS may be chosen (as transformers' min_new_tokens)")
          ->capture_default_str();
      cmd.add_option("--temperature", o->sampling.temperature, "0 = greedy")->capture_default_str();
      cmd.add_option("--top-k", o->sampling.top_k, "Keep the k most likely tokens (0 = all)")->capture_default_str();
      cmd.add_option("--top-p", o->sampling.top_p, "Nucleus sampling threshold")->capture_default_str();
      cmd.add_option("--seed", o->sampling.seed, "Sampling seed")->capture_default_str();
      cmd.add_flag("--ids", o->show_ids, "Print token ids instead of text");
      cmd.add_option("--weights", o->weights,
                     "fp32, or bf16: the projections' weights rounded to bf16 and read as such (about twice as "
                     "fast per token; activations and sums stay fp32)")
          ->check(CLI::IsMember({"fp32", "bf16"}))
          ->capture_default_str();
      return [o] {
        require(o->sampling.max_new_tokens > 0 && o->sampling.max_new_tokens <= 1'000'000,
                "--max-new-tokens must be in [1, 1000000]");
        require(o->sampling.temperature >= 0, "--temperature must not be negative");
        require(o->sampling.top_p > 0 && o->sampling.top_p <= 1, "--top-p must be in (0, 1]");
        return run_generate(*o);
      };
    }};

}  // namespace
}  // namespace keel::cli
