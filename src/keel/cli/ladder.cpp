#include "keel/cli/ladder.h"

#include <fmt/format.h>
#include <simdjson.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/core/json_text.h"
#include "keel/report/metrics.h"

namespace keel::cli {
namespace {

double number(simdjson::dom::element e, const char* key, const std::string& origin) {
  double v = 0;
  simdjson::dom::element field;
  require(e[key].get(field) == simdjson::SUCCESS, "{}: missing '{}'", origin, key);
  if (field.is_null()) return std::numeric_limits<double>::quiet_NaN();  // non-finite, as keel writes it
  require(field.get_double().get(v) == simdjson::SUCCESS, "{}: '{}' is {}, expected a number", origin, key,
          json_describe(field));
  return v;
}

std::string bucket_setting(double mb) { return fmt::format("bucket_size_mb={}", report::json_number(mb)); }

}  // namespace

std::vector<LadderStage> ladder_stages(const recipe::Recipe& r) {
  const std::string recipe_buckets = bucket_setting(r.bucket_size_mb);
  return {
      {"Baseline (tokenize on the fly, sync after backward, malloc per tensor)",
       {"data_pipeline=on_the_fly", "overlap_grad_sync=false", bucket_setting(4096), "memory_planning=per_tensor"}},
      {"+ prepared data, prefetching loader",
       {"data_pipeline=prepared", "overlap_grad_sync=false", bucket_setting(4096), "memory_planning=per_tensor"}},
      {"+ bucketed gradient sync overlapped with backward",
       {"data_pipeline=prepared", "overlap_grad_sync=true", recipe_buckets, "memory_planning=per_tensor"}},
      {"+ planned memory arena",
       {"data_pipeline=prepared", "overlap_grad_sync=true", recipe_buckets, "memory_planning=planned"}},
  };
}

std::vector<std::string> ladder_run_settings(int64_t steps, const std::string& output_dir) {
  return {fmt::format("max_steps={}", steps),
          fmt::format("output_dir={}", json_quoted(output_dir)),
          "packing=pad",
          "checkpoint_dir=\"\"",
          "save_interval=0",
          "async_save=false",
          "eval_data_path=\"\"",
          "eval_interval=0"};
}

LadderResult read_ladder_result(const std::string& dir, int64_t warmup_steps) {
  LadderResult r;
  r.output_dir = dir;
  simdjson::dom::parser parser;
  const std::string summary_path = dir + "/summary.json";
  require(path_exists(summary_path), "{}: missing (the row's run did not finish)", summary_path);
  simdjson::padded_string summary_text(read_file(summary_path));
  simdjson::dom::element summary;
  require(parser.parse(summary_text).get(summary) == simdjson::SUCCESS, "{}: invalid JSON", summary_path);
  r.peak_memory_bytes = int64_t(number(summary, "peak_memory_bytes", summary_path));
  r.planned_memory_bytes = int64_t(number(summary, "planned_memory_bytes", summary_path));
  r.ranks = int(number(summary, "ranks", summary_path));
  const double summary_mfu = number(summary, "mfu", summary_path);
  const double summary_tokens_per_s = number(summary, "tokens_per_s", summary_path);
  r.matmul_peak_flops = number(summary, "matmul_peak_flops", summary_path);
  r.flops_per_token = summary_tokens_per_s > 0 ? summary_mfu * r.matmul_peak_flops / summary_tokens_per_s : 0.0;

  struct Step {
    double time, tokens, compute, data, sync, optimizer;
  };
  std::vector<Step> steps;
  const std::string metrics_path = dir + "/metrics.jsonl";
  std::ifstream metrics(metrics_path);
  require(bool(metrics), "{}: cannot open", metrics_path);
  std::string line;
  for (int64_t number_in_file = 1; std::getline(metrics, line); ++number_in_file) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string origin = fmt::format("{}:{}", metrics_path, number_in_file);
    simdjson::dom::element m;
    require(parser.parse(line).get(m) == simdjson::SUCCESS, "{}: invalid JSON", origin);
    steps.push_back({number(m, "step_time_s", origin), number(m, "tokens", origin), number(m, "compute_share", origin),
                     number(m, "data_wait_share", origin), number(m, "grad_sync_share", origin),
                     number(m, "optimizer_share", origin)});
  }
  require(!steps.empty(), "{}: no steps", metrics_path);
  r.steps = int64_t(steps.size());
  const size_t first = r.steps > warmup_steps ? size_t(warmup_steps) : 0;
  double tokens = 0;
  for (size_t i = first; i < steps.size(); ++i) {
    const Step& s = steps[i];
    r.seconds += s.time;
    tokens += s.tokens;
    r.compute_share += s.compute * s.time;
    r.data_wait_share += s.data * s.time;
    r.grad_sync_share += s.sync * s.time;
    r.optimizer_share += s.optimizer * s.time;
  }
  r.measured_steps = r.steps - int64_t(first);
  const double t = std::max(r.seconds, 1e-12);
  for (double* share : {&r.compute_share, &r.data_wait_share, &r.grad_sync_share, &r.optimizer_share}) *share /= t;
  r.tokens_per_s = tokens / t;
  r.mfu = r.matmul_peak_flops > 0 ? r.tokens_per_s * r.flops_per_token / r.matmul_peak_flops : 0.0;
  return r;
}

LadderResult median_run(std::vector<LadderResult> runs) {
  require(!runs.empty(), "ladder: a row without runs");
  std::vector<double> all;
  for (const auto& r : runs) all.push_back(r.tokens_per_s);
  std::sort(runs.begin(), runs.end(),
            [](const LadderResult& a, const LadderResult& b) { return a.tokens_per_s < b.tokens_per_s; });
  LadderResult m = runs[(runs.size() - 1) / 2];
  m.runs_tokens_per_s = std::move(all);
  return m;
}

void use_common_matmul_peak(std::vector<LadderResult>& rows) {
  double peak = 0;
  for (const auto& r : rows) peak = std::max(peak, r.matmul_peak_flops);
  for (auto& r : rows) r.mfu = peak > 0 ? r.tokens_per_s * r.flops_per_token / peak : 0.0;
}

std::string ladder_table(const std::vector<LadderResult>& rows) {
  size_t width = 5;
  for (const auto& r : rows) width = std::max(width, r.stage.size());
  std::string out = fmt::format("{:<{}}  {:>10}  {:>11}  {:>13}  {:>9}  {:>9}  {:>6}\n", "stage", width, "tokens/s",
                                "compute", "memory/rank", "grad sync", "data wait", "MFU");
  for (const auto& r : rows)
    out += fmt::format("{:<{}}  {:>10.1f}  {:>10.1f}%  {:>10.2f} GB  {:>8.1f}%  {:>8.1f}%  {:>5.1f}%\n", r.stage, width,
                       r.tokens_per_s, 100 * r.compute_share, double(r.peak_memory_bytes) / 1e9,
                       100 * r.grad_sync_share, 100 * r.data_wait_share, 100 * r.mfu);
  if (rows.size() > 1 && rows.front().tokens_per_s > 0)
    out += fmt::format("\n{:.1f} tokens/s, {:.2f}x the baseline.\n", rows.back().tokens_per_s,
                       rows.back().tokens_per_s / rows.front().tokens_per_s);
  return out;
}

std::string ladder_json(const std::string& recipe_path, int64_t steps, int64_t warmup_steps, int64_t repeats,
                        const std::vector<LadderStage>& stages, const std::vector<LadderResult>& rows) {
  std::string out = fmt::format(
      "{{\n  \"recipe\": {},\n  \"steps\": {},\n  \"warmup_steps_excluded\": {},\n"
      "  \"repeats\": {},\n  \"ranks\": {},\n  \"rows\": [\n",
      json_quoted(recipe_path), steps, warmup_steps, repeats, rows.empty() ? 1 : rows[0].ranks);
  for (size_t i = 0; i < rows.size(); ++i) {
    const LadderResult& r = rows[i];
    std::string settings;
    for (size_t k = 0; i < stages.size() && k < stages[i].settings.size(); ++k)
      settings += (k ? ", " : "") + json_quoted(stages[i].settings[k]);
    std::string runs;
    for (size_t k = 0; k < r.runs_tokens_per_s.size(); ++k)
      runs += (k ? ", " : "") + report::json_number(r.runs_tokens_per_s[k]);
    out += fmt::format(
        "    {{\"row\": {}, \"stage\": {}, \"settings\": [{}], \"tokens_per_s\": {}, \"compute_share\": {}, "
        "\"peak_memory_bytes\": {}, \"grad_sync_share\": {}, \"data_wait_share\": {}, \"optimizer_share\": {}, "
        "\"mfu\": {}, \"matmul_peak_flops\": {}, \"planned_memory_bytes\": {}, \"measured_steps\": {}, "
        "\"seconds\": {}, \"runs_tokens_per_s\": [{}], \"output_dir\": {}}}{}\n",
        i + 1, json_quoted(r.stage), settings, report::json_number(r.tokens_per_s),
        report::json_number(r.compute_share), r.peak_memory_bytes, report::json_number(r.grad_sync_share),
        report::json_number(r.data_wait_share), report::json_number(r.optimizer_share), report::json_number(r.mfu),
        report::json_number(r.matmul_peak_flops), r.planned_memory_bytes, r.measured_steps,
        report::json_number(r.seconds), runs, json_quoted(r.output_dir), i + 1 < rows.size() ? "," : "");
  }
  out += "  ]";
  if (rows.size() > 1 && rows.front().tokens_per_s > 0)
    out +=
        fmt::format(",\n  \"speedup\": {}", report::json_number(rows.back().tokens_per_s / rows.front().tokens_per_s));
  return out + "\n}\n";
}

}  // namespace keel::cli
