#!/usr/bin/env python3
"""The optimization ladder (`keel bench ladder`) on a text recipe of moderate size: English text
records from the machine's own documentation (/usr/share/doc changelogs and copyright files;
generated sentences where there is none), a byte-level BPE tokenizer trained on them with
`keel tokenizer train`, and a new Llama-style model. Prints the four-row table (docs/performance.md).

    $(scripts/python-env.sh) bench/ladder.py KEEL [--dp 2] [--steps 8] [--repeat 3] [--mb 8]
        [--hidden 256] [--layers 4] [--keep]

--hidden 64 --layers 2 makes the compute cheap enough for the data stage to show.
"""
import glob
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

KEEL = os.path.abspath(sys.argv[1])


def arg(name, default):
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def documentation_text(limit_bytes):
    """Paragraphs of real English, in a fixed order."""
    paragraphs, size = [], 0
    files = sorted(glob.glob("/usr/share/doc/*/changelog*.gz")) + sorted(glob.glob("/usr/share/doc/*/copyright"))
    for path in files:
        try:
            with (gzip.open(path, "rt", errors="replace") if path.endswith(".gz") else
                  open(path, errors="replace")) as f:
                text = f.read()
        except OSError:
            continue
        for p in text.split("\n\n"):
            p = " ".join(p.split())
            if len(p) >= 200:
                paragraphs.append(p)
                size += len(p)
        if size >= limit_bytes:
            break
    if size < limit_bytes:  # no documentation installed: generated sentences
        rng = random.Random(1)
        words = ("the of and to in is was for on that with as by at from this which an were be model data token "
                 "training shard packing loader gradient attention layer memory thread release fixed bug").split()
        while size < limit_bytes:
            p = " ".join(rng.choice(words) for _ in range(rng.randint(40, 300)))
            paragraphs.append(p)
            size += len(p)
    return paragraphs


def main():
    dp, steps, repeat, mb = arg("--dp", 2), arg("--steps", 8), arg("--repeat", 3), arg("--mb", 8)
    hidden, layers = arg("--hidden", 256), arg("--layers", 4)
    work = tempfile.mkdtemp(prefix="keel_ladder_bench_")
    data = os.path.join(work, "train.jsonl")
    with open(data, "w") as f:
        record = []
        for p in documentation_text(mb << 20):
            record.append(p)
            if sum(len(x) for x in record) >= 1200:  # records of ~200-400 words
                f.write(json.dumps({"text": "\n\n".join(record)}) + "\n")
                record = []
    tokenizer = os.path.join(work, "tokenizer.json")
    subprocess.run([KEEL, "tokenizer", "train", "--data", data, "--vocab-size", "8000", "--special", "<|endoftext|>",
                    "--out", tokenizer], check=True, stdout=subprocess.DEVNULL)
    recipe = os.path.join(work, "recipe.toml")
    with open(recipe, "w") as f:
        f.write(f'''data_path = "{data}"
tokenizer = "{tokenizer}"
output_dir = "{work}/out"
dtype = "bf16"
max_seq_len = 512
batch_size = 4
gradient_accumulation_steps = 2
learning_rate = 3e-4
seed = 1
max_steps = {steps}
dp_degree = {dp}

[model_config]
family = "llama"
vocab_size = 8000
hidden_size = {hidden}
intermediate_size = {hidden * 43 // 16}
num_layers = {layers}
num_heads = {max(1, hidden // 64)}
num_kv_heads = {max(1, hidden // 64)}
''')
    print(f"data: {os.path.getsize(data) / 1e6:.1f} MB of text records in {data}", flush=True)
    r = subprocess.run([KEEL, "bench", "ladder", recipe, "--steps", str(steps), "--repeat", str(repeat)])
    if "--keep" in sys.argv or r.returncode != 0:
        print("kept", work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
