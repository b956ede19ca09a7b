"""keel export --format gguf against llama.cpp's convert_hf_to_gguf.py on the same model directory:
wall time, MB/s of the file written and peak resident memory of each, on a random model of Llama
3.2 1B's shape (bf16 safetensors, tied embedding, Llama 3's tokenizer), default outtype (bf16
for both), and the disk's own speed for the same bytes: a copy of the weights (copy_file_range,
no copy through user space) and the weights written from memory with write(), each synced. The files are identical but
for naming keys (tests/reference/gguf_reference.py checks that on tiny models; here only their
sizes are compared). keel fsyncs its file before renaming it into place; the converter does not.

  bench/gguf_export_vs_llama_cpp.py --keel build/keel --tokenizer DIR [--work /tmp/gguf-bench]
                                     [--layers 16] [--rounds 1]
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))


def build_model(out, tokenizer, layers):
    import torch
    import hf_models as H
    tj = json.load(open(os.path.join(tokenizer, "tokenizer.json"), encoding="utf-8"))
    vocab = 1 + max(list(tj["model"]["vocab"].values()) + [t["id"] for t in tj["added_tokens"]])
    cfg = H.make_config("llama", vocab_size=vocab, hidden_size=2048, intermediate_size=8192, num_layers=layers,
                        num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
                        tie_word_embeddings=True)
    cfg["torch_dtype"] = "bfloat16"
    g = torch.Generator().manual_seed(0)
    spec = H.spec_from_config(cfg)
    model = H.build_model(spec)
    tensors = {}
    for name, t in H.model_tensors(model).items():
        tensors[name] = (torch.randn(t.shape, generator=g) * 0.02).to(torch.bfloat16)
    del model
    shutil.rmtree(out, ignore_errors=True)
    H.save_checkpoint(out, cfg, tensors, shards=max(1, sum(t.numel() for t in tensors.values()) * 2 // (2 << 30)))
    for f in os.listdir(tokenizer):
        shutil.copy(os.path.join(tokenizer, f), os.path.join(out, f))
    return sum(t.numel() for t in tensors.values())


def timed(cmd, env=None):
    """Wall seconds and the child's peak RSS (MB), from wait4's rusage."""
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit("%s failed:\n%s" % (" ".join(cmd), p.stderr.read().decode()[-3000:]))
    return wall, usage.ru_maxrss / 1024


def write_floor(weights, copy):
    """The weights' bytes written from a buffer in memory, 4 MiB a write(), and synced: the kernel's
    copy into the page cache and the disk, which every writer of new bytes pays."""
    with open(weights, "rb") as f:
        data = memoryview(f.read())
    start = time.perf_counter()
    fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for at in range(0, len(data), 4 << 20):
        os.write(fd, data[at:at + (4 << 20)])
    os.fsync(fd)
    os.close(fd)
    wall = time.perf_counter() - start
    print("disk: write() from memory + fsync of the weights %.1f s, %.1f MB/s" % (wall, len(data) / 1e6 / wall))
    os.remove(copy)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keel", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--work", default="/tmp/gguf-bench")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--write-floor", action="store_true")
    args = ap.parse_args()
    tree = subprocess.run([os.path.join(ROOT, "scripts", "llama-cpp-sources.sh"), sys.executable],
                          capture_output=True, text=True, check=True).stdout.strip()
    model = os.path.join(args.work, "model")
    if args.write_floor:
        write_floor(os.path.join(model, "model.safetensors"), os.path.join(args.work, "copy.bin"))
        return
    if args.build_only:
        params = build_model(model, args.tokenizer, args.layers)
        print("model: %.2fB parameters, bf16, %s" % (params / 1e9, model))
        return
    # Built in a child: a child's peak RSS counts its parent's at fork (Linux keeps the high-water
    # mark across exec), and building the model takes gigabytes here.
    subprocess.run([sys.executable, __file__, "--keel", args.keel, "--tokenizer", args.tokenizer, "--work", args.work,
                    "--layers", str(args.layers), "--build-only"], check=True)
    # The disk's own speed for the same bytes: a copy of the weights, synced as keel syncs its file.
    copy = os.path.join(args.work, "copy.bin")
    start = time.perf_counter()
    shutil.copyfile(os.path.join(model, "model.safetensors"), copy)
    with open(copy, "rb+") as f:
        os.fsync(f.fileno())
    wall = time.perf_counter() - start
    print("disk: copy + fsync of the weights %.1f s, %.1f MB/s" % (wall, os.path.getsize(copy) / 1e6 / wall))
    os.remove(copy)
    # What any writer of new bytes pays (keel and the converter both write() what they made), in a
    # child so that the 2.5 GB it reads does not count in the exports' peak RSS.
    subprocess.run([sys.executable, __file__, "--keel", args.keel, "--tokenizer", args.tokenizer, "--work", args.work,
                    "--write-floor"], check=True)
    env = dict(os.environ, PYTHONPATH=os.path.join(tree, "gguf-py"))
    theirs, ours = os.path.join(args.work, "converter.gguf"), os.path.join(args.work, "keel.gguf")
    for r in range(args.rounds):
        for f in (theirs, ours):
            if os.path.exists(f):
                os.remove(f)
        # Alternate which goes first, so the page cache favours neither.
        runs = [("converter", [sys.executable, os.path.join(tree, "convert_hf_to_gguf.py"), model, "--outfile", theirs], env, theirs),
                ("keel", [args.keel, "export", model, "--to", ours, "--format", "gguf"], None, ours)]
        if r % 2:
            runs.reverse()
        for name, cmd, e, out in runs:
            wall, rss = timed(cmd, e)
            size = os.path.getsize(out) / 1e6
            print("round %d %-9s %6.1f s  %7.1f MB/s  peak RSS %6.0f MB  (%.0f MB file)" % (r + 1, name, wall, size / wall, rss, size))


if __name__ == "__main__":
    main()
