#!/usr/bin/env python3
"""keel's preference tuning against TRL itself (trl.DPOTrainer, with precompute_ref_log_probs=True).

For each family: a tiny transformers model (random weights) with a byte-level BPE tokenizer of its
own (BOS added to plain text, a ChatML template), preference pairs written in TRL's forms (plain
strings, conversational, implicit prompt), and the same recipe for both trainers: the same pairs
in the same order (TRL's sampler made sequential), AdamW, a cosine schedule with warmup, gradient
clipping, gradient accumulation. Compared per step: the loss, the gradient norm, and every metric
TRL logs (rewards/*, logps/*, logits/*); at the end every trained tensor. fp32 within 1e-5 (loss,
metrics: absolute on values of order 1, relative for the log-probabilities; weights: relative to
each tensor's change).

  dpo_reference.py KEEL --family llama --loss sigmoid [--lora] [--form strings|messages|implicit]

--dtype bf16 measures keel's bf16 run against TRL's fp32 one with TRL's own bf16 runs (SDPA and
eager attention) as the yardstick, as the SFT reference tests measure bf16: the loss, gradient norm,
log-probabilities and reward margins of every step and each final tensor within 2.5x of TRL bf16's
largest distance from fp32, over 6 steps without warmup (3 steps gave one sample of a nonzero
margin: too few for a yardstick). Elements whose fp32 gradient bf16 cannot sign at some step are
held to AdamW's step bound instead (undetermined_signs; docs/preference.md: Gemma 2's final norm).
"""
import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models as hf  # noqa: E402
from train_reference import read_metrics, run_keel, toml_str  # noqa: E402

MAX_SEQ_LEN = 40
BATCH_PAIRS = 2
GRAD_ACCUM = 2
MAX_STEPS = 3
WARMUP_STEPS = 1
LEARNING_RATE = 5e-3
WEIGHT_DECAY = 0.1
MAX_GRAD_NORM = 1.0
BETA = 0.1
SEED = 1234
TOL = 1e-5
SIMPO_GAMMA = 0.5
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("the a sky sun sea is blue green red cold warm high low water stone tree leaf river light dark fast slow "
         "two three four seven yes no maybe where what why how when who").split()


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_tokenizer(directory, rng):
    """A byte-level BPE tokenizer trained on the word list, BOS before plain text (Llama's post-processor)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    specials = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [words(rng, 20) for _ in range(400)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "pad_token": "<pad>", "chat_template": CHATML}, f)
    return tok.get_vocab_size()


def make_pairs(rng, form, n):
    pairs = []
    for _ in range(n):
        q, good, bad = words(rng, rng.randrange(3, 8)), words(rng, rng.randrange(2, 9)), words(rng, rng.randrange(2, 9))
        if good == bad:
            bad += " no"
        if form == "strings":
            pairs.append({"prompt": q + " ?", "chosen": " " + good, "rejected": " " + bad})
        elif form == "messages":
            pairs.append({"prompt": [{"role": "user", "content": q}],
                          "chosen": [{"role": "assistant", "content": good}],
                          "rejected": [{"role": "assistant", "content": bad}]})
        else:  # implicit prompt: whole conversations sharing their first turn
            user = {"role": "user", "content": q}
            pairs.append({"chosen": [user, {"role": "assistant", "content": good}],
                          "rejected": [user, {"role": "assistant", "content": bad}]})
    return pairs


def trl_train(model_dir, family, pairs, loss, lora, out_dir, ftx=0.0, smoothing=0.0, bf16=False, attention=None,
              undetermined=None):
    """TRL's run; `undetermined`, if a dict, gets {parameter: count per element of the optimizer steps
    whose gradient there was below bf16's resolution of its tensor's gradients} (undetermined_signs)."""
    import datasets
    import transformers
    import trl
    from torch.utils.data import SequentialSampler

    class SequentialDPOTrainer(trl.DPOTrainer):
        """TRL's trainer with the pairs in file order, as keel's shuffle = false reads them."""

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    # Gemma 2's logit softcapping has no SDPA kernel in transformers: eager, as transformers chooses.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32,
        attn_implementation=attention or ("eager" if family.startswith("gemma") else "sdpa"))
    if lora:  # the adapter keel starts from too (PEFT's B is zero: the reference is the base model)
        import peft
        model = peft.PeftModel.from_pretrained(model, lora, is_trainable=True)
    common = dict(
        output_dir=out_dir, per_device_train_batch_size=BATCH_PAIRS, gradient_accumulation_steps=GRAD_ACCUM,
        learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY, max_steps=MAX_STEPS, warmup_steps=WARMUP_STEPS,
        lr_scheduler_type="cosine", max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch", adam_beta1=0.9,
        adam_beta2=0.999, adam_epsilon=1e-8, seed=SEED, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, beta=BETA, max_length=MAX_SEQ_LEN, dataloader_num_workers=0, bf16=bf16, fp16=False,
        disable_tqdm=True)
    if loss in ("simpo", "orpo"):
        # SimPO is CPOTrainer's loss_type="simpo" with cpo_alpha = 0; ORPO has a trainer of its own. Both
        # tokenize plain strings only (BOS and EOS ids added), which for these pairs gives DPOTrainer's ids.
        if loss == "simpo":
            from trl.experimental.cpo import CPOConfig as Config, CPOTrainer as Base
            args = Config(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=SIMPO_GAMMA, label_smoothing=smoothing,
                          **common)
        else:
            from trl.experimental.orpo import ORPOConfig as Config, ORPOTrainer as Base
            args = Config(**common)

        class Sequential(Base):
            def _get_train_sampler(self, *args, **kwargs):
                return SequentialSampler(self.train_dataset)

        trainer = Sequential(model=model, args=args, train_dataset=datasets.Dataset.from_list(pairs),
                             processing_class=tokenizer)
    else:
        # pref_ftx is TRL's "sft" loss_type beside the preference loss, weighted so.
        losses = dict(loss_type=[loss, "sft"], loss_weights=[1.0, ftx]) if ftx else dict(loss_type=[loss])
        args = trl.DPOConfig(precompute_ref_log_probs=True, **losses, **common)
        trainer = SequentialDPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(pairs),
                                       processing_class=tokenizer)
    if undetermined is not None:
        trainer.add_callback(undetermined_signs(undetermined))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "step" in h]
    final = {}
    trained = trainer.model
    if lora:
        for name, p in trained.named_parameters():
            if p.requires_grad:
                final[name] = p.detach().float().clone()
    else:
        final = {n: p.detach().float().clone() for n, p in trained.named_parameters()}
    return logs, final


METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected"]


def close(a, b, scale=1.0):
    return abs(a - b) <= TOL * max(1.0, abs(b) / scale if scale else 1.0)


def compare(logs, metrics, loss, ftx, failures):
    if len(metrics) != MAX_STEPS or len(logs) != MAX_STEPS:
        failures.append("steps: keel %d, TRL %d (expected %d)" % (len(metrics), len(logs), MAX_STEPS))
        return
    for h in logs:
        step = h["step"]
        k = metrics.get(step)
        if k is None:
            failures.append("step %d missing from keel's metrics.jsonl" % step)
            continue
        row = ["step %d" % step]
        # CPOTrainer's and ORPOTrainer's logits/* average every position of the padded batch (prompt
        # and padding too); keel reports DPOTrainer's definition (the answers' tokens) for every loss.
        names = METRICS if loss not in ("simpo", "orpo") else [m for m in METRICS if not m.startswith("logits/")]
        if loss == "orpo":
            names += ["log_odds_ratio", "log_odds_chosen", "nll_loss"]
        for name in ["loss", "grad_norm"] + names:
            if name not in h:
                failures.append("TRL logged no %s" % name)
                continue
            if name not in k:
                failures.append("step %d: keel's metrics.jsonl has no %s" % (step, name))
                continue
            a, b = float(k[name]), float(h[name])
            # Log-probabilities are sums over tokens (tens of nats): compared relative to their size.
            ok = abs(a - b) <= TOL * max(1.0, abs(b))
            row.append("%s %.8g/%.8g%s" % (name, a, b, "" if ok else " !!"))
            if not ok:
                failures.append("step %d %s: keel %.9g, TRL %.9g (|diff| %.3g)" % (step, name, a, b, abs(a - b)))
        print("  " + "  ".join(row))
    # Step 1 starts from the reference itself: every reward is 0, and the loss is the loss of a
    # zero margin (sigmoid: ln 2; hinge: 1; ipo: (1 / (2 beta))^2) -- in keel's own numbers too.
    first = metrics.get(1, {})
    expected = {"sigmoid": math.log(2), "hinge": 1.0, "ipo": (1 / (2 * BETA)) ** 2}.get(loss)
    if expected is None:  # SimPO and ORPO have no reference: nothing is zero at step 1
        return
    if ftx:  # the added NLL term has no fixed value
        expected = float(first.get("loss", -1))
    if abs(float(first.get("loss", -1)) - expected) > 1e-6 * max(1.0, expected):
        failures.append("step 1: keel's loss %r is not %.9g (the loss at zero margin)" % (first.get("loss"), expected))
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        if float(first.get(name, 1)) != 0.0:
            failures.append("step 1: keel's %s is %r, not 0 (the policy is the reference)" % (name, first.get(name)))


BF16_GAP_FACTOR = 2.5  # as train_reference.py: keel's bf16 within 2.5x of torch bf16's own distance from fp32
BF16_RESOLUTION = 2.0 ** -8  # bf16's relative spacing: 8 bits of significand
# AdamW's step is at most lr x (1 - beta1) / sqrt(1 - beta2) (Kingma & Ba 2015, section 2.1; 3.16 at
# 0.9 / 0.999): a gradient of flipped sign moves an element by up to twice that.
ADAM_STEP_BOUND = (1 - 0.9) / math.sqrt(1 - 0.999)


def undetermined_signs(counts):
    """A TrainerCallback counting, per element, the optimizer steps where the fp32 gradient is
    smaller than BF16_RESOLUTION x the median |gradient| of its tensor. Such a gradient is zero to
    within bf16's rounding of the terms it sums, so a bf16 run may get either sign, and AdamW turns
    either into a step of about the learning rate (its first step is lr x sign(g) whatever |g| is).
    Measured on Gemma 2's final norm: element 1's step-1 gradient is -4.0e-6 against a median of
    9.2e-4; TRL's autocast run gets -2.0e-6, torch with the model in bf16 +1.1e-5, keel +: the two
    land a full step (2 x lr) apart, which no rounding of the other 63 elements comes near."""
    import transformers

    class Count(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            for name, p in model.named_parameters():
                if p.grad is None:
                    continue
                g = p.grad.detach().float().abs()
                small = (g < BF16_RESOLUTION * g.median()).to(torch.int32)
                counts[name] = counts[name] + small if name in counts else small
    return Count()
BF16_KEYS = ["loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/margins"]


def compare_bf16(logs32, runs16, metrics, final32, init, keel_final, lora, failures, undetermined):
    """keel's bf16 run against TRL's fp32 run, each quantity within BF16_GAP_FACTOR x the distance
    TRL's own bf16 autocast runs land from it (the largest over the steps and over its runs with
    SDPA and with eager attention, which round different intermediates), as the SFT reference tests
    measure bf16; the weights likewise, tensor by tensor, by train_reference.weight_errors (the
    distance's norm relative to the tensor's and to its change over the run). Elements whose
    gradient's sign bf16 cannot determine at some step (`undetermined`, from undetermined_signs)
    are held apart: each within twice AdamW's largest step (ADAM_STEP_BOUND x lr) per such step of the
    fp32 run, plus BF16_GAP_FACTOR x TRL bf16's distance at that element; keel's distance over the
    rest stays within BF16_GAP_FACTOR x TRL bf16's distance over the whole tensor."""
    for name in BF16_KEYS:
        gap = max(abs(float(b[name]) - float(f[name])) for logs16, _ in runs16 for b, f in zip(logs16, logs32))
        tol = BF16_GAP_FACTOR * gap + 1e-7
        worst = max(abs(float(metrics[f["step"]][name]) - float(f[name])) for f in logs32)
        print("  bf16 %-16s keel-fp32 %.3g, TRL bf16-fp32 %.3g (tolerance %.3g)" % (name, worst, gap, tol))
        if worst > tol:
            failures.append("bf16 %s: keel is %.3g from TRL's fp32 run, over %.1f x TRL bf16's %.3g"
                            % (name, worst, BF16_GAP_FACTOR, gap))
    from train_reference import weight_errors
    keel = load_keel_final(keel_final, final32, lora, failures)
    worst_ratio = 0.0
    for name, (a, short) in keel.items():
        f, w0 = final32[short].double(), init[short].double()
        steps = undetermined.get(short, torch.zeros_like(f, dtype=torch.int32)).reshape(f.shape)
        keep = steps == 0
        if not bool(keep.all()):
            bound = 2 * ADAM_STEP_BOUND * LEARNING_RATE * steps.double() + BF16_GAP_FACTOR * torch.stack(
                [(final16[short].double() - f).abs() for _, final16 in runs16]).amax(0)
            off = (a.double() - f).abs()
            ratio = (off[~keep] / bound[~keep]).max().item()
            print("  bf16 %s: %d element(s) of undetermined sign (fp32 gradient below 2^-8 of the median at a step); "
                  "keel's distance from fp32 at most %.2f of the bound" % (short, int((~keep).sum()), ratio))
            if ratio > 1:
                failures.append("bf16 final %s: an element of undetermined sign %.2f x beyond its bound" % (short, ratio))
        dist = weight_errors(a.double(), f, w0, keep)
        # The yardstick is TRL bf16's distance over the whole tensor, as before; only keel's side
        # leaves out the elements of undetermined sign, which are held to their own bound above.
        every = torch.ones_like(f, dtype=torch.bool)
        gaps = [weight_errors(final16[short].double(), f, w0, every) for _, final16 in runs16]
        for i, what in enumerate(("of the tensor", "of its change")):
            gap = max(g[i] for g in gaps)
            worst_ratio = max(worst_ratio, dist[i] / max(gap, 1e-30))
            if dist[i] > BF16_GAP_FACTOR * gap + 1e-9:
                failures.append("bf16 final %s: keel %.3g %s from fp32, TRL bf16 %.3g" % (short, dist[i], what, gap))
    print("  bf16 final weights: %d tensors, worst keel distance from fp32 / TRL bf16's: %.2f" % (len(keel), worst_ratio))


def load_keel_final(keel_final, trl_final, lora, failures):
    """{TRL's name: (keel's tensor, TRL's name)} for every tensor TRL trained."""
    from safetensors.torch import load_file
    out = {}
    if lora:
        tensors = load_file(os.path.join(keel_final, "adapter_model.safetensors"))
        for full in trl_final:
            key = "base_model.model." + full.replace("base_model.model.", "").replace(".default", "")
            if key in tensors:
                out[full] = (tensors[key].float(), full)
            else:
                failures.append("keel's adapter has no %s" % key)
    else:
        tensors = hf.load_checkpoint(keel_final)
        out = {n: (tensors[n].float(), n) for n in trl_final if n in tensors}
    return out


def compare_weights(keel_final, trl_final, init, lora, failures):
    """Every trained tensor within 1e-5 of TRL's (absolute: the weights are of order 0.01-1); how far
    that is relative to each tensor's change over the run is printed too."""
    from safetensors.torch import load_file
    if lora:
        keel_tensors = load_file(os.path.join(keel_final, "adapter_model.safetensors"))
        names = {n.replace("base_model.model.", "").replace(".default", ""): n for n in trl_final}
        pairs = []
        for short, full in names.items():
            key = "base_model.model." + short
            if key not in keel_tensors:
                failures.append("keel's adapter has no %s" % key)
                continue
            pairs.append((short, keel_tensors[key].float(), trl_final[full], None))
    else:
        keel_tensors = hf.load_checkpoint(keel_final)
        pairs = [(n, keel_tensors[n].float(), t, init.get(n)) for n, t in trl_final.items() if n in keel_tensors]
        missing = [n for n in trl_final if n not in keel_tensors and not n.endswith("lm_head.weight")]
        if missing:
            failures.append("tensors TRL trained that keel's final model lacks: %s" % missing[:5])
    worst = worst_rel = 0.0
    for name, a, b, w0 in pairs:
        diff = float((a - b).abs().max())
        change = float((b - w0).abs().max()) if w0 is not None else float(b.abs().max())
        worst, worst_rel = max(worst, diff), max(worst_rel, diff / max(change, 1e-12))
        if diff > TOL:
            failures.append("final %s: max |keel - TRL| = %.3g (the tensor moved %.3g)" % (name, diff, change))
    print("  final weights: %d tensors, worst |keel - TRL| %.3g (%.3g of the tensor's change)"
          % (len(pairs), worst, worst_rel))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("keel")
    ap.add_argument("--family", default="llama", choices=["llama", "qwen3", "gemma2", "qwen2", "mistral", "gemma3"])
    ap.add_argument("--loss", default="sigmoid", choices=["sigmoid", "ipo", "hinge", "simpo", "orpo"])
    ap.add_argument("--form", default="strings", choices=["strings", "messages", "implicit"])
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--ftx", type=float, default=0.0, help="pref_ftx (DPOTrainer: the sft loss_type's weight)")
    ap.add_argument("--smoothing", type=float, default=0.0, help="dpo_label_smoothing (SimPO: CPO's label_smoothing)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--work", default="")
    ap.add_argument("--timeout", type=int, default=600)
    a = ap.parse_args()
    if a.dtype == "bf16":
        # bf16's yardstick is TRL's own bf16 distance from fp32, the largest over the steps: with
        # more steps past warmup there are more samples of it (the rewards are 0 until the weights move).
        global MAX_STEPS, WARMUP_STEPS
        MAX_STEPS, WARMUP_STEPS = 6, 0
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    work = a.work or tempfile.mkdtemp(prefix="keel-dpo-")
    if os.path.isdir(work):
        shutil.rmtree(work)
    os.makedirs(work)
    rng = random.Random(SEED)
    model_dir = os.path.join(work, "model")
    vocab = make_tokenizer(model_dir, rng)
    cfg = hf.make_config(a.family, vocab_size=vocab)
    cfg.update({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})
    spec = hf.spec_from_config(cfg)
    model = hf.random_init(hf.build_model(spec), 0, embed_std=0.1 if spec.tie_word_embeddings else 0.5)
    init = hf.model_tensors(model)
    hf.save_checkpoint(model_dir, cfg, init)
    adapter = ""
    if a.lora:
        import peft
        torch.manual_seed(SEED)
        adapter = os.path.join(work, "adapter")
        peft.get_peft_model(hf.build_model(spec, init), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
        ).save_pretrained(adapter)
    pairs = make_pairs(rng, a.form, BATCH_PAIRS * GRAD_ACCUM * MAX_STEPS)
    data = os.path.join(work, "pairs.jsonl")
    with open(data, "w") as f:
        for p in pairs:
            f.write(json.dumps(p) + "\n")
    out = os.path.join(work, "out")
    lines = [
        "model_name = %s" % toml_str(model_dir), "dtype = %s" % toml_str(a.dtype), "data_path = %s" % toml_str(data),
        "max_seq_len = %d" % MAX_SEQ_LEN, "batch_size = %d" % BATCH_PAIRS,
        "gradient_accumulation_steps = %d" % GRAD_ACCUM, "learning_rate = %r" % LEARNING_RATE,
        "weight_decay = %r" % WEIGHT_DECAY, "max_steps = %d" % MAX_STEPS, "warmup_steps = %d" % WARMUP_STEPS,
        'lr_scheduler = "cosine"', "max_grad_norm = %r" % MAX_GRAD_NORM, "seed = %d" % SEED, "shuffle = false",
        'stage = "dpo"', "pref_loss = %s" % toml_str(a.loss), "pref_beta = %r" % BETA,
    ] + (["simpo_gamma = %r" % SIMPO_GAMMA] if a.loss == "simpo" else []) + (
        ["pref_ftx = %r" % a.ftx] if a.ftx else []) + (["dpo_label_smoothing = %r" % a.smoothing] if a.smoothing else []) + [
        'chat_template = "model"', "output_dir = %s" % toml_str(out),
    ]
    if a.lora:
        lines += ['finetuning_type = "lora"', "lora_rank = 4", "lora_alpha = 8",
                  "lora_target = %s" % toml_str(",".join(LORA_TARGETS)), "adapter_name_or_path = %s" % toml_str(adapter)]
    with open(os.path.join(work, "recipe.toml"), "w") as f:
        f.write("\n".join(lines) + "\n")
    failures = run_keel(a.keel, work, a.timeout)
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    metrics = read_metrics(os.path.join(out, "metrics.jsonl"), failures)
    if a.dtype == "bf16":
        undetermined = {}
        logs32, final32 = trl_train(model_dir, a.family, pairs, a.loss, adapter, os.path.join(work, "trl32"), a.ftx,
                                    a.smoothing, undetermined=undetermined)
        runs16 = [trl_train(model_dir, a.family, pairs, a.loss, adapter, os.path.join(work, "trl16_" + attention),
                            a.ftx, a.smoothing, bf16=True, attention=attention)
                  for attention in (["eager"] if a.family.startswith("gemma") else ["sdpa", "eager"])]
        print("%s %s %s%s bf16: keel against TRL fp32, TRL bf16 as the yardstick" % (
            a.family, a.loss, a.form, " LoRA" if a.lora else ""))
        start = init
        if a.lora:  # the adapter PEFT initialised, in TRL's names
            from safetensors.torch import load_file
            start = {n.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight"): t
                     for n, t in load_file(os.path.join(adapter, "adapter_model.safetensors")).items()}
        compare_bf16(logs32, runs16, metrics, final32, start, os.path.join(out, "final"), a.lora, failures, undetermined)
        if failures:
            print("FAIL (%d):\n  %s" % (len(failures), "\n  ".join(failures)))
            return 1
        print("PASS")
        return 0
    logs, trl_final = trl_train(model_dir, a.family, pairs, a.loss, adapter, os.path.join(work, "trl"), a.ftx,
                                a.smoothing)
    print("%s %s %s%s: keel / TRL per step" % (a.family, a.loss, a.form, " LoRA" if a.lora else ""))
    compare(logs, metrics, a.loss, a.ftx, failures)
    compare_weights(os.path.join(out, "final"), trl_final, init, a.lora, failures)
    if failures:
        print("FAIL (%d):\n  %s" % (len(failures), "\n  ".join(failures)))
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
