// keel.Trainer(config).train(), keel.plan() and keel.prepare(): the CLI's code paths, called with
// the GIL released (the callbacks take it back for the user's Python).
#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <csignal>
#include <iostream>

#include "keel/core/error.h"
#include "keel/data/prepare.h"
#include "keel/bindings/bindings.h"
#include "keel/report/memory_report.h"
#include "keel/recipe/recipe.h"
#include "keel/train/evaluation.h"
#include "keel/train/trainer.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace keel::bindings {
namespace {

// How records become documents: the settings keel.prepare and keel.Dataset share, set on
// data::PrepareOptions or data::TrainingDataRequest alike.
struct Encoding {
  std::string data_path, tokenizer;
  int64_t max_seq_len;
  std::string packing, chat_template;
  bool train_on_prompt, special_tokens_in_messages;
  double max_bad_fraction;
  int64_t vocab_size;
};

template <class Options>
void set_encoding(Options& o, const Encoding& e) {
  require(e.packing == "pack" || e.packing == "pad", "packing must be \"pack\" or \"pad\", got \"{}\"", e.packing);
  o.data_path = e.data_path;
  o.tokenizer_path = e.tokenizer;
  o.max_seq_len = e.max_seq_len;
  o.packing = e.packing == "pad" ? data::Packing::pad : data::Packing::pack;
  o.chat_template = e.chat_template;
  o.train_on_prompt = e.train_on_prompt;
  o.special_tokens_in_messages = e.special_tokens_in_messages;
  o.max_bad_fraction = e.max_bad_fraction;
  o.vocab_size = e.vocab_size;
}

// A step's record as the on_log callback gets it: metrics.jsonl's fields, integers as int.
nb::dict metrics_dict(const report::StepMetrics& m) {
  nb::dict d;
  d["step"] = m.step;
  for (const report::MetricField& f : report::step_metric_fields(m)) {
    if (f.format == report::MetricField::Format::Integer)
      d[f.name] = int64_t(f.value);
    else
      d[f.name] = f.value;
  }
  if (m.skipped) d["skipped"] = true;
  return d;
}

nb::dict train(const std::string& resolved_recipe, const std::string& source, const std::string& resume,
               bool overwrite, int64_t stop_after, const nb::object& on_log, const nb::object& on_evaluate,
               const nb::object& on_save) {
  const recipe::Recipe recipe = recipe::parse_recipe(resolved_recipe, source);
  // The user's callbacks run on the training thread with the GIL taken back; a Python exception
  // leaves as nb::python_error and ends the run (the trainer's destructors release its locks).
  train::TrainOptions options;
  options.resume = resume;
  options.overwrite = overwrite;
  options.stop_after_step = stop_after;
  if (!on_log.is_none())
    options.on_log = [&](const report::StepMetrics& m) {
      nb::gil_scoped_acquire gil;
      on_log(m.step, metrics_dict(m));
    };
  if (!on_evaluate.is_none())
    options.on_evaluate = [&](int64_t step, double loss, double perplexity) {
      nb::gil_scoped_acquire gil;
      nb::dict metrics;
      metrics["eval_loss"] = loss;
      metrics["eval_perplexity"] = perplexity;
      on_evaluate(step, metrics);
    };
  if (!on_save.is_none())
    options.on_save = [&](int64_t step, const std::string& directory) {
      nb::gil_scoped_acquire gil;
      on_save(step, directory);
    };
  train::TrainResult result;
  {
    nb::gil_scoped_release released;
    std::cout.flush();
    result = train::run_training(recipe, std::cout, options);
    std::cout.flush();
  }
  nb::dict out;
  out["summary_json"] = report::summary_json(result.summary);
  out["interrupted"] = result.interrupted;
  out["signal"] = result.interrupt_signal;
  return out;
}

}  // namespace

void bind_training(nb::module_& m) {
  m.def("train", &train, "resolved_recipe"_a, "source"_a, "resume"_a = "", "overwrite"_a = false,
        "stop_after"_a = 0, "on_log"_a = nb::none(), "on_evaluate"_a = nb::none(), "on_save"_a = nb::none(),
        "Runs `keel train` on a resolved recipe; returns the summary (JSON text) and whether a signal or "
        "stop_after stopped it early.");
  m.def(
      "evaluate",
      [](const std::string& resolved_recipe, const std::string& source) {
        const recipe::Recipe recipe = recipe::parse_recipe(resolved_recipe, source);
        train::EvalResult result;
        {
          nb::gil_scoped_release released;
          result = train::evaluate_recipe(recipe, std::cout);
          std::cout.flush();
        }
        nb::dict out;
        out["eval_loss"] = result.loss;
        out["eval_perplexity"] = result.perplexity;
        out["eval_target_tokens"] = result.target_tokens;
        return out;
      },
      "resolved_recipe"_a, "source"_a,
      "The recipe's model on its eval_data_path, as training evaluates: loss, perplexity, target tokens.");
  m.def(
      "plan",
      [](const std::string& resolved_recipe, const std::string& source, int64_t dp, int zero_stage,
         const std::string& device_memory, bool json) {
        const recipe::Recipe recipe = recipe::parse_recipe(resolved_recipe, source);
        report::PlanRequest request;
        request.dp = dp;
        request.zero_stage = zero_stage;
        if (!device_memory.empty()) request.device_memory_bytes = report::parse_memory_size(device_memory);
        nb::gil_scoped_release released;
        const auto report =
            json ? report::memory_report_json(recipe, request) : report::memory_report(recipe, request);
        return report.text;
      },
      "resolved_recipe"_a, "source"_a, "dp"_a = 0, "zero_stage"_a = -1, "device_memory"_a = "", "json"_a = true,
      "`keel plan`: the per-rank memory plan (JSON or the text the CLI prints).");
  m.def(
      "prepare",
      [](const std::string& data_path, const std::string& out_dir, const std::string& tokenizer, int64_t max_seq_len,
         const std::string& packing, const std::string& chat_template, bool train_on_prompt,
         bool special_tokens_in_messages, int threads, double max_bad_fraction, int64_t vocab_size) {
        data::PrepareOptions o;
        o.out_dir = out_dir;
        o.threads = threads;
        set_encoding(o, {data_path, tokenizer, max_seq_len, packing, chat_template, train_on_prompt,
                         special_tokens_in_messages, max_bad_fraction, vocab_size});
        nb::gil_scoped_release released;
        return data::report_json(data::prepare(o, &std::cerr));
      },
      "data_path"_a, "out_dir"_a, "tokenizer"_a = "", "max_seq_len"_a = 2048, "packing"_a = "pack",
      "chat_template"_a = "auto", "train_on_prompt"_a = false, "special_tokens_in_messages"_a = false,
      "threads"_a = 0, "max_bad_fraction"_a = 0.01, "vocab_size"_a = 0,
      "`keel prepare`: tokenizes and packs JSONL into shards; returns report.json's text.");
  m.def(
      "resolve_training_data",
      [](const std::string& data_path, const std::string& tokenizer, int64_t max_seq_len, const std::string& packing,
         const std::string& chat_template, bool train_on_prompt, bool special_tokens_in_messages,
         const std::string& cache_dir, double max_bad_fraction, int64_t vocab_size) {
        data::TrainingDataRequest q;
        q.cache_dir = cache_dir;
        set_encoding(q, {data_path, tokenizer, max_seq_len, packing, chat_template, train_on_prompt,
                         special_tokens_in_messages, max_bad_fraction, vocab_size});
        nb::gil_scoped_release released;
        return data::resolve_training_data(q, &std::cerr);
      },
      "data_path"_a, "tokenizer"_a, "max_seq_len"_a, "packing"_a, "chat_template"_a, "train_on_prompt"_a,
      "special_tokens_in_messages"_a, "cache_dir"_a, "max_bad_fraction"_a, "vocab_size"_a = 0,
      "What `keel train` does with data_path: a prepared directory as is, raw JSONL prepared once into the "
      "content-keyed cache (reused); returns the prepared directory.");
}

}  // namespace keel::bindings
