// config.json of the four families: parse_model_config, then two round trips that export relies
// on: the original text with only the dtype rewritten (model_config_json keeps unknown keys) and
// the text keel generates for a model built from scratch must both read back to the same config.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "fuzz_support.h"
#include "keel/model/config.h"

namespace {

std::string describe(const keel::model::ModelConfig& c, bool with_architecture = true) {
  return fmt::format(
      "family={} arch={} vocab={} hidden={} inter={} layers={} heads={} kv={} head_dim={} rotary={} interleaved={} "
      "theta={} eps={} qkv_bias={} tie={} max_pos={} dtype={} eos=[{}] bos={} pad={}",
      keel::model::family_name(c.family), with_architecture ? c.architecture : "-", c.vocab_size, c.hidden_size,
      c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim, c.rope_interleaved,
      c.rope_theta, c.rms_norm_eps, c.qkv_bias, c.tie_word_embeddings, c.max_position_embeddings,
      keel::dtype_name(c.torch_dtype), fmt::join(c.eos_token_ids, ","), c.bos_token_id, c.pad_token_id);
}

// `with_architecture`: false for the generated text, which names the family's own class even when
// the config was read with another (THUDM's remote-code names with model_type "chatglm").
void check_round_trip(const keel::model::ModelConfig& c, const std::string& text, const char* which,
                      bool with_architecture) {
  keel::model::ModelConfig back;
  try {
    back = keel::model::parse_model_config(text, "exported config.json");
  } catch (const keel::Error& e) {
    keel::fuzz::property_failed(which, fmt::format("{}\nexported text:\n{}\nerror: {}", describe(c), text, e.what()));
  }
  if (describe(back, with_architecture) != describe(c, with_architecture)) {
    keel::fuzz::property_failed(
        which, fmt::format("read:     {}\nreread:   {}\nexported text:\n{}", describe(c), describe(back), text));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  const std::string text(reinterpret_cast<const char*>(data), size);
  model::ModelConfig c;
  try {
    c = model::parse_model_config(text, "config.json");
  } catch (const Error&) {
    return 0;
  }
  (void)c.total_parameters();  // sizes are bounded by validate(): no signed overflow here (UBSan)
  (void)c.matmul_parameters();
  check_round_trip(c, model::model_config_json(c, c.torch_dtype), "original config.json round trip", true);
  model::ModelConfig scratch = c;
  scratch.config_json.clear();
  check_round_trip(scratch, model::model_config_json(scratch, c.torch_dtype), "generated config.json round trip",
                   false);
  return 0;
}
