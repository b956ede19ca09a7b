// overlap_grad_sync = "auto": the gradient sync overlaps the backward pass only when every rank on
// the host has a CPU to spare for the communication thread (train/sync_overlap.h).
#include <gtest/gtest.h>

#include "keel/train/sync_overlap.h"

using keel::recipe::OverlapGradSync;
using keel::train::decide_overlap;
using keel::train::HostCores;

TEST(SyncOverlap, AutoOverlapsOnlyWithACpuToSparePerRank) {
  // This machine under the tests' mpirun: 2 CPUs, 2 ranks of 1 thread: nothing to spare.
  EXPECT_FALSE(decide_overlap(OverlapGradSync::Auto, HostCores{2, 2, 2, 1}).overlap);
  EXPECT_FALSE(decide_overlap(OverlapGradSync::Auto, HostCores{2, 1, 2, 1}).overlap);  // bound to one CPU each
  // 16 CPUs, 2 ranks of 7 threads (+1 each): overlap; of 8 threads: every CPU computes.
  EXPECT_TRUE(decide_overlap(OverlapGradSync::Auto, HostCores{16, 16, 2, 7}).overlap);
  EXPECT_TRUE(decide_overlap(OverlapGradSync::Auto, HostCores{16, 8, 2, 7}).overlap);
  EXPECT_FALSE(decide_overlap(OverlapGradSync::Auto, HostCores{16, 16, 2, 8}).overlap);
  // Bound to fewer CPUs than threads + 1, whatever the host has.
  EXPECT_FALSE(decide_overlap(OverlapGradSync::Auto, HostCores{64, 4, 2, 4}).overlap);
  const auto d = decide_overlap(OverlapGradSync::Auto, HostCores{2, 2, 2, 1});
  EXPECT_NE(d.reason.find("overlap_grad_sync = auto"), std::string::npos) << d.reason;
  EXPECT_NE(d.reason.find("2 rank(s) on this host of 2 CPUs, 1 compute thread(s) each"), std::string::npos)
      << d.reason;
}

TEST(SyncOverlap, TrueAndFalseAreTheUsersChoice) {
  EXPECT_TRUE(decide_overlap(OverlapGradSync::True, HostCores{2, 1, 2, 1}).overlap);
  EXPECT_FALSE(decide_overlap(OverlapGradSync::False, HostCores{64, 64, 1, 1}).overlap);
}
