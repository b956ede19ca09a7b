#!/usr/bin/env python3
"""keel's TensorBoard event files (recipe report_to = "tensorboard") read back by TensorBoard's own
reader, EventAccumulator, from the pinned tensorboard package.

    $(scripts/python-env.sh) tests/reference/tensorboard_reference.py --keel build/keel --work DIR

A run with evaluation and checkpoints logs 12 steps; then it is resumed from its step-8
checkpoint into the same output directory (as after a crash that lost steps 9-12), so that the
second event file must make TensorBoard drop the first file's steps 9-12. Checked: every record's
CRC-32C against tensorboard's own masked_crc32c; every value of metrics.jsonl is a scalar with the
same value at the same step, each step exactly once, after the resume too; the recipe is there as
text.
"""
import argparse
import glob
import json
import os
import shutil
import struct
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))
from harness import check, FAILURES, write_data  # noqa: E402

import tensorboard  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c  # noqa: E402

# metrics.jsonl prints some values to fixed decimals; the event file holds float32.
DECIMALS = {"tokens_per_s": 3, "step_time_s": 6, "checkpoint_s": 6, "peak_memory_gb": 4}


def write_recipe(work, out, ckpt):
    lines = [
        'data_path = "%s"' % os.path.join(work, "train.jsonl"),
        'eval_data_path = "%s"' % os.path.join(work, "eval.jsonl"),
        'output_dir = "%s"' % out, 'checkpoint_dir = "%s"' % ckpt,
        'dtype = "fp32"', "max_seq_len = 16", "batch_size = 4", "max_steps = 12", "learning_rate = 3e-3",
        "warmup_steps = 2", "seed = 5", "save_interval = 4", "eval_interval = 6", "log_interval = 5",
        'report_to = ["tensorboard"]',
        "[model_config]", 'family = "llama"', "vocab_size = 32", "hidden_size = 32", "intermediate_size = 64",
        "num_layers = 2", "num_heads = 4", "num_kv_heads = 2",
    ]
    path = os.path.join(work, "recipe.toml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def check_records(path):
    """Every TFRecord of the file: masked CRC-32C of the length and of the data, as TensorFlow's."""
    with open(path, "rb") as f:
        data = f.read()
    pos, n = 0, 0
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        body = data[pos + 12:pos + 12 + length]
        (body_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        if not check(length_crc == masked_crc32c(header) and body_crc == masked_crc32c(body),
                     "%s: record %d has the CRCs TensorFlow computes" % (os.path.basename(path), n)):
            return
        pos += 16 + length
        n += 1
    check(pos == len(data) and n > 12, "%s: %d whole records" % (os.path.basename(path), n))


def tag_of(key):
    return "eval/" + key[len("eval_"):] if key.startswith("eval_") else "train/" + key


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keel", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    write_data(os.path.join(args.work, "train.jsonl"), 200, seed=1)
    write_data(os.path.join(args.work, "eval.jsonl"), 20, seed=2)
    out, ckpt = os.path.join(args.work, "out"), os.path.join(args.work, "ckpt")
    recipe = write_recipe(args.work, out, ckpt)
    print("tensorboard", tensorboard.__version__)

    first = subprocess.run([args.keel, "train", recipe], capture_output=True, text=True)
    check(first.returncode == 0, "the run trains (%s)" % first.stderr[-2000:])
    check("TensorBoard events in" in first.stdout, "the run says where its events go")
    # The steps after the step-8 checkpoint, as a crash would have lost them: resumed from step 8.
    step8 = [d for d in glob.glob(os.path.join(ckpt, "*")) if os.path.basename(d).endswith("8")]
    check(len(step8) == 1, "one step-8 checkpoint in %s" % os.listdir(ckpt))
    second = subprocess.run([args.keel, "train", recipe, "--resume", step8[0]], capture_output=True, text=True)
    check(second.returncode == 0, "the resumed run trains (%s)" % second.stderr[-2000:])
    check("steps from 9 on replace what an earlier run logged" in second.stdout, "the resume says what it replaces")

    files = sorted(glob.glob(os.path.join(out, "runs", "events.out.tfevents.*")))
    check(len(files) == 2, "one event file per run, got %s" % files)
    for f in files:
        check_records(f)

    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    check([m["step"] for m in lines] == list(range(1, 13)), "metrics.jsonl has steps 1..12 after the resume")

    acc = EventAccumulator(os.path.join(out, "runs"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {}
    for m in lines:
        for key, value in m.items():
            if key in ("step", "skipped"):
                continue
            expected.setdefault(tag_of(key), {})[m["step"]] = value
    check(set(expected) == tags, "the scalars are metrics.jsonl's values: %s vs %s" % (sorted(tags), sorted(expected)))
    compared = 0
    for tag, by_step in expected.items():
        if tag not in tags:
            continue
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        check(steps == sorted(by_step), "%s: steps %s once each, in order (got %s)" % (tag, sorted(by_step), steps))
        key = tag.split("/", 1)[1]
        for e in events:
            want = by_step.get(e.step)
            if want is None:
                continue
            tol = 1e-6 * abs(want) + 0.6 * 10.0 ** -DECIMALS.get(key, 4 if key.endswith("_share") else 9)
            compared += 1
            check(abs(e.value - want) <= tol, "%s at step %d: %r in the event file, %r in metrics.jsonl"
                  % (tag, e.step, e.value, want))
    check({"eval/loss", "train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/peak_memory_gb"}
          <= tags, "loss, lr, gradient norm, throughput, memory and eval loss are logged")
    print("compared %d scalars over %d tags" % (compared, len(tags)))

    texts = acc.Tags()["tensors"]
    check("recipe/text_summary" in texts, "the recipe is logged as text (tags %s)" % texts)
    if "recipe/text_summary" in texts:
        text = acc.Tensors("recipe/text_summary")[0].tensor_proto.string_val[0].decode()
        check('report_to = "tensorboard"' in text and "max_steps = 12" in text,
              "the recipe text is the resolved recipe: %s" % text[:200])
        check(acc.SummaryMetadata("recipe/text_summary").plugin_data.plugin_name == "text",
              "the recipe is for TensorBoard's text plugin")

    if FAILURES:
        print("%d failure(s)" % len(FAILURES))
        sys.exit(1)
    print("TensorBoard reads every scalar of metrics.jsonl back, across a resume")


if __name__ == "__main__":
    main()
