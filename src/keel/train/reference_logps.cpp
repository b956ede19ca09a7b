#include "keel/train/reference_logps.h"

#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "keel/core/error.h"
#include "keel/core/file_io.h"

namespace keel::train {
namespace {

constexpr char kMagic[8] = {'K', 'E', 'E', 'L', 'R', 'E', 'F', '1'};

}  // namespace

ReferenceLogps compute_reference_logps(model::Decoder& decoder, const PairSource& source, int64_t B,
                                       distributed::Communicator& comm) {
  const int64_t n = source.pairs().size(), ranks = comm.size(), rank = comm.rank();
  const int64_t passes = (n + B - 1) / B;
  const int64_t rounds = (passes + ranks - 1) / ranks;  // the same on every rank
  data::PackedMicroBatch mb = source.make_pair_batch(B);
  const size_t tokens = size_t(mb.batch * mb.seq);
  std::vector<double> nll(tokens), mean_logit(tokens), logps(size_t(2 * n), 0.0);
  std::vector<int64_t> which(static_cast<size_t>(B), 0);
  std::vector<RowScore> rows(size_t(2 * B));
  for (int64_t round = 0; round < rounds; ++round) {
    const int64_t pass = round * ranks + rank;
    // A rank past the last pass repeats the first one and keeps nothing of it.
    const int64_t first = pass < passes ? pass * B : 0;
    for (int64_t b = 0; b < B; ++b) which[size_t(b)] = first + b < n ? first + b : first;
    source.fill(which, mb);
    const model::MicroBatch batch{mb.batch, mb.seq, mb.input_ids.data(), mb.targets.data(), mb.positions.data(),
                                  nullptr};
    decoder.forward_score(batch, {nll.data(), mean_logit.data()});
    if (pass >= passes) continue;
    score_rows(batch, mb.answer_starts.data(), nll.data(), mean_logit.data(), rows.data());
    for (int64_t b = 0; b < B && first + b < n; ++b) {
      logps[size_t(2 * (first + b))] = rows[size_t(b)].logp;
      logps[size_t(2 * (first + b) + 1)] = rows[size_t(B + b)].logp;
    }
  }
  if (ranks > 1) comm.allreduce_totals(logps.data(), int64_t(logps.size()));  // each pair from one rank, zeros elsewhere
  ReferenceLogps out;
  out.chosen.resize(size_t(n));
  out.rejected.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    out.chosen[size_t(i)] = logps[size_t(2 * i)];
    out.rejected[size_t(i)] = logps[size_t(2 * i + 1)];
  }
  return out;
}

std::string reference_logps_path(const std::string& cache_dir, const std::string& key) {
  return fmt::format("{}/dpo-reference-{}.bin", cache_dir, key);
}

// Layout: magic, key length (u64), key, pairs (u64), then chosen[pairs], rejected[pairs] as doubles.
std::optional<ReferenceLogps> load_reference_logps(const std::string& path, const std::string& key, int64_t pairs) {
  if (!path_exists(path)) return std::nullopt;
  const std::string bytes = read_file(path);
  const size_t head = sizeof(kMagic) + 8 + key.size() + 8;
  if (bytes.size() != head + size_t(pairs) * 16 || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    return std::nullopt;
  uint64_t key_size = 0, count = 0;
  std::memcpy(&key_size, bytes.data() + sizeof(kMagic), 8);
  if (key_size != key.size() || bytes.compare(sizeof(kMagic) + 8, key.size(), key) != 0) return std::nullopt;
  std::memcpy(&count, bytes.data() + sizeof(kMagic) + 8 + key.size(), 8);
  if (count != uint64_t(pairs)) return std::nullopt;
  ReferenceLogps out;
  out.chosen.resize(size_t(pairs));
  out.rejected.resize(size_t(pairs));
  std::memcpy(out.chosen.data(), bytes.data() + head, size_t(pairs) * 8);
  std::memcpy(out.rejected.data(), bytes.data() + head + size_t(pairs) * 8, size_t(pairs) * 8);
  return out;
}

void save_reference_logps(const std::string& path, const std::string& key, const ReferenceLogps& logps) {
  std::string bytes(kMagic, sizeof(kMagic));
  const uint64_t key_size = key.size(), count = logps.chosen.size();
  bytes.append(reinterpret_cast<const char*>(&key_size), 8);
  bytes += key;
  bytes.append(reinterpret_cast<const char*>(&count), 8);
  bytes.append(reinterpret_cast<const char*>(logps.chosen.data()), count * 8);
  bytes.append(reinterpret_cast<const char*>(logps.rejected.data()), count * 8);
  write_file_atomic(path, bytes);
}

}  // namespace keel::train
