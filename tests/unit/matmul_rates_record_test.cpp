// The record of a machine's matmul rates (kernels/cpu/matmul_rates_record.h): timed once, then
// read by every later process; other machines' entries kept; a damaged or unwritable file only
// means measuring.
#include "keel/kernels/cpu/matmul_rates_record.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "keel/core/file_io.h"

namespace keel::kernels {
namespace {

namespace fs = std::filesystem;

struct Scratch {
  fs::path dir;
  Scratch() {
    dir = fs::temp_directory_path() / ("keel_rates_" + std::to_string(::getpid()) + "_" +
                                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
  }
  ~Scratch() { fs::remove_all(dir); }
};

TEST(MatmulRatesRecord, TimedOnceThenRead) {
  const Scratch s;
  const std::string path = (s.dir / "cache" / "keel" / "matmul-rates.json").string();
  int timings = 0;
  auto measure = [&] {
    ++timings;
    return std::pair{1.5e11, 3.25e11};
  };
  const RecordedRates first = recorded_rates(path, "cpu A | oneDNN 2.6.3", measure);
  EXPECT_EQ(timings, 1);
  EXPECT_FALSE(first.recorded);
  EXPECT_TRUE(first.kept);
  EXPECT_EQ(first.bf16_flops, 1.5e11);
  EXPECT_EQ(first.measured_on.size(), 10u);  // YYYY-MM-DD
  ASSERT_TRUE(fs::exists(path));

  const RecordedRates again = recorded_rates(path, "cpu A | oneDNN 2.6.3", measure);
  EXPECT_EQ(timings, 1) << "a recorded machine is not timed again";
  EXPECT_TRUE(again.recorded);
  EXPECT_EQ(again.bf16_flops, 1.5e11);
  EXPECT_EQ(again.f32_flops, 3.25e11);
  EXPECT_EQ(again.measured_on, first.measured_on);

  // Another CPU (or oneDNN) sharing the file, as a home directory shared by a cluster's hosts is:
  // timed and added; the first machine's entry stays.
  const RecordedRates other = recorded_rates(path, "cpu B | oneDNN 2.6.3", [] { return std::pair{4e11, 2e11}; });
  EXPECT_FALSE(other.recorded);
  EXPECT_EQ(recorded_rates(path, "cpu B | oneDNN 2.6.3", measure).f32_flops, 2e11);
  EXPECT_EQ(recorded_rates(path, "cpu A | oneDNN 2.6.3", measure).f32_flops, 3.25e11);
  EXPECT_EQ(timings, 1);
}

TEST(MatmulRatesRecord, DamagedOrUnwritableFilesMeanMeasuring) {
  const Scratch s;
  fs::create_directories(s.dir);
  const std::string path = (s.dir / "matmul-rates.json").string();
  int timings = 0;
  auto measure = [&] {
    ++timings;
    return std::pair{1e11, 2e11};
  };
  for (const char* damaged : {"not json", "{\"format\": \"something else\", \"machines\": []}",
                              "{\"format\": \"keel-matmul-rates\", \"machines\": [{\"machine\": \"cpu A\", "
                              "\"measured_on\": \"2026-12-05\", \"bf16_flops\": -1, \"f32_flops\": 2e11}]}"}) {
    std::ofstream(path) << damaged;
    const RecordedRates r = recorded_rates(path, "cpu A", measure);
    EXPECT_FALSE(r.recorded) << damaged;
    EXPECT_TRUE(r.kept) << "rewritten as a record: " << damaged;
    EXPECT_TRUE(recorded_rates(path, "cpu A", measure).recorded) << damaged;
  }
  EXPECT_EQ(timings, 3);

  // Its directory is a file: nothing can be written, the process decides from its own timing.
  const std::string blocked = (s.dir / "matmul-rates.json" / "matmul-rates.json").string();
  const RecordedRates r = recorded_rates(blocked, "cpu A", measure);
  EXPECT_FALSE(r.recorded);
  EXPECT_FALSE(r.kept);
  EXPECT_EQ(r.f32_flops, 2e11);
  const RecordedRates nowhere = recorded_rates("", "cpu A", measure);  // no home: nowhere to keep it
  EXPECT_FALSE(nowhere.kept);
  EXPECT_EQ(timings, 5);
}

// The ranks of a job start together: one measures while the others wait for its entry, so that
// all decide from the same rates (without the lock each found no entry and timed on its own).
TEST(MatmulRatesRecord, ProcessesStartingTogetherMeasureOnce) {
  const Scratch s;
  const std::string path = (s.dir / "keel" / "matmul-rates.json").string();
  std::atomic<int> timings{0};
  auto measure = [&] {
    const int n = ++timings;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a timing takes a while
    return std::pair{1.0e11 * n, 3.0e11 * n};                     // each timing its own figures
  };
  std::vector<RecordedRates> got(4);
  std::vector<std::thread> ranks;
  for (size_t r = 0; r < got.size(); ++r)
    ranks.emplace_back([&, r] { got[r] = recorded_rates(path, "cpu A", measure); });
  for (std::thread& t : ranks) t.join();
  EXPECT_EQ(timings.load(), 1);
  for (const RecordedRates& r : got) {
    EXPECT_EQ(r.bf16_flops, got[0].bf16_flops);
    EXPECT_EQ(r.f32_flops, got[0].f32_flops);
    EXPECT_TRUE(r.kept);
  }
  // A second machine sharing the directory keeps the first one's entry.
  recorded_rates(path, "cpu B", measure);
  EXPECT_TRUE(recorded_rates(path, "cpu A", measure).recorded);
  EXPECT_EQ(timings.load(), 2);
}

// The machine's key names its CPU: x86's model name, or an Arm design's numbers (its cpuinfo has
// no model name; two Arm hosts sharing a home directory must not share one entry).
TEST(MatmulRatesRecord, CpuModelNameOnX86AndArm) {
  EXPECT_EQ(cpu_model_name_from("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) "
                                "Platinum 8481C CPU @ 2.70GHz\nprocessor\t: 1\nmodel name\t: other\n",
                                "x86_64"),
            "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz");
  const std::string arm =
      "processor\t: 0\nBogoMIPS\t: 243.75\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x1\n"
      "CPU part\t: 0xd0c\nCPU revision\t: 1\n\nprocessor\t: 1\nCPU implementer\t: 0x41\nCPU variant\t: 0x3\n"
      "CPU part\t: 0xd40\n";
  EXPECT_EQ(cpu_model_name_from(arm, "aarch64"), "aarch64 CPU implementer 0x41, CPU variant 0x1, CPU part 0xd0c");
  EXPECT_NE(cpu_model_name_from(arm, "aarch64"),
            cpu_model_name_from("CPU implementer\t: 0x41\nCPU variant\t: 0x1\nCPU part\t: 0xd40\n", "aarch64"));
  EXPECT_EQ(cpu_model_name_from("processor\t: 0\n", "riscv64"), "");
}

TEST(MatmulRatesRecord, KeptInTheUsersCache) {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const std::string saved = xdg ? xdg : "";
  ::setenv("XDG_CACHE_HOME", "/tmp/xdg-cache", 1);
  EXPECT_EQ(matmul_rates_path(), "/tmp/xdg-cache/keel/matmul-rates.json");
  ::unsetenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  if (home != nullptr && *home == '/')
    EXPECT_EQ(matmul_rates_path(), std::string(home) + "/.cache/keel/matmul-rates.json");
  if (xdg) ::setenv("XDG_CACHE_HOME", saved.c_str(), 1);
}

}  // namespace
}  // namespace keel::kernels
