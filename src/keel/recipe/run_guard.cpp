#include "keel/recipe/run_guard.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>

#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::recipe {
namespace fs = std::filesystem;

namespace {

// The absolute, link-free form of a path that may not exist yet (weakly_canonical resolves the
// part that exists and normalizes the rest).
fs::path resolved(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(path, ec), ec);
  if (ec) p = fs::absolute(path).lexically_normal();
  return p;
}

// Whether `inner` is `outer` or lies below it (component-wise, so /a/bc is not inside /a/b).
bool is_within(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin(), o = outer.begin();
  for (; o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

bool is_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

std::string host_name() {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) return "unknown host";
  return host;
}

}  // namespace

void refuse_outputs_over_inputs(const std::vector<NamedPath>& outputs, const std::vector<NamedPath>& inputs) {
  for (const auto& out : outputs) {
    if (out.path.empty()) continue;
    const fs::path o = resolved(out.path);
    for (const auto& in : inputs) {
      if (in.path.empty()) continue;
      const fs::path i = resolved(in.path);
      // A directory is protected whole; a single file (a tokenizer.json given by itself) only from
      // being the output or lying inside one: its siblings are not the run's input.
      const char* relation = o == i                                 ? "is"
                             : !is_file(in.path) && is_within(o, i) ? "lies inside"
                             : is_within(i, o)                      ? "contains"
                                                                    : nullptr;
      if (!relation) continue;
      fail(
          "{} '{}' {} the input {} '{}': keel would overwrite its own input. Write the run somewhere else "
          "(e.g. a new output_dir next to it)",
          out.role, out.path, relation, in.role, in.path);
    }
  }
}

std::vector<NamedPath> recipe_inputs(const Recipe& r) {
  std::vector<NamedPath> in;
  if (!r.model_config && !r.model_name.empty()) in.push_back({"model_name", r.model_name});
  if (!r.tokenizer.empty()) in.push_back({"tokenizer", r.tokenizer});
  if (!r.adapter_name_or_path.empty()) in.push_back({"adapter_name_or_path", r.adapter_name_or_path});
  return in;
}

std::vector<NamedPath> recipe_outputs(const Recipe& r) {
  return {{"output_dir", r.output_dir}, {"checkpoint_dir", r.checkpoint_dir}};
}

DirectoryLock::DirectoryLock(const std::string& dir, std::string_view role) {
  make_dirs(dir);
  const std::string path = dir + "/.keel.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  require(fd_ >= 0, "{}: cannot open the lock file {}: {}", role, path, std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder;
    try {
      holder = read_file(path, 4096);
    } catch (const Error&) {}
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    ::close(fd_);
    fd_ = -1;
    require(err != EWOULDBLOCK,
            "{} '{}' is in use by another keel run ({}): one run at a time per directory; "
            "wait for it, or give this run another {}",
            role, dir, holder.empty() ? "owner unknown" : holder, role);
    fail("{}: cannot lock {}: {}", role, path, std::strerror(err));
  }
  // Who holds it, for the message a second run prints. Failing to write this note is harmless: the
  // lock holds without it.
  const std::string owner = fmt::format("pid {} on {}\n", ::getpid(), host_name());
  if (::ftruncate(fd_, 0) == 0) (void)!::pwrite(fd_, owner.data(), owner.size(), 0);
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

void write_model_marker(const std::string& model_dir, std::string_view what) {
  write_file_atomic(model_dir + "/" + std::string(kModelMarkerFile),
                    fmt::format("written by keel ({}); keel may replace this directory\n", what));
}

void refuse_replacing_foreign_model(const std::string& dir, bool overwrite) {
  std::error_code ec;
  if (overwrite || !fs::exists(dir, ec)) return;
  require(fs::is_directory(dir, ec), "'{}' exists and is not a directory", dir);
  if (fs::is_empty(dir, ec) || fs::exists(fs::path(dir) / kModelMarkerFile, ec)) return;
  fail(
      "'{}' already holds files that keel did not write (no {} marker): keel will not replace a model it did "
      "not write. Choose another directory, or pass --overwrite",
      dir, kModelMarkerFile);
}

}  // namespace keel::recipe
