#!/usr/bin/env python3
"""keel prepare end to end: a tokenizer trained by `keel tokenizer train`, chat records of every
shape plus bad lines, the bad-record report and threshold, packing vs padding, gzip/zstd input
giving the same shards as plain JSONL, and thread-count independence.

    $(scripts/python-env.sh) tests/integration/prepare_test.py KEEL
"""
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

from harness import FAILURES, check

KEEL = os.path.abspath(sys.argv[1])
WORK = tempfile.mkdtemp(prefix="keel_prepare_test_")


def run(*args):
    return subprocess.run([KEEL, *args], capture_output=True, text=True, timeout=300)


def words(rng, n):
    vocab = "the model learns to answer questions about data tokens shards and packing quickly".split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def main():
    rng = random.Random(5)
    corpus = os.path.join(WORK, "corpus.jsonl")
    with open(corpus, "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": words(rng, 30)}) + "\n")
    tokenizer = os.path.join(WORK, "tokenizer.json")
    r = run("tokenizer", "train", "--data", corpus, "--vocab-size", "400", "--special", "<|endoftext|>",
            "--special", "<|im_start|>", "--special", "<|im_end|>", "--out", tokenizer)
    if not check(r.returncode == 0, f"tokenizer train failed: {r.stderr}"):
        return

    data = os.path.join(WORK, "chat.jsonl")
    bad_lines = {}
    with open(data, "wb") as f:
        for i in range(1, 401):
            k = i % 5
            if i in (50, 120, 333):
                line, bad_lines[i] = b'{"messages": [{"role": "user", "content": "x"}', "invalid JSON"
            elif i == 200:
                line, bad_lines[i] = json.dumps({"prompt": "only a prompt"}).encode(), "missing field 'response'"
            elif i == 250:
                line, bad_lines[i] = b'{"text": "broken \xff byte"}', "invalid UTF-8"
            elif k == 0:
                line = json.dumps({"messages": [{"role": "system", "content": words(rng, 4)},
                                                {"role": "user", "content": words(rng, 8)},
                                                {"role": "assistant", "content": words(rng, 12)}]}).encode()
            elif k == 1:
                line = json.dumps({"prompt": words(rng, 6), "response": words(rng, 10)}).encode()
            elif k == 2:
                line = json.dumps({"instruction": words(rng, 5), "input": words(rng, 3),
                                   "output": words(rng, 9)}).encode()
            elif k == 3:
                line = json.dumps({"conversations": [{"from": "human", "value": words(rng, 5)},
                                                     {"from": "gpt", "value": words(rng, 7)}]}).encode()
            else:
                line = json.dumps({"text": words(rng, 20)}).encode()
            f.write(line + b"\n")

    def prepare(out, *extra, source=data):
        return run("prepare", "--data", source, "--tokenizer", tokenizer, "--out", os.path.join(WORK, out),
                   "--max-seq-len", "128", "--template", "chatml", *extra)

    # 5 bad of 400 = 1.25%: fails at the default 1%, passes at 2%.
    r = prepare("strict")
    check(r.returncode == 2, f"prepare above the bad-record threshold: exit {r.returncode}, want 2")
    check("5 of 400 records are bad" in r.stderr and data + ":50:" in r.stderr, f"threshold message: {r.stderr}")
    check(not os.path.exists(os.path.join(WORK, "strict", "manifest.json")), "failed prepare left a manifest")

    r = prepare("packed", "--max-bad-fraction", "0.02", "--threads", "2")
    if not check(r.returncode == 0, f"prepare failed: {r.stderr}"):
        return
    report = json.load(open(os.path.join(WORK, "packed", "report.json")))
    check(report["records"] == 400 and report["bad_records"] == 5, f"report counts: {report}")
    listed = {b["line"]: b["reason"] for b in report["bad"]}
    check(set(listed) == set(bad_lines), f"bad lines listed {sorted(listed)}, want {sorted(bad_lines)}")
    for line, reason in bad_lines.items():
        check(reason in listed.get(line, ""), f"line {line}: reason {listed.get(line)!r} lacks {reason!r}")
    check(report["documents"] == 395, f"documents kept: {report['documents']}")
    for line in bad_lines:
        check(f"chat.jsonl:{line}:" in r.stderr, f"stderr lists line {line}")
    manifest = json.load(open(os.path.join(WORK, "packed", "manifest.json")))
    check(manifest["chat_template"] == "chatml" and manifest["packing"] == "pack" and manifest["max_seq_len"] == 128,
          f"manifest settings: {manifest}")
    check(manifest["documents"] == 395 and manifest["sequences"] < 395, f"packing merged documents: {manifest}")
    check(len(manifest["tokenizer_hash"]) == 16, "tokenizer hash recorded")

    r = prepare("padded", "--max-bad-fraction", "0.02", "--pad")
    padded = json.load(open(os.path.join(WORK, "padded", "manifest.json"))) if r.returncode == 0 else {}
    check(r.returncode == 0 and padded.get("sequences") == 395, f"--pad: one document per sequence: {r.stderr}")

    # keel inspect: the prepared directory's documents, and the raw JSONL encoded on the fly as
    # prepare encodes it, are the same documents (ids and labels), in file order.
    r = run("inspect", os.path.join(WORK, "padded"), "--limit", "1000")
    from_shards = [json.loads(line) for line in r.stdout.splitlines()]
    check(r.returncode == 0 and len(from_shards) == 395, f"inspect of prepared data: {len(from_shards)} documents, "
          f"exit {r.returncode}: {r.stderr[-300:]}")
    r = run("inspect", data, "--tokenizer", tokenizer, "--template", "chatml", "--max-seq-len", "128", "--limit", "1000")
    from_jsonl = [json.loads(line) for line in r.stdout.splitlines()]
    check(r.returncode == 0 and from_jsonl == from_shards, f"inspect of the JSONL differs from the prepared documents "
          f"({len(from_jsonl)} vs {len(from_shards)}): {r.stderr[-300:]}")
    for d in from_shards[:50]:
        check(all(l == -100 or l == i for i, l in zip(d["input_ids"], d["labels"])), "labels are -100 or the id")
    check(any(-100 in d["labels"] for d in from_shards) and any(l != -100 for d in from_shards for l in d["labels"]),
          "chat documents have both trained and untrained tokens")
    r = run("inspect", data, "--tokenizer", tokenizer, "--template", "chatml", "--limit", "1", "--text")
    check(r.returncode == 0 and "«" in r.stdout and "<|im_start|>assistant" in r.stdout,
          f"inspect --text marks the trained span: {r.stdout[:400]} {r.stderr[-300:]}")

    def shard_sums(out):
        return [s["checksum"] for s in json.load(open(os.path.join(WORK, out, "manifest.json")))["shards"]]

    r = prepare("one_thread", "--max-bad-fraction", "0.02", "--threads", "1")
    check(r.returncode == 0 and shard_sums("one_thread") == shard_sums("packed"), "shards differ between 1 and 2 threads")

    with open(data, "rb") as f, gzip.open(data + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    r = prepare("gz", "--max-bad-fraction", "0.02", source=data + ".gz")
    check(r.returncode == 0 and shard_sums("gz") == shard_sums("packed"), f".jsonl.gz gives other shards: {r.stderr}")
    if shutil.which("zstd"):
        subprocess.run(["zstd", "-q", "-f", data, "-o", data + ".zst"], check=True)
        r = prepare("zst", "--max-bad-fraction", "0.02", source=data + ".zst")
        check(r.returncode == 0 and shard_sums("zst") == shard_sums("packed"), f".zst gives other shards: {r.stderr}")

    r = run("prepare", "--data", os.path.join(WORK, "missing.jsonl"), "--tokenizer", tokenizer, "--out",
            os.path.join(WORK, "x"), "--max-seq-len", "64")
    check(r.returncode == 2 and "missing.jsonl" in r.stderr, f"missing input: exit {r.returncode} {r.stderr}")


if __name__ == "__main__":
    try:
        main()
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    if FAILURES:
        print(f"prepare_test: {len(FAILURES)} failure(s)")
        sys.exit(1)
    print("prepare_test: all checks passed")
