// keel prepare --data FILE.jsonl[.gz|.zst] --tokenizer PATH|X.gguf --out DIR --max-seq-len N [--pack|--pad]
//              [--template auto|model|FILE.jinja|glm4|llama3|chatml|none] [--threads N] [--max-bad-fraction F]
//   tokenizes JSONL records once, in parallel, into packed (or padded) memory-mappable shards
//   (data/prepare.h); bad records are listed by line number in DIR/report.json.
#include <iostream>
#include <memory>

#include "keel/checkpoint/gguf_tokenizer.h"
#include "keel/cli/commands.h"
#include "keel/core/error.h"
#include "keel/core/work_progress.h"
#include "keel/data/preference_pairs.h"
#include "keel/data/prepare.h"
#include "keel/model/gguf_config.h"

namespace keel::cli {
namespace {

struct PrepareCliOptions {
  data::PrepareOptions prepare;
  bool pack = false, pad = false;
};

const CommandRegistration kPrepare{
    "prepare", "Tokenize JSONL records into packed shards for training", [](CLI::App& cmd) -> CommandAction {
      auto o = std::make_shared<PrepareCliOptions>();
      auto& p = o->prepare;
      cmd.add_option("--data", p.data_path,
                     "Records: JSONL (.jsonl, .jsonl.gz, .jsonl.zst) with text, prompt/response, "
                     "instruction/input/output, messages or input_ids")
          ->required();
      cmd.add_option("--tokenizer", p.tokenizer_path,
                     "tokenizer.json, a tiktoken rank file, a model directory, or a GGUF file (its metadata's: "
                     "written to DIR/gguf_tokenizer) (optional for input_ids records)");
      cmd.add_option("--out", p.out_dir, "Output directory (shards, manifest.json, report.json)")->required();
      cmd.add_option("--max-seq-len", p.max_seq_len, "Tokens per training sequence")
          ->required()
          ->check(CLI::Range(int64_t(2), int64_t(1) << 24));
      auto* pack = cmd.add_flag("--pack", o->pack, "Pack several documents per sequence (the default)");
      cmd.add_flag("--pad", o->pad, "One document per sequence, padded when loaded")->excludes(pack);
      cmd.add_option("--template", p.chat_template,
                     "Chat template for conversation records: auto (the model's own from the tokenizer's directory, "
                     "else a built-in chosen from it), model, a .jinja file, glm4, llama3, chatml or none")
          ->default_str("auto");
      cmd.add_option("--threads", p.threads, "Tokenizer threads (default: all cores)")->check(CLI::Range(1, 1024));
      cmd.add_option("--max-bad-fraction", p.max_bad_fraction,
                     "Fail when more than this fraction of records is bad (default 0.01)")
          ->check(CLI::Range(0.0, 1.0));
      cmd.add_flag("--train-on-prompt", p.train_on_prompt, "Loss on every token of conversations, not only answers");
      cmd.add_flag("--special-tokens-in-messages", p.special_tokens_in_messages,
                   "Special-token strings inside messages are the tokens (default: encoded as plain text)");
      cmd.add_option("--vocab-size", p.vocab_size, "Without --tokenizer: the model's vocabulary size, to check ids");
      cmd.add_option("--shard-tokens", p.shard_tokens, "Tokens per shard file (default 67108864)")
          ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
      return [o] {
        o->prepare.packing = o->pad ? data::Packing::pad : data::Packing::pack;
        o->prepare.live_progress = stdout_is_terminal();
        require(!data::holds_preference_pairs(o->prepare.data_path),
                "{}: preference pairs are not prepared into shards: a stage = \"dpo\" run tokenizes them when it "
                "starts and keeps them in memory with their reference log-probabilities. `keel inspect {} "
                "--tokenizer DIR --text` shows them as training will see them",
                o->prepare.data_path, o->prepare.data_path);
        // A GGUF file's tokenizer and chat template as a run from that file has them (its
        // output_dir/gguf_tokenizer, the same files): the shards' tokenizer hash then matches.
        if (model::is_gguf_path(o->prepare.tokenizer_path)) {
          const std::string dir = o->prepare.out_dir + "/gguf_tokenizer";
          checkpoint::write_gguf_tokenizer_dir(o->prepare.tokenizer_path, dir, &std::cerr);
          o->prepare.tokenizer_path = dir;
        }
        data::prepare(o->prepare, &std::cerr);
        return 0;
      };
    }};

}  // namespace
}  // namespace keel::cli
