#!/usr/bin/env python3
"""Where a training step's products go: sums oneDNN's verbose log of a `keel train` run per shape,
and per kind of product, per step.

    ONEDNN_VERBOSE=1 build/keel train recipe.toml > run.log
    python3 bench/onednn_verbose_summary.py run.log --steps 4 [--rank 8] [--head-dim 64] [--top 20]

Each `onednn_verbose,exec,...` line is one matmul: its problem `MxK:KxN:MxN` and its time in ms.
A product is counted as
  adapter    when a dimension equals --rank (LoRA's A and B products, rank r),
  attention  when a dimension equals --head-dim and none exceeds --seq (the per-head products of
             the blocked attention kernel, each on one thread),
  frozen/base otherwise (the projections and the LM head, on every thread).
Times are oneDNN's own, per call: the base products run on all threads, so their sum is wall
time; attention's products run one per thread at once, so theirs is thread time (divide by the
thread count for wall time). GFLOP/s is 2MNK per call over the summed time. The first step's
calls (and the bf16 timing keel runs at start) are included: use --steps for the number of steps
the log covers and read the figures as averages.
"""
import argparse
import collections
import sys


def kind_of(m, k, n, rank, head_dim, seq):
    if rank and rank in (m, k, n):
        return "adapter"
    if head_dim in (m, k, n) and max(m, k, n) <= seq:
        return "attention"
    return "base"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--steps", type=int, required=True, help="optimizer steps the log covers")
    ap.add_argument("--rank", type=int, default=0, help="LoRA rank (0: no adapters)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024, help="the longest key range attention's products span")
    ap.add_argument("--top", type=int, default=15, help="shapes to list, by time")
    a = ap.parse_args()

    time_ms, calls = collections.Counter(), collections.Counter()
    with open(a.log, errors="replace") as f:
        for line in f:
            if not line.startswith(("onednn_verbose,exec", "dnnl_verbose,exec")):
                continue
            fields = line.rstrip("\n").split(",")
            try:
                shape, ms = fields[-2], float(fields[-1])
                (m, k), (_, n) = (tuple(map(int, part.split("x"))) for part in shape.split(":")[:2])
            except ValueError:
                continue  # not a matmul problem (a reorder, say)
            time_ms[(m, k, n)] += ms
            calls[(m, k, n)] += 1
    if not time_ms:
        sys.exit("%s: no oneDNN exec lines (run with ONEDNN_VERBOSE=1)" % a.log)

    per_kind_ms, per_kind_flop = collections.Counter(), collections.Counter()
    for (m, k, n), ms in time_ms.items():
        kind = kind_of(m, k, n, a.rank, a.head_dim, a.seq)
        per_kind_ms[kind] += ms
        per_kind_flop[kind] += 2.0 * m * n * k * calls[(m, k, n)]
    print("per step (%d steps in the log):" % a.steps)
    for kind in ("base", "attention", "adapter"):
        if per_kind_ms[kind]:
            print("  %-9s %9.1f ms  %7.1f GFLOP/s%s" % (
                kind, per_kind_ms[kind] / a.steps, per_kind_flop[kind] / (per_kind_ms[kind] / 1e3) / 1e9,
                "  (thread time: one product per thread)" if kind == "attention" else ""))
    print("  %-9s %9.1f ms" % ("all", sum(per_kind_ms.values()) / a.steps))
    print("\nshapes by time (M x K x N: ms per step, calls per step, kind):")
    for (m, k, n), ms in time_ms.most_common(a.top):
        print("  %5d x %5d x %5d  %8.1f ms  %6.1f calls  %s" % (
            m, k, n, ms / a.steps, calls[(m, k, n)] / a.steps, kind_of(m, k, n, a.rank, a.head_dim, a.seq)))


if __name__ == "__main__":
    main()
