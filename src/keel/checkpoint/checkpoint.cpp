#include "keel/checkpoint/checkpoint.h"
#include "keel/checkpoint/checkpoint_files.h"
#include "keel/checkpoint/sharded_reader.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <simdjson.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <system_error>
#include <utility>

#include "keel/core/checksum.h"
#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/formats/safetensors.h"

namespace keel::checkpoint {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kFiles[] = {"weights.safetensors", "optimizer.safetensors", "trainer_state.json", "recipe.toml"};

std::vector<formats::TensorToWrite> tensors_of(const std::vector<model::Param>& layout, const float* base,
                                             const std::string& prefix) {
  std::vector<formats::TensorToWrite> out;
  for (const auto& p : layout) out.push_back({prefix + p.name, p.shape, base + p.offset});
  return out;
}

// Moments held whole in memory, as a MomentSource.
CheckpointWriter::MomentSource moments_in(const float* m, const float* v) {
  return [m, v](int which, int64_t begin, int64_t max_count, int64_t* n) {
    *n = max_count;
    return (which == 0 ? m : v) + begin;
  };
}

// The moments "m.<name>" (which = 0) or "v.<name>" (which = 1), or the weights "<name>" (which =
// 2, ZeRO-3), read from `source`.
std::vector<formats::TensorToWrite> moment_tensors(const std::vector<model::Param>& layout,
                                                 const CheckpointWriter::MomentSource& source, int which) {
  static constexpr const char* kPrefix[] = {"m.", "v.", ""};  // which: 0 = m, 1 = v, 2 = the weights
  std::vector<formats::TensorToWrite> out;
  for (const auto& p : layout)
    out.push_back({std::string(kPrefix[which]) + p.name, p.shape,
                   formats::TensorToWrite::Reader(
                       [&source, which, offset = p.offset](int64_t begin, int64_t max_count, int64_t* n) {
                         return source(which, offset + begin, max_count, n);
                       })});
  return out;
}


std::string manifest_json(const std::string& dir, int64_t step) {
  std::string files;
  for (const char* name : kFiles) {
    const std::string path = dir + "/" + name;
    files += fmt::format("{}    \"{}\": {{\"size\": {}, \"xxh3\": \"{}\"}}", files.empty() ? "" : ",\n", name,
                         fs::file_size(path), checksum_hex(file_checksum(path)));
  }
  return fmt::format(
      "{{\n  \"format\": \"keel-checkpoint\",\n  \"version\": 1,\n  \"step\": {},\n  \"files\": {{\n{}\n  }}\n}}\n",
      step, files);
}

// Checkpoint directories in `dir`, oldest first.
std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || name.rfind("step-", 0) != 0) continue;
    char* end = nullptr;
    const long long step = std::strtoll(name.c_str() + 5, &end, 10);
    if (end && *end == '\0') out.push_back({step, name});
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The manifest goes first: a deletion cut short (a kill, a full disk) leaves a directory without
// one, which no reader takes for a complete checkpoint and the next start cleans up.
void remove_checkpoint_dir(const std::string& path) {
  std::error_code ec;
  fs::remove(path + "/manifest.json", ec);
  fs::remove_all(path);
}

// Whether an error message reports a full disk (the errno text every writer of keel puts in it).
bool out_of_space(const std::string& message) {
  return message.find(std::system_category().message(ENOSPC)) != std::string::npos;
}

void remove_old_checkpoints(const std::string& dir, int64_t keep_last_n, const std::string& newest) {
  auto all = complete_checkpoints(dir);
  const int64_t excess = int64_t(all.size()) - keep_last_n;
  for (int64_t i = 0; i < excess; ++i)
    if (all[i].second != newest) remove_checkpoint_dir(dir + "/" + all[i].second);
}

}  // namespace

std::string step_name(int64_t step) { return fmt::format("step-{:08d}", step); }

void sync_directory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  require(fd >= 0, "{}: cannot open directory to sync ({})", dir, std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  require(rc == 0, "{}: fsync failed ({})", dir, std::strerror(errno));
}

std::string state_json(const TrainingState& s) {
  return fmt::format(
      "{{\n  \"format\": \"keel-training-state\",\n  \"version\": 1,\n  \"step\": {},\n  \"samples_consumed\": {},\n"
      "  \"seed\": {},\n  \"recipe_hash\": \"{}\",\n  \"model_fingerprint\": \"{}\",\n  \"data_fingerprint\": \"{}\",\n"
      "  \"compat_fingerprint\": \"{}\"{}\n}}\n",
      s.step, s.samples_consumed, s.seed, s.recipe_hash, s.model_fingerprint, s.data_fingerprint, s.compat_fingerprint,
      s.bf16_products.empty() ? "" : fmt::format(",\n  \"bf16_products\": \"{}\"", s.bf16_products));
}

// The step directory complete in `tmp` becomes `final_name` (one rename), then `latest` names it
// (another), then the oldest beyond keep_last_n go.
void publish_checkpoint(const std::string& dir, const std::string& tmp, const std::string& final_name,
                        int64_t keep_last_n) {
  sync_directory(tmp);
  const std::string final_path = dir + "/" + final_name;
  fs::remove_all(final_path);  // a stale one from an earlier run that went further
  fs::rename(tmp, final_path);
  sync_directory(dir);
  write_file_atomic(dir + "/latest", final_name + "\n");
  remove_old_checkpoints(dir, keep_last_n, final_name);
}

namespace {

// The snapshot is the only part of an asynchronous save that blocks training: use every core.
void parallel_copy(float* dst, const float* src, int64_t n) {
  constexpr int64_t kChunk = 1 << 20;
#pragma omp parallel for schedule(static)
  for (int64_t begin = 0; begin < n; begin += kChunk)
    std::memcpy(dst + begin, src + begin, sizeof(float) * std::min(kChunk, n - begin));
}

}  // namespace

std::string fingerprint_of(std::string_view text) { return checksum_hex(checksum(text)); }

std::string model_fingerprint(const model::ParamStore& params, const std::string& architecture) {
  std::string layout = architecture;
  for (const auto& p : params.params()) layout += fmt::format("|{}:{}", p.name, fmt::join(p.shape, "x"));
  return fingerprint_of(layout);
}

CheckpointWriter::CheckpointWriter(std::string dir, int64_t keep_last_n, bool async)
    : dir_(std::move(dir)), keep_last_n_(keep_last_n), async_(async) {
  make_dirs(dir_);
  if (async_) worker_ = std::make_unique<WorkerThread>();
}

CheckpointWriter::~CheckpointWriter() = default;  // worker_ first: the save in flight finishes

void CheckpointWriter::write(const std::vector<model::Param>& layout, const float* weights, const float* m,
                             const float* v, const TrainingState& state, const std::string& recipe) {
  write(layout, weights, moments_in(m, v), state, recipe, /*replayable=*/true);
}

// The retention rule on a full disk: everything but the checkpoint `latest` names goes (the one a
// resume would use), then the save is tried once more. Without it, a disk that holds two
// checkpoints fails every save after the second, since old ones are pruned only after a success.
void CheckpointWriter::write(const std::vector<model::Param>& layout, const float* weights, const MomentSource& moments,
                             const TrainingState& state, const std::string& recipe, bool replayable) {
  {
    std::lock_guard<std::mutex> lock(record_mutex_);
    ++record_.attempted;
  }
  auto failed = [&] {
    std::lock_guard<std::mutex> lock(record_mutex_);
    ++record_.failed;
    ++record_.failed_in_a_row;
  };
  try {
    try {
      write_once(layout, weights, moments, state, recipe);
    } catch (const Error& e) {
      if (!out_of_space(e.what())) throw;
      std::string note;
      if (!make_room(dir_, &note)) throw;
      {
        std::lock_guard<std::mutex> lock(record_mutex_);
        notes_.push_back(note + (replayable ? "; saving again" : "; the next save has room"));
      }
      if (!replayable) throw;
      write_once(layout, weights, moments, state, recipe);
    }
  } catch (...) {
    failed();
    throw;
  }
  std::lock_guard<std::mutex> lock(record_mutex_);
  record_.failed_in_a_row = 0;
  record_.last_saved_step = state.step;
}

bool is_out_of_space(const std::string& message) { return out_of_space(message); }

bool make_room(const std::string& dir, std::string* note) {
  // The one `latest` names: a writer put it there after a complete, fsynced save (checking every
  // checksum of a 9B model's checkpoint here would read ~100 GB).
  std::string keep;
  try {
    keep = latest_checkpoint(dir);
  } catch (const Error&) {}
  int removed = 0;
  for (const auto& [step, name] : complete_checkpoints(dir))
    if (dir + "/" + name != keep) {
      remove_checkpoint_dir(dir + "/" + name);
      ++removed;
    }
  if (removed == 0) return false;
  *note = fmt::format("checkpoint {}: the disk is full; removed {} older checkpoint(s), keeping {}", dir, removed,
                      keep.empty() ? std::string("none intact") : keep);
  return true;
}

std::vector<std::string> CheckpointWriter::take_notes() {
  std::lock_guard<std::mutex> lock(record_mutex_);
  return std::exchange(notes_, {});
}

SaveRecord CheckpointWriter::record() const {
  std::lock_guard<std::mutex> lock(record_mutex_);
  return record_;
}

void CheckpointWriter::write_once(const std::vector<model::Param>& layout, const float* weights,
                                  const MomentSource& moments, const TrainingState& state, const std::string& recipe) {
  const std::string final_name = step_name(state.step);
  const std::string tmp = fmt::format("{}/.tmp-{}-{}", dir_, final_name, ::getpid());
  try {
    fs::remove_all(tmp);
    make_dirs(tmp);
    formats::write_safetensors(tmp + "/weights.safetensors",
                             weights ? tensors_of(layout, weights, "") : moment_tensors(layout, moments, 2),
                             DType::F32);
    auto tensors = moment_tensors(layout, moments, 0);
    auto second = moment_tensors(layout, moments, 1);
    tensors.insert(tensors.end(), second.begin(), second.end());
    formats::write_safetensors(tmp + "/optimizer.safetensors", tensors, DType::F32);
    write_file_atomic(tmp + "/trainer_state.json", state_json(state));
    write_file_atomic(tmp + "/recipe.toml", recipe);
    write_file_atomic(tmp + "/manifest.json", manifest_json(tmp, state.step));
    publish_checkpoint(dir_, tmp, final_name, keep_last_n_);
  } catch (const fs::filesystem_error& e) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    fail("checkpoint {}: {}", dir_ + "/" + final_name, e.what());
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    throw;
  }
}

SaveStats CheckpointWriter::save(model::ParamStore& params, const TrainingState& state, const std::string& recipe) {
  if (async_)
    return save_snapshot(params.params(), params.total(), state, recipe, [&](float* weights, float* m, float* v) {
      const int64_t n = params.total();
      parallel_copy(weights, params.weights(), n);
      parallel_copy(m, params.adam_m(), n);
      parallel_copy(v, params.adam_v(), n);
    });
  return save_streamed(params.params(), params.weights(), moments_in(params.adam_m(), params.adam_v()), state, recipe);
}

SaveStats CheckpointWriter::save_streamed(const std::vector<model::Param>& layout, const float* weights,
                                          const MomentSource& moments, const TrainingState& state,
                                          const std::string& recipe) {
  require(!async_, "checkpoint {}: a streamed save is synchronous", dir_);
  const auto t0 = Clock::now();
  write(layout, weights, moments, state, recipe, /*replayable=*/false);
  return {std::chrono::duration<double>(Clock::now() - t0).count(), false};
}

SaveStats CheckpointWriter::save_snapshot(const std::vector<model::Param>& layout, int64_t n,
                                          const TrainingState& state, const std::string& recipe,
                                          const std::function<void(float*, float*, float*)>& fill) {
  const auto t0 = Clock::now();
  SaveStats stats;
  stats.async = async_;
  if (worker_) worker_->wait();  // at most one save in flight: the staging buffer is free after it
  if (staging_.size() != size_t(3 * n)) staging_.assign(size_t(3 * n), 0.0f);  // unless prepare() did it
  fill(staging_.data(), staging_.data() + n, staging_.data() + 2 * n);
  if (!async_) {
    write(layout, staging_.data(), staging_.data() + n, staging_.data() + 2 * n, state, recipe);
    stats.blocked_s = std::chrono::duration<double>(Clock::now() - t0).count();
    return stats;
  }
  staged_layout_ = layout;
  staged_state_ = state;
  staged_recipe_ = recipe;
  worker_->run([this] { write_staged(); });
  stats.blocked_s = std::chrono::duration<double>(Clock::now() - t0).count();
  return stats;
}

void CheckpointWriter::prepare(const model::ParamStore& params, bool snapshot) {
  if (!async_ && !snapshot) return;
  if (worker_) worker_->wait();
  staging_.assign(size_t(3 * params.total()), 0.0f);
}

// The background save of what save_snapshot staged; its error is kept for take_failure().
void CheckpointWriter::write_staged() {
  try {
    const int64_t n = int64_t(staging_.size() / 3);
    write(staged_layout_, staging_.data(), staging_.data() + n, staging_.data() + 2 * n, staged_state_,
          staged_recipe_);
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = e.what();
  }
}

std::string CheckpointWriter::wait() {
  if (worker_) worker_->wait();
  return take_failure();
}

std::string CheckpointWriter::take_failure() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string f = failure_;
  failure_.clear();
  return f;
}

int clean_incomplete_checkpoints(const std::string& dir) {
  int removed = 0;
  if (!fs::is_directory(dir)) return 0;
  std::vector<fs::path> stale;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const bool save_cut_short = name.rfind(".tmp-", 0) == 0;
    const bool pointer_cut_short = name.rfind(".latest.tmp.", 0) == 0;
    const bool deletion_cut_short =
        entry.is_directory() && name.rfind("step-", 0) == 0 && !path_exists(entry.path().string() + "/manifest.json");
    if (save_cut_short || pointer_cut_short || deletion_cut_short) stale.push_back(entry.path());
  }
  for (const auto& path : stale) {
    std::error_code ignored;
    fs::remove_all(path, ignored);
    ++removed;
  }
  return removed;
}

std::string newest_intact_checkpoint(const std::string& dir) {
  auto all = complete_checkpoints(dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    try {
      verify_checkpoint(dir + "/" + it->second);
      return dir + "/" + it->second;
    } catch (const Error&) {}
  }
  return "";
}

int remove_checkpoints(const std::string& dir) {
  std::error_code ec;
  fs::remove(fs::path(dir) / "latest", ec);
  int removed = 0;
  for (const auto& [step, name] : complete_checkpoints(dir)) {
    remove_checkpoint_dir(dir + "/" + name);
    ++removed;
  }
  return removed;
}

std::string latest_checkpoint(const std::string& dir) {
  const std::string pointer = dir + "/latest";
  if (!path_exists(pointer)) return "";
  std::string name = read_file(pointer);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
  require(name.rfind("step-", 0) == 0 && name.find('/') == std::string::npos,
          "{}: expected the name of a checkpoint directory (step-N), found '{}'", pointer, name);
  // The error_code form: a name the filesystem refuses (too long, a NUL byte) is "does not exist", not
  // an exception that escapes as an internal error.
  std::error_code ec;
  require(fs::is_directory(dir + "/" + name, ec), "{}: points to {} which does not exist", pointer, name);
  return dir + "/" + name;
}

std::string checkpoint_step_dir(const std::string& path) {
  std::error_code ec;
  require(fs::exists(path, ec), "{}: checkpoint directory does not exist", path);
  require(fs::is_directory(path, ec), "{}: expected a checkpoint directory, found a file", path);
  if (path_exists(path + "/manifest.json")) return path;
  if (path_exists(path + "/latest")) return latest_checkpoint(path);
  fail(
      "{}: not a keel checkpoint: expected manifest.json (a complete step-N checkpoint) or a 'latest' pointer "
      "(a checkpoint_dir)",
      path);
}

bool is_sharded_checkpoint(const std::string& path) {
  const std::string manifest_path = path + "/manifest.json";
  require(path_exists(manifest_path), "{}: not a complete keel checkpoint (manifest.json is missing)", path);
  return is_sharded_manifest(read_file(manifest_path));
}

void verify_checkpoint(const std::string& path) {
  require(fs::is_directory(path), "{}: checkpoint directory does not exist", path);
  if (is_sharded_checkpoint(path)) {
    ShardedCheckpoint(path).verify_all();
    return;
  }
  const std::string manifest_path = path + "/manifest.json";
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  simdjson::padded_string text(read_file(manifest_path));
  require(parser.parse(text).get(doc) == simdjson::SUCCESS, "{}: invalid JSON", manifest_path);
  simdjson::dom::object files;
  require(doc["files"].get_object().get(files) == simdjson::SUCCESS, "{}: missing 'files'", manifest_path);
  for (const char* name : kFiles) {
    const std::string file = path + "/" + name;
    simdjson::dom::element entry;
    require(files[name].get(entry) == simdjson::SUCCESS, "{}: file '{}' is not listed", manifest_path, name);
    require(path_exists(file), "{}: file '{}' is missing", path, name);
    int64_t size = -1;
    std::string_view expected;
    require(entry["size"].get_int64().get(size) == simdjson::SUCCESS &&
                entry["xxh3"].get_string().get(expected) == simdjson::SUCCESS,
            "{}: entry '{}' needs 'size' and 'xxh3'", manifest_path, name);
    require(int64_t(fs::file_size(file)) == size, "{}: size {} differs from the manifest's {} (truncated?)", file,
            fs::file_size(file), size);
    const std::string actual = checksum_hex(file_checksum(file));
    require(actual == expected, "{}: checksum {} differs from the manifest's {} (the file is corrupt)", file, actual,
            expected);
  }
}

TrainingState read_checkpoint_state(const std::string& path) {
  const std::string state_path = path + "/trainer_state.json";
  simdjson::dom::parser parser;
  simdjson::dom::element doc;
  simdjson::padded_string text(read_file(state_path));
  require(parser.parse(text).get(doc) == simdjson::SUCCESS, "{}: invalid JSON", state_path);
  TrainingState s;
  uint64_t seed = 0;
  std::string_view recipe_hash, model_fp, data_fp, compat_fp;
  require(doc["step"].get_int64().get(s.step) == simdjson::SUCCESS &&
              doc["samples_consumed"].get_int64().get(s.samples_consumed) == simdjson::SUCCESS &&
              doc["seed"].get_uint64().get(seed) == simdjson::SUCCESS &&
              doc["recipe_hash"].get_string().get(recipe_hash) == simdjson::SUCCESS &&
              doc["model_fingerprint"].get_string().get(model_fp) == simdjson::SUCCESS &&
              doc["data_fingerprint"].get_string().get(data_fp) == simdjson::SUCCESS &&
              doc["compat_fingerprint"].get_string().get(compat_fp) == simdjson::SUCCESS,
          "{}: missing or mistyped fields (step, samples_consumed, seed, fingerprints)", state_path);
  require(s.step >= 0 && s.samples_consumed >= 0, "{}: negative step or position", state_path);
  s.seed = seed;
  s.recipe_hash = recipe_hash;
  s.model_fingerprint = model_fp;
  s.data_fingerprint = data_fp;
  s.compat_fingerprint = compat_fp;
  std::string_view products;  // optional: absent in fp32 and in older checkpoints
  if (doc["bf16_products"].get_string().get(products) == simdjson::SUCCESS) {
    require(products == "native" || products == "widened", "{}: bf16_products is '{}', expected native or widened",
            state_path, products);
    s.bf16_products = products;
  }
  return s;
}

namespace {

// Reads the part of each tensor that lies in `window` of the flat buffer into base (which holds
// that window: ZeRO-1 ranks keep the moments of their shard only).
void read_tensors(const std::string& file, const std::vector<model::Param>& layout, float* base,
                  const std::string& prefix, FlatRange window) {
  auto st = formats::SafetensorsFile::open(file);
  for (const auto& p : layout) {
    const std::string name = prefix + p.name;
    const formats::TensorInfo* t = st->find(name);
    require(t != nullptr, "{}: tensor '{}' is missing", file, name);
    require(t->dtype == DType::F32 && t->shape == p.shape, "{}: tensor '{}' has dtype {} shape [{}], expected F32 [{}]",
            file, name, dtype_name(t->dtype), fmt::join(t->shape, ", "), fmt::join(p.shape, ", "));
    const FlatRange part = FlatRange{p.offset, p.offset + p.numel}.intersect(window);
    if (part.size() > 0)
      std::memcpy(base + (part.begin - window.begin), t->data + sizeof(float) * size_t(part.begin - p.offset),
                  sizeof(float) * size_t(part.size()));
  }
}

}  // namespace

// The weights this process holds: all of them, or its ZeRO-3 shard.
void read_checkpoint_weights(const std::string& path, model::ParamStore& params) {
  if (is_sharded_checkpoint(path)) {
    ShardedCheckpoint(path).read(params.params(), PieceKind::Weights, params.masters(), params.master_range());
    params.refresh_bf16_copy();
    return;
  }
  read_tensors(path + "/weights.safetensors", params.params(), params.masters(), "", params.master_range());
  params.refresh_bf16_copy();
}

TrainingState load_checkpoint(const std::string& path, model::ParamStore& params) {
  require(fs::is_directory(path), "{}: checkpoint directory does not exist", path);
  if (is_sharded_checkpoint(path)) {
    // Each piece read is verified as it is read; the pieces of other ranks' parts are not read.
    ShardedCheckpoint checkpoint(path);
    TrainingState state = read_checkpoint_state(path);
    require(state.step == checkpoint.manifest().step, "{}: trainer_state.json is of step {}, the manifest of step {}",
            path, state.step, checkpoint.manifest().step);
    checkpoint.read(params.params(), PieceKind::Weights, params.masters(), params.master_range());
    checkpoint.read(params.params(), PieceKind::M, params.adam_m(), params.optimizer_range());
    checkpoint.read(params.params(), PieceKind::V, params.adam_v(), params.optimizer_range());
    params.refresh_bf16_copy();
    return state;
  }
  verify_checkpoint(path);
  TrainingState state = read_checkpoint_state(path);
  read_tensors(path + "/weights.safetensors", params.params(), params.masters(), "", params.master_range());
  read_tensors(path + "/optimizer.safetensors", params.params(), params.adam_m(), "m.", params.optimizer_range());
  read_tensors(path + "/optimizer.safetensors", params.params(), params.adam_v(), "v.", params.optimizer_range());
  params.refresh_bf16_copy();
  return state;
}

}  // namespace keel::checkpoint
