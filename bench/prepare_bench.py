#!/usr/bin/env python3
"""keel prepare throughput (MB/s of JSONL) with 1 and 2 threads, and peak RSS on a >= 1 GB file.

    $(scripts/python-env.sh) bench/prepare_bench.py KEEL [--scaling-mb 200] [--big-gb 1.0] [--keep]

Generates chat and text JSONL under /tmp (deleted at the end), trains a small tokenizer with
`keel tokenizer train`, then runs `keel prepare`. Goals (issue 3): >= 1.8x from 1 to 2 threads,
peak RSS < 1 GB on the 1 GB file whatever its size.
"""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

KEEL = os.path.abspath(sys.argv[1])


def arg(name, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def generate(path, target_bytes, seed):
    rng = random.Random(seed)
    words = ("the of and to in is was for on that with as by at from his her they this which an were be "
             "model data token training shard packing loader gradient attention layer memory thread "
             "naïve café 数据 模型 训练 🙂 2024 3.14 don't it's").split()
    lines = []
    for i in range(2000):  # a pool of distinct records, repeated with varying numbers
        def s(n):
            return " ".join(rng.choice(words) for _ in range(n))
        k = i % 3
        if k == 0:
            lines.append(json.dumps({"messages": [{"role": "user", "content": s(rng.randint(10, 60))},
                                                  {"role": "assistant", "content": s(rng.randint(20, 200))}]},
                                    ensure_ascii=False))
        elif k == 1:
            lines.append(json.dumps({"prompt": s(rng.randint(10, 50)), "response": s(rng.randint(20, 150))},
                                    ensure_ascii=False))
        else:
            lines.append(json.dumps({"text": s(rng.randint(50, 400))}, ensure_ascii=False))
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        n = 0
        while written < target_bytes:
            block = "\n".join(lines[(n + j) % len(lines)] for j in range(len(lines))) + "\n"
            f.write(block)
            written += len(block.encode("utf-8"))
            n += 7
    return written


def timed_prepare(data, tokenizer, out, threads):
    shutil.rmtree(out, ignore_errors=True)
    start = time.monotonic()
    proc = subprocess.Popen([KEEL, "prepare", "--data", data, "--tokenizer", tokenizer, "--out", out,
                             "--max-seq-len", "2048", "--template", "chatml", "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.monotonic() - start
    stderr = proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"keel prepare failed: {stderr}")
    return seconds, usage.ru_maxrss * 1024  # ru_maxrss is in KiB on Linux


def main():
    work = tempfile.mkdtemp(prefix="keel_prepare_bench_", dir="/tmp")
    try:
        small = os.path.join(work, "small.jsonl")
        size = generate(small, int(arg("--scaling-mb", 200) * 1e6), 1)
        sample = os.path.join(work, "sample.jsonl")
        with open(small) as f, open(sample, "w") as g:
            for _, line in zip(range(3000), f):
                g.write(json.dumps({"text": json.dumps(json.loads(line), ensure_ascii=False)}, ensure_ascii=False) + "\n")
        tokenizer = os.path.join(work, "tokenizer.json")
        subprocess.run([KEEL, "tokenizer", "train", "--data", sample, "--vocab-size", "2000", "--special",
                        "<|endoftext|>", "--special", "<|im_start|>", "--special", "<|im_end|>", "--out", tokenizer],
                       check=True, capture_output=True)
        out = os.path.join(work, "out")
        results = {}
        for threads in (1, 2):
            seconds, rss = timed_prepare(small, tokenizer, out, threads)
            results[threads] = size / 1e6 / seconds
            print(f"keel prepare, {threads} thread(s): {size / 1e6:.0f} MB in {seconds:.2f} s = "
                  f"{results[threads]:.1f} MB/s, peak RSS {rss / 2**20:.0f} MiB", flush=True)
        print(f"scaling 1 -> 2 threads: {results[2] / results[1]:.2f}x (goal >= 1.8x)", flush=True)
        os.remove(small)
        big_gb = arg("--big-gb", 1.0)
        if big_gb > 0:
            big = os.path.join(work, "big.jsonl")
            size = generate(big, int(big_gb * 1e9), 2)
            seconds, rss = timed_prepare(big, tokenizer, out, 2)
            print(f"keel prepare, 2 threads: {size / 1e9:.2f} GB in {seconds:.1f} s = {size / 1e6 / seconds:.1f} MB/s, "
                  f"peak RSS {rss / 2**20:.0f} MiB (goal < 1024 MiB)", flush=True)
    finally:
        if "--keep" not in sys.argv:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
