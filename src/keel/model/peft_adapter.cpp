#include "keel/model/peft_adapter.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/core/json_text.h"
#include "keel/formats/safetensors.h"

namespace keel::model {

// The file formats this reads and writes (formats/).
using formats::CheckpointReader;
using formats::TensorToWrite;
using formats::write_safetensors;

namespace dom = simdjson::dom;

namespace {

std::string config_path(const std::string& dir) { return dir + "/" + kAdapterConfigFile; }

// PEFT's prefix of every tensor name in an adapter file.
const std::string kPeftPrefix = "base_model.model.";

double number(dom::element e, const std::string& path, const char* key) {
  double d = 0;
  int64_t i = 0;
  if (e.get(d) == simdjson::SUCCESS) return d;
  if (e.get(i) == simdjson::SUCCESS) return double(i);
  fail("{}: key '{}': expected a number, found {}", path, key, json_describe(e));
}

// W[rows of m] += scaling * B A, with B and A as fp32 [rows, r] and [r, cols]; on the experts each
// expert's W_e += scaling * B_e A_e, from keel's layouts of A and B (lora.h), as PEFT's
// ParamWrapper.merge adds its delta weight.
void merge_module(Decoder& d, const LoraModule& m, int64_t rank, double scaling, const float* a, const float* b) {
  const int64_t experts = std::max<int64_t>(m.experts, 1);
  std::vector<float> scaled_b(b, b + experts * m.rows * rank);
  for (float& v : scaled_b) v = float(double(v) * scaling);
  float* w = d.params().weight(module_weight(d.ids(), m)) + m.row_begin * m.cols;
  for (int64_t e = 0; e < experts; ++e)
    d.backend().gemm(kernels::packed_gemm(kernels::Trans::N, kernels::Trans::N, m.rows, m.cols, rank),
                     scaled_b.data() + e * m.rows * rank, a + e * rank * m.cols, w + e * m.rows * m.cols, 1.0f);
}

// A module name as target_modules and modules_to_save hold it ("q_proj", "self_attn.q_proj", a full
// path): a name with an empty part ("", "q_proj.", "a..b") matches no module of any model, so the
// loader would refuse it later; the parser refuses it with the file and key named.
void require_module_name(std::string_view name, const std::string& path, const char* key) {
  const bool empty_part = name.empty() || name.front() == '.' || name.back() == '.' ||
                          name.find("..") != std::string_view::npos;
  require(!empty_part, "{}: key '{}': \"{}\" {} matches no module; expected module names such as \"q_proj\" or "
          "\"self_attn.q_proj\"",
          path, key, name, name.empty() ? "(an empty name)" : "(an empty part between dots)");
}

std::string json_string_list(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + json_quoted(items[i]);
  return out + "]";
}

}  // namespace

bool is_peft_adapter_dir(const std::string& dir) { return path_exists(config_path(dir)); }

PeftAdapterConfig read_peft_adapter_config(const std::string& dir) {
  const std::string path = config_path(dir);
  require(path_exists(path), "{}: expected a PEFT adapter directory holding {}, found no such file", dir,
          kAdapterConfigFile);
  return parse_peft_adapter_config(read_file(path), path);
}

PeftAdapterConfig parse_peft_adapter_config(const std::string& text, const std::string& path) {
  dom::parser parser;
  dom::element root;
  if (auto error = parse_json_document(parser, text, root)) fail("{}: expected valid JSON: {}", path, simdjson::error_message(error));
  dom::object object;
  require(root.get(object) == simdjson::SUCCESS, "{}: expected a JSON object", path);
  auto get = [&](const char* key) -> std::optional<dom::element> {
    dom::element e;
    if (object.at_key(key).get(e) != simdjson::SUCCESS || e.is_null()) return std::nullopt;
    return e;
  };
  PeftAdapterConfig c;
  std::string_view type;
  require(get("peft_type") && get("peft_type")->get(type) == simdjson::SUCCESS && type == "LORA",
          "{}: key 'peft_type': expected \"LORA\" (keel loads LoRA adapters), found {}", path,
          get("peft_type") ? json_describe(*get("peft_type")) : "nothing");
  auto r = get("r");
  require(r.has_value(), "{}: key 'r': expected the LoRA rank, found nothing", path);
  const double rank = number(*r, path, "r");
  require(rank >= 1 && rank <= 65536 && rank == std::floor(rank),
          "{}: key 'r': expected a positive integer up to 65536, found {}", path, rank);
  c.spec.rank = int64_t(rank);
  c.spec.alpha = get("lora_alpha") ? number(*get("lora_alpha"), path, "lora_alpha") : 8.0;  // PEFT's default
  c.dropout = get("lora_dropout") ? number(*get("lora_dropout"), path, "lora_dropout") : 0.0;
  require(std::isfinite(c.spec.alpha), "{}: key 'lora_alpha': expected a finite number, found {}", path, c.spec.alpha);
  require(c.dropout >= 0 && c.dropout < 1, "{}: key 'lora_dropout': expected a number in [0, 1), found {}", path,
          c.dropout);
  bool rslora = false;
  if (auto e = get("use_rslora")) require(e->get(rslora) == simdjson::SUCCESS, "{}: key 'use_rslora': expected true or false", path);
  c.spec.rslora = rslora;
  std::string_view base;
  if (auto e = get("base_model_name_or_path"); e && e->get(base) == simdjson::SUCCESS) c.base_model = std::string(base);

  auto targets = get("target_modules");
  auto parameters = get("target_parameters");
  require(targets.has_value() || parameters.has_value(),
          "{}: key 'target_modules': expected a list of module names, found nothing (nor target_parameters)", path);
  c.spec.targets.clear();
  std::string_view one;
  dom::array list;
  if (!targets) {
    // target_parameters alone (below)
  } else if (targets->get(one) == simdjson::SUCCESS) {
    // PEFT reads a string as a regular expression over module paths, except "all-linear".
    require(one == "all-linear",
            "{}: key 'target_modules': the regular expression \"{}\" is not supported; keel needs a list of module "
            "names (or \"all-linear\")",
            path, one);
    c.spec.targets = {"all"};
  } else {
    require(targets->get(list) == simdjson::SUCCESS,
            "{}: key 'target_modules': expected a list of module names, found {}", path, json_describe(*targets));
    for (dom::element e : list) {
      require(e.get(one) == simdjson::SUCCESS, "{}: key 'target_modules': expected strings, found {}", path,
              json_describe(e));
      require_module_name(one, path, "target_modules");
      c.spec.targets.emplace_back(one);
    }
  }
  // PEFT's target_parameters: parameters adapted directly, which keel supports for the experts'
  // fused gate_up_proj and down_proj (lora.h). A bare name ("down_proj") matches parameters only,
  // which keel's targets spell as "experts.down_proj".
  if (parameters) {
    require(parameters->get(list) == simdjson::SUCCESS,
            "{}: key 'target_parameters': expected a list of parameter names, found {}", path,
            json_describe(*parameters));
    for (dom::element e : list) {
      require(e.get(one) == simdjson::SUCCESS, "{}: key 'target_parameters': expected strings, found {}", path,
              json_describe(e));
      require_module_name(one, path, "target_parameters");
      const std::string name(one);
      require(!name.ends_with("gate.weight"),
              "{}: key 'target_parameters': \"{}\" is the router's weight, which keel's LoRA never adapts (only the "
              "experts' gate_up_proj and down_proj)",
              path, name);
      c.spec.targets.push_back(expert_target(name) ? name : "experts." + name);
    }
  }
  require(!c.spec.targets.empty(),
          "{}: key 'target_modules': an empty list adapts nothing; expected the module names PEFT adapted", path);
  std::string_view bias = "none";
  if (auto e = get("bias"))
    require(e->get(bias) == simdjson::SUCCESS, "{}: key 'bias': expected a string, found {}", path, json_describe(*e));
  require(bias == "none", "{}: key 'bias': \"{}\" trains biases too; keel's LoRA adapters have bias \"none\"", path,
          bias);
  if (auto e = get("modules_to_save")) {  // the embedding and/or LM head trained fully beside the adapters
    dom::array saved;
    require(e->get(saved) == simdjson::SUCCESS, "{}: key 'modules_to_save': expected a list of module names, found {}",
            path, json_describe(*e));
    for (dom::element name : saved) {
      require(name.get(one) == simdjson::SUCCESS, "{}: key 'modules_to_save': expected strings, found {}", path,
              json_describe(name));
      require_module_name(one, path, "modules_to_save");
      c.spec.modules_to_save.emplace_back(one);
    }
  }
  for (const char* key : {"layers_to_transform", "rank_pattern", "alpha_pattern"}) {
    auto e = get(key);
    if (!e) continue;
    dom::array a;
    dom::object o;
    const bool empty = (e->get(a) == simdjson::SUCCESS && a.size() == 0) || (e->get(o) == simdjson::SUCCESS && o.size() == 0);
    require(empty, "{}: key '{}' = {} is not supported by keel's LoRA", path, key, json_describe(*e));
  }
  bool dora = false;
  if (auto e = get("use_dora"))
    require(e->get(dora) == simdjson::SUCCESS, "{}: key 'use_dora': expected true or false", path);
  require(!dora, "{}: key 'use_dora': DoRA adapters are not supported", path);
  return c;
}

void save_peft_adapter(const Decoder& decoder, const std::string& dir, const std::string& base_model, double dropout,
                       DType dtype) {
  require(decoder.has_adapter(), "save_peft_adapter: the model has no LoRA adapter");
  make_dirs(dir);
  const auto& modules = decoder.lora_modules();
  const auto& adapter = decoder.adapter();
  const LoraSpec& spec = decoder.options().lora;
  std::vector<TensorToWrite> tensors;
  std::vector<std::string> names, parameters;  // target_modules, target_parameters
  // The experts' B in PEFT's layout [rows, rank x experts] (lora.h), converted here.
  std::vector<std::vector<float>> peft_b;
  for (const auto& m : modules) {
    tensors.push_back({peft_tensor_name(m, true), adapter.param(m.a).shape, adapter.weight(m.a)});
    if (m.on_experts()) {
      peft_b.emplace_back(size_t(adapter.param(m.b).numel));
      expert_b_to_peft(m, spec.rank, adapter.weight(m.b), peft_b.back().data());
      tensors.push_back({peft_tensor_name(m, false), {m.rows, spec.rank * m.experts}, peft_b.back().data()});
    } else {
      tensors.push_back({peft_tensor_name(m, false), adapter.param(m.b).shape, adapter.weight(m.b)});
    }
    auto& list = m.on_experts() ? parameters : names;
    if (std::find(list.begin(), list.end(), m.name) == list.end()) list.push_back(m.name);
  }
  // target_modules (and target_parameters) as names (what vLLM and most tools expect) when those
  // names select exactly the adapted modules; a target naming some of them by path
  // (layers.0.self_attn.q_proj) would be widened by the bare name, so then every adapted module's
  // full path.
  LoraSpec by_name = spec;
  by_name.targets = names;
  for (const auto& p : parameters) by_name.targets.push_back("experts." + p);
  if (lora_modules(decoder.config(), decoder.ids(), by_name).size() != modules.size()) {
    names.clear();
    parameters.clear();
    for (const auto& m : modules) (m.on_experts() ? parameters : names).push_back(m.path);
  }
  // modules_to_save under their HF tensor names, as PEFT's get_peft_model_state_dict writes them.
  for (int copy : {decoder.trained_embedding(), decoder.trained_lm_head()})
    if (copy >= 0) tensors.push_back({kPeftPrefix + adapter.param(copy).name, adapter.param(copy).shape, adapter.weight(copy)});
  write_safetensors(dir + "/" + kAdapterWeightsFile, tensors, dtype, {{"format", "pt"}});
  // The keys PEFT's LoraConfig writes that loaders read; target_modules as the resolved names.
  const std::string json = fmt::format(
      "{{\n"
      "  \"base_model_name_or_path\": {},\n"
      "  \"bias\": \"none\",\n"
      "  \"fan_in_fan_out\": false,\n"
      "  \"inference_mode\": true,\n"
      "  \"init_lora_weights\": true,\n"
      "  \"layers_to_transform\": null,\n"
      "  \"lora_alpha\": {},\n"
      "  \"lora_dropout\": {},\n"
      "  \"modules_to_save\": {},\n"
      "  \"peft_type\": \"LORA\",\n"
      "  \"r\": {},\n"
      "  \"revision\": null,\n"
      "  \"target_modules\": {},\n"
      "  \"target_parameters\": {},\n"
      "  \"task_type\": \"CAUSAL_LM\",\n"
      "  \"use_dora\": false,\n"
      "  \"use_rslora\": {}\n"
      "}}\n",
      json_quoted(base_model), spec.alpha, dropout,
      decoder.saved_modules().names.empty() ? std::string("null") : json_string_list(decoder.saved_modules().names),
      spec.rank, names.empty() ? std::string("null") : json_string_list(names),
      parameters.empty() ? std::string("null") : json_string_list(parameters), spec.rslora ? "true" : "false");
  write_file_atomic(config_path(dir), json);
}

namespace {

// The adapter's modules for `decoder`'s model, with their checks against what the file holds.
std::vector<LoraModule> adapter_modules(const Decoder& decoder, const std::string& dir, const PeftAdapterConfig& c) {
  try {
    return lora_modules(decoder.config(), decoder.ids(), c.spec);
  } catch (const Error& e) {
    fail("{}: {}", config_path(dir), e.what());
  }
}

// A module's A and B into keel's layouts (lora.h: the experts' B permuted from PEFT's).
void read_module(const CheckpointReader& reader, const LoraModule& m, int64_t rank, float* a, float* b) {
  if (!m.on_experts()) {
    reader.read_f32(peft_tensor_name(m, true), {rank, m.cols}, a);
    reader.read_f32(peft_tensor_name(m, false), {m.rows, rank}, b);
    return;
  }
  reader.read_f32(peft_tensor_name(m, true), {m.experts * rank, m.cols}, a);
  std::vector<float> peft(size_t(m.rows * rank * m.experts));
  reader.read_f32(peft_tensor_name(m, false), {m.rows, rank * m.experts}, peft.data());
  expert_b_from_peft(m, rank, peft.data(), b);
}

// Tensors in the file that no module of the configuration reads: a different model's adapter.
void require_all_used(const CheckpointReader& reader, const std::vector<LoraModule>& modules,
                      const SavedModules& saved, const std::string& path) {
  std::set<std::string> used;
  for (const auto& m : modules) used.insert({peft_tensor_name(m, true), peft_tensor_name(m, false)});
  for (const auto& tensor : {saved.embedding, saved.lm_head})
    if (!tensor.empty()) used.insert(kPeftPrefix + tensor);
  for (const auto& name : reader.names())
    require(used.count(name), "{}: tensor '{}' belongs to no module of this model's adapter (another model's adapter?)",
            path, name);
}

}  // namespace

void load_peft_adapter(Decoder& decoder, const std::string& dir) {
  require(decoder.has_adapter(), "{}: an adapter can only be loaded into a LoRA run (finetuning_type = \"lora\")", dir);
  const PeftAdapterConfig c = read_peft_adapter_config(dir);
  const LoraSpec& mine = decoder.options().lora;
  const std::string path = config_path(dir);
  require(c.spec.rank == mine.rank, "{}: r = {} but the recipe's lora_rank is {}", path, c.spec.rank, mine.rank);
  require(c.spec.alpha == mine.alpha, "{}: lora_alpha = {} but the recipe's lora_alpha is {}", path, c.spec.alpha,
          mine.alpha);
  require(c.spec.rslora == mine.rslora, "{}: use_rslora = {} but the recipe's use_rslora is {}", path, c.spec.rslora,
          mine.rslora);
  const auto modules = adapter_modules(decoder, dir, c);
  std::vector<std::string> theirs, ours;
  for (const auto& m : modules) theirs.push_back(m.path);
  for (const auto& m : decoder.lora_modules()) ours.push_back(m.path);
  require(theirs == ours,
          "{}: target_modules {} adapt {} modules, the recipe's lora_target {} adapts {}: set lora_target to the "
          "adapter's modules",
          path, json_string_list(c.spec.targets), theirs.size(), json_string_list(mine.targets), ours.size());
  const SavedModules saved = resolve_modules_to_save(decoder.config(), decoder.ids(), c.spec);
  require(saved.embedding == decoder.saved_modules().embedding && saved.lm_head == decoder.saved_modules().lm_head,
          "{}: modules_to_save {} but the recipe's additional_target is {}: set additional_target to the adapter's",
          path, json_string_list(saved.names), json_string_list(decoder.saved_modules().names));
  const std::string weights = dir + "/" + kAdapterWeightsFile;
  const auto reader = CheckpointReader::open_file(weights);
  require_all_used(reader, modules, saved, weights);
  ParamStore& adapter = decoder.adapter();
  for (const auto& m : decoder.lora_modules()) read_module(reader, m, mine.rank, adapter.weight(m.a), adapter.weight(m.b));
  for (int copy : {decoder.trained_embedding(), decoder.trained_lm_head()})
    if (copy >= 0) reader.read_f32(kPeftPrefix + adapter.param(copy).name, adapter.param(copy).shape, adapter.weight(copy));
  adapter.refresh_bf16_copy();
}

int64_t merge_peft_adapter(Decoder& decoder, const std::string& dir) {
  const PeftAdapterConfig c = read_peft_adapter_config(dir);
  const auto modules = adapter_modules(decoder, dir, c);
  const SavedModules saved = resolve_modules_to_save(decoder.config(), decoder.ids(), c.spec);
  const std::string weights = dir + "/" + kAdapterWeightsFile;
  const auto reader = CheckpointReader::open_file(weights);
  require_all_used(reader, modules, saved, weights);
  // modules_to_save replace the model's embedding / LM head.
  ParamStore& P = decoder.params();
  const auto& ids = decoder.ids();
  if (!saved.embedding.empty())
    reader.read_f32(kPeftPrefix + saved.embedding, P.param(ids.embed).shape, P.weight(ids.embed));
  if (!saved.lm_head.empty())
    reader.read_f32(kPeftPrefix + saved.lm_head, P.param(ids.lm_head).shape, P.weight(ids.lm_head));
  const int64_t r = c.spec.rank;
  std::vector<float> a, b;
  for (const auto& m : modules) {
    const int64_t experts = std::max<int64_t>(m.experts, 1);
    a.resize(size_t(experts * r * m.cols));
    b.resize(size_t(experts * m.rows * r));
    read_module(reader, m, r, a.data(), b.data());
    merge_module(decoder, m, r, c.spec.scaling(), a.data(), b.data());
  }
  decoder.params().refresh_bf16_copy();
  return int64_t(modules.size());
}

void merge_own_adapter(Decoder& decoder) {
  const LoraSpec& spec = decoder.options().lora;
  const ParamStore& adapter = decoder.adapter();
  ParamStore& P = decoder.params();
  if (decoder.trained_embedding() >= 0)
    std::copy_n(adapter.weight(decoder.trained_embedding()), P.param(decoder.ids().embed).numel,
                P.weight(decoder.ids().embed));
  if (decoder.trained_lm_head() >= 0)
    std::copy_n(adapter.weight(decoder.trained_lm_head()), P.param(decoder.ids().lm_head).numel,
                P.weight(decoder.ids().lm_head));
  for (const auto& m : decoder.lora_modules())
    merge_module(decoder, m, spec.rank, spec.scaling(), adapter.weight(m.a), adapter.weight(m.b));
  decoder.params().refresh_bf16_copy();
}

}  // namespace keel::model
