// adapter_config.json of a PEFT LoRA adapter (adapter_name_or_path, keel generate --adapter): a
// config keel accepts must describe an adapter it can build — a rank in range, a finite alpha, a
// dropout in [0, 1), at least one target, each (and each of modules_to_save) a name that can match
// a module: no empty name, no empty part between dots — and everything else must be a keel::Error
// naming the file, never a crash.
#include <fmt/format.h>

#include <cmath>

#include "fuzz_support.h"
#include "keel/model/peft_adapter.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace keel;
  const std::string text(reinterpret_cast<const char*>(data), size);
  model::PeftAdapterConfig c;
  try {
    c = model::parse_peft_adapter_config(text, "adapter_config.json");
  } catch (const Error& e) {
    if (std::string(e.what()).rfind("adapter_config.json", 0) != 0)
      fuzz::property_failed("errors name the file", e.what());
    return 0;
  }
  if (c.spec.rank < 1 || c.spec.rank > 65536 || !std::isfinite(c.spec.alpha) || !(c.dropout >= 0 && c.dropout < 1) ||
      c.spec.targets.empty())
    fuzz::property_failed("an accepted config is usable",
                          fmt::format("rank {} alpha {} dropout {} targets {}", c.spec.rank, c.spec.alpha, c.dropout,
                                      c.spec.targets.size()));
  auto matchable = [](const std::string& name) {
    return !name.empty() && name.front() != '.' && name.back() != '.' && name.find("..") == std::string::npos;
  };
  for (const auto* names : {&c.spec.targets, &c.spec.modules_to_save})
    for (const auto& name : *names)
      if (!matchable(name)) fuzz::property_failed("an accepted module name can match a module", "\"" + name + "\"");
  (void)c.spec.scaling();
  return 0;
}
