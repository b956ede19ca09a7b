// The shard loader: seeded shuffle independent of worker count, disjoint rank partitions that
// cover every global batch and each epoch, exact resume from a position, packed rows (positions
// restart per document, no target across a boundary, segments), and corrupt shards/manifests.
#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include "keel/core/file_io.h"
#include "keel/data/prepare.h"
#include "keel/data/shard_loader.h"
#include "test_support.h"

namespace keel::data {
namespace {

using keel::testing::expect_keel_error;
using keel::testing::TempDir;

// Document i: ids [i*10+1 ...], length 2 + i % 3, first label -100. With max_seq_len 4 every
// document fits alone, and with padding each is one sequence, identified by its first id.
std::string prepared(const TempDir& dir, int documents, Packing packing, int64_t max_seq_len,
                     int64_t shard_tokens = 30) {
  std::string s;
  for (int i = 0; i < documents; ++i) {
    std::string ids, labels;
    for (int t = 0; t < 2 + i % 3; ++t) {
      ids += fmt::format("{}{}", t ? ", " : "", i * 10 + t + 1);
      labels += fmt::format("{}{}", t ? ", " : "", t == 0 ? -100 : i * 10 + t + 1);
    }
    s += fmt::format("{{\"input_ids\": [{}], \"labels\": [{}]}}\n", ids, labels);
  }
  write_file_atomic(dir / "data.jsonl", s);
  PrepareOptions o;
  o.data_path = dir / "data.jsonl";
  o.out_dir = dir / fmt::format("out-{}-{}", packing_name(packing), max_seq_len);
  o.vocab_size = 100000;
  o.max_seq_len = max_seq_len;
  o.packing = packing;
  o.shard_tokens = shard_tokens;
  o.threads = 2;
  prepare(o);
  return o.out_dir;
}

int first_document(const PackedMicroBatch& mb, int64_t row) { return (mb.input_ids[size_t(row * mb.seq)] - 1) / 10; }

// Every row of every micro-batch of `steps` steps from this loader, as document numbers.
std::vector<int> stream(ShardLoader& loader, int steps) {
  std::vector<int> out;
  for (int s = 0; s < steps; ++s)
    for (const auto& mb : loader.next_step())
      for (int64_t b = 0; b < mb.batch; ++b) out.push_back(first_document(mb, b));
  return out;
}

TEST(ShardLoader, ShuffleIsDeterministicAndIndependentOfWorkers) {
  TempDir dir;
  const std::string data = prepared(dir, 24, Packing::pad, 4);
  ShardLoaderOptions o{.batch_size = 2, .micro_batches_per_step = 3, .seed = 7};
  std::vector<std::vector<int>> runs;
  for (int workers : {0, 1, 3}) {
    for (int prefetch : {1, 4}) {
      o.num_workers = workers;
      o.prefetch_factor = prefetch;
      ShardLoader loader(data, o);
      runs.push_back(stream(loader, 10));  // 60 samples: two and a half epochs
    }
  }
  for (const auto& r : runs) EXPECT_EQ(r, runs[0]);
  // Each epoch is a permutation, different from file order and from the next epoch's.
  std::vector<int> epoch0(runs[0].begin(), runs[0].begin() + 24), epoch1(runs[0].begin() + 24, runs[0].begin() + 48);
  EXPECT_EQ(std::set<int>(epoch0.begin(), epoch0.end()).size(), 24u);
  EXPECT_EQ(std::set<int>(epoch1.begin(), epoch1.end()).size(), 24u);
  EXPECT_NE(epoch0, epoch1);
  std::vector<int> file_order(24);
  for (int i = 0; i < 24; ++i) file_order[size_t(i)] = i;
  EXPECT_NE(epoch0, file_order);
  // The same order as the trainer's in-memory path (SampleOrder over the same count and seed).
  SampleOrder order(24, true, 7);
  for (int k = 0; k < 60; ++k) EXPECT_EQ(runs[0][size_t(k)], order.record_at(k));
  // Another seed, another order; no shuffle, file order.
  o.seed = 8;
  o.num_workers = 1;
  ShardLoader other(data, o);
  EXPECT_NE(stream(other, 4), std::vector<int>(runs[0].begin(), runs[0].begin() + 24));
  o.shuffle = false;
  ShardLoader plain(data, o);
  EXPECT_EQ(stream(plain, 4), file_order);
}

TEST(ShardLoader, RanksReadDisjointPartsThatCoverEachGlobalBatch) {
  TempDir dir;
  const std::string data = prepared(dir, 24, Packing::pad, 4);
  const int ranks = 3;
  ShardLoaderOptions o{.batch_size = 2, .micro_batches_per_step = 2, .ranks = ranks, .seed = 3, .num_workers = 2};
  // 12 samples per step: two steps per epoch, each a disjoint half of the data.
  std::vector<std::vector<int>> per_rank;
  for (int r = 0; r < ranks; ++r) {
    o.rank = r;
    ShardLoader loader(data, o);
    EXPECT_EQ(loader.samples_per_step(), 12);
    per_rank.push_back(stream(loader, 4));
  }
  SampleOrder order(24, true, 3);
  for (int step = 0; step < 4; ++step) {
    std::multiset<int> global;
    for (int r = 0; r < ranks; ++r)
      for (int k = 0; k < 4; ++k) global.insert(per_rank[size_t(r)][size_t(step * 4 + k)]);
    std::multiset<int> expected;
    for (int k = 0; k < 12; ++k) expected.insert(int(order.record_at(step * 12 + k)));
    EXPECT_EQ(global, expected) << "step " << step;
    EXPECT_EQ(std::set<int>(global.begin(), global.end()).size(), 12u) << "ranks overlap in step " << step;
  }
  // Micro-batch i of rank r is the step's (i * ranks + r)-th block, as in trainer.cpp.
  for (int r = 0; r < ranks; ++r)
    for (int i = 0; i < 2; ++i)
      for (int b = 0; b < 2; ++b)
        EXPECT_EQ(per_rank[size_t(r)][size_t(i * 2 + b)], int(order.record_at((i * ranks + r) * 2 + b)));
  // An epoch (two steps) over all ranks is every sequence once.
  std::set<int> epoch;
  for (int r = 0; r < ranks; ++r) epoch.insert(per_rank[size_t(r)].begin(), per_rank[size_t(r)].begin() + 8);
  EXPECT_EQ(epoch.size(), 24u);
}

TEST(ShardLoader, ResumeContinuesAtTheExactNextSample) {
  TempDir dir;
  const std::string data = prepared(dir, 24, Packing::pad, 4);
  ShardLoaderOptions o{.batch_size = 3, .micro_batches_per_step = 2, .seed = 11, .num_workers = 2};
  ShardLoader full(data, o);
  const std::vector<int> all = stream(full, 9);
  EXPECT_EQ(full.position(), 9 * 6);
  ShardLoader first(data, o);
  stream(first, 4);
  const int64_t saved = first.position();  // what the checkpoint stores
  ShardLoader resumed(data, o);
  resumed.seek(saved);
  const std::vector<int> rest = stream(resumed, 5);
  EXPECT_EQ(rest, std::vector<int>(all.begin() + 24, all.end()));
  // step_batches(step) seeks by itself and then streams.
  ShardLoader by_step(data, o);
  const auto batches = by_step.step_batches(7);
  EXPECT_EQ(first_document(batches[0], 0), all[36]);
  EXPECT_EQ(first_document(by_step.micro_batch(8, 1), 2), all[47]);
  EXPECT_EQ(first_document(by_step.micro_batch(2, 0), 0), all[6]);  // backwards too
  EXPECT_GE(by_step.total_wait_seconds(), 0.0);
}

TEST(ShardLoader, PackedRowsRestartPositionsAndNeverPredictAcrossDocuments) {
  TempDir dir;
  const std::string data = prepared(dir, 30, Packing::pack, 10);
  ShardLoaderOptions o{.batch_size = 1, .seq_len = 12, .shuffle = false, .num_workers = 1, .pad_id = 0};
  ShardLoader loader(data, o);
  PreparedData direct(data);
  int doc = 0;
  for (int64_t s = 0; s < loader.sequences(); ++s) {
    const auto& mb = loader.next_step()[0];
    int64_t t = 0, segment = 0, targets = 0;
    for (; doc < 30; ++doc, ++segment) {
      const int len = 2 + doc % 3;
      if (t + len > 10) break;
      for (int i = 0; i < len; ++i, ++t) {
        ASSERT_EQ(mb.input_ids[size_t(t)], doc * 10 + i + 1);
        EXPECT_EQ(mb.positions[size_t(t)], i) << "positions restart at each document";
        EXPECT_EQ(mb.segments[size_t(t)], segment);
        const int expected = i + 1 < len ? doc * 10 + i + 2 : -100;  // label -100 only on first tokens
        EXPECT_EQ(mb.targets[size_t(t)], expected) << "sequence " << s << " token " << t;
        targets += expected != -100;
      }
    }
    EXPECT_EQ(mb.input_tokens, t);
    EXPECT_EQ(mb.target_tokens, targets);
    for (; t < 12; ++t) {  // padding
      EXPECT_EQ(mb.targets[size_t(t)], -100);
      EXPECT_EQ(mb.input_ids[size_t(t)], 0);
      EXPECT_GT(mb.segments[size_t(t)], segment - 1);
      EXPECT_LT(mb.positions[size_t(t)], 12);
    }
  }
  EXPECT_EQ(doc, 30);
}

void flip_byte(const std::string& path, long offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset, offset < 0 ? std::ios::end : std::ios::beg);
  char c;
  f.read(&c, 1);
  f.seekp(offset, offset < 0 ? std::ios::end : std::ios::beg);
  c ^= 0x5a;
  f.write(&c, 1);
}

TEST(ShardLoader, CorruptShardsAndManifestsAreErrorsNamingTheFile) {
  TempDir dir;
  const std::string data = prepared(dir, 24, Packing::pack, 8, 1 << 20);
  const std::string shard = data + "/shard-00000.bin";
  const std::string manifest = read_file(data + "/manifest.json");
  const std::string good = read_file(shard);
  const ShardManifest m = parse_manifest(manifest, "manifest.json");
  ShardLoaderOptions o{.num_workers = 1};

  flip_byte(shard, 5);  // a token
  expect_keel_error([&] { ShardLoader{data, o}; }, {"shard-00000.bin", "checksum"});
  write_file_atomic(shard, good);
  flip_byte(shard, -20);  // the footer
  expect_keel_error([&] { ShardLoader{data, o}; }, {"shard-00000.bin", "footer"});
  write_file_atomic(shard, good.substr(0, good.size() - 9));
  expect_keel_error([&] { ShardLoader{data, o}; }, {"shard-00000.bin"});
  write_file_atomic(shard, "tiny");
  expect_keel_error([&] { ShardLoader{data, o}; }, {"shard-00000.bin", "too small"});
  write_file_atomic(shard, good);
  EXPECT_NO_THROW((ShardLoader{data, o}));

  auto with_manifest = [&](const std::string& text, std::initializer_list<std::string> parts) {
    write_file_atomic(data + "/manifest.json", text);
    expect_keel_error([&] { ShardLoader{data, o}; }, parts);
  };
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string m = manifest;
    const size_t at = m.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return m.replace(at, from.size(), to);
  };
  with_manifest("{", {"manifest.json", "invalid JSON"});
  with_manifest(replaced("\"shard-00000.bin\"", "\"../shard-00000.bin\""), {"manifest.json", "plain file name"});
  with_manifest(replaced("\"max_seq_len\": 8", "\"max_seq_len\": -8"), {"manifest.json", "max_seq_len"});
  with_manifest(replaced("\"version\": 1", "\"version\": 9"), {"manifest.json", "version 9"});
  with_manifest(replaced("\"packing\": \"pack\"", "\"packing\": \"zip\""), {"manifest.json", "packing"});
  with_manifest(replaced(fmt::format("\"tokens\": {}, \"documents\"", m.shards[0].tokens),
                         fmt::format("\"tokens\": {}, \"documents\"", m.shards[0].tokens + 1)),
                {"shard-00000.bin", "manifest says"});
  // A smaller max_seq_len in the manifest than the sequences hold: caught by the index check.
  with_manifest(replaced("\"max_seq_len\": 8", "\"max_seq_len\": 2"), {"shard-00000.bin", "tokens (expected 1..2)"});
  write_file_atomic(data + "/manifest.json", manifest);
  // Rows shorter than the prepared sequences, and a model vocabulary smaller than the data's.
  expect_keel_error([&] { ShardLoader(data, ShardLoaderOptions{.seq_len = 4}); }, {"max_seq_len 8"});
  expect_keel_error([&] { ShardLoader(data, ShardLoaderOptions{.vocab_size = 50}); }, {"vocabulary"});
}

}  // namespace
}  // namespace keel::data
