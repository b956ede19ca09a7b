#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <set>

#include "keel/core/error.h"
#include "keel/data/batch_builder.h"
#include "keel/data/token_records.h"

using namespace keel::data;

namespace {

std::string write_temp(const std::string& text) {
  char name[] = "/tmp/keel_records_XXXXXX";
  int fd = mkstemp(name);
  close(fd);
  std::ofstream(name) << text;
  return name;
}

}  // namespace

TEST(TokenRecords, ReadsIdsAndLabels) {
  auto path = write_temp("{\"input_ids\": [1, 2, 3]}\n\n{\"input_ids\": [4, 5], \"labels\": [-100, 5]}\n");
  auto r = read_token_records(path, 10);
  ASSERT_EQ(r.size(), 2);
  EXPECT_EQ(r.length(0), 3);
  EXPECT_EQ(r.labels[0], 1);
  EXPECT_EQ(r.labels[3], -100);
}

TEST(TokenRecords, BadLinesNameFileAndLine) {
  auto expect_error = [](const std::string& text, const std::string& needle) {
    auto path = write_temp(text);
    try {
      read_token_records(path, 10);
      FAIL() << "no error for " << text;
    } catch (const keel::Error& e) {
      std::string what = e.what();
      EXPECT_NE(what.find(path + ":2"), std::string::npos) << what;
      EXPECT_NE(what.find(needle), std::string::npos) << what;
    }
  };
  expect_error("{\"input_ids\": [1]}\n{\"input_ids\": [1, 12]}\n", "outside the vocabulary");
  expect_error("{\"input_ids\": [1]}\n{\"input\": [1]}\n", "missing field 'input_ids'");
  expect_error("{\"input_ids\": [1]}\n{\"input_ids\": [1, 2], \"labels\": [1]}\n", "'labels' has 1 entries");
  expect_error("{\"input_ids\": [1]}\n{\"input_ids\": [1,\n", "invalid JSON");
  expect_error("{\"input_ids\": [1]}\n{\"input_ids\": [1.5]}\n", "only integers");
}

TEST(BatchBuilder, ShiftsLabelsPadsAndTruncates) {
  auto path = write_temp("{\"input_ids\": [1, 2, 3, 4, 5, 6]}\n{\"input_ids\": [7, 8], \"labels\": [-100, 8]}\n");
  auto records = read_token_records(path, 10);
  SampleOrder order(records.size(), false, 0);
  auto mb = make_micro_batch_buffers(2, 4);
  fill_micro_batch(records, order, 0, 0, mb);
  EXPECT_EQ(mb.input_ids, (std::vector<int32_t>{1, 2, 3, 4, 7, 8, 0, 0}));
  EXPECT_EQ(mb.targets, (std::vector<int32_t>{2, 3, 4, -100, 8, -100, -100, -100}));
  EXPECT_EQ(mb.positions, (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(mb.input_tokens, 6);
  EXPECT_EQ(mb.target_tokens, 4);
}

TEST(SampleOrder, ShuffleIsAPermutationPerEpochAndDeterministic) {
  SampleOrder a(100, true, 7), b(100, true, 7), c(100, true, 8);
  std::vector<int64_t> first, second;
  for (int k = 0; k < 100; ++k) first.push_back(a.record_at(k));
  for (int k = 100; k < 200; ++k) second.push_back(a.record_at(k));
  EXPECT_EQ(std::set<int64_t>(first.begin(), first.end()).size(), 100u);
  EXPECT_NE(first, second);  // a new permutation each epoch
  bool differs = false;
  for (int k = 0; k < 100; ++k) {
    EXPECT_EQ(b.record_at(k), first[k]);
    differs |= c.record_at(k) != first[k];
  }
  EXPECT_TRUE(differs);
  SampleOrder plain(5, false, 7);
  EXPECT_EQ(plain.record_at(7), 2);
}
