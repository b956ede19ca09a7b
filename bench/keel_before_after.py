#!/usr/bin/env python3
"""Step time of two keel builds on the same recipe, run in turn: before, after, before, after ...

For a change that must leave speed alone (a refactor: issue 54's "the bench workload's speed
unchanged within noise"), or one that claims a gain. Each round runs both binaries once, in turn,
each in its own process on the same recipe, data and cores, and reads the step times keel itself
records (metrics.jsonl's step_time_s, the first step left out as warm-up: it pays the first touch
of every page and oneDNN's primitive creation). Reported: each side's median step time over all
rounds, the after/before ratio within each round (the machine drifts less inside a round than
across the run) and the median of those ratios. Whole-process times are not used: setup (reading
or initialising weights, pre-faulting the arena) varies with the machine's memory far more than
the step does.

  bench/keel_before_after.py --before /path/old/keel --after build/keel --recipe R.toml --rounds 3

The recipe is any keel recipe; bench/train_vs_pytorch.py --skip-torch --work DIR writes the bench
workload's (DIR/recipe.toml, its model and data). Each run writes into a scratch output_dir that is
removed after its metrics are read.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile


def version(binary):
    out = subprocess.run([binary, "--version"], capture_output=True, text=True)
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else "?"


def step_times(binary, recipe, steps, scratch):
    out_dir = os.path.join(scratch, "out")
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [binary, "train", recipe, "--set", f"max_steps={steps}", "--set", f"output_dir={out_dir}",
           "--set", "save_interval=0"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stderr[-2000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    shutil.rmtree(out_dir, ignore_errors=True)
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r.get("step", 0) >= 2]
    if not times:
        sys.exit(f"{binary}: no steps after the first in metrics.jsonl (give --steps >= 2)")
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="keel binary before the change")
    p.add_argument("--after", required=True, help="keel binary after the change")
    p.add_argument("--recipe", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run; the first is warm-up")
    args = p.parse_args()

    print(f"before: {version(args.before)}")
    print(f"after:  {version(args.after)}")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"CPU: {cpu}, {len(os.sched_getaffinity(0))} usable cores, load average {os.getloadavg()[0]:.1f} at start")
    sides = {"before": [], "after": []}
    ratios = []
    with tempfile.TemporaryDirectory(prefix="keel_before_after_") as scratch:
        for r in range(args.rounds):
            medians = {}
            for side in ("before", "after"):
                times = step_times(getattr(args, side), args.recipe, args.steps, scratch)
                sides[side] += times
                medians[side] = statistics.median(times)
            ratios.append(medians["after"] / medians["before"])
            print(f"round {r + 1}: before {medians['before']:.3f} s/step, after {medians['after']:.3f} s/step, "
                  f"after/before {ratios[-1]:.3f} (load average {os.getloadavg()[0]:.1f})", flush=True)
    b, a = statistics.median(sides["before"]), statistics.median(sides["after"])
    print(f"median step: before {b:.3f} s, after {a:.3f} s; after/before: median of rounds "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    print(json.dumps({"bench": "keel_before_after", "before": version(args.before), "after": version(args.after),
                      "cpu": cpu, "rounds": args.rounds, "before_step_s": b, "after_step_s": a,
                      "ratios": ratios, "median_ratio": statistics.median(ratios)}))


if __name__ == "__main__":
    main()
