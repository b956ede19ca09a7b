// The files a run keeps growing (metrics.jsonl) are streamed, never read whole: line splitting
// with torn and overlong lines, trimming on resume, and loss.svg's points thinned to a bounded
// number whatever the run's length.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "keel/core/file_io.h"
#include "keel/report/loss_plot.h"
#include "keel/report/metrics.h"
#include "test_support.h"

namespace keel {
namespace {

using testing::TempDir;

TEST(ForEachLine, SplitsLinesReportsATornLastOneAndSkipsOverlongOnes) {
  TempDir dir;
  const std::string long_line(100000, 'x');  // crosses the 64 KiB read size
  write_file_atomic(dir / "f", "a\n\n" + long_line + "\nbc\n" + std::string(300, 'y') + "\ntorn");
  std::vector<std::pair<std::string, bool>> seen;
  const int64_t skipped = for_each_line(dir / "f", 200000, [&](std::string_view l, bool complete) {
    seen.push_back({std::string(l), complete});
  });
  EXPECT_EQ(skipped, 0);
  ASSERT_EQ(seen.size(), 6u);
  EXPECT_EQ(seen[0], std::make_pair(std::string("a"), true));
  EXPECT_EQ(seen[1], std::make_pair(std::string(), true));
  EXPECT_EQ(seen[2], std::make_pair(long_line, true));
  EXPECT_EQ(seen[3], std::make_pair(std::string("bc"), true));
  EXPECT_EQ(seen[5], std::make_pair(std::string("torn"), false));
  seen.clear();
  EXPECT_EQ(for_each_line(dir / "f", 256,
                          [&](std::string_view l, bool) {
                            seen.push_back({std::string(l), true});
                          }),
            2);
  ASSERT_EQ(seen.size(), 4u);  // the 100000- and 300-byte lines are skipped
  EXPECT_EQ(seen[2].first, "bc");
  EXPECT_EQ(seen[3].first, "torn");
}

std::string metrics_line(int64_t step, double loss, bool eval) {
  return fmt::format("{{\"step\": {}, \"loss\": {}, \"lr\": 0.001{}}}\n", step, loss,
                     eval ? fmt::format(", \"eval_loss\": {}", loss + 0.5) : "");
}

TEST(LossPlot, ThinsALongRunToABoundedNumberOfPointsKeepingBothEnds) {
  TempDir dir;
  std::string text;
  const int64_t steps = 100000;
  for (int64_t s = 1; s <= steps; ++s) text += metrics_line(s, 10.0 / double(s), s % 100 == 0);
  write_file_atomic(dir / "metrics.jsonl", text + "{\"step\": 100001, \"lo");  // a torn last line
  const auto points = report::read_plot_points(dir / "metrics.jsonl");
  int64_t training = 0, evaluations = 0;
  for (const auto& p : points) {
    training += std::isfinite(p.loss);
    evaluations += p.eval_loss >= 0;
  }
  EXPECT_LE(training, 4001);
  EXPECT_GE(training, 2000);
  EXPECT_EQ(evaluations, 1000);  // 1000 evaluations fit the budget: all kept
  EXPECT_EQ(points.front().step, 1);
  EXPECT_EQ(points.back().step, steps);  // the last step is always shown
  for (size_t i = 1; i < points.size(); ++i) EXPECT_LE(points[i - 1].step, points[i].step);
  const std::string svg = report::loss_plot_svg(points, "run");
  EXPECT_LT(svg.size(), size_t(400000));
}

TEST(MetricsWriter, ResumeKeepsTheLinesThroughTheCheckpointStepAndDropsATornOne) {
  TempDir dir;
  write_file_atomic(dir / "metrics.jsonl",
                    metrics_line(1, 3, false) + metrics_line(2, 2, false) + metrics_line(3, 1, false) + "{\"step\": 4");
  { report::MetricsWriter writer(dir / "metrics.jsonl", 2); }
  EXPECT_EQ(read_file(dir / "metrics.jsonl"), metrics_line(1, 3, false) + metrics_line(2, 2, false));
  { report::MetricsWriter writer(dir / "metrics.jsonl", 0); }  // a fresh run starts empty
  EXPECT_EQ(read_file(dir / "metrics.jsonl"), "");
}

}  // namespace
}  // namespace keel
