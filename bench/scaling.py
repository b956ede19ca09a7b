#!/usr/bin/env python3
"""How keel's training throughput and MFU change with the amount of work: sequence lengths
512/1024/2048/4096 on the speed issue's 134M-parameter model, and a ~1B-parameter model.

Each configuration trains a new model (inline [model_config], no checkpoint to write) on random
token data for a few steps in bf16 and reads the median step of metrics.jsonl (step 1 is warm-up).
Micro-batches hold 2048 tokens where the sequence allows (batch = 2048 / seq, at least 1), so
longer sequences change the attention share, not the GEMM sizes. MFU counts (6N + 12·L·T·d)
FLOPs per token against the bf16 matmul peak measured in the same run.

    $(scripts/python-env.sh) bench/scaling.py --keel build/keel [--quick] [--skip-1b]
"""
import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys

MODELS = {
    "134M": dict(hidden=768, layers=12, heads=12, intermediate=2048, vocab=32000),
    "1B": dict(hidden=2048, layers=16, heads=16, intermediate=5632, vocab=32000),
}


def flops_per_token(m, seq):
    d = m["hidden"]
    matmul = m["layers"] * (4 * d * d + 3 * d * m["intermediate"]) + m["vocab"] * d
    return 6 * matmul + 12 * m["layers"] * seq * d, matmul


def run(keel, work, name, m, seq, steps, checkpointing):
    batch = max(1, 2048 // seq)
    d = os.path.join(work, "%s_%d" % (name, seq))
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    rng = random.Random(seq)
    with open(os.path.join(d, "train.jsonl"), "w") as f:
        for _ in range(steps * batch):
            f.write(json.dumps({"input_ids": [rng.randrange(m["vocab"]) for _ in range(seq)]}) + "\n")
    with open(os.path.join(d, "recipe.toml"), "w") as f:
        f.write('data_path = "%s/train.jsonl"\noutput_dir = "%s/out"\ndtype = "bf16"\nmax_seq_len = %d\n'
                'batch_size = %d\nmax_steps = %d\nlearning_rate = 1e-4\nshuffle = false\nlog_interval = 1\n'
                'use_gradient_checkpointing = %s\n' % (d, d, seq, batch, steps, "true" if checkpointing else "false"))
        f.write('[model_config]\nfamily = "llama"\nvocab_size = %d\nhidden_size = %d\nintermediate_size = %d\n'
                'num_layers = %d\nnum_heads = %d\nmax_position_embeddings = %d\n'
                % (m["vocab"], m["hidden"], m["intermediate"], m["layers"], m["heads"], max(seq, 4096)))
    proc = subprocess.run([keel, "train", os.path.join(d, "recipe.toml")], capture_output=True, text=True)
    if proc.returncode != 0:
        return None, "keel failed: " + (proc.stdout + proc.stderr)[-400:]
    steps_m = [json.loads(l) for l in open(os.path.join(d, "out", "metrics.jsonl"))][1:]
    summary = json.load(open(os.path.join(d, "out", "summary.json")))
    tps = batch * seq / statistics.median(s["step_time_s"] for s in steps_m)
    shutil.rmtree(os.path.join(d, "out", "final"), ignore_errors=True)  # the exported weights
    return (tps, summary["peak_memory_bytes"], batch), None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keel", required=True)
    p.add_argument("--work", default="/tmp/keel_bench_scaling")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="sequence 512 and 1024 only")
    p.add_argument("--skip-1b", action="store_true")
    a = p.parse_args()
    a.work = os.path.abspath(a.work)  # recipe paths resolve against the recipe file, not the cwd
    peak_tool = os.path.join(os.path.dirname(os.path.abspath(a.keel)), "bench", "matmul_peak")
    peak = json.loads(subprocess.check_output([peak_tool]))["bf16_flops"]
    print("bf16 matmul peak: %.1f GFLOP/s" % (peak / 1e9))
    print("%-6s %6s %6s %10s %7s %10s %s" % ("model", "seq", "batch", "tokens/s", "MFU", "peak RSS", "note"))
    seqs = [512, 1024] if a.quick else [512, 1024, 2048, 4096]
    configs = [("134M", s, False) for s in seqs]
    if not a.skip_1b:
        configs.append(("1B", 1024, True))  # ~1B: fewer steps, gradient checkpointing to fit 24 GB
    for name, seq, ckpt in configs:
        m = MODELS[name]
        fpt, n = flops_per_token(m, seq)
        res, err = run(a.keel, a.work, name, m, seq, 3 if name == "1B" else a.steps, ckpt)
        if err:
            print("%-6s %6d %6s %s" % (name, seq, "-", err.replace("\n", " ")))
            continue
        tps, rss, batch = res
        print("%-6s %6d %6d %10.1f %6.1f%% %8.2f GB %s" % (name, seq, batch, tps, 100 * tps * fpt / peak, rss / 1e9,
                                                          "N=%.0fM%s" % (n / 1e6, ", checkpointing" if ckpt else "")))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
