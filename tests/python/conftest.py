"""Shared fixtures of the keel Python package's tests (pytest, in the reference environment).

The package under test is the one on sys.path: build/python (ctest sets PYTHONPATH) or the one
`pip install .` installed (scripts/check-fresh-machine.sh). Tiny models are built with
transformers; a byte-level BPE tokenizer is trained by `keel tokenizer train` on generated text.
"""
import json
import os
import random
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import keel  # noqa: E402
from keel._command import keel_binary  # noqa: E402

WORDS = "the model learns to answer questions about data tokens shards and packing quickly".split()


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_recipe(path, keys, model_config=None):
    """A TOML recipe file from a dict (strings quoted, booleans lowercase)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)
    lines = ["%s = %s" % (k, value(v)) for k, v in keys.items()]
    if model_config:
        lines += ["[model_config]"] + ["%s = %s" % (k, value(v)) for k, v in model_config.items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def run_cli(*args, cwd=None):
    return subprocess.run([keel_binary()] + [str(a) for a in args], capture_output=True, text=True, cwd=cwd)


def write_counting_data(path, n, seed, vocab=32):
    """Pre-tokenized records of a learnable pattern (counting up modulo the vocabulary)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            start, length = rng.randrange(vocab), rng.randrange(6, 20)
            f.write(json.dumps({"input_ids": [(start + i) % vocab for i in range(length)]}) + "\n")
    return str(path)


SMALL_MODEL = {"family": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
               "num_heads": 4, "num_kv_heads": 2}


@pytest.fixture(scope="session")
def chat_setup(tmp_path_factory):
    """A byte-level BPE tokenizer (ChatML specials), a tiny transformers Llama with it saved as an
    HF model directory, and 200 chat records."""
    import torch
    import transformers
    work = tmp_path_factory.mktemp("chat")
    rng = random.Random(7)
    corpus = work / "corpus.jsonl"
    with open(corpus, "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": words(rng, 30)}) + "\n")
    tokenizer = work / "tokenizer.json"
    r = run_cli("tokenizer", "train", "--data", corpus, "--vocab-size", 320, "--special", "<|endoftext|>",
                "--special", "<|im_start|>", "--special", "<|im_end|>", "--out", tokenizer)
    assert r.returncode == 0, r.stderr
    vocab = len(json.load(open(tokenizer))["model"]["vocab"])
    model_dir = work / "model"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
                                      pad_token_id=0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(model_dir, safe_serialization=True)
    (model_dir / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    data = work / "chat.jsonl"
    with open(data, "w") as f:
        for _ in range(200):
            f.write(json.dumps({"messages": [{"role": "user", "content": words(rng, rng.randrange(3, 12))},
                                             {"role": "assistant", "content": words(rng, rng.randrange(4, 20))}]})
                    + "\n")
    return {"work": work, "model": str(model_dir), "data": str(data), "tokenizer": str(tokenizer), "vocab": vocab}


def metrics_lines(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f if l.strip()]


# Timing and memory are measurements of the process (a Python process holds more than the CLI);
# everything else two runs of the same recipe write must be equal.
TIMING = ("step_time_s", "tokens_per_s", "compute_share", "data_wait_share", "optimizer_share", "grad_sync_share",
          "checkpoint_s", "peer_wait_share", "peak_memory_gb")


def without_timing(lines):
    return [{k: v for k, v in l.items() if k not in TIMING} for l in lines]


__all__ = ["keel", "sys"]
