// Pre-tokenized JSONL ({"input_ids": [...], "labels": [...]} per line): read_token_records on a
// tmpfs file, and the invariants the batch builder relies on.
#include "fuzz_support.h"
#include "keel/data/token_records.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  static const std::string path = fuzz::scratch_dir() + "/train.jsonl";
  fuzz::write_bytes(path, data, size);
  constexpr int64_t kVocab = 151552;  // GLM-4's padded vocabulary
  try {
    data::TokenRecords r = data::read_token_records(path, kVocab);
    if (r.labels.size() != r.input_ids.size() || r.offsets.empty() || r.offsets.front() != 0 ||
        r.offsets.back() != int64_t(r.input_ids.size()))
      fuzz::property_failed("token records arrays disagree");
    for (int64_t i = 0; i < r.size(); ++i) {
      if (r.length(i) <= 0) fuzz::property_failed("empty record accepted");
    }
    for (size_t i = 0; i < r.input_ids.size(); ++i) {
      if (r.input_ids[i] < 0 || r.input_ids[i] >= kVocab) fuzz::property_failed("id outside the vocabulary");
      if (r.labels[i] != -100 && (r.labels[i] < 0 || r.labels[i] >= kVocab)) fuzz::property_failed("bad label");
    }
  } catch (const Error&) {}
  return 0;
}
