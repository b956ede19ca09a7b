#!/usr/bin/env python3
"""Nothing lost, nothing silent: the everyday mistakes that used to overwrite or mix the user's
work without a word, each tried as a user would make it.

  - a run whose output_dir holds its own input model (continuing from a previous result)
  - keel export over the run's base model, and over any directory keel did not write
  - two runs at once into one output_dir / checkpoint_dir (also while one runs under mpirun)
  - a fresh run into a checkpoint_dir that holds another run's checkpoints
  - --resume auto on a finished run (used to overwrite summary.json with zeros)
  - max_seq_len beyond max_position_embeddings (train, plan), generation past it
  - exit codes: usage errors 2, `keel plan` 3 when it does not fit; `keel --version`
  - Ctrl-C without a checkpoint_dir (used to save nothing, without a word)
  - a resume that changes the learning rate (a raised max_steps) or runs on changed data
  - a chat template whose markers the tokenizer lacks; a tokenizer larger than the model
  - relative paths in a recipe (resolved against the recipe file), cache_dir, max_bad_fraction and
    the report of a failed preparation

    $(scripts/python-env.sh) tests/integration/run_safety_test.py KEEL [--only NAME]
"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from harness import check, mpi_env, run_tests, start_training, write_data, write_recipe_file

KEEL = os.path.abspath(sys.argv[1])
ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
WORK = tempfile.mkdtemp(prefix="keel_run_safety_test_")
MODEL_CONFIG = {"family": "llama", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
                "num_heads": 4, "num_kv_heads": 2, "max_position_embeddings": 64}


def recipe(name, scratch=True, **overrides):
    d = os.path.join(WORK, name)
    os.makedirs(d, exist_ok=True)
    keys = {"data_path": os.path.join(WORK, "train.jsonl"), "output_dir": os.path.join(d, "out"),
            "dtype": "fp32", "max_seq_len": 16, "batch_size": 4, "learning_rate": 3e-3,
            "max_steps": 4, "seed": 5, "log_interval": 2}
    keys.update(overrides)
    return write_recipe_file(os.path.join(d, "recipe.toml"), keys, MODEL_CONFIG if scratch else None), d


def run(args, **kw):
    return subprocess.run([KEEL] + [str(a) for a in args], capture_output=True, text=True, **kw)


def digest_tree(d):
    """{relative path: sha256} of every file below d but the run lock (which names its last holder)."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            if f == ".keel.lock":
                continue
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, d)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def trained_model(name):
    """A finished run: returns (its directory, output_dir/final)."""
    path, d = recipe(name)
    r = run(["train", path])
    check(r.returncode == 0, "%s trains (%s)" % (name, r.stderr.strip()[-300:]))
    return d, os.path.join(d, "out", "final")


def test_output_dir_over_the_input_model():
    # Continue tuning a previous result with output_dir = the previous run's directory: its
    # final/ (this run's input) is where this run would write its own final/.
    d, final = trained_model("base")
    before = digest_tree(final)
    for key, value in (("output_dir", os.path.join(d, "out")), ("output_dir", final),
                       ("checkpoint_dir", os.path.join(final, "ckpt"))):
        path, _ = recipe("continue_" + key, scratch=False, model_name=final,
                         **{key: value})
        r = run(["train", path])
        check(r.returncode == 2, "%s = %s over the input model is refused with exit 2 (got %d)"
              % (key, value, r.returncode))
        check(key in r.stderr and final in r.stderr and "input" in r.stderr,
              "the refusal names %s and the input model (%s)" % (key, r.stderr.strip()))
    check(digest_tree(final) == before, "the input model is unchanged")
    # The same continuation into a new directory works.
    path, d2 = recipe("continue_ok", scratch=False, model_name=final)
    r = run(["train", path])
    check(r.returncode == 0, "continuing into a new output_dir trains (%s)" % r.stderr.strip()[-300:])


def test_export_never_replaces_a_foreign_model():
    base_d, base = trained_model("export_base")
    path, d = recipe("export_run", scratch=False, model_name=base,
                     checkpoint_dir=os.path.join(WORK, "export_run", "ckpt"), save_interval=2)
    r = run(["train", path])
    check(r.returncode == 0, "the run to export trains (%s)" % r.stderr.strip()[-300:])
    ckpt = os.path.join(d, "ckpt")
    before = digest_tree(base)
    r = run(["export", ckpt, "--to", base])
    check(r.returncode == 2 and "model_name" in r.stderr and base in r.stderr,
          "export onto the run's own base model is refused naming it (exit %d: %s)" % (r.returncode, r.stderr.strip()))
    r = run(["export", ckpt, "--to", base, "--overwrite"])
    check(r.returncode == 2, "--overwrite does not allow replacing the run's input model (exit %d)" % r.returncode)
    check(digest_tree(base) == before, "the base model is unchanged")

    foreign = os.path.join(WORK, "someone_elses_model")
    os.makedirs(foreign)
    with open(os.path.join(foreign, "model.safetensors"), "wb") as f:
        f.write(b"not keel's")
    r = run(["export", ckpt, "--to", foreign])
    check(r.returncode == 2 and "--overwrite" in r.stderr,
          "export into a directory keel did not write is refused, naming --overwrite (%s)" % r.stderr.strip())
    with open(os.path.join(foreign, "model.safetensors"), "rb") as f:
        check(f.read() == b"not keel's", "the foreign file is untouched")
    r = run(["export", ckpt, "--to", foreign, "--overwrite"])
    check(r.returncode == 0, "--overwrite replaces it (%s)" % r.stderr.strip())

    mine = os.path.join(WORK, "my_export")
    for attempt in ("first", "again"):
        r = run(["export", ckpt, "--to", mine])
        check(r.returncode == 0, "%s export into keel's own export directory (%s)" % (attempt, r.stderr.strip()))
    check(os.path.exists(os.path.join(mine, ".keel-model")), "the export carries keel's marker")
    check(os.path.exists(os.path.join(base, ".keel-model")), "a run's final/ carries keel's marker")


def start_long_run(name, launcher=()):
    path, d = recipe(name, max_steps=100000, checkpoint_dir=os.path.join(WORK, name, "ckpt"),
                     save_interval=1000000, **({"dp_degree": 2} if launcher else {}))
    env = mpi_env() if launcher else dict(os.environ)
    p = subprocess.Popen(list(launcher) + [KEEL, "train", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True, env=env)
    lock = os.path.join(d, "out", ".keel.lock")
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:  # the first step shows the lock is held
        if os.path.exists(os.path.join(d, "out", "metrics.jsonl")) and os.path.getsize(lock) > 0:
            break
        time.sleep(0.1)
    return path, d, p


def stop(p):
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()


def check_second_run_refused(path, d, what):
    # A plain second run (dp_degree = 1) into the directories the first run holds. It must not wait
    # for the lock: the first run never finishes, so a second run that waited would end only at this
    # timeout. No bound on how fast the refusal comes: with both ranks of an mpirun job busy on a
    # shared 2-core machine, merely starting keel has taken 41 s (CI, stop 34).
    try:
        r = run(["train", path, "--overwrite", "--set", "dp_degree=1"], timeout=600)
    except subprocess.TimeoutExpired:
        check(False, "%s: a second run into the same directories is refused, not left waiting (still running "
                     "after 600 s)" % what)
        return
    check(r.returncode == 2, "%s: a second run into the same directories is refused (exit %d)" % (what, r.returncode))
    check("in use by another keel run" in r.stderr and "pid" in r.stderr,
          "%s: the refusal names the holder (%s)" % (what, r.stderr.strip()))


def test_one_run_per_directory():
    path, d, p = start_long_run("concurrent")
    check(p.poll() is None, "the first run is training")
    check_second_run_refused(path, d, "plain")
    stop(p)
    mpirun = shutil.which("mpirun")
    if check(mpirun is not None, "mpirun is installed (scripts/install-deps.sh)"):
        path, d, p = start_long_run("concurrent_mpi", launcher=(mpirun, "--allow-run-as-root", "--oversubscribe",
                                                                "-np", "2", "-x", "OMP_NUM_THREADS=1"))
        check(p.poll() is None, "the mpirun job is training")
        check_second_run_refused(path, d, "under mpirun")
        stop(p)


def test_fresh_run_into_another_runs_checkpoints():
    ck = os.path.join(WORK, "shared_ckpt")
    path, d = recipe("first", checkpoint_dir=ck, save_interval=2)
    check(run(["train", path]).returncode == 0, "the first run trains")
    before = digest_tree(ck)
    path2, d2 = recipe("second", checkpoint_dir=ck, save_interval=2, seed=6, max_steps=6)
    r = run(["train", path2])
    check(r.returncode == 2 and "--resume" in r.stderr and "--overwrite" in r.stderr,
          "a fresh run into a checkpoint_dir holding another run is refused, naming --resume and --overwrite (%s)"
          % r.stderr.strip())
    check(digest_tree(ck) == before, "the earlier run's checkpoints are untouched")
    r = run(["train", path2, "--overwrite"])
    check(r.returncode == 0 and "removed" in r.stdout, "--overwrite starts afresh, saying what it removed (%s)"
          % r.stderr.strip()[-300:])
    names = sorted(n for n in os.listdir(ck) if n.startswith("step-"))
    check(names == ["step-00000002", "step-00000004", "step-00000006"] or len(names) <= 3,
          "only the new run's checkpoints remain (%s)" % names)


def test_resume_of_a_finished_run_changes_nothing():
    path, d = recipe("finished", checkpoint_dir=os.path.join(WORK, "finished", "ckpt"), save_interval=2)
    check(run(["train", path]).returncode == 0, "the run trains to the end")
    before = digest_tree(os.path.join(d, "out"))
    r = run(["train", path, "--resume", "auto"])
    check(r.returncode == 0 and "already complete at step 4" in r.stdout,
          "--resume auto on a finished run says it is complete (%s %s)" % (r.stdout.strip()[-200:], r.stderr.strip()))
    after = digest_tree(os.path.join(d, "out"))
    check(after == before, "summary.json, metrics and final/ are unchanged")


def test_sequence_longer_than_the_model():
    path, d = recipe("too_long", max_seq_len=128)  # the model has 64 positions
    for cmd in (["train", path], ["plan", path]):
        r = run(cmd)
        check(r.returncode == 2 and "128" in r.stderr and "64" in r.stderr and "max_position_embeddings" in r.stderr,
              "keel %s: max_seq_len beyond max_position_embeddings is an error with both numbers (exit %d: %s)"
              % (cmd[0], r.returncode, r.stderr.strip()))
    _, final = trained_model("short_model")
    r = run(["generate", "--model", final, "--prompt-ids", "1,2,3", "--max-new-tokens", "100", "--ids"])
    check(r.returncode == 2 and "max_position_embeddings" in r.stderr,
          "generation past the model's positions is refused (exit %d: %s)" % (r.returncode, r.stderr.strip()))
    r = run(["generate", "--model", final, "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--ids"])
    check(r.returncode == 0, "generation within them works (%s)" % r.stderr.strip())


def test_exit_codes_and_version():
    r = run(["prepare"])
    check(r.returncode == 2, "a usage error (missing required options) exits 2 (got %d)" % r.returncode)
    r = run(["train", "--no-such-flag", "x.toml"])
    check(r.returncode == 2, "an unknown option exits 2 (got %d)" % r.returncode)
    r = run(["--help"])
    check(r.returncode == 0, "--help exits 0")
    r = run(["--version"])
    check(r.returncode == 0 and r.stdout.startswith("keel ") and "commit" in r.stdout,
          "--version prints the version and commit (%s)" % r.stdout.strip())
    path, d = recipe("plan")
    r = run(["plan", path, "--device-memory", "1MiB"])
    check(r.returncode == 3 and "fits: NO" in r.stdout, "keel plan exits 3 when the plan does not fit (got %d)"
          % r.returncode)
    r = run(["plan", path, "--device-memory", "64GB"])
    check(r.returncode == 0 and "fits: yes" in r.stdout, "and 0 when it fits (got %d)" % r.returncode)
    r = run(["plan", path])
    check(r.returncode == 0, "and 0 when nothing is checked (got %d)" % r.returncode)


def final_weights(d):
    with open(os.path.join(d, "out", "final", "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_interrupt_without_checkpoint_dir_keeps_the_work():
    # SIGINT in the middle of a long run: exit 130, a checkpoint in output_dir/interrupted, and the
    # exact command that resumes it.
    path, d = recipe("interrupted", max_steps=100000)
    p = start_training(KEEL, path, os.path.join(d, "out", "metrics.jsonl"))
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    saved = os.path.join(d, "out", "interrupted")
    check(p.returncode == 130, "SIGINT exits 130 (got %s: %s)" % (p.returncode, err.strip()[-300:]))
    check(os.path.exists(os.path.join(saved, "latest")), "a checkpoint is saved in output_dir/interrupted")
    command = "keel train %s --resume %s" % (path, saved)
    check(command in out, "the exact resume command is printed (%s)" % out.strip()[-300:])
    # The saved work continues where it stopped: stopped after step 3 and resumed with the printed
    # command, a run ends with the weights of a run never interrupted.
    path, d = recipe("interrupted_resumed", max_steps=6)
    r = run(["train", path, "--stop-after", "3"])
    saved = os.path.join(d, "out", "interrupted")
    check(("--resume %s" % saved) in r.stdout, "--stop-after saves and prints the command too (%s)"
          % r.stdout.strip()[-300:])
    r = run(["train", path, "--resume", saved])
    check(r.returncode == 0 and "resumed from" in r.stdout, "the printed command resumes (%s)" % r.stderr.strip())
    path2, d2 = recipe("never_interrupted", max_steps=6)
    check(run(["train", path2]).returncode == 0, "the same run without interruption trains")
    check(final_weights(d) == final_weights(d2), "interrupted + resumed = never interrupted, byte for byte")


def test_resume_says_what_changes():
    # A raised max_steps stretches the cosine decay: the rate at the resume step jumps. Said, with both rates.
    ck = os.path.join(WORK, "schedule", "ckpt")
    path, d = recipe("schedule", checkpoint_dir=ck, save_interval=2, max_steps=4, warmup_steps=1)
    check(run(["train", path]).returncode == 0, "the run trains")
    r = run(["train", path, "--resume", "auto", "--set", "max_steps=8"])
    check(r.returncode == 0 and "the learning-rate schedule changed (max_steps 4 -> 8" in r.stdout
          and "step 5 trains at" in r.stdout,
          "a resume with a raised max_steps prints the old and new learning rate (%s)" % r.stdout.strip()[-400:])
    # Data changed since the checkpoint: refused, naming the flag that accepts it; accepted with it.
    data = os.path.join(WORK, "schedule", "data.jsonl")
    write_data(data, 64, seed=1)
    ck = os.path.join(WORK, "newdata", "ckpt")
    path, d = recipe("newdata", checkpoint_dir=ck, save_interval=2, max_steps=4, data_path=data)
    check(run(["train", path]).returncode == 0, "the run on the first data trains")
    write_data(data, 64, seed=2)
    r = run(["train", path, "--resume", "auto", "--set", "max_steps=6"])
    check(r.returncode == 2 and "--resume-with-new-data" in r.stderr,
          "a resume on changed data is refused, naming --resume-with-new-data (%s)" % r.stderr.strip())
    r = run(["train", path, "--resume", "auto", "--set", "max_steps=6", "--resume-with-new-data"])
    check(r.returncode == 0 and "the training data changed since" in r.stdout and "step 5 on reads" in r.stdout,
          "--resume-with-new-data continues, saying where the new data is read from (%s %s)"
          % (r.stdout.strip()[-300:], r.stderr.strip()))


def small_tokenizer(name, specials):
    """A 300-token BPE tokenizer trained by keel, with the given special tokens."""
    d = os.path.join(WORK, name)
    os.makedirs(d, exist_ok=True)
    corpus = os.path.join(d, "corpus.jsonl")
    with open(corpus, "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": "the quick brown fox %d jumps over the lazy dog %d" % (i, i * 7)}) + "\n")
    out = os.path.join(d, "tokenizer.json")
    args = ["tokenizer", "train", "--data", corpus, "--vocab-size", "300", "--out", out]
    for s in specials:
        args += ["--special", s]
    r = run(args)
    check(r.returncode == 0, "the tokenizer trains (%s)" % r.stderr.strip())
    return out, corpus


def test_template_markers_and_vocabulary_checked_up_front():
    tokenizer, corpus = small_tokenizer("plain_tokenizer", ["<|endoftext|>"])
    chat = os.path.join(WORK, "plain_tokenizer", "chat.jsonl")
    with open(chat, "w") as f:
        for i in range(20):
            f.write(json.dumps({"messages": [{"role": "user", "content": "hi %d" % i},
                                             {"role": "assistant", "content": "the fox %d" % i}]}) + "\n")
    r = run(["prepare", "--data", chat, "--tokenizer", tokenizer, "--out", os.path.join(WORK, "chatml_out"),
             "--max-seq-len", "64", "--template", "chatml"])
    check(r.returncode == 2 and "<|im_start|>" in r.stderr and "one token" in r.stderr,
          "--template chatml with a tokenizer lacking <|im_start|> is refused (exit %d: %s)"
          % (r.returncode, r.stderr.strip()))
    # A 300-token tokenizer for a 32-token model: refused before anything is tokenized.
    path, d = recipe("vocab_too_large", data_path=corpus, tokenizer=tokenizer)
    r = run(["train", path])
    check(r.returncode == 2 and "-token vocabulary, larger than the model's vocab_size 32" in r.stderr
          and "Nothing was tokenized" in r.stderr,
          "a tokenizer larger than the model is refused up front, with both sizes (exit %d: %s)"
          % (r.returncode, r.stderr.strip()))
    check(not os.path.exists(os.path.join(os.path.dirname(corpus), ".keel-cache")),
          "nothing was prepared before the refusal")


def test_paths_cache_and_bad_records():
    # A recipe with relative paths, run from another directory: they resolve against the recipe file.
    d = os.path.join(WORK, "relative")
    os.makedirs(d, exist_ok=True)
    shutil.copy(os.path.join(WORK, "train.jsonl"), os.path.join(d, "data.jsonl"))
    write_recipe_file(os.path.join(d, "recipe.toml"), {"data_path": "data.jsonl", "output_dir": "out", "dtype": "fp32",
                                                       "max_seq_len": 16, "batch_size": 4, "max_steps": 2}, MODEL_CONFIG)
    elsewhere = os.path.join(WORK, "elsewhere")
    os.makedirs(elsewhere, exist_ok=True)
    r = run(["train", os.path.join(d, "recipe.toml")], cwd=elsewhere)
    check(r.returncode == 0 and os.path.exists(os.path.join(d, "out", "final", "config.json")),
          "relative paths resolve against the recipe's directory, not the current one (%s)" % r.stderr.strip())
    r = run(["train", os.path.join(d, "recipe.toml"), "--set", "output_dir=cli_out", "--print-recipe"], cwd=elsewhere)
    check('output_dir = "%s"' % os.path.join(elsewhere, "cli_out") in r.stdout,
          "a --set path is relative to the current directory (%s)" % r.stdout.strip()[-300:])
    # 5 bad records of 69 (7%): over the default 1%, the failed preparation's report is kept where
    # the message says; max_bad_fraction = 0.1 accepts them; cache_dir chooses where shards go.
    data = os.path.join(WORK, "bad_records.jsonl")
    shutil.copy(os.path.join(WORK, "train.jsonl"), data)
    with open(data, "a") as f:
        for _ in range(5):
            f.write('{"input_ids": [1, 2, \n')
    cache = os.path.join(WORK, "my_cache")
    path, _ = recipe("bad_records", data_path=data, packing="pack", cache_dir=cache)
    r = run(["train", path])
    reports = [w for w in r.stderr.replace(";", " ").split() if w.endswith("report.json")]
    check(r.returncode == 2 and "5 of 69 records are bad" in r.stderr and reports and os.path.exists(reports[0]),
          "bad records over the threshold: the message names a report that exists (%s)" % r.stderr.strip())
    r = run(["train", path, "--set", "max_bad_fraction=0.1"])
    check(r.returncode == 0, "max_bad_fraction = 0.1 accepts them (%s)" % r.stderr.strip()[-300:])
    check(os.path.isdir(cache) and any(n != os.path.basename(reports[0] if reports else "") for n in os.listdir(cache))
          and not os.path.exists(os.path.join(WORK, ".keel-cache")),
          "the shards went to cache_dir, not next to the data (%s)" % (os.listdir(cache) if os.path.isdir(cache) else None))
    cache2 = os.path.join(WORK, "cli_cache")
    r = run(["train", path, "--set", "max_bad_fraction=0.1", "--overwrite", "--cache-dir", cache2])
    check(r.returncode == 0 and os.path.isdir(cache2) and os.listdir(cache2),
          "keel train --cache-dir chooses the cache too (%s)" % r.stderr.strip()[-300:])


def test_decisions_are_printed():
    # What keel decided for the user is said before the work: tokenizer, template, packing; and rows
    # that are mostly padding are warned about, naming the better setting.
    r = run(["prepare", "--data", os.path.join(WORK, "train.jsonl"), "--vocab-size", "32", "--max-seq-len", "256",
             "--pad", "--out", os.path.join(WORK, "padded")])
    out = r.stdout + r.stderr  # keel prepare logs to stderr
    check(r.returncode == 0 and "tokenizer none (pre-tokenized records); chat template none" in out
          and "one document per row, padded" in out,
          "prepare prints the tokenizer, template and packing it uses (%s)" % out.strip()[:400])
    check("% padding" in out and 'packing = "pack"' in out,
          "rows that are mostly padding are warned about (%s)" % out.strip()[-400:])
    # Progress while a file is prepared (every KEEL_PROGRESS_INTERVAL_S seconds; 0 = every chunk):
    # records, bytes, the share of the file and the time left. Short inputs print none by default.
    r = subprocess.run([KEEL, "prepare", "--data", os.path.join(WORK, "train.jsonl"), "--vocab-size", "32",
                        "--max-seq-len", "64", "--out", os.path.join(WORK, "progress")], capture_output=True,
                       text=True, env=dict(os.environ, KEEL_PROGRESS_INTERVAL_S="0"))
    check(r.returncode == 0 and "keel prepare: 64 records, " in r.stderr and "% of the file" in r.stderr
          and "MB/s" in r.stderr, "prepare prints its progress (%s)" % r.stderr.strip()[:400])
    # A model trained without any tokenizer (pre-tokenized data, scratch model): its final/ cannot
    # generate from text, and the run says so instead of `keel generate` failing later.
    path, d = recipe("no_tokenizer")
    r = run(["train", path])
    check(r.returncode == 0 and "has no tokenizer" in r.stdout and "--tokenizer" in r.stdout,
          "a final model without a tokenizer is warned about (%s)" % r.stdout.strip()[-300:])
    # Loading a model's weights and writing an export show their progress too: a plain line per
    # interval in a log, one line rewritten in place on a terminal (KEEL_PROGRESS=live stands in).
    path, d = recipe("progress_load", scratch=False, model_name=os.path.join(WORK, "no_tokenizer", "out", "final"),
                     checkpoint_dir=os.path.join(WORK, "progress_load", "ckpt"), max_steps=2, save_interval=2)
    quick = dict(os.environ, KEEL_PROGRESS_INTERVAL_S="0", KEEL_PROGRESS="plain")
    r = run(["train", path], env=quick)
    final = os.path.join(WORK, "no_tokenizer", "out", "final")
    check(r.returncode == 0 and ("loading %s: " % final) in r.stdout and "M weights" in r.stdout
          and "s left" in r.stdout, "loading weights prints its progress (%s)" % r.stdout.strip()[:600])
    r = subprocess.run([KEEL, "export", os.path.join(d, "ckpt"), "--to", os.path.join(d, "exported")],
                       capture_output=True, env=dict(quick, KEEL_PROGRESS="live"))  # bytes: "\r" kept as is
    out = r.stdout.decode(errors="replace")
    live = out.split("\n")[0]  # rewritten in place: one line until it ends
    check(r.returncode == 0 and live.count("\r\033[Kwriting ") > 1 and " MB (" in live and "MB/s" in live
          and "keel: exported" in out, "export shows a live progress line (%r)" % out[:600])
    tokenizer, _ = small_tokenizer("chatml_tokenizer", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    chat = os.path.join(WORK, "chatml_tokenizer", "chat.jsonl")
    with open(chat, "w") as f:
        for i in range(20):
            f.write(json.dumps({"messages": [{"role": "user", "content": "hi %d" % i},
                                             {"role": "assistant", "content": "the fox %d" % i}]}) + "\n")
    r = run(["prepare", "--data", chat, "--tokenizer", tokenizer, "--max-seq-len", "64",
             "--out", os.path.join(WORK, "chatml_out")])
    check(r.returncode == 0 and "chat template chatml (detected from the tokenizer's special tokens)" in r.stderr,
          "the template chosen, and why (%s %s)" % (r.stdout.strip()[:400], r.stderr.strip()))


def test_ranks_die_with_their_launcher():
    mpirun = shutil.which("mpirun")
    if not check(mpirun is not None, "mpirun is installed (scripts/install-deps.sh)"):
        return
    path, d, p = start_long_run("orphans", launcher=(mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2",
                                                     "-x", "OMP_NUM_THREADS=1"))
    ranks = [r for r in subprocess.run(["pgrep", "-f", " train %s" % path], capture_output=True,
                                       text=True).stdout.split() if int(r) != p.pid]  # not mpirun itself
    check(len(ranks) == 2, "two ranks train (%s)" % ranks)
    metrics = os.path.join(d, "out", "metrics.jsonl")

    def steps_logged():
        with open(metrics) as f:
            return sum(1 for _ in f)

    os.kill(p.pid, signal.SIGKILL)  # the launcher goes, as after a double Ctrl-C
    p.communicate()
    at_launcher_death = steps_logged()

    def alive():
        return [r for r in ranks if os.path.exists("/proc/%s" % r)
                and open("/proc/%s/stat" % r).read().split()[2] != "Z"]

    deadline = time.time() + 10
    while time.time() < deadline and alive():
        time.sleep(0.05)
    check(not alive(), "the ranks die with their launcher (alive: %s)" % alive())
    # Steps of this model take milliseconds: ranks that trained on "out of sight" for even a
    # fraction of a second would log many more. At most the step in flight may land.
    check(steps_logged() - at_launcher_death <= 1, "no rank trains on after its launcher is gone (%d more steps)"
          % (steps_logged() - at_launcher_death))
    for r in alive():
        os.kill(int(r), signal.SIGKILL)


def main():
    write_data(os.path.join(WORK, "train.jsonl"), 64, seed=1)
    run_tests(globals(), "run safety", WORK, only=ONLY)


if __name__ == "__main__":
    main()
