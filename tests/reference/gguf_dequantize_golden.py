"""Writes the golden data of keel's GGUF dequantizers (tests/unit/gguf_dequantize_test.cpp): for each
type keel reads, random blocks (their f16 scales set to finite values of a weight's size) and the
values gguf-py's own dequantizer (gguf.quants.dequantize, from the llama.cpp tree
scripts/llama-cpp-sources.sh fetches) gives for them, as float32.

  tests/data/gguf_dequantize/<TYPE>.blocks   the blocks' bytes
  tests/data/gguf_dequantize/<TYPE>.f32      gguf-py's values, little-endian float32

    $(scripts/python-env.sh) tests/reference/gguf_dequantize_golden.py   (rerun when gguf-py changes)
"""
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
tree = subprocess.run([os.path.join(ROOT, "scripts", "llama-cpp-sources.sh"), sys.executable], check=True,
                      capture_output=True, text=True).stdout.strip()
sys.path.insert(0, os.path.join(tree, "gguf-py"))
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, quants  # noqa: E402

# type -> byte offsets of its f16 fields within a block (d, and dmin or m where it has one)
HALVES = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}
BLOCKS = 4

rng = np.random.default_rng(20261206)
out = os.path.join(ROOT, "tests", "data", "gguf_dequantize")
os.makedirs(out, exist_ok=True)
for qtype, halves in HALVES.items():
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(BLOCKS, type_size), dtype=np.uint8)
    for at in halves:
        scale = rng.uniform(-0.02, 0.02, size=BLOCKS).astype(np.float16)
        blocks[:, at:at + 2] = scale.view(np.uint8).reshape(BLOCKS, 2)
    values = quants.dequantize(blocks.reshape(-1), qtype).astype(np.float32).reshape(-1)
    assert values.size == BLOCKS * block_size and np.isfinite(values).all()
    blocks.tofile(os.path.join(out, qtype.name + ".blocks"))
    values.astype("<f4").tofile(os.path.join(out, qtype.name + ".f32"))
    print("%s: %d blocks, %d values" % (qtype.name, BLOCKS, values.size))
