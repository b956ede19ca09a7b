"""What the integration test scripts share: a failure list with check(), recipe files from
dicts, tiny pre-tokenized training data, a run's metrics and final weights, the worst relative
difference of two sets of tensors, and the runner that calls every test_* function of a script."""
import json
import os
import random
import shutil
import sys
import time

FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("  FAIL:", what)
    return cond


def toml_value(v):
    """v as a TOML value: booleans lowercase, strings quoted and escaped, lists of these."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def toml_lines(keys):
    """'key = value' lines of a recipe table; a key whose value is None is left out."""
    return ["%s = %s" % (k, toml_value(v)) for k, v in keys.items() if v is not None]


def write_recipe_file(path, keys, model_config=None):
    """A recipe at path: `keys` as its top-level table (a None value left out), then, when given,
    `model_config`'s keys as its [model_config] table (the random-init model). Returns path."""
    text = "".join(line + "\n" for line in toml_lines(keys))
    if model_config is not None:
        text += "[model_config]\n" + "".join(line + "\n" for line in toml_lines(model_config))
    with open(path, "w") as f:
        f.write(text)
    return path


def start_training(keel, recipe_path, metrics_path, timeout=60):
    """Starts `keel train RECIPE` and returns the process once its first step is logged in
    metrics_path (or after `timeout` seconds): a run that is surely training, to interrupt."""
    import os
    import subprocess
    p = subprocess.Popen([keel, "train", recipe_path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while time.time() < deadline and not (os.path.exists(metrics_path) and os.path.getsize(metrics_path) > 0):
        time.sleep(0.05)
    return p


def write_data(path, n, seed, vocab=32, lo=6, hi=20):
    """n pre-tokenized records of a learnable pattern: counting up from a random start, modulo
    the vocabulary."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            start, length = rng.randrange(vocab), rng.randrange(lo, hi)
            f.write(json.dumps({"input_ids": [(start + i) % vocab for i in range(length)]}) + "\n")


def mpi_env(env=None):
    """The environment for runs under mpirun: `env` (default: this process's) with leak checking
    off. OpenMPI's MPI_Finalize leaks ~120 KB from MCA components it has dlclosed by then (frames
    in "<unknown module>", which no LeakSanitizer suppression can match), so in a sanitizer build
    (scripts/test-sanitizers.sh) runs under mpirun go without leak checking; ASan's memory errors
    and UBSan stay on. Other builds ignore ASAN_OPTIONS."""
    env = dict(os.environ if env is None else env)
    asan = env.get("ASAN_OPTIONS", "")
    env["ASAN_OPTIONS"] = (asan + ":" if asan else "") + "detect_leaks=0"  # the last setting wins
    return env


def metrics(d):
    """The records of d/out/metrics.jsonl (a run whose output_dir is d/out)."""
    with open(os.path.join(d, "out", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def final_bytes(d):
    """The bytes of d/out/final/model.safetensors: what a bit-exact comparison compares."""
    with open(os.path.join(d, "out", "final", "model.safetensors"), "rb") as f:
        return f.read()


def max_rel_l2(a, b):
    """Worst relative L2 difference over the tensors of b (torch tensors, by name), and its name."""
    worst, worst_name = 0.0, ""
    for name, t in b.items():
        e = float((a[name].double() - t.double()).norm() / max(float(t.double().norm()), 1e-30))
        if e > worst:
            worst, worst_name = e, name
    return worst, worst_name


def run_tests(namespace, suite, work, failures=FAILURES, only=None, skip=None):
    """Runs namespace's test_* functions in definition order (those whose name contains `only`,
    none containing `skip`), removes `work`, and exits 1 if anything failed."""
    for name, fn in [(n, f) for n, f in namespace.items() if n.startswith("test_") and callable(f)]:
        if (only and only not in name) or (skip and skip in name):
            continue
        print(name)
        t0 = time.time()
        fn()
        print("  %.1f s" % (time.time() - t0))
    shutil.rmtree(work, ignore_errors=True)
    if failures:
        print("%d failure(s)" % len(failures))
        sys.exit(1)
    print("all %s checks passed" % suite)


def checkpoint_tensors(step_dir):
    """A training-state checkpoint's tensors, as torch tensors by name: "w.<name>" (fp32 masters),
    "m.<name>" and "v.<name>" (AdamW moments), from either layout: weights.safetensors and
    optimizer.safetensors, or the sharded layout, each tensor assembled from its pieces in the
    shard files where manifest.json places them (a piece missing or doubled is an error)."""
    import numpy
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
    import hf_models
    with open(os.path.join(step_dir, "manifest.json")) as f:
        manifest = json.load(f)
    if manifest.get("layout") != "sharded":
        out = {"w." + k: v for k, v in hf_models.load_safetensors(os.path.join(step_dir, "weights.safetensors")).items()}
        out.update(hf_models.load_safetensors(os.path.join(step_dir, "optimizer.safetensors")))
        return out
    shapes = {t["name"]: t["shape"] for t in manifest["tensors"]}
    flat, filled = {}, {}
    for kind, prefix in (("weights", "w."), ("m", "m."), ("v", "v.")):
        for name, shape in shapes.items():
            flat[prefix + name] = numpy.zeros(int(numpy.prod(shape)), dtype=numpy.float32)
            filled[prefix + name] = 0
    files = [os.path.join(step_dir, s["file"]) for s in manifest["shards"]]
    for p in manifest["pieces"]:
        key = {"weights": "w.", "m": "m.", "v": "v."}[p["kind"]] + p["tensor"]
        count = p["end"] - p["begin"]
        with open(files[p["shard"]], "rb") as f:
            f.seek(p["offset"])
            flat[key][p["begin"]:p["end"]] = numpy.frombuffer(f.read(4 * count), dtype="<f4")
        filled[key] += count
    out = {}
    for key, values in flat.items():
        if filled[key] != values.size:
            raise ValueError("%s: the pieces of %s cover %d of its %d elements" % (step_dir, key, filled[key], values.size))
        out[key] = torch.from_numpy(values.reshape(shapes[key[2:]]))
    return out
