#include "keel/report/loss_plot.h"

#include <fmt/format.h>
#include <simdjson.h>

#include <algorithm>
#include <cmath>

#include "keel/core/error.h"
#include "keel/core/file_io.h"
#include "keel/report/metrics.h"

namespace keel::report {
namespace {

constexpr double kWidth = 800, kHeight = 450, kLeft = 70, kRight = 80, kTop = 40, kBottom = 55;

// "Nice" tick values covering [lo, hi] (1, 2 or 5 times a power of ten apart).
std::vector<double> ticks(double lo, double hi, int target = 6) {
  if (!(hi > lo)) hi = lo + 1;
  const double raw = (hi - lo) / target, magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = magnitude;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (raw <= m * magnitude) {
      step = m * magnitude;
      break;
    }
  std::vector<double> out;
  for (double v = std::ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push_back(v);
  return out;
}

std::string xml_escaped(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string label(double v) { return fmt::format("{:.4g}", v); }

struct Axis {
  double lo, hi, pixel_lo, pixel_hi;
  double map(double v) const { return pixel_lo + (v - lo) / (hi - lo) * (pixel_hi - pixel_lo); }
};

std::string polyline(const std::vector<std::pair<double, double>>& xy, const std::string& color, double width,
                     const std::string& dash = "") {
  if (xy.empty()) return "";
  std::string pts;
  for (auto [x, y] : xy) pts += fmt::format("{:.1f},{:.1f} ", x, y);
  return fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"{}\"{} points=\"{}\"/>\n", color, width,
                     dash.empty() ? "" : fmt::format(" stroke-dasharray=\"{}\"", dash), pts);
}

}  // namespace

namespace {

// Keeps at most about 2 * kMaxPlotPoints of a series of any length, evenly spread: when the
// kept points reach twice the budget every other one goes and the stride doubles. An 800-pixel
// plot shows no more, and a run of a billion steps plots in bounded memory.
constexpr size_t kMaxPlotPoints = 2000;

class Decimator {
 public:
  void add(const PlotPoint& p) {
    last_ = p;
    if (seen_++ % stride_ != 0) return;
    kept_.push_back(p);
    if (kept_.size() < 2 * kMaxPlotPoints) return;
    for (size_t i = 0; 2 * i < kept_.size(); ++i) kept_[i] = kept_[2 * i];
    kept_.resize((kept_.size() + 1) / 2);
    stride_ *= 2;
  }
  // The kept points, and always the last one seen (the plot ends where the run ended).
  std::vector<PlotPoint>& points() {
    if (seen_ > 0 && (seen_ - 1) % stride_ != 0) kept_.push_back(last_);
    seen_ = 0;
    return kept_;
  }

 private:
  std::vector<PlotPoint> kept_;
  PlotPoint last_{};
  int64_t seen_ = 0, stride_ = 1;
};

}  // namespace

std::vector<PlotPoint> read_plot_points(const std::string& path) {
  require(path_exists(path), "{}: no metrics to plot (expected metrics.jsonl from keel train)", path);
  Decimator training, evaluations;  // evaluations are rarer: thinned on their own
  simdjson::dom::parser parser;
  for_each_line(path, kMaxMetricsLineBytes, [&](std::string_view line, bool) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) return;
    simdjson::dom::element doc;
    if (parser.parse(line.data(), line.size()).get(doc) != simdjson::SUCCESS) return;  // a line cut by a crash
    PlotPoint p{-1, NAN, NAN, -1};
    double v;
    int64_t i;
    if (doc["step"].get_int64().get(i) == simdjson::SUCCESS) p.step = double(i);
    if (doc["loss"].get_double().get(v) == simdjson::SUCCESS) p.loss = v;
    if (doc["lr"].get_double().get(v) == simdjson::SUCCESS) p.lr = v;
    if (doc["eval_loss"].get_double().get(v) == simdjson::SUCCESS) p.eval_loss = v;
    if (p.step < 0) return;
    if (p.eval_loss >= 0) evaluations.add({p.step, NAN, NAN, p.eval_loss});
    p.eval_loss = -1;
    training.add(p);
  });
  std::vector<PlotPoint> points = std::move(training.points());
  points.insert(points.end(), evaluations.points().begin(), evaluations.points().end());
  std::stable_sort(points.begin(), points.end(),
                   [](const PlotPoint& a, const PlotPoint& b) { return a.step < b.step; });
  return points;
}

std::string loss_plot_svg(const std::vector<PlotPoint>& points, const std::string& title) {
  double s_lo = 1e300, s_hi = -1e300, l_lo = 1e300, l_hi = -1e300, lr_hi = 0;
  for (const auto& p : points) {
    s_lo = std::min(s_lo, p.step), s_hi = std::max(s_hi, p.step);
    for (double l : {p.loss, p.eval_loss})
      if (std::isfinite(l) && l >= 0) l_lo = std::min(l_lo, l), l_hi = std::max(l_hi, l);
    if (std::isfinite(p.lr)) lr_hi = std::max(lr_hi, p.lr);
  }
  if (points.empty()) s_lo = 0, s_hi = 1;
  if (l_lo > l_hi) l_lo = 0, l_hi = 1;
  if (s_hi <= s_lo) s_hi = s_lo + 1;
  const double pad = (l_hi - l_lo) * 0.05 + 1e-12;
  Axis x{s_lo, s_hi, kLeft, kWidth - kRight};
  Axis y{std::max(0.0, l_lo - pad), l_hi + pad, kHeight - kBottom, kTop};
  Axis y_lr{0, lr_hi > 0 ? lr_hi * 1.05 : 1, kHeight - kBottom, kTop};

  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"22\" font-size=\"15\" text-anchor=\"middle\">{3}</text>\n",
      kWidth, kHeight, kWidth / 2, xml_escaped(title));
  for (double t : ticks(x.lo, x.hi)) {
    svg += fmt::format("<line x1=\"{0:.1f}\" x2=\"{0:.1f}\" y1=\"{1}\" y2=\"{2}\" stroke=\"#eee\"/>\n", x.map(t), kTop,
                       kHeight - kBottom);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", x.map(t),
                       kHeight - kBottom + 16, label(t));
  }
  for (double t : ticks(y.lo, y.hi)) {
    svg += fmt::format("<line x1=\"{0}\" x2=\"{1}\" y1=\"{2:.1f}\" y2=\"{2:.1f}\" stroke=\"#eee\"/>\n", kLeft,
                       kWidth - kRight, y.map(t));
    svg +=
        fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", kLeft - 6, y.map(t) + 4, label(t));
  }
  if (lr_hi > 0)
    for (double t : ticks(0, y_lr.hi, 5))
      svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" fill=\"#c60\">{}</text>\n", kWidth - kRight + 6, y_lr.map(t) + 4,
                         fmt::format("{:.2g}", t));
  svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#333\"/>\n", kLeft,
                     kTop, kWidth - kLeft - kRight, kHeight - kTop - kBottom);
  svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">optimizer step</text>\n",
                     (kLeft + kWidth - kRight) / 2, kHeight - 12);
  svg += fmt::format("<text transform=\"translate(18 {}) rotate(-90)\" text-anchor=\"middle\">loss</text>\n",
                     (kTop + kHeight - kBottom) / 2);
  svg += fmt::format(
      "<text transform=\"translate({} {}) rotate(90)\" text-anchor=\"middle\" fill=\"#c60\">learning rate</text>\n",
      kWidth - 18, (kTop + kHeight - kBottom) / 2);

  std::vector<std::pair<double, double>> train, eval, lr;
  for (const auto& p : points) {
    if (std::isfinite(p.loss)) train.push_back({x.map(p.step), y.map(p.loss)});
    if (p.eval_loss >= 0) eval.push_back({x.map(p.step), y.map(p.eval_loss)});
    if (std::isfinite(p.lr) && lr_hi > 0) lr.push_back({x.map(p.step), y_lr.map(p.lr)});
  }
  svg += polyline(lr, "#c60", 1.2, "5,3");
  svg += polyline(train, "#1f77b4", 1.6);
  svg += polyline(eval, "#2ca02c", 2.0);
  for (auto [px, py] : eval)
    svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"#2ca02c\"/>\n", px, py);

  // Legend, top right inside the plot.
  std::vector<std::tuple<const char*, const char*, const char*>> entries = {{"training loss", "#1f77b4", ""}};
  if (!eval.empty()) entries.push_back({"eval loss", "#2ca02c", ""});
  if (!lr.empty()) entries.push_back({"learning rate", "#c60", "5,3"});
  const double lx = kWidth - kRight - 150, ly = kTop + 12;
  svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"142\" height=\"{}\" fill=\"white\" stroke=\"#999\"/>\n", lx - 6,
                     ly - 8, 8 + 18 * entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    auto [name, color, dash] = entries[i];
    const double yy = ly + 4 + i * 18;
    svg += polyline({{lx, yy}, {lx + 24, yy}}, color, 2.0, dash);
    svg += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", lx + 30, yy + 4, name);
  }
  return svg + "</svg>\n";
}

std::string write_loss_plot(const std::string& run_dir) {
  const auto points = read_plot_points(run_dir + "/metrics.jsonl");
  const std::string path = run_dir + "/loss.svg";
  write_file_atomic(path, loss_plot_svg(points, "keel: " + run_dir));
  return path;
}

}  // namespace keel::report
