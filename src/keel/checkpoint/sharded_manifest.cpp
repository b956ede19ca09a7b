#include "keel/checkpoint/sharded_manifest.h"

#include <fmt/format.h>
#include <simdjson.h>

#include <algorithm>
#include <limits>
#include <map>

#include "keel/core/checksum.h"
#include "keel/core/error.h"
#include "keel/core/json_text.h"

namespace keel::checkpoint {
namespace {

constexpr int64_t kMaxElements = int64_t(1) << 56;  // far above any tensor, far below overflow at 4 bytes each

std::string piece_json(const Piece& p) {
  return fmt::format(R"({{"tensor": {}, "kind": "{}", "begin": {}, "end": {}, "shard": {}, "offset": {}, "xxh3": "{}"}})",
                     json_quoted(p.tensor), piece_kind_name(p.kind), p.begin, p.end, p.shard, p.offset,
                     checksum_hex(p.xxh3));
}

uint64_t parse_hex(std::string_view hex, const std::string& path, const std::string& what) {
  const auto v = checksum_from_hex(hex);
  require(v.has_value(), "{}: {}: xxh3 must be 16 lowercase hex digits, found '{}'", path, what, hex);
  return *v;
}

Piece parse_piece(simdjson::dom::element e, const std::string& path, size_t index) {
  Piece p;
  std::string_view tensor, kind, hex;
  int64_t shard = -1;
  require(e["tensor"].get_string().get(tensor) == simdjson::SUCCESS &&
              e["kind"].get_string().get(kind) == simdjson::SUCCESS &&
              e["begin"].get_int64().get(p.begin) == simdjson::SUCCESS &&
              e["end"].get_int64().get(p.end) == simdjson::SUCCESS &&
              e["shard"].get_int64().get(shard) == simdjson::SUCCESS &&
              e["offset"].get_int64().get(p.offset) == simdjson::SUCCESS &&
              e["xxh3"].get_string().get(hex) == simdjson::SUCCESS,
          "{}: piece {} needs tensor, kind, begin, end, shard, offset and xxh3", path, index);
  p.tensor = tensor;
  const std::string what = fmt::format("piece {} ({})", index, p.tensor);
  if (kind == "weights") p.kind = PieceKind::Weights;
  else if (kind == "m") p.kind = PieceKind::M;
  else if (kind == "v") p.kind = PieceKind::V;
  else fail("{}: {}: kind is '{}', expected weights, m or v", path, what, kind);
  require(p.begin >= 0 && p.begin < p.end && p.end <= kMaxElements, "{}: {}: element range [{}, {}) is empty or invalid",
          path, what, p.begin, p.end);
  require(shard >= 0 && shard <= std::numeric_limits<int>::max() && p.offset >= 0 && p.offset <= kMaxElements,
          "{}: {}: negative or invalid shard {} or offset {}", path, what, shard, p.offset);
  p.shard = int(shard);
  p.xxh3 = parse_hex(hex, path, what);
  return p;
}

simdjson::dom::element parse_object(simdjson::dom::parser& parser, const simdjson::padded_string& text,
                                    const std::string& path, std::string_view format) {
  simdjson::dom::element doc;
  require(parser.parse(text).get(doc) == simdjson::SUCCESS, "{}: invalid JSON", path);
  std::string_view f;
  require(doc["format"].get_string().get(f) == simdjson::SUCCESS && f == format, "{}: 'format' is not \"{}\"", path,
          format);
  return doc;
}

}  // namespace

std::string_view piece_kind_name(PieceKind kind) {
  switch (kind) {
    case PieceKind::Weights: return "weights";
    case PieceKind::M: return "m";
    case PieceKind::V: return "v";
  }
  return "?";
}

std::string piece_tensor_name(PieceKind kind, const std::string& tensor) {
  return kind == PieceKind::Weights ? tensor : fmt::format("{}.{}", piece_kind_name(kind), tensor);
}

std::string Piece::describe(const std::string& file) const {
  return fmt::format("piece {}[{}:{}] in {} at byte {}", piece_tensor_name(kind, tensor), begin, end, file, offset);
}

int64_t TensorShape::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shard_file_name(int rank, int ranks) { return fmt::format("shard-{:05d}-of-{:05d}.bin", rank, ranks); }

bool is_sharded_manifest(std::string_view text) {
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  simdjson::padded_string padded(text);
  std::string_view layout;
  return parser.parse(padded).get(doc) == simdjson::SUCCESS &&
         doc["layout"].get_string().get(layout) == simdjson::SUCCESS && layout == "sharded";
}

std::string sharded_manifest_json(const ShardedManifest& m) {
  std::string out = fmt::format(
      "{{\n  \"format\": \"keel-checkpoint\",\n  \"version\": 2,\n  \"layout\": \"sharded\",\n  \"step\": {},\n"
      "  \"world_size\": {},\n  \"zero_stage\": {},\n  \"files\": {{\n",
      m.step, m.world_size, m.zero_stage);
  for (size_t i = 0; i < m.files.size(); ++i)
    out += fmt::format("    {}: {{\"size\": {}, \"xxh3\": \"{}\"}}{}\n", json_quoted(m.files[i].name), m.files[i].size,
                       checksum_hex(m.files[i].xxh3), i + 1 < m.files.size() ? "," : "");
  out += "  },\n  \"tensors\": [\n";
  for (size_t i = 0; i < m.tensors.size(); ++i)
    out += fmt::format("    {{\"name\": {}, \"shape\": [{}]}}{}\n", json_quoted(m.tensors[i].name),
                       fmt::join(m.tensors[i].shape, ", "), i + 1 < m.tensors.size() ? "," : "");
  out += "  ],\n  \"shards\": [\n";
  for (size_t i = 0; i < m.shards.size(); ++i)
    out += fmt::format("    {{\"file\": {}, \"size\": {}}}{}\n", json_quoted(m.shards[i].name), m.shards[i].size,
                       i + 1 < m.shards.size() ? "," : "");
  out += "  ],\n  \"pieces\": [\n";
  for (size_t i = 0; i < m.pieces.size(); ++i)
    out += "    " + piece_json(m.pieces[i]) + (i + 1 < m.pieces.size() ? ",\n" : "\n");
  out += "  ]\n}\n";
  return out;
}

ShardedManifest parse_sharded_manifest(std::string_view text, const std::string& path) {
  simdjson::dom::parser parser;
  simdjson::padded_string padded(text);
  simdjson::dom::element doc = parse_object(parser, padded, path, "keel-checkpoint");
  ShardedManifest m;
  int64_t version = 0, world = 0, stage = -1;
  std::string_view layout;
  require(doc["version"].get_int64().get(version) == simdjson::SUCCESS && version == 2 &&
              doc["layout"].get_string().get(layout) == simdjson::SUCCESS && layout == "sharded",
          "{}: expected version 2 with \"layout\": \"sharded\"", path);
  require(doc["step"].get_int64().get(m.step) == simdjson::SUCCESS && m.step >= 0 &&
              doc["world_size"].get_int64().get(world) == simdjson::SUCCESS && world >= 1 && world <= 1 << 20 &&
              doc["zero_stage"].get_int64().get(stage) == simdjson::SUCCESS && stage >= 0 && stage <= 3,
          "{}: needs step >= 0, world_size >= 1 and zero_stage 0..3", path);
  m.world_size = int(world);
  m.zero_stage = int(stage);

  simdjson::dom::object files;
  require(doc["files"].get_object().get(files) == simdjson::SUCCESS, "{}: missing 'files'", path);
  for (auto [key, value] : files) {
    FileChecksum f;
    f.name = key;
    std::string_view hex;
    require(value["size"].get_int64().get(f.size) == simdjson::SUCCESS && f.size >= 0 &&
                value["xxh3"].get_string().get(hex) == simdjson::SUCCESS,
            "{}: file '{}' needs 'size' and 'xxh3'", path, f.name);
    require(f.name.find('/') == std::string::npos && !f.name.empty() && f.name[0] != '.',
            "{}: file name '{}' is not a plain name in the checkpoint directory", path, f.name);
    f.xxh3 = parse_hex(hex, path, "file " + f.name);
    m.files.push_back(std::move(f));
  }

  simdjson::dom::array tensors, shards, pieces;
  require(doc["tensors"].get_array().get(tensors) == simdjson::SUCCESS &&
              doc["shards"].get_array().get(shards) == simdjson::SUCCESS &&
              doc["pieces"].get_array().get(pieces) == simdjson::SUCCESS,
          "{}: needs the arrays 'tensors', 'shards' and 'pieces'", path);
  std::map<std::string, int64_t> numel;
  for (simdjson::dom::element t : tensors) {
    TensorShape ts;
    std::string_view name;
    simdjson::dom::array dims;
    require(t["name"].get_string().get(name) == simdjson::SUCCESS && t["shape"].get_array().get(dims) == simdjson::SUCCESS,
            "{}: tensor {} needs 'name' and 'shape'", path, m.tensors.size());
    ts.name = name;
    int64_t n = 1;
    for (simdjson::dom::element d : dims) {
      int64_t v = -1;
      require(d.get_int64().get(v) == simdjson::SUCCESS && v >= 1 && v <= kMaxElements && n <= kMaxElements / v,
              "{}: tensor '{}' has an invalid shape", path, ts.name);
      ts.shape.push_back(v);
      n *= v;
    }
    require(numel.emplace(ts.name, n).second, "{}: tensor '{}' is listed twice", path, ts.name);
    m.tensors.push_back(std::move(ts));
  }
  for (simdjson::dom::element s : shards) {
    ShardFile f;
    std::string_view name;
    require(s["file"].get_string().get(name) == simdjson::SUCCESS && s["size"].get_int64().get(f.size) == simdjson::SUCCESS &&
                f.size >= 0,
            "{}: shard {} needs 'file' and 'size'", path, m.shards.size());
    f.name = name;
    require(f.name.find('/') == std::string::npos && !f.name.empty() && f.name[0] != '.',
            "{}: shard file name '{}' is not a plain name in the checkpoint directory", path, f.name);
    m.shards.push_back(std::move(f));
  }
  for (simdjson::dom::element e : pieces) {
    Piece p = parse_piece(e, path, m.pieces.size());
    auto it = numel.find(p.tensor);
    require(it != numel.end(), "{}: piece {} names tensor '{}', which 'tensors' does not list", path, m.pieces.size(),
            p.tensor);
    require(p.end <= it->second, "{}: piece {} of '{}' ends at element {}, past the tensor's {}", path, m.pieces.size(),
            p.tensor, p.end, it->second);
    require(size_t(p.shard) < m.shards.size(), "{}: piece {} names shard {}, but there are {}", path, m.pieces.size(),
            p.shard, m.shards.size());
    require(p.offset + p.bytes() <= m.shards[size_t(p.shard)].size, "{}: {} runs past the file's {} bytes", path,
            p.describe(m.shards[size_t(p.shard)].name), m.shards[size_t(p.shard)].size);
    m.pieces.push_back(std::move(p));
  }
  // No two pieces share bytes of a file (a manifest that did could pass every checksum and still
  // load one tensor's values into another).
  std::vector<size_t> order(m.pieces.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const Piece &x = m.pieces[a], &y = m.pieces[b];
    return x.shard != y.shard ? x.shard < y.shard : x.offset < y.offset;
  });
  for (size_t i = 1; i < order.size(); ++i) {
    const Piece &prev = m.pieces[order[i - 1]], &cur = m.pieces[order[i]];
    require(prev.shard != cur.shard || prev.offset + prev.bytes() <= cur.offset, "{}: {} overlaps {}", path,
            cur.describe(m.shards[size_t(cur.shard)].name), prev.describe(m.shards[size_t(prev.shard)].name));
  }
  return m;
}

std::string shard_report_json(const ShardFile& file, const std::vector<Piece>& pieces) {
  std::string out = fmt::format("{{\n  \"format\": \"keel-checkpoint-shard\",\n  \"file\": {},\n  \"size\": {},\n  \"pieces\": [\n",
                                json_quoted(file.name), file.size);
  for (size_t i = 0; i < pieces.size(); ++i) out += "    " + piece_json(pieces[i]) + (i + 1 < pieces.size() ? ",\n" : "\n");
  return out + "  ]\n}\n";
}

void parse_shard_report(std::string_view text, const std::string& path, ShardFile* file, std::vector<Piece>* pieces) {
  simdjson::dom::parser parser;
  simdjson::padded_string padded(text);
  simdjson::dom::element doc = parse_object(parser, padded, path, "keel-checkpoint-shard");
  std::string_view name;
  simdjson::dom::array list;
  require(doc["file"].get_string().get(name) == simdjson::SUCCESS &&
              doc["size"].get_int64().get(file->size) == simdjson::SUCCESS && file->size >= 0 &&
              doc["pieces"].get_array().get(list) == simdjson::SUCCESS,
          "{}: needs 'file', 'size' and 'pieces'", path);
  file->name = name;
  pieces->clear();
  for (simdjson::dom::element e : list) pieces->push_back(parse_piece(e, path, pieces->size()));
}

}  // namespace keel::checkpoint
