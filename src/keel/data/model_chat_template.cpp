#include "keel/data/model_chat_template.h"

#include <simdjson.h>

#include <filesystem>

#include "keel/core/checksum.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/core/json_text.h"
#include "keel/data/hf_tokenizer_json.h"
#include "keel/data/record_reader.h"

namespace keel::data {
namespace fs = std::filesystem;
using jinja::Dict;
using jinja::List;
using jinja::Str;
using jinja::Value;

namespace {

// `role_source`: the source marked on a top-level "role" string (a message's role is data but not
// its text), else `source`.
Dict json_to_dict(simdjson::dom::object object, int source, int role_source) {
  Dict d;
  d.items.reserve(object.size());
  for (auto field : object) {
    const int marked = role_source != source && field.key == "role" && field.value.is_string() ? role_source : source;
    Value v = json_to_value(field.value, marked);
    // A key is its own dict key unless it starts with NUL (string_dict_key escapes it): the
    // common case builds the key's string once, in place.
    if (!field.key.empty() && field.key[0] == '\0')
      d.set(jinja::string_dict_key(field.key), std::move(v));
    else
      d.set(field.key, std::move(v));
  }
  return d;
}

}  // namespace

Value json_to_value(simdjson::dom::element e, int source) {
  using T = simdjson::dom::element_type;
  switch (e.type()) {
    case T::NULL_VALUE: return Value::none();
    case T::BOOL: return Value(bool(e.get_bool().value()));
    case T::INT64: return Value(int64_t(e.get_int64().value()));
    case T::UINT64:  // Python would keep it exact; keel's integers are 64-bit, and says so
      fail("the integer {} is beyond 64 bits", e.get_uint64().value());
    case T::DOUBLE: return Value(e.get_double().value());
    case T::STRING: return Value(Str(std::string(e.get_string().value()), source));
    case T::ARRAY: {
      List items;
      simdjson::dom::array array = e.get_array().value_unsafe();
      for (simdjson::dom::element x : array) items.push_back(json_to_value(x, source));
      return Value(std::move(items));
    }
    case T::OBJECT: return Value(json_to_dict(e.get_object().value_unsafe(), source, source));
    default: return Value::none();
  }
}

namespace {

// transformers' special_tokens_map: the named special tokens that are set, then the model's
// extra ones (Gemma 3's boi_token, ...); each a string or an AddedToken object.
Dict special_tokens_of(const std::string& dir) {
  Dict out;
  if (dir.empty()) return out;
  const std::string path = (fs::path(dir) / "tokenizer_config.json").string();
  if (!path_exists(path)) return out;
  const std::string text = read_file(path);
  simdjson::dom::parser parser;
  simdjson::dom::element root;
  if (parse_json_document(parser, text, root) != simdjson::SUCCESS || !root.is_object()) return out;
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    simdjson::dom::element v;
    if (root[key].get(v) != simdjson::SUCCESS) continue;
    if (auto s = config_token_text(v)) out.set(key, Value(std::string(*s)));
  }
  simdjson::dom::object extra;
  if (root["extra_special_tokens"].get_object().get(extra) == simdjson::SUCCESS)
    for (auto field : extra)
      if (auto s = config_token_text(field.value)) out.set(std::string(field.key), Value(std::string(*s)));
  return out;
}

ModelChatTemplate make(std::string text, std::string origin, const std::string& tokenizer_dir) {
  ModelChatTemplate t;
  t.checksum = checksum_hex(checksum(text));
  t.templ = std::make_shared<const jinja::Template>(std::move(text), origin, special_tokens_of(tokenizer_dir));
  t.origin = std::move(origin);
  return t;
}

// A "chat_template" field: a string, or a list of {"name", "template"} from which `name` (or
// tool_use with tools, else default) is chosen.
std::optional<std::pair<std::string, std::string>> pick(simdjson::dom::element field, const std::string& file,
                                                        const std::string& name, bool with_tools) {
  std::string_view s;
  if (field.get_string().get(s) == simdjson::SUCCESS) {
    require(name.empty() || name == "default", "{}: has a single chat template, not one named '{}'", file, name);
    return std::pair{std::string(s), std::string()};
  }
  simdjson::dom::array list;
  require(field.get_array().get(list) == simdjson::SUCCESS,
          "{}: \"chat_template\" is {}, expected a string or a list of {{\"name\", \"template\"}}", file,
          json_describe(field));
  std::vector<std::pair<std::string, std::string>> named;
  for (simdjson::dom::element item : list) {
    std::string_view n, t;
    require(item["name"].get_string().get(n) == simdjson::SUCCESS &&
                item["template"].get_string().get(t) == simdjson::SUCCESS,
            "{}: each entry of \"chat_template\" needs a string \"name\" and \"template\"", file);
    named.emplace_back(std::string(n), std::string(t));
  }
  std::string wanted = name;
  auto has = [&](const std::string& n) {
    for (const auto& [k, v] : named)
      if (k == n) return true;
    return false;
  };
  if (wanted.empty()) wanted = with_tools && has("tool_use") ? "tool_use" : "default";
  for (const auto& [k, v] : named)
    if (k == wanted) return std::pair{v, k};
  std::string names;
  for (const auto& [k, v] : named) names += (names.empty() ? "" : ", ") + k;
  fail("{}: no chat template named '{}' (it has: {})", file, wanted, names);
}

std::optional<ModelChatTemplate> from_json_file(const std::string& path, const std::string& name, bool with_tools,
                                                const std::string& tokenizer_dir) {
  const std::string text = read_file(path);
  simdjson::dom::parser parser;
  simdjson::dom::element root, field;
  require(parse_json_document(parser, text, root) == simdjson::SUCCESS, "{}: not valid JSON", path);
  if (root["chat_template"].get(field) != simdjson::SUCCESS) return std::nullopt;
  auto chosen = pick(field, path, name, with_tools);
  if (!chosen) return std::nullopt;
  return make(std::move(chosen->first), chosen->second.empty() ? path : path + " [" + chosen->second + "]",
              tokenizer_dir);
}

}  // namespace

std::optional<ModelChatTemplate> find_model_chat_template(const std::string& dir, const std::string& name,
                                                          bool with_tools) {
  const fs::path d(dir);
  if (const fs::path jinja_file = d / "chat_template.jinja"; fs::exists(jinja_file)) {
    require(name.empty() || name == "default", "{}: has a single chat template, not one named '{}'",
            jinja_file.string(), name);
    return make(read_file(jinja_file.string()), jinja_file.string(), dir);
  }
  for (const char* file : {"chat_template.json", "tokenizer_config.json"}) {
    const fs::path p = d / file;
    if (!fs::exists(p)) continue;
    if (auto t = from_json_file(p.string(), name, with_tools, dir)) return t;
  }
  return std::nullopt;
}

ModelChatTemplate chat_template_from_file(const std::string& path, const std::string& tokenizer_dir) {
  require(path_exists(path), "chat template file {} does not exist", path);
  if (fs::path(path).extension() == ".json") {
    auto t = from_json_file(path, "", false, tokenizer_dir);
    require(t.has_value(), "{}: has no \"chat_template\"", path);
    return *t;
  }
  return make(read_file(path), path, tokenizer_dir);
}

namespace {

// transformers' _normalize_chat_messages and _alias_reasoning_fields.
Value normalized_message(Dict out) {
  std::erase_if(out.items, [](const auto& item) { return item.second.is_none(); });
  // The first of reasoning_content, thinking, reasoning the message has (transformers' order), in
  // one pass over its keys: most messages have none of them.
  const Value* reasoning = nullptr;
  int rank = 3;
  for (const auto& [k, v] : out.items) {
    const int r = jinja::same_name(k, "reasoning_content") ? 0
                  : jinja::same_name(k, "thinking")        ? 1
                  : jinja::same_name(k, "reasoning")       ? 2
                                                           : 3;
    if (r < rank) {
      rank = r;
      reasoning = &v;
    }
  }
  if (!reasoning) return Value(std::move(out));
  const Value r = *reasoning;
  Dict aliased;
  aliased.set("thinking", r);
  for (auto& [k, v] : out.items) aliased.set(k, v);
  aliased.set("reasoning_content", r);
  return Value(std::move(aliased));
}

}  // namespace

std::string chat_input_from_record(simdjson::dom::element record, ChatInput& out) {
  simdjson::dom::element list;
  const bool sharegpt = record["messages"].get(list) != simdjson::SUCCESS;
  if (sharegpt && record["conversations"].get(list) != simdjson::SUCCESS)
    return "no 'messages' or 'conversations' field";
  const char* field = sharegpt ? "conversations" : "messages";
  simdjson::dom::array array;
  if (list.get_array().get(array) != simdjson::SUCCESS) return fmt::format("field '{}' is not an array", field);
  List messages;
  messages.reserve(array.size());
  int index = 0;
  for (simdjson::dom::element m : array) {
    if (!m.is_object()) return fmt::format("{}[{}] is not an object", field, index);
    // The role is data but not the message's own text: where it lands does not start the turn.
    Dict d = json_to_dict(m.get_object().value_unsafe(), index, jinja::kOtherData);
    if (sharegpt) {
      Dict converted;
      for (auto& [k, x] : d.items) {
        if (k == "from") {
          const std::string role = x.is_string() ? normalized_role(x.as_str().text) : "";
          if (role.empty()) return fmt::format("{}[{}]: unknown speaker {}", field, index, jinja::repr(x));
          converted.set("role", Value(Str(role, jinja::kOtherData)));
        } else {
          converted.set(k == "value" ? "content" : k, x);
        }
      }
      d = std::move(converted);
    }
    const Value* role = d.find("role");
    if (!role || !role->is_string()) return fmt::format("{}[{}]: missing string field 'role'", field, index);
    messages.push_back(normalized_message(std::move(d)));
    ++index;
  }
  if (messages.empty()) return fmt::format("field '{}' is empty", field);
  out.messages = Value(std::move(messages));
  simdjson::dom::element e;
  out.tools = record["tools"].get(e) == simdjson::SUCCESS ? json_to_value(e, jinja::kOtherData) : Value::none();
  out.documents = record["documents"].get(e) == simdjson::SUCCESS ? json_to_value(e, jinja::kOtherData) : Value::none();
  return {};
}

ChatInput chat_input_from_messages(const std::vector<ChatMessage>& messages) {
  ChatInput in;
  List list;
  for (size_t i = 0; i < messages.size(); ++i) {
    Dict m;
    m.set("role", Value(Str(messages[i].role, jinja::kOtherData)));
    m.set("content", Value(Str(messages[i].content, int(i))));
    list.emplace_back(std::move(m));
  }
  in.messages = Value(std::move(list));
  in.tools = in.documents = Value::none();
  return in;
}

Dict template_variables(const ChatInput& input) {
  Dict vars;
  vars.items.reserve(4 + input.variables.items.size());
  vars.set("messages", input.messages);
  vars.set("tools", input.tools.is_undefined() ? Value::none() : input.tools);
  vars.set("documents", input.documents.is_undefined() ? Value::none() : input.documents);
  vars.set("add_generation_prompt", Value(input.add_generation_prompt));
  for (const auto& [k, v] : input.variables.items) vars.set(k, v);
  return vars;
}

}  // namespace keel::data
