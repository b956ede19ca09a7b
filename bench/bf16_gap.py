#!/usr/bin/env python3
"""How far keel's bf16 training lands from fp32, next to how far torch's own bf16 autocast does.

    $(scripts/python-env.sh) bench/bf16_gap.py --keel build/keel --family llama [--factor 1]

Runs tests/reference/train_reference.py's training of one family in bf16, but compares keel's
result with torch's **fp32** run instead of torch's bf16 run, each final tensor's tolerance being
`factor` x the distance between torch's bf16 and fp32 runs, with no fixed floor (the reference test
itself compares with torch bf16 at max(5e-2, 5 x that distance)). The per-tensor table shows the
ratio keel needs; a FAIL at factor 1 means keel's bf16 is further from fp32 than torch's is for
that tensor. A measurement, not a test.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))
import train_reference as tr  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keel", required=True)
    ap.add_argument("--family", default="llama")
    ap.add_argument("--factor", type=float, default=1.0)
    ap.add_argument("--work", default=None)
    a = ap.parse_args()

    def reference(spec, init, records, dtype):
        bf16 = tr.torch_train(spec, init, records, "bf16")
        fp32 = tr.torch_train(spec, init, records, "fp32")
        tr.TOL["bf16"]["weights"] = tr.TOL["bf16"]["update"] = 0.0  # no floor: the gap alone
        tr.BF16_NOISE_FACTOR = a.factor
        fp32["tol"] = tr.tensor_tolerances(spec, "bf16", init, bf16, fp32)
        return fp32  # keel's bf16 run is compared with torch's fp32 one

    tr.reference = reference
    sys.argv = [sys.argv[0], "--keel", a.keel, "--family", a.family, "--dtype", "bf16", "--work",
                a.work or "/tmp/keel_bf16_gap_" + a.family]
    return tr.main()


if __name__ == "__main__":
    sys.exit(main())
