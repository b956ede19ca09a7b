#!/usr/bin/env python3
"""Fault injection for keel train: failing disks and corrupt inputs.

Writes that fail: an LD_PRELOAD shim (fault_shim.c, compiled here) makes write() fail with
ENOSPC or EIO, or fsync() fail with EIO, once a byte budget under the checkpoint directory is
spent, so the first checkpoint is saved and the later ones fail; where mounting is permitted
(CI runs as root) a small tmpfs that really fills up is used as well. In every case training either
continues with a clear warning (fail_on_save_error = false) or stops with a clear error and exit
status 2 (fail_on_save_error = true), no partial checkpoint is left behind, and the last good
checkpoint still loads: `keel train --resume auto` continues from it, bit-identically.

Corrupt inputs: a truncated safetensors model directory, a corrupt config.json, data files of
binary garbage or invalid UTF-8, a binary recipe: each exits with status 2 and a message naming the
file. (Corrupt checkpoints are tests/integration/trainer_test.py's; killed ranks are
tests/integration/data_parallel_test.py's.)

    $(scripts/python-env.sh) tests/integration/fault_injection_test.py KEEL [--only NAME] [--verbose]
"""
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from harness import final_bytes, mpi_env, write_data, write_recipe_file

KEEL = os.path.abspath(sys.argv[1])
ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
VERBOSE = "--verbose" in sys.argv  # print every check, not only the failed ones
HERE = os.path.dirname(os.path.abspath(__file__))
WORK = tempfile.mkdtemp(prefix="keel_fault_test_")
SHIM = os.path.join(WORK, "fault_shim.so")
FAILURES = []
SAVE_BYTES = [0]  # bytes one checkpoint save writes, measured by test_baseline


def check(cond, what, output=None):
    if cond and VERBOSE:
        print("  ok:", what)
    if not cond:
        FAILURES.append(what)
        print("  FAIL:", what)
        if output:
            print("    output:", output.strip().replace("\n", "\n    ")[-3000:])
    return cond


def recipe(name, scratch=True, **overrides):
    d = os.path.join(WORK, name)
    os.makedirs(d, exist_ok=True)
    keys = {
        "data_path": os.path.join(WORK, "train.jsonl"), "output_dir": os.path.join(d, "out"),
        "dtype": "fp32", "max_seq_len": 16, "batch_size": 4, "gradient_accumulation_steps": 1,
        "learning_rate": 3e-3, "warmup_steps": 1, "max_steps": 6, "seed": 7, "log_interval": 1,
    }
    keys.update(overrides)
    model = {"family": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
             "num_heads": 4, "num_kv_heads": 2}
    return write_recipe_file(os.path.join(d, "recipe.toml"), keys, model if scratch else None), d


def run(args, env=None, timeout=600, launcher=()):
    e = dict(os.environ)
    e.update(env or {})
    if launcher:  # under mpirun: Open MPI's own leaks at exit, so no leak check (harness.mpi_env)
        e = mpi_env(e)
    p = subprocess.run(list(launcher) + [KEEL] + args, capture_output=True, text=True, errors="replace", env=e, timeout=timeout)
    p.output = p.stdout + p.stderr
    return p


def fault_env(directory, budget, op="write", error="ENOSPC"):
    asan = os.environ.get("ASAN_OPTIONS", "")
    return {
        "LD_PRELOAD": SHIM, "KEEL_FAULT_DIR": directory, "KEEL_FAULT_BYTES": str(budget),
        "KEEL_FAULT_OP": op, "KEEL_FAULT_ERRNO": error,
        # An ASan build wants its runtime first among the preloaded libraries; the shim only wraps
        # libc calls and forwards them (through ASan's interceptors), so the order is harmless.
        "ASAN_OPTIONS": (asan + ":" if asan else "") + "verify_asan_link_order=0",
    }


def steps_of(d):
    path = os.path.join(d, "out", "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(l)["step"] for l in f if l.strip()]


def latest_of(ck):
    try:
        with open(os.path.join(ck, "latest")) as f:
            return f.read().strip()
    except OSError:
        return None


def leftovers(ck):
    """Partial saves: .tmp-* directories and .<name>.tmp.<pid> files anywhere under ck."""
    found = []
    for root, dirs, files in os.walk(ck):
        found += [os.path.join(root, n) for n in dirs + files if n.startswith(".tmp-") or ".tmp." in n]
    return found



def check_last_good_checkpoint(name, d, ck, expected="step-00000002", reference=None):
    """The last good checkpoint is intact and `keel train --resume auto` continues from it; with a
    reference final model (a run that never stopped), the resumed run ends bit-identical to it."""
    check(latest_of(ck) == expected, "%s: latest points to %s (found %s)" % (name, expected, latest_of(ck)))
    check(not leftovers(ck), "%s: no partial checkpoint left behind (found %s)" % (name, leftovers(ck)))
    step = int(expected.split("-")[1])
    p = run(["train", os.path.join(d, "recipe.toml"), "--resume", "auto", "--set", "fail_on_save_error=false"])
    if not check(p.returncode == 0, "%s: resume from the last good checkpoint exits 0 (got %d)" % (name, p.returncode),
                 p.output):
        return
    check("resumed from %s at step %d" % (os.path.join(ck, expected), step) in p.output,
          "%s: resumed from %s" % (name, expected), p.output)
    check(steps_of(d) == list(range(1, 7)), "%s: metrics hold steps 1..6 after the resume (%s)" % (name, steps_of(d)))
    if reference is not None:
        check(final_bytes(d) == reference, "%s: the resumed run ends bit-identical to an uninterrupted one" % name)


# --- failing writes -------------------------------------------------------------------------------

def test_baseline():
    """An uninterrupted run with checkpoints, no faults: the reference model, and the size of a save."""
    ck = os.path.join(WORK, "baseline", "ckpt")
    path, d = recipe("baseline", checkpoint_dir=ck, save_interval=2, keep_last_n=10)
    p = run(["train", path])
    check(p.returncode == 0, "baseline run exits 0", p.output)
    step2 = os.path.join(ck, "step-00000002")
    SAVE_BYTES[0] = sum(os.path.getsize(f) for f in glob.glob(os.path.join(step2, "*"))) + len("step-00000002\n")
    check(SAVE_BYTES[0] > 0, "baseline: a checkpoint was written")
    REFERENCE[0] = final_bytes(d)


REFERENCE = [None]


def budget():
    return int(SAVE_BYTES[0] * 1.5)  # the first save fits, the second runs out of space


def save_fault_case(name, fail_on_save_error, async_save=False, op="write", error="ENOSPC", message=None):
    ck = os.path.join(WORK, name, "ckpt")
    path, d = recipe(name, checkpoint_dir=ck, save_interval=2, async_save=async_save,
                     fail_on_save_error=fail_on_save_error)
    p = run(["train", path], env=fault_env(ck, budget(), op, error))
    message = message or ("No space left on device" if error == "ENOSPC" else "Input/output error")
    if fail_on_save_error:
        check(p.returncode == 2, "%s: stops with exit status 2 (got %d)" % (name, p.returncode), p.output)
        check("error:" in p.stderr and message in p.stderr and ck in p.stderr,
              "%s: the error names the checkpoint and says '%s'" % (name, message), p.output)
        check(steps_of(d)[-1:] in ([3], [4], [5], [6]),
              "%s: stopped soon after the failed save at step 4 (metrics: %s)" % (name, steps_of(d)), p.output)
    else:
        check(p.returncode == 0, "%s: training continues and exits 0 (got %d)" % (name, p.returncode), p.output)
        check("warning:" in p.output and "checkpoint save failed" in p.output and message in p.output,
              "%s: a warning says the save failed with '%s'" % (name, message), p.output)
        check(steps_of(d) == list(range(1, 7)), "%s: all 6 steps ran (%s)" % (name, steps_of(d)), p.output)
        check(os.path.exists(os.path.join(d, "out", "final", "model.safetensors")),
              "%s: the final model is written (output_dir is not on the failing disk)" % name)
        if REFERENCE[0] is not None and os.path.exists(os.path.join(d, "out", "final", "model.safetensors")):
            check(final_bytes(d) == REFERENCE[0], "%s: failed saves do not change the training" % name)
    check_last_good_checkpoint(name, d, ck, reference=REFERENCE[0])


def test_enospc_continues():
    save_fault_case("enospc_continue", fail_on_save_error=False)


def test_enospc_stops():
    save_fault_case("enospc_stop", fail_on_save_error=True)


def test_enospc_async_continues():
    save_fault_case("enospc_async_continue", fail_on_save_error=False, async_save=True)


def test_enospc_async_stops():
    save_fault_case("enospc_async_stop", fail_on_save_error=True, async_save=True)


def test_eio_write_stops():
    save_fault_case("eio_write_stop", fail_on_save_error=True, error="EIO")


def test_fsync_eio_stops():
    save_fault_case("fsync_eio_stop", fail_on_save_error=True, op="fsync", error="EIO")


def test_fsync_eio_continues():
    save_fault_case("fsync_eio_continue", fail_on_save_error=False, op="fsync", error="EIO")


def mpirun_with(env):
    """mpirun for 2 ranks passing `env` (the fault shim's settings) on to them."""
    env.update(mpi_env(env))  # Open MPI's own leaks at exit: no leak check under mpirun
    launcher = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "OMP_NUM_THREADS=1"]
    for var in env:
        launcher += ["-x", var]
    return launcher


def test_slow_save_under_mpirun():
    """dp=2: rank 0 writes a checkpoint on a slow disk while rank 1 waits (at the next step, or under
    ZeRO-1 while sending its shard of the moments). A save slower than comm_timeout_s ends the job
    with an error that names the save, not a bare "hang"; with a timeout above the save's length the
    same run completes."""
    if not shutil.which("mpirun"):
        print("  skipped: no mpirun")
        return
    for name, timeout_s, zero in (("slow_save_timeout", 2, 0), ("slow_save_timeout_zero1", 2, 1),
                                  ("slow_save_ok", 120, 0)):
        d = os.path.join(WORK, name)
        path, _ = recipe(name, max_steps=3, save_interval=2, dp_degree=2, comm_timeout_s=timeout_s, zero_stage=zero,
                         checkpoint_dir=os.path.join(d, "ck"), checkpoint_layout="single_file")
        env = fault_env(os.path.join(d, "ck"), 0, op="slow")
        env["KEEL_FAULT_SLEEP_S"] = "0.4"  # per fsync: a save makes about 14 (files and directories)
        p = run(["train", path], env=env, timeout=300, launcher=mpirun_with(env))
        if timeout_s < 100:
            check(p.returncode != 0 and "did not complete within 2 s" in p.output and
                  "checkpoint of step 2, which rank 0 writes" in p.output and "raise comm_timeout_s" in p.output,
                  "%s: a save slower than comm_timeout_s: the error names the save" % name, p.output)
        else:
            check(p.returncode == 0 and steps_of(d) == [1, 2, 3], "the same slow save within the timeout", p.output)


def test_zero1_failed_saves_under_mpirun():
    """ZeRO-1 at dp=2: rank 0's saves fail (disk full) before or while it writes the moments rank 1
    is sending. Rank 0 still takes every piece, so rank 1 is never left waiting: training goes on
    and ends as a run without faults does, and then says (non-zero exit) that no save succeeded."""
    if not shutil.which("mpirun"):
        print("  skipped: no mpirun")
        return
    finals = []
    for name in ("zero1_no_fault", "zero1_enospc_at_once", "zero1_enospc_midway"):
        budget_bytes = -1 if name == "zero1_no_fault" else 0
        if name == "zero1_enospc_midway":  # the weights fit, the disk fills halfway through the moments
            step2 = os.path.join(WORK, "zero1_no_fault", "ck", "step-00000002")
            budget_bytes = os.path.getsize(os.path.join(step2, "weights.safetensors")) + \
                os.path.getsize(os.path.join(step2, "optimizer.safetensors")) // 2
        d = os.path.join(WORK, name)
        ck = os.path.join(d, "ck")
        path, _ = recipe(name, dp_degree=2, zero_stage=1, checkpoint_dir=ck, save_interval=2,
                         fail_on_save_error=False, comm_timeout_s=10, checkpoint_layout="single_file")
        env = fault_env(ck, budget_bytes)
        p = run(["train", path], env=env, timeout=300, launcher=mpirun_with(env))
        faults = budget_bytes >= 0
        ok = check((p.returncode != 0) == faults and steps_of(d) == list(range(1, 7))
                   and (not faults or "3 of 3 checkpoint saves" in p.output),
                   "%s: training continues through the failed saves, then %s" % (
                       name, "reports that none succeeded (non-zero exit)" if faults else "exits 0"), p.output)
        if budget_bytes >= 0:
            check("checkpoint save failed" in p.output and "No space left on device" in p.output,
                  "%s: a warning says the save failed" % name, p.output)
        if ok:
            finals.append(final_bytes(d))
    check(len(finals) == 3 and finals[0] == finals[1] == finals[2], "failed ZeRO-1 saves do not change the training")


def test_full_tmpfs():
    """A real full file system: a tmpfs mounted with room for about one and a half checkpoints."""
    mnt = os.path.join(WORK, "tmpfs")
    os.makedirs(mnt)
    size_kib = max(64, (budget() + 1023) // 1024)
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%dk" % size_kib, "tmpfs", mnt], capture_output=True,
                       text=True)
    if m.returncode != 0:
        print("  skipped: cannot mount a tmpfs here (%s); the LD_PRELOAD cases cover ENOSPC" % m.stderr.strip())
        return
    try:
        for fail in (False, True):
            name = "tmpfs_%s" % ("stop" if fail else "continue")
            ck = os.path.join(mnt, name)
            path, d = recipe(name, checkpoint_dir=ck, save_interval=2, fail_on_save_error=fail)
            p = run(["train", path])
            if fail:
                check(p.returncode == 2 and "No space left on device" in p.stderr and ck in p.stderr,
                      "%s: exit 2 with an error naming the checkpoint and ENOSPC (got %d)" % (name, p.returncode),
                      p.output)
            else:
                check(p.returncode == 0 and "No space left on device" in p.output,
                      "%s: exit 0 with an ENOSPC warning (got %d)" % (name, p.returncode), p.output)
                check(steps_of(d) == list(range(1, 7)), "%s: all 6 steps ran" % name)
            check(latest_of(ck) == "step-00000002", "%s: latest points to step-00000002 (%s)" % (name, latest_of(ck)))
            check(not leftovers(ck), "%s: no partial checkpoint left on the full disk (%s)" % (name, leftovers(ck)))
            # Resume on the still-full disk: the good checkpoint loads; later saves fail again.
            # Every save of the resumed run fails (the disk has no older checkpoint to give up): it
            # trains to the end, then says so with a non-zero exit.
            p = run(["train", path, "--resume", "auto", "--set", "fail_on_save_error=false"])
            check(p.returncode != 0 and "resumed from %s/step-00000002 at step 2" % ck in p.output
                  and "2 of 2 checkpoint saves" in p.output,
                  "%s: resumes from the last good checkpoint on the full disk, and reports its failed saves"
                  % name, p.output)
            if REFERENCE[0] is not None and os.path.exists(os.path.join(d, "out", "final", "model.safetensors")):
                check(final_bytes(d) == REFERENCE[0], "%s: the resumed run ends bit-identical" % name)
            shutil.rmtree(ck, ignore_errors=True)

        # output_dir on the full disk (checkpoints elsewhere): the export of the final model fails
        # with a clear error; once space is freed (the tmpfs grown), --resume finishes the job.
        name = "tmpfs_output"
        ck = os.path.join(WORK, name, "ckpt")
        out = os.path.join(mnt, name)
        path, d = recipe(name, checkpoint_dir=ck, save_interval=2, output_dir=out)
        subprocess.run(["mount", "-o", "remount,size=64k", mnt], check=True)
        p = run(["train", path])
        check(p.returncode == 2 and "No space left on device" in p.stderr and out in p.stderr,
              "%s: exit 2 with an error naming the file on the full disk (got %d)" % (name, p.returncode), p.output)
        check(latest_of(ck) == "step-00000006", "%s: the last checkpoint was saved (%s)" % (name, latest_of(ck)))
        subprocess.run(["mount", "-o", "remount,size=%dk" % (4 * size_kib), mnt], check=True)
        p = run(["train", path, "--resume", "auto"])
        check(p.returncode == 0 and "resumed from %s/step-00000006 at step 6" % ck in p.output,
              "%s: after space is freed, --resume finishes from the last checkpoint" % name, p.output)
        if REFERENCE[0] is not None and p.returncode == 0:
            with open(os.path.join(out, "final", "model.safetensors"), "rb") as f:
                check(f.read() == REFERENCE[0], "%s: the exported model equals an uninterrupted run's" % name)
    finally:
        subprocess.run(["umount", mnt])


# --- checkpoints under disk pressure ---------------------------------------------------------------

def test_disk_holding_two_checkpoints():
    """A disk with room for two and a half checkpoints, a save every step: old checkpoints used to be
    deleted only after a new save succeeded, so every save after the second failed and the run ended
    with exit 0 at step 2. Now a full disk makes room (all but the newest intact checkpoint) and saves
    again."""
    ck = os.path.join(WORK, "two_fit", "ckpt")
    path, d = recipe("two_fit", checkpoint_dir=ck, save_interval=1)
    p = run(["train", path], env=fault_env(ck, int(SAVE_BYTES[0] * 2.5), op="capacity"))
    check(p.returncode == 0, "two_fit: exits 0 (got %d)" % p.returncode, p.output)
    check(latest_of(ck) == "step-00000006", "two_fit: every step's save went through (latest %s)" % latest_of(ck),
          p.output)
    check("the disk is full; removed" in p.output, "two_fit: says it made room, and how", p.output)
    check(not leftovers(ck), "two_fit: no partial checkpoint left (%s)" % leftovers(ck))
    if REFERENCE[0] is not None and p.returncode == 0:
        check(final_bytes(d) == REFERENCE[0], "two_fit: the training is unchanged")


def test_checkpoint_that_never_fits():
    """No save ever fits: the run used to exit 0 without a single checkpoint. Now it ends with an
    error and a summary line saying how many saves failed."""
    ck = os.path.join(WORK, "never_fits", "ckpt")
    path, d = recipe("never_fits", checkpoint_dir=ck, save_interval=2, fail_on_save_error=False)
    p = run(["train", path], env=fault_env(ck, SAVE_BYTES[0] // 2, op="capacity"))
    check(p.returncode != 0, "never_fits: a run with no successful save does not exit 0", p.output)
    check("3 of 3 checkpoint saves" in p.output and "none was written" in p.output,
          "never_fits: says every save failed and nothing was written", p.output)
    check(os.path.exists(os.path.join(d, "out", "final", "model.safetensors")),
          "never_fits: the final model (outside the full disk) is still written")


def test_resume_from_a_corrupt_latest_names_the_intact_one():
    ck = os.path.join(WORK, "corrupt_latest", "ckpt")
    path, d = recipe("corrupt_latest", checkpoint_dir=ck, save_interval=2, keep_last_n=10)
    check(run(["train", path]).returncode == 0, "corrupt_latest: trains")
    weights = os.path.join(ck, "step-00000006", "weights.safetensors")
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) - 8)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    p = run(["train", path, "--resume", "auto", "--set", "max_steps=8"])
    intact = os.path.join(ck, "step-00000004")
    check(p.returncode == 2 and "newest intact checkpoint is %s" % intact in p.stderr
          and "--resume %s" % intact in p.stderr,
          "corrupt_latest: refused, naming the newest intact checkpoint and how to resume from it", p.output)


def test_leftovers_of_killed_processes_are_cleaned():
    """What a kill -9 can leave: a save cut short (.tmp-step-N-PID/), a pointer update cut short
    (.latest.tmp.PID) and a deletion cut short (step-N/ without its manifest). The next start removes
    them all; they used to stay (the last two forever)."""
    ck = os.path.join(WORK, "leftovers", "ckpt")
    path, d = recipe("leftovers", checkpoint_dir=ck, save_interval=2, keep_last_n=10)
    check(run(["train", path]).returncode == 0, "leftovers: trains")
    os.makedirs(os.path.join(ck, ".tmp-step-00000007-999"))
    with open(os.path.join(ck, ".latest.tmp.999"), "w") as f:
        f.write("step-00000007\n")
    os.remove(os.path.join(ck, "step-00000002", "manifest.json"))  # as a deletion cut short leaves it
    p = run(["train", path, "--resume", "auto", "--set", "max_steps=8"])
    check(p.returncode == 0 and "removed 3 incomplete checkpoint(s)" in p.output,
          "leftovers: the next start removes the three and says so", p.output)
    check(not leftovers(ck) and not os.path.exists(os.path.join(ck, "step-00000002")),
          "leftovers: none remain (%s)" % leftovers(ck))


# --- sharded checkpoints (dp > 1: every rank writes its own shard) ---------------------------------

def sharded_recipe(name, **keys):
    """dp 2, ZeRO-2, rank-ordered sums: the sharded layout, and runs that end on the same bytes."""
    keys = dict(dict(save_interval=2, keep_last_n=10), **keys)
    return recipe(name, dp_degree=2, zero_stage=2, deterministic_reduce=True,
                  checkpoint_dir=os.path.join(WORK, name, "ck"), **keys)


def sharded_reference():
    """The final bytes of an uninterrupted dp 2 ZeRO-2 run without faults (computed once)."""
    if "sharded" not in REFERENCE_BY_NAME:
        path, d = sharded_recipe("sharded_reference")
        p = run(["train", path], timeout=300, launcher=MPIRUN2)
        check(p.returncode == 0, "sharded_reference: trains", p.output)
        REFERENCE_BY_NAME["sharded"] = final_bytes(d) if p.returncode == 0 else None
    return REFERENCE_BY_NAME["sharded"]


REFERENCE_BY_NAME = {}
MPIRUN2 = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "OMP_NUM_THREADS=1"]


def rank_pid(recipe_path, rank):
    """The pid of MPI rank `rank` of `keel train recipe_path` (Open MPI's OMPI_COMM_WORLD_RANK)."""
    for pid in subprocess.run(["pgrep", "-f", "train %s" % recipe_path], capture_output=True, text=True).stdout.split():
        try:
            with open("/proc/%s/environ" % pid, "rb") as f:
                if b"OMPI_COMM_WORLD_RANK=%d\0" % rank in f.read():
                    return int(pid)
        except OSError:
            pass
    return None


def test_sharded_rank_killed_mid_shard_write():
    """kill -9 of rank 1 while it writes its shard of step 4 (fsyncs slowed so the moment can be
    caught: its file is there, the report that follows its fsync is not): the job ends, `latest` still names step 2,
    and --resume auto removes the half-written step, continues from step 2 and ends on the bytes of
    a run that was never killed."""
    if not shutil.which("mpirun"):
        print("  skipped: no mpirun")
        return
    reference = sharded_reference()
    path, d = sharded_recipe("sharded_killed")
    ck = os.path.join(d, "ck")
    env = fault_env(ck, -1, op="slow")
    env["KEEL_FAULT_SLEEP_S"] = "0.3"
    launcher = mpirun_with(env)  # env gains the no-leak-check setting mpirun passes on
    e = dict(os.environ)
    e.update(env)
    p = subprocess.Popen(launcher + [KEEL, "train", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=e)
    victim, deadline = None, time.time() + 120
    tmp = os.path.join(ck, ".tmp-step-00000004-sharded")
    while victim is None and time.time() < deadline and p.poll() is None:
        # Rank 1's shard file exists, its report (written once the file is fsynced) does not yet.
        if (latest_of(ck) == "step-00000002" and os.path.exists(os.path.join(tmp, "shard-00001-of-00002.bin"))
                and not os.path.exists(os.path.join(tmp, "shard-00001-of-00002.json"))):
            victim = rank_pid(path, 1)
        else:
            time.sleep(0.02)
    if not check(victim is not None, "sharded_killed: rank 1 caught writing its shard of step 4"):
        p.kill()
        p.communicate()
        return
    os.kill(victim, signal.SIGKILL)
    out, _ = p.communicate(timeout=120)
    check(p.returncode != 0, "sharded_killed: the job ends when a rank is killed", out)
    check(latest_of(ck) == "step-00000002" and not os.path.exists(os.path.join(ck, "step-00000004")),
          "sharded_killed: latest still names step 2, and no step 4 was published (%s)" % latest_of(ck))
    r = run(["train", path, "--resume", "auto"], timeout=300, launcher=MPIRUN2)
    check(r.returncode == 0 and "removed 1 incomplete checkpoint(s)" in r.output and
          "resumed from %s at step 2" % os.path.join(ck, "step-00000002") in r.output,
          "sharded_killed: --resume auto cleans the half-written step and continues from step 2", r.output)
    check(r.returncode == 0 and reference is not None and final_bytes(d) == reference,
          "sharded_killed: the resumed run ends bit-identical to one never killed")


def test_sharded_full_disk_on_one_rank():
    """Rank 1's disk is full (the shim on rank 1 only, an MPMD launch): every save fails, each
    failure names rank 1 and ENOSPC, `latest` never moves, no partial step is left, and training
    goes on to the same final bytes, then exits non-zero saying no save succeeded."""
    if not shutil.which("mpirun"):
        print("  skipped: no mpirun")
        return
    reference = sharded_reference()
    path, d = sharded_recipe("sharded_enospc", fail_on_save_error=False)
    ck = os.path.join(d, "ck")
    env = mpi_env(fault_env(ck, 0))  # rank 1's settings, without leak checking as every mpirun run
    launcher = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-x", "OMP_NUM_THREADS=1", "-np", "1", KEEL,
                "train", path, ":", "-np", "1"]
    for var, value in env.items():
        launcher += ["-x", "%s=%s" % (var, value)]
    p = subprocess.run(launcher + [KEEL, "train", path], capture_output=True, text=True, timeout=300, env=mpi_env())
    out = p.stdout + p.stderr
    check(p.returncode != 0 and "3 of 3 checkpoint saves" in out, "sharded_enospc: ends saying no save succeeded", out)
    check("rank 1: " in out and "shard-00001-of-00002.bin" in out and "No space left on device" in out,
          "sharded_enospc: the warning names rank 1, its shard file and the full disk", out)
    check(latest_of(ck) is None and not leftovers(ck), "sharded_enospc: no latest, no partial step (%s)" % leftovers(ck))
    check(steps_of(d) == list(range(1, 7)) and reference is not None and final_bytes(d) == reference,
          "sharded_enospc: the failed saves do not change the training")


def test_sharded_disk_holding_two_checkpoints():
    """dp 2, a save every step, a disk (shared by both ranks) with room for two and a half sharded
    checkpoints: the third save runs out of space on a rank, the ranks agree it failed, and rank 0
    makes room (every checkpoint but the one `latest` names, said in the log), so the next save
    fits; the run ends on the last step's checkpoint and on the bytes of a run without faults."""
    if not shutil.which("mpirun"):
        print("  skipped: no mpirun")
        return
    reference = sharded_reference()
    step2 = os.path.join(WORK, "sharded_reference", "ck", "step-00000002")
    size = sum(os.path.getsize(os.path.join(step2, f)) for f in os.listdir(step2))
    path, d = sharded_recipe("sharded_two_fit", save_interval=1, keep_last_n=3)
    ck = os.path.join(d, "ck")
    env = fault_env(ck, int(size * 2.5), op="capacity")
    p = run(["train", path], env=env, timeout=300, launcher=mpirun_with(env))
    check(p.returncode == 0 and "No space left on device" in p.output and "the disk is full; removed" in p.output
          and "the next save has room" in p.output,
          "sharded_two_fit: saves that ran out of space are reported, room is made, the run exits 0", p.output)
    check(latest_of(ck) == "step-00000006" and not leftovers(ck),
          "sharded_two_fit: the last step's save went through, nothing partial left (latest %s, %s)" % (
              latest_of(ck), leftovers(ck)))
    check(reference is not None and final_bytes(d) == reference, "sharded_two_fit: the training is unchanged")


def test_sharded_corrupt_piece_names_it():
    """A flipped byte in rank 1's file of the newest sharded checkpoint: --resume auto refuses,
    naming the piece (tensor, element range, file) and the newest intact checkpoint."""
    if not shutil.which("mpirun"):
        print("  skipped: no mpirun")
        return
    path, d = sharded_recipe("sharded_corrupt")
    ck = os.path.join(d, "ck")
    p = run(["train", path], timeout=300, launcher=MPIRUN2)
    if not check(p.returncode == 0, "sharded_corrupt: trains", p.output):
        return
    step = os.path.join(ck, "step-00000006")
    with open(os.path.join(step, "manifest.json")) as f:
        piece = [x for x in json.load(f)["pieces"] if x["shard"] == 1 and x["kind"] == "v"][0]
    with open(os.path.join(step, "shard-00001-of-00002.bin"), "r+b") as f:
        f.seek(piece["offset"] + 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = run(["train", path, "--resume", "auto", "--set", "max_steps=8"], timeout=300, launcher=MPIRUN2)
    name = "v.%s[%d:%d]" % (piece["tensor"], piece["begin"], piece["end"])
    intact = os.path.join(ck, "step-00000004")
    check(r.returncode != 0 and name in r.output and "shard-00001-of-00002.bin" in r.output and "corrupt" in r.output
          and "newest intact checkpoint is %s" % intact in r.output,
          "sharded_corrupt: refused, naming %s and the intact %s" % (name, intact), r.output)


# --- corrupt inputs ---------------------------------------------------------------------------------

def expect_input_error(name, args, fragments, anywhere=()):
    """Exit status 2, an error on stderr containing every fragment, and the output as a whole
    (stdout too: a data report lists bad lines there) containing each of `anywhere`."""
    p = run(args)
    ok = check(p.returncode == 2, "%s: exit status 2 (got %d)" % (name, p.returncode), p.output)
    ok = ok and check(all(f in p.stderr for f in fragments), "%s: the error names %s" % (name, fragments), p.output)
    ok = ok and check(all(f in p.output for f in anywhere), "%s: the output names %s" % (name, list(anywhere)),
                      p.output)
    ok and check("internal error" not in p.output and "Sanitizer" not in p.output, "%s: a clean keel::Error" % name,
                 p.output)


def model_dir(name):
    """A copy of the baseline run's exported model (config.json + model.safetensors)."""
    src = os.path.join(WORK, "baseline", "out", "final")
    dst = os.path.join(WORK, "models", name)
    shutil.copytree(src, dst)
    return dst


def test_truncated_model():
    if not os.path.exists(os.path.join(WORK, "baseline", "out", "final", "config.json")):
        check(False, "truncated_model: needs the baseline model")
        return
    for label, keep in (("half", None), ("header", 4), ("data", -100)):
        m = model_dir("truncated_" + label)
        st = os.path.join(m, "model.safetensors")
        size = os.path.getsize(st)
        os.truncate(st, size // 2 if keep is None else (keep if keep > 0 else size + keep))
        path, _ = recipe("truncated_model_" + label, scratch=False, model_name=m)
        expect_input_error("truncated model.safetensors (%s)" % label, ["train", path], [st])
    # A sharded directory whose index names a missing shard.
    m = model_dir("missing_shard")
    os.rename(os.path.join(m, "model.safetensors"), os.path.join(m, "model-00001-of-00002.safetensors"))
    index = os.path.join(m, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}, f)
    path, _ = recipe("missing_shard", scratch=False, model_name=m)
    expect_input_error("index naming a missing shard", ["train", path], [index, "model-00002-of-00002.safetensors"])


def test_corrupt_config():
    if not os.path.exists(os.path.join(WORK, "baseline", "out", "final", "config.json")):
        check(False, "corrupt_config: needs the baseline model")
        return
    cases = {
        "garbage": bytes(random.Random(3).randrange(256) for _ in range(512)),
        "truncated": None,
        "absurd": None,
        "not_an_object": b"[1, 2, 3]",
        "empty": b"",
    }
    for label, content in cases.items():
        m = model_dir("config_" + label)
        cfg = os.path.join(m, "config.json")
        if label == "truncated":
            os.truncate(cfg, os.path.getsize(cfg) // 2)
        elif label == "absurd":
            with open(cfg) as f:
                c = json.load(f)
            c["hidden_size"] = 2 ** 40
            with open(cfg, "w") as f:
                json.dump(c, f)
        else:
            with open(cfg, "wb") as f:
                f.write(content)
        path, _ = recipe("config_" + label, scratch=False, model_name=m)
        expect_input_error("config.json: %s" % label, ["train", path],
                           [cfg] + (["hidden_size"] if label == "absurd" else []))


def test_corrupt_data():
    rng = random.Random(11)
    good = '{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8]}\n'
    cases = {
        "binary_garbage": bytes(rng.randrange(256) for _ in range(4096)),
        "nul_bytes": b"\0" * 1000,
        "invalid_utf8_in_string": (good + '{"input_ids": [1, 2], "note": "').encode() + b"\xff\xfe\x80" + b'"}\n',
        "overlong_utf8": (good * 3 + '{"input_ids": [1], "x": "').encode() + b"\xc0\xaf" + b'"}\n',
        "truncated_line": (good * 2 + '{"input_ids": [1, 2').encode(),
        "garbage_after_good_lines": (good * 5).encode() + bytes(rng.randrange(256) for _ in range(64)) + b"\n",
    }
    line = {"binary_garbage": 1, "nul_bytes": 1, "invalid_utf8_in_string": 2, "overlong_utf8": 4,
            "truncated_line": 3, "garbage_after_good_lines": 6}
    for label, content in cases.items():
        data = os.path.join(WORK, "data_%s.jsonl" % label)
        with open(data, "wb") as f:
            f.write(content)
        # The error names the file; the first bad line is named in it or in the report before it.
        where = "%s:%d" % (data, line[label])
        path, _ = recipe("data_" + label, data_path=data)
        expect_input_error("data file: %s" % label, ["train", path], [data], [where])
        # The same file as evaluation data.
        path, _ = recipe("eval_" + label, eval_data_path=data, eval_interval=2)
        expect_input_error("eval data file: %s" % label, ["train", path], [data], [where])
    path, _ = recipe("data_directory", data_path=WORK)
    expect_input_error("a directory as data_path", ["train", path], [WORK])


def test_corrupt_recipe():
    d = os.path.join(WORK, "recipe_garbage")
    os.makedirs(d)
    path = os.path.join(d, "recipe.toml")
    with open(path, "wb") as f:
        f.write(bytes(random.Random(5).randrange(256) for _ in range(300)))
    expect_input_error("binary recipe", ["train", path], [path])
    with open(path, "wb") as f:
        f.write(b'data_path = "\xff\xfe"\nmax_steps = 2\n')
    expect_input_error("recipe with invalid UTF-8", ["train", path], [path])


def main():
    try:
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", SHIM, os.path.join(HERE, "fault_shim.c"), "-ldl"],
                       check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print("cannot compile the fault shim:", e)
        sys.exit(1)
    write_data(os.path.join(WORK, "train.jsonl"), 200, seed=1)
    tests = [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]
    for name, fn in tests:
        if ONLY and ONLY not in name and name != "test_baseline":
            continue
        print(name)
        t0 = time.time()
        fn()
        print("  %.1f s" % (time.time() - t0))
    if FAILURES:
        print("%d failure(s); work directory kept: %s" % (len(FAILURES), WORK))
        sys.exit(1)
    shutil.rmtree(WORK, ignore_errors=True)
    print("all fault injection checks passed")


if __name__ == "__main__":
    main()
