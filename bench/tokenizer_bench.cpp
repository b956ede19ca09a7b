// Encode throughput of keel's tokenizer, 1 and 2 threads, on a JSONL corpus of {"text": ...}
// documents. bench/tokenizer_bench.mjs runs it next to npm tiktoken on the same corpus and prints
// the ratios; run alone it prints keel's figures only.
//
// usage: tokenizer_bench TOKENIZER CORPUS.jsonl [PATTERN] [REPEATS]
// prints one JSON line: {"bytes": ..., "tokens": ..., "mb_per_s_1": ..., "mb_per_s_2": ...}
#include <fmt/format.h>
#include <simdjson.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <thread>

#include "keel/core/error.h"
#include "keel/data/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

// Best seconds of `repeats` passes over all documents with `threads` threads, each taking every
// threads-th document (interleaved, so threads get the same mix of long and short documents).
// The threads live across passes, as in a long tokenization job: what they cache (PCRE2 match
// data, recent BPE pieces) is kept, as the npm tiktoken workers keep their JIT-compiled code.
double best_encode_seconds(const keel::data::Tokenizer& tokenizer, const std::vector<std::string>& docs, int threads,
                           int repeats, size_t& tokens) {
  std::vector<size_t> counts(threads, 0);
  std::barrier sync(threads + 1);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      std::vector<int32_t> ids;
      for (int r = 0; r < repeats; ++r) {
        sync.arrive_and_wait();
        counts[t] = 0;
        for (size_t i = t; i < docs.size(); i += threads) {
          ids.clear();
          tokenizer.encode(docs[i], ids);
          counts[t] += ids.size();
        }
        sync.arrive_and_wait();
      }
    });
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    sync.arrive_and_wait();
    const auto start = Clock::now();
    sync.arrive_and_wait();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  for (auto& th : pool) th.join();
  tokens = 0;
  for (size_t c : counts) tokens += c;
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    fmt::print(stderr, "usage: {} TOKENIZER CORPUS.jsonl [PATTERN] [REPEATS]\n", argv[0]);
    return 2;
  }
  try {
    const auto tokenizer = keel::data::load_tokenizer(argv[1], argc > 3 ? argv[3] : "");
    const int repeats = argc > 4 ? std::max(1, std::atoi(argv[4])) : 3;
    simdjson::padded_string corpus;
    keel::require(simdjson::padded_string::load(argv[2]).get(corpus) == simdjson::SUCCESS, "{}: cannot read", argv[2]);
    simdjson::dom::parser parser;
    std::vector<std::string> docs;
    size_t bytes = 0;
    for (auto doc : parser.parse_many(corpus)) {
      std::string_view text;
      keel::require(doc["text"].get_string().get(text) == simdjson::SUCCESS, "{}: expected {{\"text\": ...}} lines",
                    argv[2]);
      docs.emplace_back(text);
      bytes += text.size();
    }
    size_t tokens = 0;
    const double best1 = best_encode_seconds(tokenizer, docs, 1, repeats, tokens);
    const double best2 = best_encode_seconds(tokenizer, docs, 2, repeats, tokens);
    fmt::print("{{\"bytes\": {}, \"documents\": {}, \"tokens\": {}, \"mb_per_s_1\": {:.2f}, \"mb_per_s_2\": {:.2f}}}\n",
               bytes, docs.size(), tokens, bytes / best1 / 1e6, bytes / best2 / 1e6);
  } catch (const keel::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 2;
  }
  return 0;
}
