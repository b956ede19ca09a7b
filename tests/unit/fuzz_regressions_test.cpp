// Inputs found by the fuzzers (fuzz/, scripts/fuzz.sh), minimised, each kept as a regression test.
//
// Two kinds:
//  - Replay: the target's seeds (fuzz/seed_corpus.h: inputs keel's own writers make) and every file
//    under tests/data/fuzz/<target>/ are run through the fuzz target itself (fuzz/<target>_fuzz.cpp
//    is compiled into this executable as keel_fuzz_<target>): a crash, a sanitizer report, an
//    exception other than keel::Error or a broken property aborts the test, and a target with no
//    input to replay fails it (a replay of nothing passes whatever the code does).
//  - Named cases below: the minimised input embedded, with the error keel must now give.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "keel/core/error.h"
#include "keel/data/hf_tokenizer_json.h"
#include "keel/model/config.h"
#include "keel/model/peft_adapter.h"
#include "keel/recipe/recipe.h"
#include "seed_corpus.h"
#include "test_support.h"

#define KEEL_FUZZ_ENTRY(target) extern "C" int keel_fuzz_##target(const uint8_t* data, size_t size);
KEEL_FUZZ_ENTRY(safetensors)
KEEL_FUZZ_ENTRY(safetensors_index)
KEEL_FUZZ_ENTRY(model_config)
KEEL_FUZZ_ENTRY(recipe)
KEEL_FUZZ_ENTRY(token_records)
KEEL_FUZZ_ENTRY(checkpoint)
KEEL_FUZZ_ENTRY(sharded_checkpoint)
KEEL_FUZZ_ENTRY(rank_table)
KEEL_FUZZ_ENTRY(tokenizer_json)
KEEL_FUZZ_ENTRY(tiktoken)
KEEL_FUZZ_ENTRY(records)
KEEL_FUZZ_ENTRY(shard)
KEEL_FUZZ_ENTRY(peft_adapter_config)
KEEL_FUZZ_ENTRY(chat_template)
KEEL_FUZZ_ENTRY(preference_pairs)
KEEL_FUZZ_ENTRY(llama_cpp_vocab)
KEEL_FUZZ_ENTRY(gguf)
KEEL_FUZZ_ENTRY(sentencepiece_model)

namespace {

using keel::testing::expect_keel_error;
namespace fs = std::filesystem;

// Every fuzz target's seeds, made once for the whole executable.
const std::vector<keel::fuzz::SeedInput>& seeds() {
  static const keel::testing::TempDir scratch;
  static const std::vector<keel::fuzz::SeedInput> all = keel::fuzz::seed_inputs(scratch.path());
  return all;
}

void run_input(int (*entry)(const uint8_t*, size_t), const std::string& name, const std::string& bytes) {
  SCOPED_TRACE(name);
  std::fprintf(stderr, "replaying %s (%zu bytes)\n", name.c_str(), bytes.size());  // names the input if it crashes
  entry(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

// Runs `target`'s seeds and every saved input through its fuzz entry point; returns how many.
int replay(const std::string& target, int (*entry)(const uint8_t*, size_t)) {
  int replayed = 0;
  for (const auto& seed : seeds()) {
    if (seed.target != target) continue;
    run_input(entry, "seed " + target + "/" + seed.name, seed.bytes);
    ++replayed;
  }
  const fs::path dir = fs::path(KEEL_TEST_DATA_DIR) / "fuzz" / target;
  std::vector<fs::path> files;
  if (fs::is_directory(dir))
    for (const auto& e : fs::directory_iterator(dir))
      if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    run_input(entry, f.string(), std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
    ++replayed;
  }
  return replayed;
}

}  // namespace

#define KEEL_FUZZ_REPLAY(target) \
  TEST(FuzzReplay, target) { EXPECT_GT(replay(#target, keel_fuzz_##target), 0) << "no input replayed for " #target; }
KEEL_FUZZ_REPLAY(safetensors)
KEEL_FUZZ_REPLAY(safetensors_index)
KEEL_FUZZ_REPLAY(model_config)
KEEL_FUZZ_REPLAY(recipe)
KEEL_FUZZ_REPLAY(token_records)
KEEL_FUZZ_REPLAY(checkpoint)
KEEL_FUZZ_REPLAY(sharded_checkpoint)
KEEL_FUZZ_REPLAY(rank_table)
KEEL_FUZZ_REPLAY(tokenizer_json)
KEEL_FUZZ_REPLAY(tiktoken)
KEEL_FUZZ_REPLAY(records)
KEEL_FUZZ_REPLAY(shard)
KEEL_FUZZ_REPLAY(peft_adapter_config)
KEEL_FUZZ_REPLAY(chat_template)
KEEL_FUZZ_REPLAY(preference_pairs)
KEEL_FUZZ_REPLAY(llama_cpp_vocab)
KEEL_FUZZ_REPLAY(gguf)
KEEL_FUZZ_REPLAY(sentencepiece_model)

// --- named cases ----------------------------------------------------------------------------------

// recipe fuzzer: a --set whose key is not a TOML key ("a b"). The value is retried as a quoted
// string, and that second parse threw toml::parse_error out of parse_recipe: `keel train` said
// "internal error" and exited 1 instead of 2. (data/fuzz/recipe/set-override-not-a-key)
TEST(FuzzRegressions, RecipeOverrideWithoutAKey) {
  expect_keel_error([] { keel::recipe::parse_recipe("", "recipe.toml", {"a b=1"}); },
                    {"--set 'a b=1'", "expected key=value"});
  expect_keel_error([] { keel::recipe::parse_recipe("", "recipe.toml", {std::string("\0\0h = 1", 7)}); }, {"--set"});
  expect_keel_error([] { keel::recipe::parse_recipe("", "recipe.toml", {"[x]=1"}); }, {"--set '[x]=1'"});
}

// Found with the UBSan build: an added token with id 2^31 - 1 made the vocabulary size id + 1
// overflow int32 in the Tokenizer constructor. (data/fuzz/tokenizer_json/added-token-id-int32-max)
TEST(FuzzRegressions, TokenizerAddedTokenIdInt32Max) {
  expect_keel_error(
      [] {
        keel::data::hf_tokenizer_from_json(
            R"({"added_tokens": [{"id": 2147483647, "content": "<s>", "special": true}], "model": {"type": "BPE", )"
            R"("vocab": {"a": 0}, "merges": []}, "decoder": {"type": "ByteLevel"}})",
            "tokenizer.json");
      },
      {"tokenizer.json", "added_tokens[0].id: 2147483647"});
}

// recipe fuzzer (round-trip property): a string holding a control character ("\u0001", "\r") was
// written raw by recipe_to_toml, which TOML forbids, so the resolved recipe (--print-recipe, a
// checkpoint's recipe.toml) did not parse back. (data/fuzz/recipe/control-character-in-string)
TEST(FuzzRegressions, RecipeToTomlEscapesControlCharacters) {
  const std::string model =
      "max_steps = 1\n[model_config]\nvocab_size = 8\nhidden_size = 8\nintermediate_size = 8\n"
      "num_layers = 1\nnum_heads = 1\n";
  for (const char* value : {R"(x\u0001y)", R"(x\ry)", R"(x\u007Fy)", R"(tab\there)", R"(q\"uote\\)"}) {
    SCOPED_TRACE(value);
    const auto r = keel::recipe::parse_recipe(std::string("data_path = \"") + value + "\"\n" + model, "recipe.toml");
    const std::string text = keel::recipe::recipe_to_toml(r);
    keel::recipe::Recipe back;
    ASSERT_NO_THROW(back = keel::recipe::parse_recipe(text, "resolved.toml")) << text;
    EXPECT_EQ(back.data_path, r.data_path);
  }
}

// peft_adapter_config fuzzer (its own property): an empty target_modules was
// accepted, an adapter that adapts nothing, which only the loader refused later; so were names
// that match no module of any model (empty, or with an empty part between dots), there and in
// modules_to_save. (data/fuzz/peft_adapter_config/empty-target-modules, module-name-with-empty-part)
TEST(FuzzRegressions, PeftAdapterConfigNamesModules) {
  auto parse = [](const std::string& json) {
    return [json] { keel::model::parse_peft_adapter_config(json, "adapter_config.json"); };
  };
  const std::string lora = R"({"peft_type": "LORA", "r": 8, )";
  expect_keel_error(parse(lora + R"("target_modules": []})"),
                    {"adapter_config.json: key 'target_modules': an empty list adapts nothing",
                     "expected the module names PEFT adapted"});
  for (const char* name : {R"("")", R"("q_proj.")", R"(".q_proj")", R"("self_attn..q_proj")"}) {
    SCOPED_TRACE(name);
    expect_keel_error(parse(lora + R"("target_modules": ["v_proj", )" + name + "]}"),
                      {"adapter_config.json: key 'target_modules'", "matches no module"});
    expect_keel_error(parse(lora + R"("target_modules": ["v_proj"], "modules_to_save": [)" + name + "]}"),
                      {"adapter_config.json: key 'modules_to_save'", "matches no module"});
  }
  EXPECT_EQ(keel::model::parse_peft_adapter_config(lora + R"("target_modules": ["self_attn.q_proj", "v_proj"]})",
                                                   "adapter_config.json")
                .spec.targets.size(),
            2u);
}
