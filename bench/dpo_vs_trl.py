#!/usr/bin/env python3
"""DPO step throughput and memory: keel against TRL's DPOTrainer at its best settings on the CPU
(precompute_ref_log_probs=True, so no reference model is kept either; bf16 autocast; SDPA
attention; fused AdamW where torch has it on the CPU), on the same checkpoint, the same pairs, the
same cores, in one run. Each runs in its own process; this parent never imports torch.

Builds the bench model of train_vs_pytorch.py (random Llama: hidden 768, 12 layers, 12 heads,
intermediate 2048, vocab 32000) with a byte-level BPE tokenizer of its own, and preference pairs
whose rows (prompt + one answer) are about --seq tokens. Then:

  keel DPO       `keel train` with stage = "dpo" (sigmoid), dtype bf16
  TRL DPO        trl.DPOTrainer, precompute_ref_log_probs=True, bf16=True, use_cpu=True, sdpa
  keel SFT       `keel train` on the same rows as next-token data (batch 2 x pairs): the same tokens
                 per step, for the "no second model" memory claim

Reported: tokens/s (both answers' rows counted: the non-padding tokens of a step / the median step
time after the first), the reference pass's time (measured apart from the steps), peak RSS of the
process (ru_maxrss), keel's planned peak (summary.json), and the ratios. The last line is the table
as JSON (for docs/performance.md).

    $(scripts/python-env.sh) bench/dpo_vs_trl.py --keel build/keel [--steps 5] [--pairs 2] [--seq 512]
        [--small] [--threads N]
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))
from train_vs_pytorch import cpu_model, keel_version, run_child  # noqa: E402

WORDS = ("the a sky sun sea is blue green red cold warm high low water stone tree leaf river light dark fast slow "
         "two three four seven yes no maybe where what why how when who").split()


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keel", default="build/keel")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=2, help="pairs per step (batch_size; no accumulation)")
    ap.add_argument("--seq", type=int, default=512, help="tokens of a row (prompt + one answer), about")
    ap.add_argument("--small", action="store_true", help="a tiny model (hidden 128, 2 layers, vocab 2000): smoke test")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--work", default="")
    ap.add_argument("--role", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.small:
        a.hidden, a.layers, a.heads, a.intermediate, a.vocab = 128, 2, 4, 256, 2000
    else:
        a.hidden, a.layers, a.heads, a.intermediate, a.vocab = 768, 12, 12, 2048, 32000
    return a


def make_workload(a):
    """model/ (weights, tokenizer, template), pairs.jsonl and sft.jsonl (the same rows as ids)."""
    import torch  # noqa: F401  (hf_models needs it)
    import hf_models as hm
    from dpo_reference import make_tokenizer
    rng = random.Random(7)
    model_dir = os.path.join(a.work, "model")
    vocab = make_tokenizer(model_dir, rng)
    cfg = hm.make_config("llama", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.heads, head_dim=a.hidden // a.heads,
                         max_position_embeddings=a.seq + 64, tie_word_embeddings=False)
    cfg.update({"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2})
    model = hm.random_init(hm.build_model(hm.spec_from_config(cfg)), seed=1)
    hm.save_checkpoint(model_dir, cfg, hm.model_tensors(model))
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    per_word = len(tok.encode(words(400)).ids) / 400.0
    prompt_words, answer_words = int(a.seq * 0.4 / per_word), int(a.seq * 0.55 / per_word)
    with open(os.path.join(a.work, "pairs.jsonl"), "w") as f, open(os.path.join(a.work, "sft.jsonl"), "w") as g:
        for _ in range(a.steps * a.pairs):
            p = {"prompt": words(prompt_words), "chosen": " " + words(answer_words),
                 "rejected": " " + words(answer_words)}
            f.write(json.dumps(p) + "\n")
            for answer in (p["chosen"], p["rejected"]):
                ids = tok.encode(p["prompt"] + answer + "</s>").ids
                g.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")
    return model_dir, vocab


def keel_recipe(a, model_dir, name, dpo):
    out = os.path.join(a.work, name)
    lines = ["model_name = %s" % json.dumps(model_dir), 'dtype = "bf16"',
             "data_path = %s" % json.dumps(os.path.join(a.work, "pairs.jsonl" if dpo else "sft.jsonl")),
             "max_seq_len = %d" % (a.seq + 32), "batch_size = %d" % (a.pairs if dpo else 2 * a.pairs),
             "gradient_accumulation_steps = 1", "learning_rate = 1e-5", 'lr_scheduler = "constant"',
             "max_steps = %d" % a.steps, "shuffle = false", "weight_decay = 0.01", "max_grad_norm = 1.0",
             "output_dir = %s" % json.dumps(out), "cache_dir = %s" % json.dumps(os.path.join(out, "cache"))]
    if dpo:
        lines += ['stage = "dpo"', 'pref_loss = "sigmoid"', "pref_beta = 0.1", 'chat_template = "model"']
    path = os.path.join(a.work, name + ".toml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path, out


def run_keel(a, model_dir, name, dpo):
    path, out = keel_recipe(a, model_dir, name, dpo)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    code, log, rss = run_child([a.keel, "train", path], env=env)
    if code != 0:
        raise SystemExit("keel %s failed:\n%s" % (name, log[-3000:]))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        m = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    times = [x["step_time_s"] for x in m[1:]] or [m[0]["step_time_s"]]
    tokens = statistics.median(x["tokens"] for x in m)
    ref_s = None
    for line in log.splitlines():
        if "reference log-probabilities of" in line and " s (one forward pass" in line:
            ref_s = float(line.split(" in ")[1].split(" s ")[0])
    return {"tokens_per_s": tokens / statistics.median(times), "step_s": statistics.median(times),
            "tokens_per_step": tokens, "peak_rss": rss, "planned": s.get("planned_memory_bytes", 0),
            "reference_s": ref_s}


def trl_worker(a):
    """In its own process: TRL's DPOTrainer; prints one JSON line of its timings."""
    import time

    import datasets
    import torch
    import transformers
    import trl
    from torch.utils.data import SequentialSampler
    torch.set_num_threads(a.threads)
    model_dir = os.path.join(a.work, "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="sdpa")
    with open(os.path.join(a.work, "pairs.jsonl")) as f:
        pairs = [json.loads(line) for line in f]
    times, tokens = [], []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    class Trainer(trl.DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def _precompute_ref_logps(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._precompute_ref_logps(*args, **kwargs)
            self.reference_s = time.perf_counter() - t0
            return out

        def compute_loss(self, model, inputs, *args, **kwargs):
            tokens.append(int(inputs["attention_mask"].sum()))
            return super().compute_loss(model, inputs, *args, **kwargs)

    try:
        optim = "adamw_torch_fused"
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True)
    except Exception:  # no fused AdamW on this build's CPU path
        optim = "adamw_torch"
    args = trl.DPOConfig(
        output_dir=os.path.join(a.work, "trl"), per_device_train_batch_size=a.pairs, gradient_accumulation_steps=1,
        learning_rate=1e-5, lr_scheduler_type="constant", max_steps=a.steps, weight_decay=0.01, max_grad_norm=1.0,
        optim=optim, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=True, beta=0.1,
        loss_type=["sigmoid"], precompute_ref_log_probs=True, max_length=a.seq + 32, dataloader_num_workers=0,
        disable_tqdm=True, seed=1)
    trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(pairs),
                      processing_class=tokenizer, callbacks=[Timer()])
    trainer.train()
    step_s = statistics.median(times[1:] or times)
    print(json.dumps({"tokens_per_s": statistics.median(tokens) / step_s, "step_s": step_s,
                      "tokens_per_step": statistics.median(tokens), "reference_s": getattr(trainer, "reference_s", None),
                      "optim": optim, "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                                   "torch": torch.__version__}}))


def main():
    a = parse_args()
    if a.role == "trl":
        return trl_worker(a)
    if a.role == "make":
        make_workload(a)
        return 0
    a.work = a.work or tempfile.mkdtemp(prefix="keel-dpo-bench-")
    os.makedirs(a.work, exist_ok=True)
    # The workload is built in a child too: this process stays without torch (its peak RSS is not inherited).
    code, log, _ = run_child([sys.executable, __file__, "--role", "make"] + sys.argv[1:] + ["--work", a.work])
    if code != 0:
        raise SystemExit("building the workload failed:\n%s" % log[-3000:])
    rows = {}
    rows["keel DPO"] = run_keel(a, os.path.join(a.work, "model"), "keel_dpo", True)
    code, log, rss = run_child([sys.executable, __file__, "--role", "trl"] + sys.argv[1:] + ["--work", a.work],
                               env=dict(os.environ, OMP_NUM_THREADS=str(a.threads)))
    if code != 0:
        raise SystemExit("TRL failed:\n%s" % log[-3000:])
    trl_row = json.loads([line for line in log.splitlines() if line.startswith("{")][-1])
    trl_row["peak_rss"] = rss
    rows["TRL DPO"] = trl_row
    rows["keel SFT (same tokens)"] = run_keel(a, os.path.join(a.work, "model"), "keel_sft", False)
    print("DPO: %s; keel %s; trl %s, transformers %s, torch %s; %d thread(s); bench model hidden %d, %d layers, "
          "vocab %d; %d pairs a step, rows of ~%d tokens, %d steps" % (
              cpu_model(), keel_version(a.keel), trl_row["versions"]["trl"], trl_row["versions"]["transformers"],
              trl_row["versions"]["torch"], a.threads, a.hidden, a.layers, a.vocab, a.pairs, a.seq, a.steps))
    print("%-24s %12s %10s %14s %12s %12s" % ("", "tokens/s", "step s", "reference s", "peak RSS", "plan"))
    for name, r in rows.items():
        print("%-24s %12.1f %10.2f %14s %10.2f GB %12s" % (
            name, r["tokens_per_s"], r["step_s"], "%.2f" % r["reference_s"] if r.get("reference_s") else "-",
            r["peak_rss"] / 1e9, "%.2f GB" % (r["planned"] / 1e9) if r.get("planned") else "-"))
    k, t, s = rows["keel DPO"], rows["TRL DPO"], rows["keel SFT (same tokens)"]
    ratios = {"speed keel/TRL": k["tokens_per_s"] / t["tokens_per_s"],
              "reference pass TRL/keel": (t["reference_s"] / k["reference_s"]) if k["reference_s"] and t["reference_s"]
              else None,
              "peak RSS keel/TRL": k["peak_rss"] / t["peak_rss"],
              "peak RSS DPO/SFT (keel)": k["peak_rss"] / s["peak_rss"],
              "peak RSS / plan (keel DPO)": k["peak_rss"] / k["planned"] if k["planned"] else None}
    for name, v in ratios.items():
        print("%-28s %s" % (name, "%.3f" % v if v is not None else "-"))
    print(json.dumps({"rows": rows, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
