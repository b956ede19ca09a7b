// The starting inputs of the fuzz targets, made with keel's own writers (fuzz/seed_corpus.cpp):
// written to disk by fuzz_seed_corpus for scripts/fuzz.sh, and replayed through each target by the
// unit tests (tests/unit/fuzz_regressions_test.cpp), so that every target runs on inputs keel
// accepts even where no crash was ever saved.
#pragma once
#include <string>
#include <vector>

namespace keel::fuzz {

struct SeedInput {
  std::string target;  // the fuzz target: "recipe" for fuzz/recipe_fuzz.cpp
  std::string name;
  std::string bytes;
};

// Every target's seeds. The writers that need files (safetensors, checkpoints, shards) write them
// under `scratch`, an existing directory.
std::vector<SeedInput> seed_inputs(const std::string& scratch);

}  // namespace keel::fuzz
