// The starting corpora of the fuzz targets, written with keel's own writers, so that every target
// starts from inputs keel produces and accepts (seed_corpus.h). fuzz_seed_corpus writes them for
// scripts/fuzz.sh; the unit tests replay them (tests/unit/fuzz_regressions_test.cpp).
#include "seed_corpus.h"

#include <fmt/format.h>

#include <cstring>

#include "keel/core/file_io.h"
#include "keel/data/bpe_trainer.h"
#include "keel/data/shard_format.h"
#include "keel/cluster/rank_table.h"
#include "keel/model/config.h"
#include "keel/model/params.h"
#include "keel/formats/gguf_writer.h"
#include "keel/formats/safetensors.h"
#include "keel/checkpoint/checkpoint.h"
#include "keel/checkpoint/sharded_writer.h"
#include "keel/recipe/recipe.h"

namespace keel::fuzz {
namespace {

using Seeds = std::vector<SeedInput>;

void seed(Seeds& out, const std::string& target, const std::string& name, std::string_view bytes) {
  out.push_back({target, name, std::string(bytes)});
}

std::string prefixed(char selector, std::string_view bytes) { return std::string(1, selector) + std::string(bytes); }

void safetensors_seeds(Seeds& out, const std::string& tmp) {
  const float v[24] = {1,  -2, 3.5f, 0,  1e-3f, 65504, -0.0f, 7,  8,  9,  10, 11,
                       12, 13, 14,   15, 16,    17,    18,    19, 20, 21, 22, 23};
  int n = 0;
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    const std::string path = fmt::format("{}/seed{}.safetensors", tmp, n);
    formats::write_safetensors(
        path,
        {{"model.embed_tokens.weight", {4, 3}, v},
         {"model.norm.weight", {3}, v + 12},
         {"scalar", {}, v + 15},
         {"empty", {0, 3}, nullptr}},
        dtype, n == 0 ? std::map<std::string, std::string>{{"format", "pt"}} : std::map<std::string, std::string>{});
    seed(out, "safetensors", fmt::format("writer-{}", dtype_name(dtype)), read_file(path));
    ++n;
  }
  // A dtype keel does not read (I64): its size is still checked, reading it is an error.
  std::string header =
      R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},"w":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}})";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[size_t(i)] = char(uint64_t(header.size()) >> (8 * i));
  file += header + std::string(20, '\x01');
  seed(out, "safetensors", "other-dtype", file);
}

void safetensors_index_seeds(Seeds& out, const std::string& tmp) {
  static const float values[6] = {1, 2, 3, 4, 5, 6};
  const std::string dir = tmp + "/sharded";
  formats::write_model_weights(
      dir, {{"embed.weight", {2, 2}, values}, {"norm.weight", {2}, values}, {"lm_head.weight", {3, 2}, values}},
      DType::BF16, 12);
  seed(out, "safetensors_index", "writer", read_file(dir + "/model.safetensors.index.json"));
}

model::ModelConfig family_config(model::Family family) {
  model::ModelConfig c;
  c.family = family;
  c.vocab_size = 256;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 512;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.eos_token_ids = {1, 2};
  c.bos_token_id = 0;
  model::apply_family_traits(c);  // biases, RoPE layout, q/k norms, Gemma's layout
  c.tie_word_embeddings = family == model::Family::Qwen2 || c.gemma();
  if (family == model::Family::Mistral || c.gemma()) {  // windows, and layers of both kinds for Gemma
    c.sliding_window = 32;
    c.sliding_layers = {true, !c.gemma()};
  }
  if (family == model::Family::Qwen3Moe || family == model::Family::Mixtral) {  // 4 experts, top 2
    c.moe.experts = 4;
    c.moe.experts_per_token = 2;
    c.moe.intermediate_size = family == model::Family::Mixtral ? c.intermediate_size : 32;
    c.moe.norm_topk_prob = family == model::Family::Mixtral;
    c.moe.sparse_layers = {true, family == model::Family::Mixtral};
  }
  if (family == model::Family::Glm4Moe) {  // layer 0 dense; 4 experts in 2 groups, top 2, a shared expert
    c.moe.experts = 4;
    c.moe.experts_per_token = 2;
    c.moe.intermediate_size = 32;
    c.moe.shared_intermediate_size = 32;
    c.moe.norm_topk_prob = true;
    c.moe.sigmoid_router = true;
    c.moe.groups = 2;
    c.moe.routed_scaling_factor = 2.5;
    c.moe.router_aux_loss_coef = 0;
    c.moe.sparse_layers = {false, true};
    c.nextn_predict_layers = 1;
  }
  model::validate(c, "seed");
  return c;
}

void model_config_seeds(Seeds& out) {
  for (auto family : model::supported_families()) {
    for (DType dtype : {DType::BF16, DType::F32}) {
      seed(out, "model_config", fmt::format("writer-{}-{}", model::family_name(family), dtype_name(dtype)),
           model::model_config_json(family_config(family), dtype));
    }
  }
}

void recipe_seeds(Seeds& out) {
  recipe::Recipe r;
  r.data_path = "data/train.jsonl";
  r.eval_data_path = "data/eval.jsonl";
  r.eval_interval = 10;
  r.max_steps = 100;
  r.checkpoint_dir = "ckpt";
  r.save_interval = 20;
  recipe::ScratchModel m;
  m.vocab_size = 256, m.hidden_size = 64, m.intermediate_size = 128, m.num_layers = 2, m.num_heads = 4;
  r.model_config = m;
  const std::string text = recipe::recipe_to_toml(r);
  recipe::parse_recipe(text, "seed");  // the seed must itself be valid
  seed(out, "recipe", "writer-scratch", text);
  seed(out, 
      "recipe", "writer-scratch-with-overrides",
      text + std::string(1, '\0') + "max_steps=5\nlr_scheduler=linear\noutput_dir=runs/a b\nmodel_config.num_layers=3");
  recipe::Recipe hf = r;
  hf.model_config.reset();
  hf.model_name = "models/glm-4-9b";
  hf.dtype = recipe::Precision::Fp32;
  seed(out, "recipe", "writer-hf-model", recipe::recipe_to_toml(hf));
}

void token_records_seeds(Seeds& out) {
  seed(out, "token_records", "ids", "{\"input_ids\": [1, 2, 3, 4]}\n{\"input_ids\": [5]}\n");
  seed(out, "token_records", "labels",
       "{\"input_ids\": [1, 2, 3], \"labels\": [-100, 2, 3]}\n\n{\"input_ids\":[7,8],\"labels\":[7,-100]}");
  seed(out, "token_records", "crlf", "{\"input_ids\": [151551, 0]}\r\n  \r\n{\"labels\": [1], \"input_ids\": [1]}\r\n");
}

// A three-tensor model with its AdamW state (values 0, 1, 2, ...) in p, and the state of step 5 of
// its run: what both checkpoint layouts' seeds are written from.
checkpoint::TrainingState small_training_state(model::ParamStore& p) {
  p.add("embed.weight", {4, 3}, true);
  p.add("layers.0.norm.weight", {3}, false);
  p.add("lm_head.weight", {4, 3}, true);
  p.allocate(false);
  p.allocate_optimizer_state();
  for (int64_t i = 0; i < p.total(); ++i) p.weights()[i] = p.adam_m()[i] = p.adam_v()[i] = float(i);
  checkpoint::TrainingState state;
  state.step = 5;
  state.samples_consumed = 40;
  state.seed = 42;
  state.recipe_hash = state.model_fingerprint = state.data_fingerprint = state.compat_fingerprint = "0123456789abcdef";
  return state;
}

void checkpoint_seeds(Seeds& out, const std::string& tmp) {
  model::ParamStore p;
  const checkpoint::TrainingState state = small_training_state(p);
  const std::string root = tmp + "/checkpoints";
  {
    checkpoint::CheckpointWriter writer(root, 3, false);
    writer.save(p, state, "max_steps = 10\n");
  }
  const std::string dir = root + "/step-00000005";
  seed(out, "checkpoint", "manifest", prefixed(0, read_file(dir + "/manifest.json")));
  seed(out, "checkpoint", "trainer_state", prefixed(1, read_file(dir + "/trainer_state.json")));
  seed(out, "checkpoint", "weights", prefixed(2, read_file(dir + "/weights.safetensors")));
  seed(out, "checkpoint", "optimizer", prefixed(3, read_file(dir + "/optimizer.safetensors")));
  seed(out, "checkpoint", "latest", prefixed(4, read_file(root + "/latest")));
}

// The files of a sharded checkpoint two "ranks" wrote, as sharded_checkpoint_fuzz.cpp selects them.
void sharded_checkpoint_seeds(Seeds& out, const std::string& tmp) {
  model::ParamStore p;
  const checkpoint::TrainingState state = small_training_state(p);
  const std::string root = tmp + "/sharded_checkpoints";
  const std::string step_tmp = checkpoint::sharded_step_tmp(root, 5);
  const auto windows = shard_ranges(p.total(), 2);
  for (int rank = 0; rank < 2; ++rank) {
    checkpoint::ShardWriter writer(false, 0);
    writer.write(step_tmp, rank, 2, p.params(), windows[size_t(rank)],
                 {p.masters(), p.master_range(), p.adam_m(), p.adam_v(), p.optimizer_range()});
  }
  seed(out, "sharded_checkpoint", "report", prefixed(3, read_file(step_tmp + "/shard-00000-of-00002.json")));
  checkpoint::commit_sharded_checkpoint(root, step_tmp, windows, 1, p.params(), state, "max_steps = 10\n", 3);
  const std::string dir = root + "/step-00000005";
  seed(out, "sharded_checkpoint", "manifest", prefixed(0, read_file(dir + "/manifest.json")));
  seed(out, "sharded_checkpoint", "trainer_state", prefixed(1, read_file(dir + "/trainer_state.json")));
  seed(out, "sharded_checkpoint", "shard", prefixed(2, read_file(dir + "/shard-00000-of-00002.bin")));
}

void rank_table_seeds(Seeds& out) {
  cluster::RankTableRequest one;
  one.npu_count = 8;
  one.server_id = "10.0.0.1";
  one.hccn_conf_path = "/nonexistent/hccn.conf";
  one.device_ips = {"192.168.100.101", "192.168.101.101", "192.168.102.101", "192.168.103.101",
                    "192.168.100.100", "192.168.101.100", "192.168.102.100", "192.168.103.100"};
  const std::string single = cluster::rank_table_json(cluster::build_rank_table(one).table);
  seed(out, "rank_table", "writer-one-server", prefixed(0, single));
  seed(out, "rank_table", "writer-one-server-topology", prefixed(1, single));

  const std::string servers_text = "10.0.0.1 npus=4 devices=0,1,2,3\n10.0.0.2 slots=4 # a hostfile line\n";
  cluster::RankTableRequest two;
  two.npu_count = 4;
  two.topology = cluster::HcclTopology::Pcie;
  two.servers = cluster::parse_servers_file(servers_text, "servers.txt");
  const std::string multi = cluster::rank_table_json(cluster::build_rank_table(two).table);
  seed(out, "rank_table", "writer-two-servers", prefixed(0, multi));
  seed(out, "rank_table", "writer-two-servers-pcie", prefixed(1, multi));  // '{' is odd: the pcie rule
  seed(out, "rank_table", "hccn-conf",
       prefixed(2, "address_0=192.168.100.101\nnetmask_0=255.255.255.0\n# comment\naddress_1=192.168.101.101\n"));
  seed(out, "rank_table", "servers", prefixed(3, servers_text + "10.0.0.3 device_ips=1.2.3.4,1.2.3.5 hccn_conf=/x\n"));
}

void tokenizer_seeds(Seeds& out) {
  data::BpeTrainingOptions options;
  options.vocab_size = 300;
  options.special_tokens = {"<|endoftext|>", "<|user|>"};
  options.min_frequency = 1;
  data::BpeTrainer trainer(options);
  trainer.add_text("the quick brown fox jumps over the lazy dog; the dog sleeps. 12345 naïve café 你好 the the");
  const std::string json = trainer.tokenizer_json();
  seed(out, "tokenizer_json", "keel-trained", json);
  seed(out, "tokenizer_json", "keel-trained-with-text", json + std::string(1, '\0') + "<|user|> the dog 42\n");
  // The same as a model directory's tokenizer for GGUF (its pre-tokenizer is not llama.cpp's: the
  // reading runs to the end, then refuses), with a tokenizer_config.json and a config.json.
  const std::string nul(1, '\0');
  seed(out, "llama_cpp_vocab", "keel-trained",
       json + nul +
           R"({"bos_token": "<|endoftext|>", "eos_token": {"content": "<|user|>"}, "add_bos_token": true,
               "chat_template": "{% for m in messages %}{{ m.content }}<|user|>{% endfor %}"})" +
           nul + R"({"pad_token_id": 0, "eos_token_id": [1, 2], "bos_token_id": 1})");
  seed(out, "llama_cpp_vocab", "pair-merges",
       R"({"model": {"type": "BPE", "vocab": {"a": 0, " b": 1, "a b": 2}, "merges": [["a", " b"]]},
           "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}},
             {"Sequence": {"id": "A"}}], "pair": [{"SpecialToken": {"id": "<s>"}}, {"Sequence": {"id": "A"}},
             {"SpecialToken": {"id": "</s>"}}, {"Sequence": {"id": "B"}}]},
           "added_tokens": [{"id": 3, "content": "<s>", "special": true}, {"id": 4, "content": "</s>"}]})" +
           nul + R"({"bos_token": "<s>", "eos_token": "</s>"})" + nul);

  // A rank file: the 256 bytes, then a few merges (tiktoken's base64 + rank lines).
  auto base64 = [](std::string_view bytes) {
    static const char* alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::string out;
    size_t i = 0;
    for (; i + 2 < bytes.size(); i += 3) {
      uint32_t v = uint8_t(bytes[i]) << 16 | uint8_t(bytes[i + 1]) << 8 | uint8_t(bytes[i + 2]);
      for (int s = 18; s >= 0; s -= 6) out += alphabet[(v >> s) & 63];
    }
    if (i + 1 == bytes.size()) {
      uint32_t v = uint8_t(bytes[i]) << 16;
      out += alphabet[(v >> 18) & 63], out += alphabet[(v >> 12) & 63], out += "==";
    } else if (i + 2 == bytes.size()) {
      uint32_t v = uint8_t(bytes[i]) << 16 | uint8_t(bytes[i + 1]) << 8;
      out += alphabet[(v >> 18) & 63], out += alphabet[(v >> 12) & 63], out += alphabet[(v >> 6) & 63], out += '=';
    }
    return out;
  };
  std::string ranks;
  int rank = 0;
  for (int b = 0; b < 256; ++b) ranks += fmt::format("{} {}\n", base64(std::string(1, char(b))), rank++);
  for (const char* merge : {"th", "he", "the", " t", " the", "ll", "llo", " w"}) {
    ranks += fmt::format("{} {}\n", base64(merge), rank++);
  }
  seed(out, "tiktoken", "ranks", ranks);
}

void records_seeds(Seeds& out) {
  seed(out, "records", "every-shape",
       "{\"text\": \"Hello, world.\"}\n"
       "{\"prompt\": \"2+2?\", \"response\": \"4\", \"system\": \"Be brief.\"}\n"
       "{\"instruction\": \"Translate\", \"input\": \"chat\", \"output\": \"cat\"}\n"
       "{\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", \"content\": \"hi\"}, "
       "{\"role\": \"assistant\", \"content\": \"hello\"}]}\n"
       "{\"conversations\": [{\"from\": \"human\", \"value\": \"hi\"}, {\"from\": \"gpt\", \"value\": \"yo\"}]}\n"
       "{\"input_ids\": [1, 2, 3], \"labels\": [-100, 2, 3]}\n");
  seed(out, "records", "crlf-and-blank", "{\"text\": \"a\"}\r\n\r\n{\"text\": \"caf\u00e9 \u4f60\u597d\"}");
}

// One line of each pair form, and the bad ones training lists.
void preference_pairs_seeds(Seeds& out) {
  seed(out, "preference_pairs", "strings", R"({"prompt": "where is the sky", "chosen": " blue", "rejected": " red</s>"})");
  seed(out, "preference_pairs", "messages",
       R"({"prompt": [{"role": "user", "content": "hello"}], "chosen": [{"role": "assistant", "content": "world"}], )"
       R"("rejected": [{"role": "assistant", "content": "answer"}], "system": "be brief", "tools": "[]"})");
  seed(out, "preference_pairs", "implicit-messages",
       R"({"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}], )"
       R"("rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}]})");
  seed(out, "preference_pairs", "implicit-strings", R"({"chosen": "the sky is blue", "rejected": "the sky is café"})");
  seed(out, "preference_pairs", "same-answer", R"({"prompt": "q", "chosen": " a", "rejected": " a"})");
}

void shard_seeds(Seeds& out, const std::string& tmp) {
  const std::string path = tmp + "/shard-00000.bin";
  data::ShardWriter writer(path);
  const uint32_t a[] = {1, 2, 3, 4, 5}, b[] = {7, 8, 9};
  const uint8_t ma[] = {0, 1, 1, 1, 1}, mb[] = {1, 1, 0};
  writer.add_document(a, ma);
  writer.add_document(b, mb);
  writer.end_sequence();
  writer.add_document(b, mb);
  const data::ShardInfo info = writer.finish();
  std::string counts(24, '\0');
  const int64_t c[3] = {info.sequences, info.tokens, info.documents};
  std::memcpy(counts.data(), c, sizeof c);
  seed(out, "shard", "writer-shard", prefixed(1, counts + read_file(path)));
  data::ShardManifest m;
  m.tokenizer_hash = "0123456789abcdef";
  m.chat_template = "chatml";
  m.max_seq_len = 64;
  m.vocab_size = 1000;
  m.source = "train.jsonl";
  m.shards.push_back(info);
  seed(out, "shard", "writer-manifest", prefixed(0, data::manifest_json(m)));
}

}  // namespace

// GGUF files from keel's writer: a model's shape of metadata (strings, arrays, scalars) with float
// and block-quantized tensors, and one without metadata.
void gguf_seeds(Seeds& out, const std::string& tmp) {
  // A tensor of n values 0.25 x (i - n / 2), as the writer asks for it: values [begin, begin + count).
  auto ramp = [](int n) {
    return [n](int64_t begin, int64_t count, float* d) {
      for (int64_t i = 0; i < count; ++i) d[i] = 0.25f * float(int(begin + i) - n / 2);
    };
  };
  formats::GgufMetadata kv;
  kv.add_string("general.architecture", "llama");
  kv.add_uint32("llama.block_count", 1);
  kv.add_float32("llama.rope.freq_base", 10000.0f);
  kv.add_bool("tokenizer.ggml.add_bos_token", true);
  kv.add_strings("tokenizer.ggml.tokens", {"a", "b", "<s>"});
  kv.add_int32s("tokenizer.ggml.token_type", {1, 1, 3});
  const std::string path = tmp + "/seed.gguf";
  formats::write_gguf(path, kv,
                      {{"token_embd.weight", {3, 32}, formats::GgmlType::Q8_0, ramp(96)},
                       {"blk.0.attn_q.weight", {2, 32}, formats::GgmlType::Q4_0, ramp(64)},
                       {"output_norm.weight", {32}, formats::GgmlType::F32, ramp(32)},
                       {"output.weight", {3, 32}, formats::GgmlType::BF16, ramp(96)}});
  seed(out, "gguf", "writer-model", read_file(path));
  formats::write_gguf(path, formats::GgufMetadata{}, {{"t", {2}, formats::GgmlType::F16, ramp(2)}});
  seed(out, "gguf", "writer-no-metadata", read_file(path));
  // A model keel trains from (model_name = "x.gguf"): every config key, and a byte-level BPE
  // tokenizer with merges, special ids and a chat template.
  formats::GgufMetadata model;
  model.add_string("general.architecture", "qwen2");
  for (const auto& [key, value] : {std::pair{"block_count", 1}, {"context_length", 64}, {"embedding_length", 32},
                                   {"feed_forward_length", 32}, {"attention.head_count", 2},
                                   {"attention.head_count_kv", 1}})
    model.add_uint32(std::string("qwen2.") + key, uint32_t(value));
  model.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6f);
  model.add_string("tokenizer.ggml.model", "gpt2");
  model.add_string("tokenizer.ggml.pre", "qwen2");
  model.add_strings("tokenizer.ggml.tokens", {"a", "b", "ab", "\xc4\xa0", "<|im_end|>", "<think>"});
  model.add_int32s("tokenizer.ggml.token_type", {1, 1, 1, 1, 3, 4});
  model.add_strings("tokenizer.ggml.merges", {"a b"});
  model.add_uint32("tokenizer.ggml.eos_token_id", 4);
  model.add_uint32("tokenizer.ggml.padding_token_id", 3);
  model.add_bool("tokenizer.ggml.add_bos_token", false);
  model.add_string("tokenizer.chat_template", "{{ messages[0]['content'] }}");
  formats::write_gguf(path, model,
                      {{"token_embd.weight", {6, 32}, formats::GgmlType::Q8_0, ramp(192)}});
  seed(out, "gguf", "writer-trainable-model", read_file(path));
}

std::vector<SeedInput> seed_inputs(const std::string& scratch) {
  Seeds out;
  safetensors_seeds(out, scratch);
  safetensors_index_seeds(out, scratch);
  model_config_seeds(out);
  recipe_seeds(out);
  token_records_seeds(out);
  checkpoint_seeds(out, scratch);
  sharded_checkpoint_seeds(out, scratch);
  rank_table_seeds(out);
  tokenizer_seeds(out);
  records_seeds(out);
  preference_pairs_seeds(out);
  shard_seeds(out, scratch);
  gguf_seeds(out, scratch);
  return out;
}

}  // namespace keel::fuzz
