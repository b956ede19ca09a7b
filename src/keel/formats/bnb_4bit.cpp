#include "keel/formats/bnb_4bit.h"

#include <fmt/ranges.h>

#include <cstring>

#include "keel/core/error.h"
#include "keel/core/json_text.h"

namespace keel::formats {
namespace {

namespace dom = simdjson::dom;

std::string quant_state_name(const std::string& name, FourBitType type) {
  return name + ".quant_state.bitsandbytes__" + std::string(four_bit_type_name(type));
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// What QuantState.as_dict(packed=True) writes beside the tensors, as keel needs it.
struct QuantState {
  FourBitType type = FourBitType::Nf4;
  DType dtype = DType::F32;  // the weights' dtype before quantization: dequantize_4bit's output
  bool nested = false;
  float nested_offset = 0.0f;
};

QuantState read_quant_state(const CheckpointReader& reader, const std::string& name, const std::vector<int64_t>& shape,
                            FourBitType expected) {
  QuantState state;
  std::string entry;
  for (FourBitType type : {FourBitType::Nf4, FourBitType::Fp4})
    if (reader.has_bytes(quant_state_name(name, type))) entry = quant_state_name(name, type), state.type = type;
  if (entry.empty())
    fail(
        "{}: tensor '{}': expected a bitsandbytes 4-bit weight (a '{}' entry beside it), found none: the checkpoint's "
        "config.json says load_in_4bit, but this projection was saved unquantized",
        reader.dir(), name, quant_state_name(name, expected));
  if (state.type != expected)
    fail("{}: tensor '{}': stored as {} ({}), expected {} as the model's quantization_config says", reader.dir(), name,
         four_bit_type_name(state.type), entry, four_bit_type_name(expected));

  const auto entry_shape = reader.bytes_shape(entry);
  const int64_t length = entry_shape.size() == 1 ? entry_shape[0] : -1;
  if (length < 0 || length > (int64_t(1) << 20))
    fail("{}: tensor '{}': expected a 1-d JSON entry of at most 1 MiB", reader.dir(), entry);
  std::string text(size_t(length), '\0');
  reader.read_u8(entry, entry_shape, reinterpret_cast<uint8_t*>(text.data()));
  dom::parser parser;
  dom::element root;
  dom::object object;
  if (parse_json_document(parser, text, root) != simdjson::SUCCESS || root.get(object) != simdjson::SUCCESS)
    fail("{}: tensor '{}': expected a JSON object (bitsandbytes' packed quantization state)", reader.dir(), entry);
  auto field = [&](const char* key) -> dom::element {
    dom::element e;
    if (object[key].get(e) != simdjson::SUCCESS)
      fail("{}: tensor '{}': expected the key '{}', found none", reader.dir(), entry, key);
    return e;
  };
  std::string_view text_value;
  int64_t integer = 0;
  if (field("quant_type").get(text_value) != simdjson::SUCCESS || text_value != four_bit_type_name(state.type))
    fail("{}: tensor '{}': quant_type: expected \"{}\" (the entry's name), found {}", reader.dir(), entry,
         four_bit_type_name(state.type), json_describe(field("quant_type")));
  if (field("blocksize").get(integer) != simdjson::SUCCESS || integer != kFourBitBlockSize)
    fail("{}: tensor '{}': blocksize: expected {} (the block keel's 4-bit weights use), found {}", reader.dir(), entry,
         kFourBitBlockSize, json_describe(field("blocksize")));
  dom::array dims;
  std::vector<int64_t> stored_shape;
  if (field("shape").get(dims) != simdjson::SUCCESS)
    fail("{}: tensor '{}': shape: expected an array", reader.dir(), entry);
  for (dom::element d : dims) {
    if (d.get(integer) != simdjson::SUCCESS) fail("{}: tensor '{}': shape: expected integers", reader.dir(), entry);
    stored_shape.push_back(integer);
  }
  if (stored_shape != shape)
    fail("{}: tensor '{}': shape: expected [{}], found [{}]", reader.dir(), entry, fmt::join(shape, ", "),
         fmt::join(stored_shape, ", "));
  if (field("dtype").get(text_value) != simdjson::SUCCESS)
    fail("{}: tensor '{}': dtype: expected a string", reader.dir(), entry);
  if (text_value == "bfloat16")
    state.dtype = DType::BF16;
  else if (text_value == "float16")
    state.dtype = DType::F16;
  else if (text_value != "float32")
    fail("{}: tensor '{}': dtype: expected \"float32\", \"bfloat16\" or \"float16\", found \"{}\"", reader.dir(), entry,
         text_value);

  dom::element offset;
  state.nested = object["nested_offset"].get(offset) == simdjson::SUCCESS;
  if (state.nested) {
    double value = 0;
    if (offset.get(value) != simdjson::SUCCESS)
      fail("{}: tensor '{}': nested_offset: expected a number", reader.dir(), entry);
    state.nested_offset = float(value);  // written from an fp32 .item(): exact
    if (field("nested_blocksize").get(integer) != simdjson::SUCCESS || integer != kAbsmaxBlockSize)
      fail("{}: tensor '{}': nested_blocksize: expected {}, found {}", reader.dir(), entry, kAbsmaxBlockSize,
           json_describe(field("nested_blocksize")));
  }
  return state;
}

// The packed codes and fp32 absmax of a weight of n elements.
QuantState read_codes(const CheckpointReader& reader, const std::string& name, const std::vector<int64_t>& shape,
                      FourBitType expected, uint8_t* packed, float* absmax) {
  const QuantState state = read_quant_state(reader, name, shape, expected);
  const int64_t n = numel(shape);
  const int64_t blocks = (n + kFourBitBlockSize - 1) / kFourBitBlockSize;
  reader.read_u8(name, {(n + 1) / 2, 1}, packed);

  float map[16];
  reader.read_f32(name + ".quant_map", {16}, map);
  const float* values = four_bit_values(state.type);
  for (int i = 0; i < 16; ++i)
    if (std::memcmp(&map[i], &values[i], sizeof(float)) != 0)
      fail("{}: tensor '{}.quant_map': code {} is {}, expected {} (bitsandbytes' {} values)", reader.dir(), name, i,
           map[i], values[i], four_bit_type_name(state.type));

  if (!state.nested) {
    reader.read_f32(name + ".absmax", {blocks}, absmax);
    return state;
  }
  std::vector<uint8_t> codes(static_cast<size_t>(blocks));
  reader.read_u8(name + ".absmax", {blocks}, codes.data());
  std::vector<float> absmax2(size_t((blocks + kAbsmaxBlockSize - 1) / kAbsmaxBlockSize)), nested_map(256);
  reader.read_f32(name + ".nested_absmax", {int64_t(absmax2.size())}, absmax2.data());
  reader.read_f32(name + ".nested_quant_map", {256}, nested_map.data());
  dequantize_absmax(codes.data(), absmax2.data(), state.nested_offset, blocks, absmax, nested_map.data());
  return state;
}

}  // namespace

bool is_bnb_4bit(const CheckpointReader& reader, const std::string& name) {
  return reader.has_bytes(quant_state_name(name, FourBitType::Nf4)) ||
         reader.has_bytes(quant_state_name(name, FourBitType::Fp4));
}

std::vector<std::string> bnb_4bit_parts(const CheckpointReader& reader, const std::string& name) {
  std::vector<std::string> parts;
  for (const char* part : {".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map"})
    if (reader.has(name + part)) parts.push_back(name + part);
  for (FourBitType type : {FourBitType::Nf4, FourBitType::Fp4})
    if (reader.has_bytes(quant_state_name(name, type))) parts.push_back(quant_state_name(name, type));
  return parts;
}

void read_bnb_4bit(const CheckpointReader& reader, const std::string& name, const std::vector<int64_t>& shape,
                   FourBitType expected, uint8_t* packed, float* absmax) {
  const int64_t n = numel(shape);
  require(n % kFourBitBlockSize == 0, "{}: tensor '{}': {} elements, not whole {}-element blocks", reader.dir(), name,
          n, kFourBitBlockSize);
  read_codes(reader, name, shape, expected, packed, absmax);
}

void read_bnb_4bit_dequantized(const CheckpointReader& reader, const std::string& name,
                               const std::vector<int64_t>& shape, FourBitType expected, float* out) {
  const int64_t n = numel(shape);
  std::vector<uint8_t> packed(size_t((n + 1) / 2));
  std::vector<float> absmax(size_t((n + kFourBitBlockSize - 1) / kFourBitBlockSize));
  const QuantState state = read_codes(reader, name, shape, expected, packed.data(), absmax.data());
  four_bit_dequantize(state.type, packed.data(), absmax.data(), n, out);
  if (state.dtype == DType::BF16)
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(float_to_bf16(out[i]));
  else if (state.dtype == DType::F16)
    for (int64_t i = 0; i < n; ++i) out[i] = f16_to_float(float_to_f16(out[i]));
}

}  // namespace keel::formats
