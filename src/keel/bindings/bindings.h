// keel._native: the C++ side of the keel Python package (python/keel/). Each file binds one room's
// entry points; python/keel/ builds the Python API (TrainingConfig, Trainer, DataLoader) on them.
#pragma once
#include <nanobind/nanobind.h>

namespace keel::bindings {

void bind_recipe(nanobind::module_& m);    // recipe_bindings.cpp: defaults, aliases, validation
void bind_training(nanobind::module_& m);  // training_bindings.cpp: train, plan, prepare
void bind_loader(nanobind::module_& m);    // loader_bindings.cpp: the prefetching shard loader

}  // namespace keel::bindings
