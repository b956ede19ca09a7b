#!/usr/bin/env python3
"""keel train end to end: progress output in both modes, metrics/summary/plot files, evaluation,
SIGINT, NaN handling, bit-exact resume, SIGKILL crash recovery and corrupt checkpoints.

    $(scripts/python-env.sh) tests/integration/trainer_test.py KEEL [--only NAME]
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from harness import check, final_bytes, metrics, run_tests, start_training, write_data, write_recipe_file

KEEL = os.path.abspath(sys.argv[1])
ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
# --skip NAME: leave a test out (the sanitizer build skips crash_recovery: 1200 steps under ASan).
SKIP = sys.argv[sys.argv.index("--skip") + 1] if "--skip" in sys.argv else None
WORK = tempfile.mkdtemp(prefix="keel_trainer_test_")


def recipe(name, **overrides):
    d = os.path.join(WORK, name)
    os.makedirs(d, exist_ok=True)
    keys = {
        "data_path": os.path.join(WORK, "train.jsonl"), "output_dir": os.path.join(d, "out"),
        "dtype": "fp32", "max_seq_len": 16, "batch_size": 4, "gradient_accumulation_steps": 2,
        "learning_rate": 3e-3, "warmup_steps": 2, "max_steps": 12, "seed": 5, "shuffle": True,
        "log_interval": 4, "weight_decay": 0.01,
    }
    keys.update(overrides)
    model = {"family": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
             "num_heads": 4, "num_kv_heads": 2}
    return write_recipe_file(os.path.join(d, "recipe.toml"), keys, model), d


def run(args, env=None, unset=(), **kw):
    e = dict(os.environ)
    e.update(env or {})
    for name in unset:
        e.pop(name, None)
    return subprocess.run([KEEL] + args, capture_output=True, text=True, env=e, **kw)




def test_outputs_and_plain_progress():
    path, d = recipe("plain", eval_data_path=os.path.join(WORK, "eval.jsonl"), eval_interval=6)
    r = run(["train", path], env={"KEEL_PROGRESS": ""})
    check(r.returncode == 0, "plain run exits 0 (%s)" % r.stderr)
    step_lines = [l for l in r.stdout.splitlines() if l.startswith("step ")]
    check([l.split()[1] for l in step_lines] == ["4/12", "6/12", "8/12", "12/12"],
          "non-terminal progress: one line per log_interval plus eval steps, got %s" % step_lines)
    check("\r" not in r.stdout, "no carriage returns when not a terminal")
    m = metrics(d)
    check([x["step"] for x in m] == list(range(1, 13)), "metrics.jsonl has steps 1..12")
    for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "compute_share", "data_wait_share",
                "optimizer_share", "grad_sync_share"):
        check(all(key in x for x in m), "metrics.jsonl lines have %s" % key)
    check("eval_loss" in m[5] and "eval_loss" in m[11] and "eval_loss" not in m[0], "eval at steps 6 and 12 only")
    check(m[11]["loss"] < m[0]["loss"], "training loss falls (%s -> %s)" % (m[0]["loss"], m[11]["loss"]))
    with open(os.path.join(d, "out", "summary.json")) as f:
        s = json.load(f)
    for key in ("tokens_per_s", "compute_share", "data_wait_share", "grad_sync_share", "optimizer_share",
                "peak_memory_bytes", "mfu", "steps", "final_loss", "eval_loss", "eval_perplexity"):
        check(key in s, "summary.json has %s" % key)
    check(s["steps"] == 12 and s["peak_memory_bytes"] > 0 and 0 < s["mfu"] < 1, "summary values are sane: %s" % s)
    check(abs(s["eval_perplexity"] - 2.718281828 ** s["eval_loss"]) < 1e-3 * s["eval_perplexity"],
          "perplexity = exp(eval loss)")
    for label in ("throughput", "compute utilization", "memory per rank", "gradient sync share", "MFU"):
        check(label in r.stdout, "summary table shows %s" % label)
    with open(os.path.join(d, "out", "loss.svg")) as f:
        svg = f.read()
    check(svg.startswith("<svg") and "training loss" in svg and "eval loss" in svg and "learning rate" in svg,
          "loss.svg has the curves and the legend")
    os.remove(os.path.join(d, "out", "loss.svg"))
    r = run(["plot", os.path.join(d, "out")])
    check(r.returncode == 0 and os.path.exists(os.path.join(d, "out", "loss.svg")), "keel plot redraws loss.svg")


def test_live_progress():
    path, d = recipe("live", max_steps=6)
    e = dict(os.environ, KEEL_PROGRESS="live")
    r = subprocess.run([KEEL, "train", path], capture_output=True, env=e)  # bytes: keep the carriage returns
    check(r.returncode == 0, "live run exits 0")
    check(r.stdout.count(b"\r\033[K") == 6 and b"ETA" in r.stdout, "terminal mode rewrites one live line per step")


def test_sigint_saves_and_exits():
    path, d = recipe("sigint", max_steps=100000, checkpoint_dir=os.path.join(WORK, "sigint", "ckpt"),
                     save_interval=1000)
    p = start_training(KEEL, path, os.path.join(d, "out", "metrics.jsonl"))
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    check(p.returncode == 130, "SIGINT exits with 130, got %s" % p.returncode)
    check("interrupted after step" in out, "SIGINT is reported")
    latest = os.path.join(WORK, "sigint", "ckpt", "latest")
    check(os.path.exists(latest), "a checkpoint is saved on SIGINT")
    r = run(["train", path, "--resume", "--set", "max_steps=%d" % (len(metrics(d)) + 2)])
    check(r.returncode == 0 and "resumed from" in r.stdout, "the interrupted run resumes (%s)" % r.stderr)


def test_nonfinite():
    path, d = recipe("nan", learning_rate=1e30, max_grad_norm=0.0, max_steps=6)
    r = run(["train", path])
    check(r.returncode == 2 and "not finite" in r.stderr and "step" in r.stderr,
          "a NaN/Inf loss stops training with a clear error (%s)" % r.stderr.strip())
    path, d = recipe("nan_skip", learning_rate=1e30, max_grad_norm=0.0, max_steps=6, skip_nonfinite_steps=True)
    r = run(["train", path])
    check(r.returncode == 0, "skip_nonfinite_steps keeps going (%s)" % r.stderr)
    with open(os.path.join(d, "out", "summary.json")) as f:
        s = json.load(f)
    check(s["skipped_steps"] > 0, "skipped steps are counted (%s)" % s["skipped_steps"])


def resume_case(name, dtype, async_save):
    ck = os.path.join(WORK, name, "ckpt")
    path, d = recipe(name, dtype=dtype, max_steps=10, checkpoint_dir=ck, save_interval=5, async_save=async_save)
    r = run(["train", path])
    check(r.returncode == 0, "%s straight run (%s)" % (name, r.stderr))
    straight_m, straight_w = metrics(d), final_bytes(d)
    shutil.rmtree(d + "/out")
    shutil.rmtree(ck)
    r1 = run(["train", path, "--stop-after", "5"])
    r2 = run(["train", path, "--resume"])
    check(r1.returncode == 0 and r2.returncode == 0, "%s stop + resume runs (%s %s)" % (name, r1.stderr, r2.stderr))
    resumed_m = metrics(d)
    key = lambda m: [(x["step"], x["loss"], x["lr"], x["grad_norm"]) for x in m]
    check(key(straight_m) == key(resumed_m), "%s: losses bit-identical after resume" % name)
    check(straight_w == final_bytes(d), "%s: final weights bit-identical after resume" % name)


def test_resume():
    resume_case("resume_fp32", "fp32", False)
    resume_case("resume_bf16", "bf16", True)


def test_resume_keeps_products():
    """A bf16 resume multiplies as the run that wrote its checkpoint did (kernels/gemm.h:
    keep_bf16_products), not as its own measurement would choose: each way in turn writes the
    checkpoint (KEEL_BF16_MATMUL), and the resume, left to choose, must end bit-identical to that
    way's uninterrupted run. On a CPU with oneDNN's bf16 matmul one of the two resumes goes against
    the measurement whichever way it points; without one, both ways widen."""
    finals, native_ran = {}, False
    # After the checkpoint, where a resume's products matter. Gradient norms show a product's last
    # bits; the fp32 weights can absorb them (an update's change below their last place).
    after = lambda m: [(x["step"], x["loss"], x["grad_norm"]) for x in m if x["step"] > 3]
    for way in ("native", "widened"):
        name = "products_" + way
        ck = os.path.join(WORK, name, "ckpt")
        path, d = recipe(name, dtype="bf16", max_steps=6, checkpoint_dir=ck, save_interval=3)
        forced = {"KEEL_BF16_MATMUL": way}
        r = run(["train", path], env=forced)
        check(r.returncode == 0, "%s: straight run (%s)" % (name, r.stderr))
        finals[way] = (final_bytes(d), after(metrics(d)))
        native_ran = native_ran or (way == "native" and "bf16 GEMMs on oneDNN" in r.stdout)
        shutil.rmtree(d + "/out")
        shutil.rmtree(ck)
        r1 = run(["train", path, "--stop-after", "3"], env=forced)
        check(r1.returncode == 0, "%s: run stopped after step 3 (%s)" % (name, r1.stderr))
        states = [os.path.join(root, "trainer_state.json") for root, _, files in os.walk(ck)
                  if "trainer_state.json" in files]
        with open(states[0]) as f:
            recorded = json.load(f).get("bf16_products")
        check(recorded == (way if native_ran or way == "widened" else "widened"),
              "%s: the checkpoint records how the products ran (%s)" % (name, recorded))
        r2 = run(["train", path, "--resume"], unset=["KEEL_BF16_MATMUL"])
        check(r2.returncode == 0, "%s: resume (%s)" % (name, r2.stderr))
        if native_ran:
            check("as the run that wrote" in r2.stdout, "%s: the resume says whose products it keeps" % name)
        check((final_bytes(d), after(metrics(d))) == finals[way],
              "%s: the resumed steps and weights are bit-identical to the uninterrupted run's" % name)
        if way == "native" and native_ran:  # an override against the checkpoint is said, not silent
            shutil.rmtree(d + "/out")
            shutil.rmtree(ck)
            run(["train", path, "--stop-after", "3"], env=forced)
            r3 = run(["train", path, "--resume"], env={"KEEL_BF16_MATMUL": "widened"})
            check(r3.returncode == 0 and "note: the run that wrote" in r3.stdout and "round differently" in r3.stdout,
                  "a resume told to multiply otherwise says its steps round differently (%s)" % r3.stdout[-400:])
    if native_ran:  # else the comparisons above could not tell one way from the other
        check(finals["native"][1] != finals["widened"][1],
              "the two ways give different gradient norms after step 3 on this model")


def backend_line(r):
    """The log's `cpu backend:` line: how the run's products multiply, and why."""
    return next((l for l in r.stdout.splitlines() if "cpu backend:" in l), "")


def test_matmul_rates_record():
    """How bf16 products run is decided from matmul rates timed once per machine and kept
    (kernels/cpu/matmul_rates_record.h): the first run writes them, later runs read them and say so,
    and the kept rates, not a new timing, decide. Checked where the decision is timed at all (not
    on a CPU without oneDNN's bf16 matmul, nor with AMX)."""
    cache = os.path.join(WORK, "xdg")
    env = {"XDG_CACHE_HOME": cache}
    path, d = recipe("rates", dtype="bf16", max_steps=1)
    r = run(["train", path], env=env, unset=["KEEL_BF16_MATMUL"])
    check(r.returncode == 0, "rates: first run (%s)" % r.stderr)
    line = backend_line(r)
    if "one thread of this CPU" not in line:
        print("  (this CPU's bf16 products are not chosen by timing: %s)" % line.strip())
        return
    record = os.path.join(cache, "keel", "matmul-rates.json")
    check("measured now, kept in " + record in line, "the first run says it kept the rates it timed: %s" % line)
    with open(record) as f:
        kept = json.load(f)
    check(kept["format"] == "keel-matmul-rates" and len(kept["machines"]) == 1, "one machine recorded: %s" % kept)
    shutil.rmtree(d + "/out")
    r = run(["train", path], env=env, unset=["KEEL_BF16_MATMUL"])
    line = backend_line(r)
    check(r.returncode == 0 and ", measured %s, kept in %s" % (kept["machines"][0]["measured_on"], record) in line,
          "a later run reads the kept rates: %s" % line)
    # The kept rates decide: turned around, the other way is taken.
    entry = kept["machines"][0]
    widened = "widened to fp32" in line
    entry["bf16_flops"], entry["f32_flops"] = (4 * entry["f32_flops"], entry["f32_flops"]) if widened else \
        (entry["bf16_flops"], 4 * entry["bf16_flops"])
    with open(record, "w") as f:
        json.dump(kept, f)
    shutil.rmtree(d + "/out")
    r = run(["train", path], env=env, unset=["KEEL_BF16_MATMUL"])
    line = backend_line(r)
    check(r.returncode == 0 and ("GEMMs on oneDNN" if widened else "widened to fp32") in line,
          "the kept rates decide how products run: %s" % line)


def test_crash_recovery():
    """SIGKILL at 20 random moments (some during async saves); each time resume from the last
    complete checkpoint; the final weights must equal an uninterrupted run's."""
    ck = os.path.join(WORK, "crash", "ckpt")
    path, d = recipe("crash", max_steps=3000, checkpoint_dir=ck, save_interval=3, async_save=True, keep_last_n=2,
                     batch_size=8)
    t0 = time.time()
    r = run(["train", path])
    duration = time.time() - t0
    check(r.returncode == 0, "uninterrupted run")
    expected = final_bytes(d)
    # Each attempt lives at most duration/25, so 20 attempts cannot finish the run whatever the
    # machine's speed: all 20 kills happen, then a last resume completes it.
    shutil.rmtree(d + "/out")
    shutil.rmtree(ck)
    rng = random.Random(7)
    kills = 0
    for attempt in range(200):
        p = subprocess.Popen([KEEL, "train", path, "--resume"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if kills < 20:
            try:
                p.wait(timeout=rng.uniform(0.2, 1.0) * duration / 25)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                kills += 1
                continue
        else:
            p.wait(timeout=600)  # generous: CI machines may be loaded
        out, err = p.communicate()
        if p.returncode == 0:
            break
        check(False, "a resumed run failed after a kill: %s" % err.decode())
        return
    # Fewer kills happen only when the machine got faster than during the timed run (a shared CI
    # machine): the run then finished early, which is fine as long as it was interrupted often.
    check(kills >= 5, "the run was killed %d times (at least 5)" % kills)
    check(final_bytes(d) == expected, "after the SIGKILLs, the final weights equal the uninterrupted run's")


def test_corrupt_checkpoints():
    ck = os.path.join(WORK, "corrupt", "ckpt")
    path, d = recipe("corrupt", max_steps=4, checkpoint_dir=ck, save_interval=2)
    check(run(["train", path, "--stop-after", "2"]).returncode == 0, "checkpoint written")
    step = os.path.join(ck, "step-00000002")
    pristine = os.path.join(WORK, "corrupt", "pristine")
    shutil.copytree(step, pristine)

    def case(label, damage, expected, extra=()):
        shutil.rmtree(step)
        shutil.copytree(pristine, step)
        damage()
        r = run(["train", path, "--resume"] + list(extra))
        check(r.returncode == 2 and expected in r.stderr,
              "%s gives a clear error containing '%s' (got %d: %s)" % (label, expected, r.returncode, r.stderr.strip()))

    def flip():
        f = os.path.join(step, "weights.safetensors")
        data = bytearray(open(f, "rb").read())
        data[len(data) // 2] ^= 0x40
        open(f, "wb").write(bytes(data))

    def truncate():
        f = os.path.join(step, "optimizer.safetensors")
        os.truncate(f, os.path.getsize(f) // 2)

    case("a flipped byte", flip, "checksum")
    case("a truncated file", truncate, "truncated")
    case("a missing file", lambda: os.remove(os.path.join(step, "trainer_state.json")), "missing")
    case("a changed recipe", lambda: None, "recipe changed", ["--set", "batch_size=2"])
    write_data(os.path.join(WORK, "other.jsonl"), 50, seed=99)
    case("changed data", lambda: None, "different training data",
         ["--set", "data_path=%s" % os.path.join(WORK, "other.jsonl")])


def test_partial_checkpointing():
    """Recomputing only the first block (gradient_checkpointing_layers = 1 of 2) trains the same
    model bit for bit as keeping every activation, and the start-up line says which blocks recompute."""
    finals = {}
    for name, keys in (("stored", {}),
                       ("first_block", {"use_gradient_checkpointing": True, "gradient_checkpointing_layers": 1})):
        path, d = recipe("checkpointing_" + name, dtype="bf16", **keys)
        r = run(["train", path])
        check(r.returncode == 0, "%s run exits 0 (%s)" % (name, r.stderr))
        if keys:
            check("gradient checkpointing (1 of 2 blocks recompute)" in r.stdout,
                  "the start-up line names the recomputed blocks: %s" % r.stdout.splitlines()[:3])
        finals[name] = final_bytes(d)
    check(finals["stored"] == finals["first_block"], "the final weights are bit-identical with block 0 recomputed")


def test_zero3_one_rank():
    """zero_stage = 3 with one rank casts each position's bf16 weights instead of keeping a whole
    copy: the start-up line says so, and the run (evaluation and checkpointing included, with and
    without gradient checkpointing) trains the same model bit for bit as ZeRO-0, resumed or not."""
    for ckpt in (False, True):
        finals = {}
        for stage in (0, 3):
            name = "zero%d_one_rank%s" % (stage, "_ckpt" if ckpt else "")
            ck = os.path.join(WORK, name, "ckpt")
            path, d = recipe(name, dtype="bf16", zero_stage=stage, use_gradient_checkpointing=ckpt,
                             eval_data_path=os.path.join(WORK, "eval.jsonl"), eval_interval=6,
                             save_interval=6, checkpoint_dir=ck)
            r = run(["train", path])
            check(r.returncode == 0, "%s exits 0 (%s)" % (name, r.stderr))
            cast = "bf16 weights cast per position" in r.stdout
            check(cast == (stage == 3), "%s: the start-up line %s the per-position casts: %s"
                  % (name, "names" if stage == 3 else "does not name", r.stdout.splitlines()[:4]))
            finals[name] = final_bytes(d)
            if stage == 3:
                straight_m = metrics(d)
                shutil.rmtree(d + "/out")
                shutil.rmtree(ck)
                r1 = run(["train", path, "--stop-after", "6"])
                r2 = run(["train", path, "--resume"])
                check(r1.returncode == 0 and r2.returncode == 0,
                      "%s stop + resume runs (%s %s)" % (name, r1.stderr, r2.stderr))
                key = lambda m: [(x["step"], x.get("loss"), x.get("eval_loss")) for x in m]
                check(key(metrics(d)) == key(straight_m), "%s: losses bit-identical after resume" % name)
                check(final_bytes(d) == finals[name], "%s: the resumed run ends on the same weights" % name)
        a, b = finals.values()
        check(a == b, "the final weights are bit-identical with and without the per-position casts (%s)"
              % ("checkpointing" if ckpt else "no checkpointing"))


def main():
    write_data(os.path.join(WORK, "train.jsonl"), 200, seed=1)
    write_data(os.path.join(WORK, "eval.jsonl"), 20, seed=2)
    run_tests(globals(), "trainer", WORK, only=ONLY, skip=SKIP)


if __name__ == "__main__":
    main()
