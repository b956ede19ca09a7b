#include <nanobind/nanobind.h>

#include "keel/core/error.h"
#include "keel/bindings/bindings.h"

NB_MODULE(_native, m) {
  m.doc() = "keel's native core (the keel package wraps it: import keel)";
  // keel::Error (bad input, failed operations) is keel.Error, with the message the CLI prints.
  nanobind::exception<keel::Error>(m, "Error");
  keel::bindings::bind_recipe(m);
  keel::bindings::bind_training(m);
  keel::bindings::bind_loader(m);
}
