#!/usr/bin/env python3
"""Preference tuning (stage = "dpo") end to end, beyond the numbers TRL checks (dpo_reference.py):
an interrupted run resumes bit-exactly (with the reference log-probabilities from their cache, and
recomputed when the cache is gone; and at dp = 2 under ZeRO-2); a second run reads the cache instead of a reference pass;
held-out pairs are evaluated with TRL's eval_* metrics; data parallel (dp = 2, ZeRO 0-3) gives dp = 1's
losses and metrics; bf16 trains; bad pairs and pair data given to supervised fine-tuning are named.

    $(scripts/python-env.sh) tests/integration/preference_test.py KEEL [--only NAME]
"""
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
from dpo_reference import make_pairs, make_tokenizer  # noqa: E402
from harness import check, final_bytes, metrics, mpi_env, run_tests, write_recipe_file  # noqa: E402

KEEL = os.path.abspath(sys.argv[1])
ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
WORK = tempfile.mkdtemp(prefix="keel_preference_test_")
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-x", "OMP_NUM_THREADS=1"]
TOKENIZER = os.path.join(WORK, "tokenizer")
VOCAB = make_tokenizer(TOKENIZER, random.Random(3))
TRAIN, HELD_OUT = os.path.join(WORK, "pairs.jsonl"), os.path.join(WORK, "held_out.jsonl")
for path, form, n, seed in ((TRAIN, "strings", 48, 1), (HELD_OUT, "messages", 5, 2)):
    with open(path, "w") as f:
        for p in make_pairs(random.Random(seed), form, n):
            f.write(json.dumps(p) + "\n")
MODEL = {"family": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
         "num_heads": 4, "num_kv_heads": 2}


def recipe(name, **overrides):
    d = os.path.join(WORK, name)
    os.makedirs(d, exist_ok=True)
    keys = {"data_path": TRAIN, "tokenizer": TOKENIZER, "chat_template": "model", "output_dir": os.path.join(d, "out"),
            "dtype": "fp32", "max_seq_len": 40, "batch_size": 2, "gradient_accumulation_steps": 2,
            "learning_rate": 3e-3, "warmup_steps": 1, "max_steps": 8, "seed": 5, "shuffle": True, "log_interval": 1,
            "stage": "dpo", "pref_beta": 0.2, "cache_dir": os.path.join(d, "cache")}
    keys.update(overrides)
    return write_recipe_file(os.path.join(d, "recipe.toml"), keys, MODEL), d


def run(args, ranks=1, timeout=600):
    cmd = ([KEEL] if ranks == 1 else MPIRUN + ["-np", str(ranks), KEEL]) + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=None if ranks == 1 else mpi_env())




KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
        "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected")


def test_resume_is_bit_exact():
    for drop_cache in (False, True):
        name = "resume_%s" % ("recomputed" if drop_cache else "cached")
        ck = os.path.join(WORK, name, "ckpt")
        path, d = recipe(name, checkpoint_dir=ck, save_interval=4)
        r = run(["train", path])
        check(r.returncode == 0, "%s: straight run (%s)" % (name, r.stderr[-800:]))
        check("reference log-probabilities of 48 training pairs computed" in r.stdout,
              "%s: the reference pass is reported (%s)" % (name, r.stdout[-1500:]))
        straight_m, straight_w = metrics(d), final_bytes(d)
        shutil.rmtree(os.path.join(d, "out"))
        shutil.rmtree(ck)
        r1 = run(["train", path, "--stop-after", "4"])
        if drop_cache:
            shutil.rmtree(os.path.join(d, "cache"))
        r2 = run(["train", path, "--resume"])
        check(r1.returncode == 0 and r2.returncode == 0, "%s: stop + resume (%s %s)" % (name, r1.stderr, r2.stderr))
        said = "computed by an earlier run" if not drop_cache else "computed by the initial weights"
        check(said in r2.stdout, "%s: the resume says where the reference came from: %r" % (name, said))
        key = lambda m: [[x.get(k) for k in KEYS] for x in m]
        check(key(straight_m) == key(metrics(d)), "%s: every step's loss and metrics bit-identical" % name)
        check(straight_w == final_bytes(d), "%s: final weights bit-identical" % name)


def test_resume_at_dp2_is_bit_exact():
    """Two ranks under ZeRO-2, stopped after step 4 and resumed: the straight run's every step and final bytes."""
    ck = os.path.join(WORK, "resume_dp2", "ckpt")
    path, d = recipe("resume_dp2", checkpoint_dir=ck, save_interval=4, dp_degree=2, zero_stage=2,
                     gradient_accumulation_steps=1, deterministic_reduce=True)
    r = run(["train", path], ranks=2)
    check(r.returncode == 0, "dp 2 straight run (%s)" % (r.stdout + r.stderr)[-1500:])
    if r.returncode != 0:
        return
    straight_m, straight_w = metrics(d), final_bytes(d)
    check(len(straight_m) == 8 and "resumed" not in r.stdout, "dp 2: 8 steps straight (%d)" % len(straight_m))
    shutil.rmtree(os.path.join(d, "out"))
    shutil.rmtree(ck)
    r1 = run(["train", path, "--stop-after", "4"], ranks=2)
    r2 = run(["train", path, "--resume"], ranks=2)
    check(r1.returncode == 0 and r2.returncode == 0, "dp 2 stop + resume (%s %s)" % (r1.stderr[-800:], r2.stderr[-800:]))
    key = lambda m: [[x.get(k) for k in KEYS] for x in m]
    check("resumed from" in r2.stdout, "dp 2: the second run resumed (%s)" % r2.stdout[-600:])
    check(key(straight_m) == key(metrics(d)), "dp 2: every step's loss and metrics bit-identical after resume")
    check(straight_w == final_bytes(d), "dp 2: final weights bit-identical after resume")


def test_second_run_reads_the_cache_and_evaluation():
    path, d = recipe("eval", eval_data_path=HELD_OUT, eval_interval=4)
    first = run(["train", path])
    check(first.returncode == 0, "first run (%s)" % first.stderr[-800:])
    second = run(["train", path])
    check(second.returncode == 0 and "computed by an earlier run" in second.stdout
          and "held-out pairs from" in second.stdout,
          "a second run reads both sets' reference log-probabilities from the cache (%s)" % second.stdout[-1500:])
    check(len(glob.glob(os.path.join(d, "cache", "dpo-reference-*.bin"))) == 2, "one cache file per pair set")
    m = metrics(d)
    evaluated = [x for x in m if "eval_loss" in x]
    check([x["step"] for x in evaluated] == [4, 8], "evaluated at steps 4 and 8")
    for name in ("eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/chosen", "eval_logits/rejected"):
        check(all(name in x for x in evaluated), "metrics.jsonl carries %s" % name)
    check(all("eval_perplexity" not in x for x in m), "no perplexity for a preference loss")
    with open(os.path.join(d, "out", "summary.json")) as f:
        s = json.load(f)
    check("reward_accuracy" in s and "eval_reward_accuracy" in s, "summary.json has the reward accuracies (%s)" % s)
    check("final reward accuracy" in second.stdout and "eval reward accuracy" in second.stdout,
          "the summary table prints the reward accuracies")


def test_data_parallel_equals_one_rank():
    runs = {}
    base, d1 = recipe("dp1", gradient_accumulation_steps=4, max_steps=4, shuffle=False)
    r = run(["train", base])
    check(r.returncode == 0, "dp 1 (%s)" % r.stderr[-800:])
    runs["dp1"] = metrics(d1)
    for zero in (0, 1, 2, 3):
        name = "dp2_zero%d" % zero
        path, d = recipe(name, gradient_accumulation_steps=2, max_steps=4, shuffle=False, dp_degree=2,
                         zero_stage=zero, cache_dir=os.path.join(WORK, "dp1", "cache"))
        r = run(["train", path], ranks=2)
        check(r.returncode == 0, "%s (%s)" % (name, (r.stdout + r.stderr)[-1500:]))
        if r.returncode != 0:
            continue
        m = metrics(d)
        worst = max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for a, b in zip(m, runs["dp1"]) for k in KEYS)
        print("  %s: worst relative difference from dp 1 over %d steps: %.3g" % (name, len(m), worst))
        check(len(m) == 4 and worst < 1e-6, "%s: dp 2 gives dp 1's losses and metrics (worst %.3g)" % (name, worst))


def test_bf16_and_simpo_train():
    for name, extra in (("bf16", {"dtype": "bf16"}), ("simpo", {"pref_loss": "simpo"}),
                        ("orpo_lora", {"pref_loss": "orpo", "finetuning_type": "lora"})):
        path, d = recipe(name, **extra)
        r = run(["train", path])
        check(r.returncode == 0, "%s trains (%s)" % (name, r.stderr[-800:]))
        if r.returncode == 0:
            check(all(x["loss"] == x["loss"] for x in metrics(d)), "%s: finite losses" % name)
            if name != "bf16":
                check("no reference model (this loss needs none)" in r.stdout and "reference log-prob" not in r.stdout,
                      "%s: no reference pass" % name)


def test_inspect_shows_pairs_and_prepare_points_to_it():
    r = run(["inspect", HELD_OUT, "--tokenizer", TOKENIZER, "--text", "--limit", "2"])
    check(r.returncode == 0, "keel inspect reads pairs (%s)" % r.stderr)
    check("--- document 1 (line 1, chosen" in r.stdout and "--- document 2 (line 1, rejected" in r.stdout,
          "both rows of the first pair are shown (%s)" % r.stdout)
    check("<|im_start|>assistant\n«" in r.stdout and "<|im_end|>\n»" in r.stdout,
          "the answer after the generation prompt is what trains (%s)" % r.stdout)
    r = run(["prepare", "--data", TRAIN, "--tokenizer", TOKENIZER, "--max-seq-len", "64", "--out",
             os.path.join(WORK, "prepared")])
    check(r.returncode != 0 and "keel inspect" in r.stderr and not os.path.exists(os.path.join(WORK, "prepared")),
          "keel prepare says pairs are not prepared, and how to see them (%s)" % r.stderr)


def test_bad_pairs_are_named():
    bad = os.path.join(WORK, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"prompt": "a", "chosen": " b"}\n')
        f.write('{"prompt": [{"role": "user", "content": "hi"}], "chosen": " b", "rejected": " c"}\n')
        f.write('{"prompt": "sky", "chosen": " blue", "rejected": " blue"}\n')
        f.write("not json\n")
    path, _ = recipe("bad", data_path=bad)
    r = run(["train", path])
    for what in ("bad.jsonl:1: missing field 'rejected'", "bad.jsonl:2: field 'prompt'", "bad.jsonl:3: chosen and "
                 "rejected are the same answer", "bad.jsonl:4: not valid JSON", "4 of 4 pairs are bad"):
        check(r.returncode != 0 and what in r.stdout + r.stderr, "the error names %r (%s)" % (what, r.stderr))
    path, _ = recipe("sft_on_pairs", stage="sft")  # pref_beta = 0.2 is left set
    r = run(["train", path])
    check(r.returncode != 0 and "applies to preference tuning" in r.stderr, "a preference key under stage = sft is refused")
    path, _ = recipe("sft_on_pairs2", stage="sft", pref_beta=0.1)  # the default: nothing preference-only set
    r = run(["train", path])
    check(r.returncode != 0 and "preference pairs" in r.stderr and "stage = \"dpo\"" in r.stderr,
          "pair data under stage = sft names the fix (%s)" % r.stderr)


if __name__ == "__main__":
    sys.exit(run_tests(globals(), "preference", WORK, only=ONLY))
