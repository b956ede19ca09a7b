#!/usr/bin/env python3
"""keel generate against PyTorch: greedy continuations of the same prompts are token-identical for
every family (tiny random HF checkpoints built here; no tokenizer needed, ids in and out).

With `--weights bf16` keel reads each projection's weight rounded to bf16 (sums stay fp32): that
must generate what PyTorch generates in fp32 from the same model with every nn.Linear weight
rounded to bf16 and back (unit test Generator.Bf16WeightsAreTheRoundedModel checks the logits).

    $(scripts/python-env.sh) tests/reference/generate_reference.py --keel build/keel --work DIR
"""
import argparse
import copy
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_models as hm  # noqa: E402


def bf16_rounded(model):
    """The model with every nn.Linear weight rounded to bf16 (biases, norms, embeddings as they are)."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for m in rounded.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(m.weight.to(torch.bfloat16).to(torch.float32))
    return rounded


def keel_generate(a, model_dir, prompt, *extra):
    r = subprocess.run([a.keel, "generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, prompt)),
                        "--max-new-tokens", "16", "--ids", "--backend", a.backend, *extra], capture_output=True,
                       text=True)
    return [int(x) for x in r.stdout.split()] if r.returncode == 0 else None, r


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--keel", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--backend", default="cpu", choices=("cpu", "reference"), help="keel generate --backend")
    a = p.parse_args()
    torch.set_num_threads(2)
    failures = 0
    prompts = [[5, 17, 42, 8], [200, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    for family in hm.FAMILIES:
        # Untied head: with tied embeddings a random model just repeats its last token (the residual
        # stream stays close to that token's embedding), which would make a weak test.
        cfg = hm.make_config(family, max_position_embeddings=64, tie_word_embeddings=False)
        spec = hm.spec_from_config(cfg)
        model = hm.random_init(hm.build_model(spec), seed=3, head_std=1.0)
        model_dir = os.path.join(a.work, family)
        hm.save_checkpoint(model_dir, cfg, hm.model_tensors(model))
        rounded = bf16_rounded(model)
        for prompt in prompts:
            expected_bf16 = hm.greedy_generate(rounded, prompt, 16)
            got_bf16, r3 = keel_generate(a, model_dir, prompt, "--weights", "bf16")
            ok = got_bf16 == expected_bf16
            print("%s %s bf16 weights: keel %s, torch %s%s" % ("ok  " if ok else "FAIL", family, got_bf16,
                                                             expected_bf16, "" if ok else " <- differ " + r3.stderr))
            failures += not ok
            expected = hm.greedy_generate(model, prompt, 16)
            r = subprocess.run([a.keel, "generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, prompt)),
                                "--max-new-tokens", "16", "--ids", "--backend", a.backend], capture_output=True,
                               text=True)
            if r.returncode != 0:
                print("FAIL %s: keel generate exited %d: %s" % (family, r.returncode, r.stderr))
                failures += 1
                continue
            got = [int(x) for x in r.stdout.split()]
            # Sampling with top_k = 1 must reduce to greedy whatever the temperature and seed.
            r2 = subprocess.run([a.keel, "generate", "--model", model_dir, "--prompt-ids",
                                 ",".join(map(str, prompt)), "--max-new-tokens", "16", "--ids", "--temperature", "0.7",
                                 "--top-k", "1", "--seed", "9", "--backend", a.backend], capture_output=True,
                                text=True)
            sampled = [int(x) for x in r2.stdout.split()] if r2.returncode == 0 else None
            ok = got == expected and sampled == expected
            print("%s %s: keel %s, torch %s%s" % ("ok  " if ok else "FAIL", family, got, expected,
                                                 "" if ok else " <- differ"))
            failures += not ok
    if failures:
        print("%d failure(s)" % failures)
        sys.exit(1)
    print("greedy generation matches PyTorch for every family, with fp32 and with bf16-rounded weights")


if __name__ == "__main__":
    main()
