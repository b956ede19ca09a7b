"""Writes the golden data of keel's llama-quantize quantizers (tests/unit/gguf_k_quants_test.cpp):
fp32 values and the bytes llama.cpp's own ggml library (libggml-base, as scripts/llama-cpp-library.sh
builds it) makes of them with ggml_quantize_chunk and no importance matrix, which is what
llama_model_quantize runs for each tensor. gguf-py has no k-quant quantizers, so the library is the
reference.

  tests/data/gguf_k_quants/values.f32      the values, little-endian float32
  tests/data/gguf_k_quants/<TYPE>.blocks   ggml's bytes

    $(scripts/python-env.sh) tests/reference/gguf_k_quants_golden.py   (rerun when llama.cpp changes)

The values are weights of a trained model's scale (normal, sigma 0.02) with the cases the
quantizers branch on mixed in: an all-zero group, a group of one positive value repeated (max ==
min), an all-positive group (the min clamped to 0), a lone outlier, tiny values near
GROUP_MAX_EPS, and a super-block of zeros.
"""
import ctypes
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
lib_dir = subprocess.run([os.path.join(ROOT, "scripts", "llama-cpp-library.sh"), sys.executable], check=True,
                         capture_output=True, text=True).stdout.strip()
ggml = ctypes.CDLL(os.path.join(lib_dir, "llama_cpp", "lib", "libggml-base.so"))
ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
ggml.ggml_row_size.restype = ctypes.c_size_t
ggml.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]

TYPES = {"Q4_K": 12, "Q6_K": 14, "Q5_0": 6, "Q8_0": 8}  # ggml.h enum ggml_type
ROW = 512  # two super-blocks per row
ROWS = 6


def values(rng):
    x = rng.normal(0.0, 0.02, size=(ROWS, ROW)).astype(np.float32)
    x[1, 0:32] = 0.0                                   # an all-zero group
    x[1, 32:64] = np.float32(0.0137)                   # max == min after min is clamped to 0
    x[1, 64:96] = np.abs(x[1, 64:96]) + np.float32(0.01)  # all positive
    x[1, 100] = np.float32(0.9)                        # an outlier
    x[2, 0:16] = rng.normal(0.0, 1e-16, size=16).astype(np.float32)  # below GROUP_MAX_EPS
    x[2, 16:32] = -np.abs(x[2, 16:32])                 # all negative
    x[3, 0:256] = 0.0                                  # a super-block of zeros
    x[4] *= np.float32(40.0)                           # large weights (an embedding's scale)
    x[5, ::7] = np.float32(0.0)                        # scattered zeros
    return np.ascontiguousarray(x)


rng = np.random.default_rng(20261206)
out = os.path.join(ROOT, "tests", "data", "gguf_k_quants")
os.makedirs(out, exist_ok=True)
x = values(rng)
x.astype("<f4").tofile(os.path.join(out, "values.f32"))
for name, qtype in TYPES.items():
    row_size = ggml.ggml_row_size(qtype, ROW)
    dst = np.zeros(ROWS * row_size, dtype=np.uint8)
    written = ggml.ggml_quantize_chunk(qtype, x.ctypes.data, dst.ctypes.data, 0, ROWS, ROW, None)
    assert written == dst.size, (name, written, dst.size)
    dst.tofile(os.path.join(out, name + ".blocks"))
    print("%s: %d values, %d bytes" % (name, x.size, dst.size))
