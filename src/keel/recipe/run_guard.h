// What keeps a run from destroying the user's files: its outputs may not be, contain or lie inside
// its inputs, and one run at a time owns an output directory.
#pragma once
#include <string>
#include <string_view>
#include <vector>

#include "keel/recipe/recipe.h"

namespace keel::recipe {

// A path the run reads (the model directory, the tokenizer) or writes (output_dir, checkpoint_dir,
// an export target), with the recipe key or option that named it, for messages.
struct NamedPath {
  std::string role;  // e.g. "output_dir", "model_name"
  std::string path;
};

// keel::Error naming both paths when an output is, contains, or lies inside an input. Paths are
// compared after resolving symbolic links and "..", whether or not they exist yet.
void refuse_outputs_over_inputs(const std::vector<NamedPath>& outputs, const std::vector<NamedPath>& inputs);

// The inputs and outputs of a training recipe (model_name's directory, the tokenizer's directory;
// output_dir, checkpoint_dir).
std::vector<NamedPath> recipe_inputs(const Recipe& r);
std::vector<NamedPath> recipe_outputs(const Recipe& r);

// An exclusive lock on a directory for the life of a run: flock() on DIR/.keel.lock, which holds the
// owner's pid and host. A second run fails at once with a keel::Error naming them; a lock left by a
// killed process is released by the kernel with its file descriptors, so it never goes stale.
class DirectoryLock {
 public:
  DirectoryLock(const std::string& dir, std::string_view role);  // creates dir if missing
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

// The file keel writes into every model directory it creates (output_dir/final, keel export
// targets), so that it can tell its own output, which it may replace, from a model it must not.
inline constexpr std::string_view kModelMarkerFile = ".keel-model";
void write_model_marker(const std::string& model_dir, std::string_view what);
// keel::Error unless `dir` is missing, empty, or holds keel's marker (or `overwrite` is set).
void refuse_replacing_foreign_model(const std::string& dir, bool overwrite);

}  // namespace keel::recipe
