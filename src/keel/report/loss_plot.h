// A picture of the run: training loss and eval loss against steps, learning rate on a second
// axis, as a self-contained SVG (no plotting package needed), from metrics.jsonl.
#pragma once
#include <string>
#include <vector>

namespace keel::report {

struct PlotPoint {
  double step, loss, lr, eval_loss;  // eval_loss < 0 when not evaluated at that step
};

std::vector<PlotPoint> read_plot_points(const std::string& metrics_jsonl_path);
std::string loss_plot_svg(const std::vector<PlotPoint>& points, const std::string& title);
// Reads run_dir/metrics.jsonl and writes run_dir/loss.svg; returns the SVG's path.
std::string write_loss_plot(const std::string& run_dir);

}  // namespace keel::report
