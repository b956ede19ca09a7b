// fuzz_seed_corpus OUT_DIR: writes the starting corpora (seed_corpus.h) as OUT_DIR/<target>/<name>.
// scripts/fuzz.sh adds the repository's sample files (recipes/*.toml, tests/data) next to these.
#include <filesystem>
#include <iostream>

#include "fuzz_support.h"
#include "seed_corpus.h"

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc != 2) {
    std::cerr << "usage: fuzz_seed_corpus OUT_DIR\n";
    return 2;
  }
  const std::string out_root = argv[1];
  try {
    for (const auto& seed : keel::fuzz::seed_inputs(keel::fuzz::scratch_dir())) {
      fs::create_directories(out_root + "/" + seed.target);
      keel::fuzz::write_bytes(out_root + "/" + seed.target + "/" + seed.name, seed.bytes);
    }
  } catch (const std::exception& e) {
    std::cerr << "fuzz_seed_corpus: " << e.what() << "\n";
    return 1;
  }
  std::cout << "fuzz_seed_corpus: seeds written to " << out_root << "\n";
  return 0;
}
