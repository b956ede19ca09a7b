// The run banner's lines about a mixture of experts (train/trainer.cpp prints the rest): nothing
// for a dense model.
#pragma once
#include <ostream>
#include <string>

#include "keel/model/decoder.h"

namespace keel::train {

// Which layers are sparse and how they route, and whether the load-balancing loss joins the loss
// (it is reported as aux_loss either way).
void print_experts_routing(std::ostream& log, const model::Decoder& decoder);
// QLoRA: what is 4-bit among the experts (`type`: NF4 or FP4), and what is not.
void print_experts_four_bit(std::ostream& log, const model::Decoder& decoder, const std::string& type);
// LoRA: whether the experts are adapted (PEFT's target_parameters), and that the router never is.
void print_experts_lora(std::ostream& log, const model::Decoder& decoder);

}  // namespace keel::train
