// The embedded demo: a tiny Llama-architecture model learns two-digit addition, asked in chat
// form, from scratch. Everything it needs is generated here, so it runs on a fresh machine with
// nothing downloaded: conversations (train and held-out problems), a byte-level BPE tokenizer
// trained by keel on them, a recipe whose raw JSONL keel prepares with the ChatML template (loss on
// the answers only), training through the normal `keel train` path, then greedy chat answers on
// the held-out problems before and after, from the exported model and its tokenizer. With --dpo, a
// preference stage follows: pairs of the correct answer and a plausible wrong one (a carry
// missed, a digit off), DPO from the SFT model, and the same held-out answers after it.
#pragma once
#include <cstdint>
#include <ostream>
#include <string>

namespace keel::cli {

struct DemoOptions {
  std::string work_dir = "demo";
  int64_t max_steps = 1500;
  int64_t held_out = 200;
  // A preference stage after supervised fine-tuning: DPO on pairs of a correct answer and a wrong
  // one, from the SFT model, for dpo_steps steps.
  bool dpo = false;
  int64_t dpo_steps = 150;
};

struct DemoResult {
  double accuracy_before = 0, accuracy_after = 0;
  double first_loss = 0, final_loss = 0;
  double accuracy_after_dpo = -1;                  // held-out chat accuracy of the DPO model
  double reward_accuracy = -1, held_out_reward_accuracy = -1;  // DPO's, at its last step
};

DemoResult run_demo(const DemoOptions& options, std::ostream& log);

}  // namespace keel::cli
