#!/usr/bin/env python3
"""Exposed gradient-synchronisation share of the step at dp=2, with and without overlap, next to
the raw MPI allreduce bandwidth measured in the same invocation.

Trains the speed issue's reference workload (or --small) under `mpirun -np 2` (one OpenMP thread
per rank on a 2-core machine) twice: overlap_grad_sync = true (each bucket's allreduce starts
during the backward pass as soon as its gradients are final) and false (all buckets after the
backward pass). Reports per configuration the median step time, the exposed sync time (what the
step still waits for after the backward pass: metrics.jsonl grad_sync_s) and its share, and the
bus bandwidth of the allreduce the gradients need (bench/allreduce_bandwidth, same buffer size,
same bucket size).

    $(scripts/python-env.sh) bench/grad_sync_bench.py --keel build/keel [--small] [--steps 4] [--zero 1|2|3] [--lora R [--qlora]] [--repeat 3]

On a shared machine one run can be off by a rank slowed by other work (the "after backward" row
then shows that skew); --repeat R runs both configurations R times, alternating, and prints each
run and the median of the runs.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_vs_pytorch as tvp  # the same workload as the throughput benchmark

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "OMP_NUM_THREADS=1",
          "-x", "OMP_WAIT_POLICY=passive"]


def run_dp2(a, model_dir, overlap):
    """One training run at dp=2: (median step time, median exposed sync, median wait for the other rank)."""
    out = os.path.join(a.work, "out_overlap" if overlap else "out_after")
    recipe = os.path.join(a.work, "recipe.toml")
    with open(recipe, "w") as f:
        f.write('model_name = "%s"\ndata_path = "%s"\noutput_dir = "%s"\n' %
                (model_dir, os.path.join(a.work, "train.jsonl"), out))
        f.write('dtype = "%s"\nmax_seq_len = %d\nbatch_size = %d\nmax_steps = %d\nlearning_rate = 1e-4\n'
                'shuffle = false\nlog_interval = 1\ndp_degree = 2\nbucket_size_mb = %g\n'
                'overlap_grad_sync = %s\nzero_stage = %d\n' % (a.dtype, a.seq, a.batch, a.steps, a.bucket_mb,
                                                                 "true" if overlap else "false", a.zero))
        if a.lora:  # LoRA on every linear layer: under ZeRO-3 the frozen base is what is gathered
            f.write('finetuning_type = "lora"\nlora_rank = %d\nlora_target = "all"\n' % a.lora)
            if a.qlora:
                f.write("quantization_bit = 4\n")
    proc = subprocess.run(MPIRUN + [a.keel, "train", recipe], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit("keel under mpirun failed:\n" + proc.stdout[-3000:] + proc.stderr[-3000:])
    steps = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))][1:]  # step 1 warms up
    step = statistics.median(s["step_time_s"] for s in steps)
    sync = statistics.median(s["grad_sync_share"] * s["step_time_s"] for s in steps)
    wait = statistics.median(s.get("peer_wait_share", 0) * s["step_time_s"] for s in steps)
    return step, sync, wait


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keel", required=True)
    p.add_argument("--work", default="/tmp/keel_bench_sync")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--small", action="store_true")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--bucket-mb", type=float, default=25)
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                   help="ZeRO stage: 1 reduce-scatters the buckets and all-gathers the updated weights")
    p.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA of this rank on every linear layer")
    p.add_argument("--qlora", action="store_true", help="with --lora: the projections in NF4")
    p.add_argument("--repeat", type=int, default=1, help="runs of each configuration, alternating")
    a = p.parse_args()
    a.work = os.path.abspath(a.work)  # recipe paths resolve against the recipe file, not the cwd
    # The workload's sizes: the throughput benchmark's defaults (or its --small).
    sys.argv = [sys.argv[0], "--keel", a.keel, "--work", a.work, "--steps", str(2 * a.steps), "--dtype", a.dtype] + \
        (["--small"] if a.small else [])
    wl = tvp.parse_args()
    for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "seq", "batch"):
        setattr(a, k, getattr(wl, k))
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    model_dir = tvp.make_workload(wl)  # 2 * steps * batch records: both ranks' samples

    grads_mb = tvp.matmul_parameters(wl) * 4 / 2**20  # fp32 gradients of the matmul weights (the bulk)
    bw_tool = os.path.join(os.path.dirname(os.path.abspath(a.keel)), "bench", "allreduce_bandwidth")
    bw = json.loads(subprocess.check_output(MPIRUN + [bw_tool, "--mb", str(a.bucket_mb), "--total-mb",
                                                      "%.0f" % grads_mb]).decode().strip().splitlines()[-1])
    runs = {False: [], True: []}
    for _ in range(max(1, a.repeat)):
        for overlap in (False, True):
            runs[overlap].append(run_dp2(a, model_dir, overlap))

    print("model: llama hidden %d, %d layers, vocab %d; seq %d x batch %d per rank, %s, dp=2 (mpirun -np 2, 1 thread"
          " per rank), buckets of %g MB, ZeRO-%d%s" % (a.hidden, a.layers, a.vocab, a.seq, a.batch, a.dtype,
                                                      a.bucket_mb, a.zero,
                                                      ", %sLoRA rank %d" % ("Q" if a.qlora else "", a.lora)
                                                      if a.lora else ""))
    print("raw MPI allreduce (%s): %.0f MB in %g MB buckets: %.3f s, bus bandwidth %.2f GB/s" %
          (bw["communicator"], bw["bytes"] / 2**20, a.bucket_mb, bw["seconds"], bw["busbw_GBps"]))
    def show(label, step, sync, wait):
        print("%-28s step %7.3f s   exposed grad sync %6.3f s = %5.2f%% of the step (of which %.3f s waiting for "
              "the other rank at the step's first collective)" % (label, step, sync, 100 * sync / step, wait))

    for overlap in (False, True):
        label = "overlapped with backward:" if overlap else "after backward (baseline):"
        if len(runs[overlap]) > 1:
            for i, run in enumerate(runs[overlap]):
                show("  run %d, %s" % (i + 1, "overlapped" if overlap else "after backward"), *run)
            shares = sorted(100 * sync / step for step, sync, _ in runs[overlap])
            label = "%s (median of %d runs; shares %s%%)" % (label[:-1], len(shares),
                                                           ", ".join("%.2f" % x for x in shares))
            print(label)
            label = ""
        show(label, *[statistics.median(run[i] for run in runs[overlap]) for i in range(3)])


if __name__ == "__main__":
    main()
