#!/usr/bin/env python3
"""Checkpoint time at dp N under ZeRO-3: rank 0's gather into one file (checkpoint_layout =
"single_file") against every rank writing its own shard ("sharded"), synchronous and
asynchronous; and each rank's peak RSS against `keel plan`'s figure for the same run.

Trains a random Llama (default hidden 512, 6 layers, vocab 16000: 25M parameters, 0.3 GB of fp32
weights + AdamW moments) for --steps steps on N ranks (mpirun --oversubscribe), saving every
--save-every steps, once per layout. Prints, from metrics.jsonl: the median step time without a
save, the median time a save blocked its step (synchronous: the whole save; asynchronous: the
hand-off plus any wait for the writer before the next optimizer step), and the exposed checkpoint
time per step (the sum of checkpoint_s over all steps / steps, as a share of the step time).

    $(scripts/python-env.sh) bench/sharded_checkpoint_bench.py --keel build/keel [--dp 4] [--steps 40]
"""
import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keel", required=True)
    p.add_argument("--work", default="/tmp/keel_bench_sharded_checkpoint")
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--zero", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    return p.parse_args()


# Each rank's keel under a Python parent that prints the child's peak RSS (getrusage's ru_maxrss,
# KiB) with the rank: every rank's peak, not only rank 0's (summary.json).
RANK_PEAK = ("import os, resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
             "print('rank-peak-rss-kib', os.environ.get('OMPI_COMM_WORLD_RANK', '0'), "
             "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True); sys.exit(code)")


def recipe(args, name, **keys):
    d = os.path.join(args.work, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    base = {"data_path": os.path.join(args.work, "train.jsonl"), "output_dir": os.path.join(d, "out"),
            "checkpoint_dir": os.path.join(d, "ck"), "save_interval": args.save_every, "keep_last_n": 2,
            "dtype": "bf16", "max_seq_len": args.seq, "batch_size": 1, "gradient_accumulation_steps": 1,
            "learning_rate": 1e-4, "warmup_steps": 1, "max_steps": args.steps, "seed": 1, "log_interval": 10,
            "dp_degree": args.dp, "zero_stage": args.zero}
    base.update(keys)
    lines = ["%s = %s" % (k, json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v)
             for k, v in base.items()]
    lines += ["[model_config]", 'family = "llama"', "vocab_size = %d" % args.vocab, "hidden_size = %d" % args.hidden,
              "intermediate_size = %d" % (args.hidden * 8 // 3 // 16 * 16), "num_layers = %d" % args.layers,
              "num_heads = %d" % (args.hidden // 64), "num_kv_heads = %d" % (args.hidden // 64)]
    path = os.path.join(d, "recipe.toml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path, d


def main():
    args = parse_args()
    os.makedirs(args.work, exist_ok=True)
    rng = random.Random(1)
    with open(os.path.join(args.work, "train.jsonl"), "w") as f:
        for _ in range(args.steps * args.dp * 2):
            f.write(json.dumps({"input_ids": [rng.randrange(args.vocab) for _ in range(args.seq)]}) + "\n")
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.dp), "-x",
              "OMP_NUM_THREADS=%d" % args.threads]
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
    print("CPU: %s, %d cores; dp %d, ZeRO-%d, %d steps, a save every %d" % (
        model, os.cpu_count(), args.dp, args.zero, args.steps, args.save_every))
    rows = []
    for name, keys in (("single_file sync", dict(checkpoint_layout="single_file", async_save=False)),
                       ("sharded sync", dict(checkpoint_layout="sharded", async_save=False)),
                       ("single_file async", dict(checkpoint_layout="single_file", async_save=True)),
                       ("sharded async", dict(checkpoint_layout="sharded", async_save=True))):
        path, d = recipe(args, name.replace(" ", "_"), **keys)
        plan = subprocess.run([args.keel, "plan", path, "--json"], capture_output=True, text=True)
        planned = json.loads(plan.stdout)["training_bytes"] if plan.returncode == 0 else None
        t0 = time.time()
        r = subprocess.run(mpirun + [sys.executable, "-c", RANK_PEAK, args.keel, "train", path], capture_output=True,
                           text=True)
        if r.returncode != 0:
            print("%s: failed\n%s" % (name, (r.stdout + r.stderr)[-2000:]))
            sys.exit(1)
        with open(os.path.join(d, "out", "metrics.jsonl")) as f:
            m = [json.loads(l) for l in f if l.strip()]
        with open(os.path.join(d, "out", "summary.json")) as f:
            summary = json.load(f)
        saves = [x["checkpoint_s"] for x in m if x["step"] % args.save_every == 0]
        plain = [x["step_time_s"] - x.get("checkpoint_s", 0) for x in m if x["step"] % args.save_every != 0]
        exposed = sum(x.get("checkpoint_s", 0) for x in m) / len(m)
        step = statistics.median(plain)
        peaks = {int(w[1]): int(w[2]) * 1024 / 2**30 for w in (l.split() for l in r.stdout.splitlines())
                 if len(w) == 3 and w[0] == "rank-peak-rss-kib"}
        rows.append((name, step, statistics.median(saves), exposed, 100 * exposed / step,
                     summary.get("peak_memory_bytes", 0) / 2**30, (planned or 0) / 2**30, time.time() - t0,
                     peaks.get(0, 0.0), max((v for k, v in peaks.items() if k != 0), default=0.0)))
    print("%-18s %10s %12s %14s %8s %12s %12s %12s %12s %8s" % (
        "layout", "step (s)", "save (s)", "exposed/step", "share", "peak RSS", "rank 0", "other ranks", "plan",
        "wall"))
    for name, step, save, exposed, share, peak, plan, wall, rank0, others in rows:
        print("%-18s %10.3f %12.3f %14.4f %7.2f%% %9.2f GiB %9.2f GiB %9.2f GiB %9.2f GiB %7.0fs" % (
            name, step, save, exposed, share, peak, rank0, others, plan, wall))
    print("save (s): median checkpoint_s of a step that saved (synchronous: the whole save; asynchronous: "
          "the hand-off and any wait before the next optimizer step). exposed/step: all checkpoint_s / steps. "
          "peak RSS: summary.json (rank 0); rank 0, other ranks: each process's ru_maxrss (the largest of the "
          "other ranks'); plan: keel plan's per-rank figure while training")


if __name__ == "__main__":
    main()
