#!/usr/bin/env python3
"""Greedy decoding speed of `keel generate` next to transformers' `generate` with torch 2, on the
same checkpoint, prompts and cores, in one run.

    $(scripts/python-env.sh) bench/generate_vs_transformers.py --keel build/keel \\
        [--hidden 2048 --layers 16 --heads 16 --intermediate 5632] [--prompt 64] [--new 64]

Builds a random Llama-architecture checkpoint (default: the speed issue's bench model, hidden 768,
12 layers, 12 heads, intermediate 2048, vocab 32000) and --prompts random prompts of --prompt ids,
then continues each greedily by --new tokens:

  keel (fp32)          `keel generate --prompt-ids ... --ids` (fp32 weights and KV cache: keel's
                       generator computes in fp32)
  keel (bf16 weights)  the same with `--weights bf16`: each projection's weight rounded to bf16 and
                       read as such per token (gemv_bf16); activations, cache and sums in fp32
  transformers fp32    AutoModelForCausalLM.from_pretrained(..., attn_implementation="sdpa"),
                       model.generate(do_sample=False, use_cache=True) in fp32
  transformers bf16    the same with dtype=torch.bfloat16 (what users run for speed)

Every run generates exactly `new` tokens (transformers' min_new_tokens, keel's --min-new-tokens: a
random model may otherwise choose EOS early). Decoding speed = (new - 1) / (time for `new` tokens -
time for 1 token), per prompt, so loading,
the prompt's prefill and process start cancel out; the median over prompts is reported, with the
prefill time (the 1-token run less the loading, transformers only). Every peer uses --threads
threads (torch.set_num_threads, OMP_NUM_THREADS for keel). keel's continuations are compared with
transformers' fp32 ones and the count printed: equal on the bench model; a deep random model (the
~1B) is chaotic enough that the rounding order alone changes the argmax (transformers' own fp32 and
fp64 logits differ by 7 of 15 there), so the count is information, not a check.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_vs_pytorch as tvp  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keel", required=True)
    p.add_argument("--work", default="/tmp/keel_bench_generate")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt", type=int, default=64, help="prompt length in tokens")
    p.add_argument("--new", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    a = p.parse_args()
    a.work = os.path.abspath(a.work)
    a.kv_heads, a.family, a.steps, a.batch = a.heads, "llama", 1, 1
    a.seq = a.prompt + a.new + 1  # max_position_embeddings of the checkpoint
    return a


def keel_recipe(a, model_dir, prompt, new, weights="fp32"):
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    start = time.perf_counter()
    out = subprocess.run([a.keel, "generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, prompt)),
                          "--max-new-tokens", str(new), "--min-new-tokens", str(new), "--ids", "--weights", weights],
                         env=env, capture_output=True, text=True, check=True)
    ids = [int(x) for x in out.stdout.split()]
    if len(ids) != new:  # the speed below assumes `new` tokens
        sys.exit("keel generate gave %d tokens, not %d" % (len(ids), new))
    return time.perf_counter() - start, ids


def main():
    a = parse_args()
    os.makedirs(a.work, exist_ok=True)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(a.threads)
    model_dir = tvp.make_workload(a)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, a.vocab, (a.prompt,), generator=g).tolist() for _ in range(a.prompts)]
    print("keel %s | torch %s, transformers %s | %s, %d threads"
          % (tvp.keel_version(a.keel), torch.__version__, transformers.__version__, tvp.cpu_model(), a.threads))
    print("model: llama hidden %d, %d layers, %d heads, intermediate %d, vocab %d; %d prompts of %d ids, %d new "
          "tokens each, greedy" % (a.hidden, a.layers, a.heads, a.intermediate, a.vocab, a.prompts, a.prompt, a.new))

    rows, reference = {}, {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()
        speeds, prefills = [], []
        with torch.no_grad():
            for i, prompt in enumerate(prompts):
                ids = torch.tensor([prompt])
                mask = torch.ones_like(ids)
                model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)  # warm-up
                t0 = time.perf_counter()
                model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
                t1 = time.perf_counter()
                out = model.generate(ids, attention_mask=mask, max_new_tokens=a.new, do_sample=False,
                                     min_new_tokens=a.new)
                t2 = time.perf_counter()
                speeds.append((a.new - 1) / ((t2 - t1) - (t1 - t0)))
                prefills.append(t1 - t0)
                if dtype_name == "fp32":
                    reference[i] = out[0, a.prompt:].tolist()
        rows["transformers " + dtype_name] = (statistics.median(speeds), statistics.median(prefills))
        del model

    for weights in ("fp32", "bf16"):
        keel_recipe(a, model_dir, prompts[0], 1, weights)  # warm-up: the checkpoint's pages into the cache
        speeds, same_here = [], 0
        for i, prompt in enumerate(prompts):
            t1, _ = keel_recipe(a, model_dir, prompt, 1, weights)
            tn, ids = keel_recipe(a, model_dir, prompt, a.new, weights)
            speeds.append((a.new - 1) / (tn - t1))
            same_here += ids == reference[i]
        rows["keel (fp32)" if weights == "fp32" else "keel (bf16 weights)"] = (statistics.median(speeds), None)
        if weights == "fp32":
            same = same_here
    print("keel's continuations equal transformers' fp32 ones: %d of %d prompts%s" % (
        same, len(prompts), "" if same == len(prompts) else " (a deep random model is chaotic: rounding order alone "
        "changes its argmax, transformers' own fp32 and fp64 runs disagree too; token equality is "
        "tests/reference/generate_reference.py's, on models where it is meaningful)"))

    keel_fp32, keel_bf16 = rows["keel (fp32)"][0], rows["keel (bf16 weights)"][0]
    print("\n%-20s %12s %12s %16s %16s" % ("peer", "tokens/s", "prefill s", "keel fp32 / peer", "keel bf16 / peer"))
    for name, (speed, prefill) in rows.items():
        print("%-20s %12.2f %12s %15.2fx %15.2fx" % (name, speed, "%.3f" % prefill if prefill is not None else "-",
                                                     keel_fp32 / speed, keel_bf16 / speed))
    print(json.dumps({"model": [a.hidden, a.layers, a.heads, a.intermediate, a.vocab], "prompt": a.prompt,
                      "new": a.new, "tokens_per_s": {k: round(v[0], 3) for k, v in rows.items()},
                      "same_continuations": same, "prompts": len(prompts)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
