#!/usr/bin/env python3
"""The baseline modes of `keel bench ladder` and the ladder itself, end to end:

- data_pipeline = "on_the_fly" (records tokenized on the training thread) trains on exactly the
  batches of prepared shards with packing = "pad": the same losses, token counts and final weights,
  for text, prompt/response and chat records through a tokenizer made by `keel tokenizer train`;
- memory_planning = "per_tensor" gives the planned arena's results bit for bit;
- a checkpoint of one mode resumes in the other (the modes are not data or model changes);
- clear errors for combinations that cannot work;
- `keel bench ladder` at dp=1 (twice round, --repeat 2) and dp=2 under mpirun when it is
  installed: four rows with positive throughput, ladder.json, and the same losses in every row.

    $(scripts/python-env.sh) tests/integration/ladder_test.py KEEL
"""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

from harness import mpi_env, write_recipe_file

KEEL = os.path.abspath(sys.argv[1])
WORK = tempfile.mkdtemp(prefix="keel_ladder_test_")
FAILURES = []


def check(cond, what):
    print("  %s: %s" % ("ok" if cond else "FAIL", what))
    if not cond:
        FAILURES.append(what)
    return cond


def run(*args, timeout=300, env=None):
    return subprocess.run([KEEL, *args], capture_output=True, text=True, timeout=timeout, env=env)


def words(rng, n):
    vocab = "the model learns to answer questions about data tokens shards and packing quickly".split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def make_data():
    rng = random.Random(7)
    corpus = os.path.join(WORK, "corpus.jsonl")
    with open(corpus, "w") as f:
        for _ in range(200):
            f.write(json.dumps({"text": words(rng, 30)}) + "\n")
    tokenizer = os.path.join(WORK, "tokenizer.json")
    r = run("tokenizer", "train", "--data", corpus, "--vocab-size", "300", "--special", "<|endoftext|>",
            "--special", "<|im_start|>", "--special", "<|im_end|>", "--out", tokenizer)
    if not check(r.returncode == 0, "keel tokenizer train (%s)" % r.stderr.strip()):
        sys.exit(1)
    data = os.path.join(WORK, "train.jsonl")
    with open(data, "w") as f:
        for i in range(150):
            k = i % 4
            if i == 77:
                f.write('{"text": "not closed\n')  # a bad record: both pipelines drop it
            elif k == 0:
                f.write(json.dumps({"text": words(rng, rng.randrange(4, 60))}) + "\n")  # some truncated at 48
            elif k == 1:
                # Some prompts fill all 48 tokens: no target is left, and both pipelines drop the record.
                f.write(json.dumps({"prompt": words(rng, rng.choice([6, 60])), "response": words(rng, 9)}) + "\n")
            elif k == 2:
                f.write(json.dumps({"messages": [{"role": "system", "content": words(rng, 3)},
                                                 {"role": "user", "content": words(rng, 7)},
                                                 {"role": "assistant", "content": words(rng, 10)}]}) + "\n")
            else:
                f.write("\n")  # blank lines are skipped by both
    return tokenizer, data


def write_recipe(name, tokenizer, data, **overrides):
    keys = {"data_path": data, "tokenizer": tokenizer, "chat_template": "chatml",
            "output_dir": os.path.join(WORK, name), "dtype": "fp32", "max_seq_len": 48, "batch_size": 3,
            "gradient_accumulation_steps": 2, "learning_rate": 3e-3, "warmup_steps": 1, "max_steps": 6,
            "seed": 3, "shuffle": True, "log_interval": 1}
    keys.update(overrides)
    model = {"family": "qwen2", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 48, "num_layers": 2,
             "num_heads": 4, "num_kv_heads": 2}
    return write_recipe_file(os.path.join(WORK, name + ".toml"), keys, model)


def steps_of(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(m["loss"], m["tokens"], m["target_tokens"], m["grad_norm"]) for m in map(json.loads, f)]


def weights_of(out):
    with open(os.path.join(out, "final", "model.safetensors"), "rb") as f:
        return f.read()


def train(name, tokenizer, data, *extra, **keys):
    path = write_recipe(name, tokenizer, data, **keys)
    r = run("train", path, *extra)
    check(r.returncode == 0, "%s trains (%s)" % (name, r.stderr.strip()[-400:]))
    return r


def test_modes(tokenizer, data):
    print("on-the-fly tokenization and per-tensor memory give the prepared, planned results")
    train("prepared", tokenizer, data)
    r = train("on_the_fly", tokenizer, data, data_pipeline="on_the_fly")
    check("on the training thread" in r.stdout and "without targets" in r.stdout, "on_the_fly says what it does")
    base = steps_of(os.path.join(WORK, "prepared"))
    check(len(base) == 6 and all(s[2] > 0 for s in base), "prepared run has 6 steps with targets")
    check(steps_of(os.path.join(WORK, "on_the_fly")) == base,
          "on_the_fly: same losses, tokens, targets and gradient norms per step")
    check(weights_of(os.path.join(WORK, "on_the_fly")) == weights_of(os.path.join(WORK, "prepared")),
          "on_the_fly: same final weights")
    for dtype in ("bf16",):  # fp32 and bf16 in tests/unit/memory_planning_test.cpp
        train("planned_" + dtype, tokenizer, data, dtype=dtype)
        train("per_tensor_" + dtype, tokenizer, data, dtype=dtype, memory_planning="per_tensor")
        a, b = os.path.join(WORK, "planned_" + dtype), os.path.join(WORK, "per_tensor_" + dtype)
        check(steps_of(a) == steps_of(b) and weights_of(a) == weights_of(b),
              "per_tensor (%s): same losses and final weights as planned" % dtype)


def test_resume_across_modes(tokenizer, data):
    print("a checkpoint of one mode resumes in the other")
    ck = os.path.join(WORK, "ck")
    train("resume", tokenizer, data, "--stop-after", "3", checkpoint_dir=ck, save_interval=3)
    r = train("resume", tokenizer, data, "--resume", checkpoint_dir=ck, save_interval=3,
              data_pipeline="on_the_fly", memory_planning="per_tensor")
    check("resumed from" in r.stdout, "resumed with the baseline modes")
    check(steps_of(os.path.join(WORK, "resume")) == steps_of(os.path.join(WORK, "prepared")),
          "resumed run continues the same losses")
    check(weights_of(os.path.join(WORK, "resume")) == weights_of(os.path.join(WORK, "prepared")),
          "resumed run ends with the same weights")


def test_errors(tokenizer, data):
    print("errors")
    path = write_recipe("errors", tokenizer, data)
    r = run("train", path, "--set", "data_pipeline=on_the_fly", "--set", "packing=pack")
    check(r.returncode == 2 and 'needs packing = "pad"' in r.stderr, "on_the_fly with packing: %s" % r.stderr.strip())
    r = run("train", path, "--set", "memory_planning=arena")
    check(r.returncode == 2 and "'memory_planning' must be" in r.stderr, "bad memory_planning: %s" % r.stderr.strip())
    prepared = os.path.join(WORK, "shards")
    r = run("prepare", "--data", data, "--tokenizer", tokenizer, "--out", prepared, "--max-seq-len", "48",
            "--template", "chatml", "--pad", "--max-bad-fraction", "0.05")
    check(r.returncode == 0, "keel prepare (%s)" % r.stderr.strip())
    r = run("train", path, "--set", "data_pipeline=on_the_fly", "--set", "data_path=" + prepared)
    check(r.returncode == 2 and "this is prepared data" in r.stderr, "on_the_fly on shards: %s" % r.stderr.strip())
    r = run("train", path, "--print-recipe", "--set", "data_pipeline=on_the_fly")
    check('data_pipeline = "on_the_fly"' in r.stdout and 'memory_planning = "planned"' in r.stdout,
          "--print-recipe shows both keys")


def check_ladder(out, ranks, steps):
    with open(os.path.join(out, "ladder.json")) as f:
        ladder = json.load(f)
    rows = ladder["rows"]
    check(len(rows) == 4 and ladder["ranks"] == ranks, "ladder.json: 4 rows at %d rank(s)" % ranks)
    check(all(r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0 and 0 < r["compute_share"] <= 1 for r in rows),
          "every row has positive throughput, memory and a compute share: %s" %
          [(r["tokens_per_s"], r["peak_memory_bytes"], r["compute_share"]) for r in rows])
    check(all(r["measured_steps"] == steps - 1 for r in rows), "the warm-up step is left out of the timings")
    check("data_pipeline=on_the_fly" in rows[0]["settings"] and "memory_planning=planned" in rows[3]["settings"],
          "rows switch the optimisations on in turn")
    losses = [[m["loss"] for m in map(json.loads, open(os.path.join(r["output_dir"], "metrics.jsonl")))]
              for r in rows]
    check(len(losses[0]) == steps and all(l == losses[0] for l in losses),
          "every row trains the same losses: %s" % losses)
    return rows


def test_ladder(tokenizer, data):
    print("keel bench ladder, one rank")
    path = write_recipe("ladder", tokenizer, data)
    r = run("bench", "ladder", path, "--steps", "3", "--repeat", "2", timeout=600)
    if not check(r.returncode == 0, "ladder runs (%s)" % r.stderr.strip()[-600:]):
        return
    for label in ("Baseline", "+ prepared data", "+ bucketed gradient sync", "+ planned memory", "tokens/s",
                  "memory/rank", "grad sync"):
        check(label in r.stdout, "table shows %r" % label)
    rows = check_ladder(os.path.join(WORK, "ladder"), 1, 3)
    check(all(len(r["runs_tokens_per_s"]) == 2 and r["tokens_per_s"] in r["runs_tokens_per_s"] for r in rows),
          "--repeat 2: two runs per row, the table shows one of them")
    r = run("bench", "ladder", path, "--steps", "2", "--set", "data_pipeline=bogus")
    check(r.returncode == 2 and "'data_pipeline'" in r.stderr, "ladder checks the recipe first")
    r = run("bench", "ladder", path, "--steps", "2", "--set", "data_path=" + os.path.join(WORK, "missing.jsonl"))
    check(r.returncode == 2 and "row 1" in r.stderr and "missing.jsonl" in r.stderr,
          "a failing row names itself and shows its log: %s" % r.stderr.strip()[-300:])

    if shutil.which("mpirun") is None:
        print("  (mpirun not installed: the dp=2 ladder is left out)")
        return
    print("keel bench ladder, two ranks under mpirun")
    path = write_recipe("ladder_dp2", tokenizer, data, dp_degree=2, gradient_accumulation_steps=1)
    r = run("bench", "ladder", path, "--steps", "3", timeout=600, env=mpi_env())
    if not check(r.returncode == 0, "dp=2 ladder runs (%s)" % r.stderr.strip()[-600:]):
        return
    rows = check_ladder(os.path.join(WORK, "ladder_dp2"), 2, 3)
    check(rows[0]["grad_sync_share"] > 0, "dp=2 baseline spends time in gradient sync")


def main():
    tokenizer, data = make_data()
    test_modes(tokenizer, data)
    test_resume_across_modes(tokenizer, data)
    test_errors(tokenizer, data)
    test_ladder(tokenizer, data)
    if FAILURES:
        print("%d FAILED (work dir kept: %s)" % (len(FAILURES), WORK))
        sys.exit(1)
    shutil.rmtree(WORK, ignore_errors=True)
    print("all passed")


if __name__ == "__main__":
    main()
