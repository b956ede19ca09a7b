// What stage = "dpo" adds to a training run (train/trainer.cpp holds one when the recipe asks):
// the pairs as the run's batch source, the reference log-probabilities (computed once by the
// initial weights, or read from their cache), the preference objective, and evaluation on
// held-out pairs with the same loss and metrics.
#pragma once
#include <memory>
#include <optional>
#include <ostream>
#include <string>

#include "keel/distributed/communicator.h"
#include "keel/model/decoder.h"
#include "keel/report/metrics.h"
#include "keel/recipe/recipe.h"
#include "keel/train/data_sources.h"
#include "keel/train/objective.h"
#include "keel/train/preference_loss.h"

namespace keel::train {

class PreferenceStage {
 public:
  // Reads the training pairs (and eval_data_path's) with `options` (batch_size counts pairs).
  PreferenceStage(const recipe::Recipe& recipe, const BatchSourceOptions& options, const BatchSourceOptions& eval_options,
                  int rank, int ranks, std::ostream& log);

  // The training pairs as the run's batch source (once).
  std::unique_ptr<BatchSource> take_source();
  // The reference pass (or its cache), with the decoder's weights as they are: call it before a
  // resume loads a checkpoint's. Nothing for SimPO and ORPO.
  void prepare_reference(model::Decoder& decoder, distributed::Communicator& comm);
  // The step's objective (it reads the reference log-probabilities this stage keeps).
  std::unique_ptr<Objective> make_objective() const;
  bool evaluates() const { return eval_ != nullptr; }
  // The loss and metrics over every held-out pair, in order (each rank computes the whole).
  void evaluate(model::Decoder& decoder, report::StepMetrics& m) const;
  // What the banner says of the stage.
  std::string describe() const;

 private:
  const recipe::Recipe& r_;
  int rank_, ranks_;
  std::ostream& log_;
  std::unique_ptr<PairSource> train_owned_;
  PairSource* train_ = nullptr;
  std::unique_ptr<PairSource> eval_;
  ReferenceLogps reference_, eval_reference_;
};

// The reference log-probabilities' cache key: what the reference model is (its weight files and the
// adapter's by content, the precision and quantization, the backend, the row length), then with the
// ids of one set of pairs.
std::string reference_model_key(const recipe::Recipe& recipe);
std::string reference_cache_key(const std::string& model_key, const PairSource& pairs);

}  // namespace keel::train
