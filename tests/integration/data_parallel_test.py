#!/usr/bin/env python3
"""Data parallel over MPI (mpirun -np 2): same losses and weights as dp=1 with doubled gradient
accumulation (shuffled or not), bit-identical reruns with deterministic_reduce, ZeRO-1 equal to
non-sharded training (fp32 and bf16, checkpoints and resume included) with half the optimizer
memory per rank, resuming on another number of ranks, keel launch (with a hostfile too) equal to
mpirun, and a clear error for a dp_degree that disagrees with the world size, for ranks started
with different recipes, for a rank that dies and for one that hangs.

    $(scripts/python-env.sh) tests/integration/data_parallel_test.py KEEL
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
import hf_models  # noqa: E402  (safetensors reader)
from harness import checkpoint_tensors, max_rel_l2, write_recipe_file  # noqa: E402

KEEL = os.path.abspath(sys.argv[1])
WORK = tempfile.mkdtemp(prefix="keel_dp_test_")
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-x", "OMP_NUM_THREADS=1"]
FAILURES = []


def check(cond, what):
    print("  %s: %s" % ("ok" if cond else "FAIL", what))
    if not cond:
        FAILURES.append(what)
    return cond


SMALL_MODEL = {"vocab_size": 40, "hidden_size": 32, "intermediate_size": 48, "num_layers": 2, "num_heads": 4,
               "num_kv_heads": 2}


def write_recipe(name, model=None, **overrides):
    keys = {"data_path": os.path.join(WORK, "train.jsonl"), "output_dir": os.path.join(WORK, name),
            "dtype": "fp32", "max_seq_len": 16, "batch_size": 2, "gradient_accumulation_steps": 2,
            "learning_rate": 3e-3, "warmup_steps": 1, "max_steps": 5, "seed": 11, "shuffle": True,
            "weight_decay": 0.1, "max_grad_norm": 0.5, "log_interval": 1, "dp_degree": 1,
            # The overlapped path, which these tests were written for; the default ("auto") picks
            # it only with a CPU to spare per rank (compare_to_dp1 in file order runs the default).
            "overlap_grad_sync": True}
    keys.update(overrides)
    # llama: no q/k/v biases. The k bias has an exactly zero true gradient (softmax is invariant to
    # adding the same q.b_k to every score), so Adam turns rounding noise there into lr-sized steps
    # of random sign in any implementation; it cannot be compared across reduction orders.
    return write_recipe_file(os.path.join(WORK, name + ".toml"), keys, dict(family="llama", **(model or SMALL_MODEL)))


def train(path, ranks, *extra, timeout=300):
    cmd = ([KEEL] if ranks == 1 else MPIRUN + ["-np", str(ranks), KEEL]) + ["train", path] + list(extra)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def why(r):
    """A failed run's output tail, for a check's message (nothing when it succeeded)."""
    return "" if r.returncode == 0 else " (%s)" % (r.stdout + r.stderr)[-800:]


def results(name):
    with open(os.path.join(WORK, name, "metrics.jsonl")) as f:
        metrics = [json.loads(l) for l in f if l.strip()]
    weights = hf_models.load_checkpoint(os.path.join(WORK, name, "final"))
    return metrics, weights


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def compare_to_dp1(shuffle):
    tag = "shuffled" if shuffle else "file order"
    one = write_recipe("dp1_%s" % shuffle, shuffle=shuffle, gradient_accumulation_steps=4)
    overlap = True if shuffle else "auto"
    two = write_recipe("dp2_%s" % shuffle, shuffle=shuffle, gradient_accumulation_steps=2, dp_degree=2,
                       overlap_grad_sync=overlap)
    r1, r2 = train(one, 1), train(two, 2)
    if not (check(r1.returncode == 0, "dp=1 run (%s)" % r1.stderr[-500:]) and
            check(r2.returncode == 0, "dp=2 run (%s)" % (r2.stdout + r2.stderr)[-800:])):
        return
    said = [l for l in r2.stdout.splitlines() if "gradient buckets sync" in l]
    check(len(said) == 1 and ("overlap_grad_sync = %s" % ("true" if overlap is True else "auto:")) in said[0],
          "%s: the run says how it syncs and why (%s)" % (tag, said))
    m1, w1 = results("dp1_%s" % shuffle)
    m2, w2 = results("dp2_%s" % shuffle)
    check([x["step"] for x in m1] == [x["step"] for x in m2] == [1, 2, 3, 4, 5], "%s: both runs have 5 steps" % tag)
    worst = max(rel(a["loss"], b["loss"]) for a, b in zip(m2, m1))
    check(worst <= 1e-6, "%s: dp=2 losses equal dp=1 with doubled accumulation (worst %.2e)" % (tag, worst))
    check(all(a["tokens"] == b["tokens"] for a, b in zip(m1, m2)), "%s: same tokens per step" % tag)
    worst_w, worst_name = 0.0, ""
    for name, t in w1.items():
        e = float((w2[name] - t).norm() / t.norm())
        if e > worst_w:
            worst_w, worst_name = e, name
    check(worst_w <= 1e-5, "%s: final weights equal (worst relative L2 %.2e, %s)" % (tag, worst_w, worst_name))
    # MFU is the job's: its FLOPs per second over the sum of the peaks every rank measured (rank 0's
    # peak alone made it twice too high at dp = 2). Checked as accounting, not as a timing.
    s1, s2 = (json.load(open(os.path.join(WORK, n, "summary.json"))) for n in ("dp1_%s" % shuffle, "dp2_%s" % shuffle))
    check(len(s1["matmul_peak_flops_per_rank"]) == 1 and len(s2["matmul_peak_flops_per_rank"]) == 2 and
          all(p > 0 for p in s2["matmul_peak_flops_per_rank"]), "%s: a measured peak per rank %s" %
          (tag, s2["matmul_peak_flops_per_rank"]))
    for s in (s1, s2):
        check(rel(s["matmul_peak_flops"], sum(s["matmul_peak_flops_per_rank"])) <= 1e-7,  # 9 printed digits
              "%s: the job's peak is the sum of the ranks' (%s)" % (tag, s["matmul_peak_flops_per_rank"]))
        check(rel(s["mfu"], s["tokens_per_s"] * s["flops_per_token"] / s["matmul_peak_flops"]) <= 1e-5,
              "%s: mfu = job tokens/s x FLOPs per token / job peak" % tag)
    check(rel(s1["flops_per_token"], s2["flops_per_token"]) <= 1e-12,
          "%s: dp=1 and dp=2 count the same FLOPs per token" % tag)


def test_lora_data_parallel():
    """LoRA over 2 ranks, ZeRO-1 sharding the adapter's moments: the buckets, the gradient norm
    and the all-gather work on the adapter; the result is dp=1's with doubled accumulation, LoRA
    dropout included (its masks follow the micro-batch's place in the global step)."""
    lora = {"finetuning_type": "lora", "lora_rank": 4, "lora_target": "all", "lora_dropout": 0.1}
    one = write_recipe("lora_dp1", gradient_accumulation_steps=4, **lora)
    two = write_recipe("lora_dp2", gradient_accumulation_steps=2, dp_degree=2, zero_stage=1, **lora)
    r1, r2 = train(one, 1), train(two, 2)
    if not (check(r1.returncode == 0, "LoRA dp=1 run%s" % why(r1)) and check(r2.returncode == 0, "LoRA dp=2 run%s" % why(r2))):
        return
    check("LoRA rank 4" in r1.stdout and "AdamW moments sharded over 2 ranks" in r2.stdout,
          "LoRA announced; ZeRO-1 shards the adapter's moments")
    adapters = []
    for name in ("lora_dp1", "lora_dp2"):
        with open(os.path.join(WORK, name, "metrics.jsonl")) as f:
            metrics = [json.loads(l) for l in f if l.strip()]
        adapters.append((metrics, hf_models.load_safetensors(os.path.join(WORK, name, "final", "adapter_model.safetensors"))))
    (m1, a1), (m2, a2) = adapters
    worst = max(rel(a["loss"], b["loss"]) for a, b in zip(m2, m1))
    check(len(m1) == len(m2) == 5 and worst <= 1e-6, "LoRA: dp=2 losses equal dp=1 (worst %.2e)" % worst)
    worst_w = max(float((a2[k] - t).norm() / t.norm()) for k, t in a1.items())
    check(set(a1) == set(a2) and worst_w <= 1e-5, "LoRA: the adapters equal (worst relative L2 %.2e)" % worst_w)


def test_deterministic_reduce():
    path = write_recipe("det", dp_degree=2, deterministic_reduce=True)
    runs = []
    for i in range(2):
        r = train(path, 2)
        if not check(r.returncode == 0, "deterministic run %d (%s)" % (i, r.stderr[-500:])):
            return
        with open(os.path.join(WORK, "det", "metrics.jsonl")) as f:
            losses = [json.loads(l)["loss"] for l in f]
        with open(os.path.join(WORK, "det", "final", "model.safetensors"), "rb") as f:
            runs.append((losses, f.read()))
    check(runs[0] == runs[1], "two dp=2 runs with deterministic_reduce are bit-identical")


def test_keel_launch():
    """keel launch starts the same job as a plain mpirun, with and without a hostfile (the multi-node
    path: here one host, localhost, with two slots): bit-identical with deterministic_reduce."""
    finals = []
    for name, extra in (("launch_mpirun", None), ("launch", []), ("launch_hostfile", ["--hostfile"])):
        path = write_recipe(name, dp_degree=2, deterministic_reduce=True)
        if extra is None:
            r = train(path, 2)
        else:
            if extra:
                hostfile = os.path.join(WORK, "hostfile")
                with open(hostfile, "w") as f:
                    f.write("localhost slots=2\n")
                extra = extra + [hostfile]
            r = subprocess.run([KEEL, "launch", "-n", "2"] + extra + [path], capture_output=True, text=True,
                               timeout=300)
        if not check(r.returncode == 0, name + why(r)):
            return
        with open(os.path.join(WORK, name, "final", "model.safetensors"), "rb") as f:
            finals.append(f.read())
    check(finals[0] == finals[1] == finals[2],
          "keel launch -n 2, with and without --hostfile, trains bit-identically to mpirun -np 2")


def compare_zero1(dtype, async_save):
    """ZeRO-1 against replicated optimizer state, both at dp=2: same losses, weights and moments.
    The checkpoints are sharded (checkpoint_layout = "auto" at dp > 1): each rank writes its part,
    synchronously or through its staging buffer (async_save)."""
    runs = {}
    for zero in (0, 1):
        name = "zero%d_%s" % (zero, dtype)
        path = write_recipe(name, dp_degree=2, dtype=dtype, zero_stage=zero, async_save=async_save,
                            checkpoint_dir=os.path.join(WORK, name, "ckpt"), save_interval=2)
        r = train(path, 2)
        if not check(r.returncode == 0, "%s: dp=2 ZeRO-%d run (%s)" % (dtype, zero, (r.stdout + r.stderr)[-800:])):
            return
        tensors = checkpoint_tensors(os.path.join(WORK, name, "ckpt", "step-00000005"))
        runs[zero] = (r.stdout,) + results(name) + ({k: v for k, v in tensors.items() if not k.startswith("w.")},)
    # bf16 full fine-tuning shards the fp32 masters with the moments (DeepSpeed's stage 1).
    says = "ZeRO-1: AdamW moments and fp32 masters sharded" if dtype == "bf16" else "ZeRO-1: AdamW moments sharded"
    check(says + " over 2 ranks" in runs[1][0], "%s: the run reports the sharding" % dtype)
    (_, m0, w0, o0), (_, m1, w1, o1) = runs[0], runs[1]
    worst = max(rel(a["loss"], b["loss"]) for a, b in zip(m1, m0))
    check(len(m0) == len(m1) == 5 and worst <= 1e-6, "%s: ZeRO-1 losses equal replicated (worst %.2e)" % (dtype, worst))
    worst = max(rel(a["grad_norm"], b["grad_norm"]) for a, b in zip(m1, m0))
    check(worst <= 1e-6, "%s: ZeRO-1 gradient norms equal replicated (worst %.2e)" % (dtype, worst))
    worst, where = max_rel_l2(w1, w0)
    check(worst <= 1e-6, "%s: ZeRO-1 final weights equal replicated (worst relative L2 %.2e, %s)" % (dtype, worst, where))
    # The checkpoint holds the whole moments, in pieces from both ranks' shards.
    worst, where = max_rel_l2(o1, o0)
    check(len(o1) == len(o0) and worst <= 1e-6,
          "%s: ZeRO-1 checkpoint moments equal replicated (worst relative L2 %.2e, %s)" % (dtype, worst, where))


def test_zero1_equals_replicated():
    compare_zero1("fp32", async_save=False)
    compare_zero1("bf16", async_save=True)  # also: each rank refreshes the bf16 copy of the other's shard


def test_zero1_checkpoint_spans_pieces():
    """A model whose ZeRO-1 shards are larger than one 16 MB message (9.3M parameters: each rank's
    slice of m and of v goes to rank 0 in two pieces): the single-file layout's streamed synchronous
    save and gathered asynchronous one write the same bytes as replicated training does."""
    model = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 64, "num_layers": 1, "num_heads": 4,
             "num_kv_heads": 2}
    files = {}
    for tag, zero, async_save in (("replicated", 0, False), ("zero1_streamed", 1, False), ("zero1_async", 1, True)):
        name = "pieces_" + tag
        ckpt = os.path.join(WORK, name, "ckpt")
        r = train(write_recipe(name, model=model, dp_degree=2, zero_stage=zero, async_save=async_save, max_steps=2,
                               gradient_accumulation_steps=1, checkpoint_dir=ckpt, save_interval=2,
                               checkpoint_layout="single_file"), 2)
        if not check(r.returncode == 0, "%s run%s" % (tag, why(r))):
            return
        step = os.path.join(ckpt, "step-00000002")
        files[tag] = []
        for f in ("weights.safetensors", "optimizer.safetensors"):
            with open(os.path.join(step, f), "rb") as fh:
                files[tag].append(fh.read())
    check(files["zero1_streamed"] == files["replicated"],
          "ZeRO-1's streamed save writes the same weights and optimizer files as replicated training")
    check(files["zero1_async"] == files["replicated"], "so does ZeRO-1's asynchronous save")


def test_zero1_resume_and_determinism():
    """An interrupted ZeRO-1 run resumed from its checkpoint ends bit-identical to an uninterrupted
    one, and with deterministic_reduce two runs are bit-identical."""
    def final_bytes(name):
        with open(os.path.join(WORK, name, "final", "model.safetensors"), "rb") as f:
            return f.read()

    whole = write_recipe("zero_whole", dp_degree=2, zero_stage=1, deterministic_reduce=True)
    finals = []
    for i in range(2):
        r = train(whole, 2)
        if not check(r.returncode == 0, "ZeRO-1 deterministic run %d (%s)" % (i, r.stderr[-500:])):
            return
        finals.append(final_bytes("zero_whole"))
    check(finals[0] == finals[1], "two ZeRO-1 runs with deterministic_reduce are bit-identical")

    split = write_recipe("zero_split", dp_degree=2, zero_stage=1, deterministic_reduce=True,
                         checkpoint_dir=os.path.join(WORK, "zero_split", "ckpt"))
    r = train(split, 2, "--stop-after", "2")
    if not check(r.returncode == 0, "ZeRO-1 run stopped after step 2 (%s)" % (r.stdout + r.stderr)[-500:]):
        return
    r = train(split, 2, "--resume", "auto")
    if not check(r.returncode == 0 and "resumed from" in r.stdout, "ZeRO-1 resume (%s)" % (r.stdout + r.stderr)[-500:]):
        return
    check(final_bytes("zero_split") == finals[0], "ZeRO-1 resumed from its checkpoint ends bit-identical")


def test_resume_on_another_number_of_ranks():
    """A run stopped after step 2 resumes on another number of ranks with the accumulation changed
    to keep the global batch (2 ranks x 2 <-> 1 rank x 4; ZeRO-1 on 2 ranks too): the same losses
    and final weights as the uninterrupted run, up to the reduction order. A different global batch
    is refused."""
    one, two = {"dp_degree": 1, "gradient_accumulation_steps": 4}, {"dp_degree": 2, "gradient_accumulation_steps": 2}
    whole = write_recipe("elastic_whole", **one)
    r = train(whole, 1)
    if not check(r.returncode == 0, "uninterrupted run" + why(r)):
        return
    m0, w0 = results("elastic_whole")
    for name, first, then in (("elastic_2_to_1", dict(two), one), ("elastic_1_to_2", one, dict(two, zero_stage=1))):
        ckpt = {"checkpoint_dir": os.path.join(WORK, name, "ckpt"), "save_interval": 1}
        r = train(write_recipe(name, **first, **ckpt), first["dp_degree"], "--stop-after", "2")
        if not check(r.returncode == 0, "%s: first part%s" % (name, why(r))):
            continue
        r = train(write_recipe(name, **then, **ckpt), then["dp_degree"], "--resume", "auto")
        if not check(r.returncode == 0 and "resumed from" in r.stdout,
                     "%s: resumed on %d rank(s)%s" % (name, then["dp_degree"], why(r))):
            continue
        m, w = results(name)
        worst = max(rel(a["loss"], b["loss"]) for a, b in zip(m, m0))
        check([x["step"] for x in m] == [1, 2, 3, 4, 5] and worst <= 1e-6,
              "%s: same losses as the uninterrupted run (worst %.2e)" % (name, worst))
        worst, where = max_rel_l2(w, w0)
        check(worst <= 1e-5, "%s: same final weights (worst relative L2 %.2e, %s)" % (name, worst, where))
    # Accumulation 2 on 1 rank is half the global batch: refused, naming the key.
    r = train(write_recipe("elastic_1_to_2", dp_degree=1, gradient_accumulation_steps=2,
                           checkpoint_dir=os.path.join(WORK, "elastic_1_to_2", "ckpt")), 1, "--resume", "auto")
    check(r.returncode == 2 and "gradient_accumulation_steps x dp_degree" in r.stderr,
          "a resume with another global batch is refused (%s)" % r.stderr.strip()[-300:])


def test_zero1_plan_halves_optimizer_memory():
    path = write_recipe("zero_plan", dp_degree=2)
    plans = {}
    for zero in (0, 1):
        r = subprocess.run([KEEL, "plan", path, "--json", "--zero", str(zero)], capture_output=True, text=True)
        if not check(r.returncode == 0, "keel plan --zero %d (%s)" % (zero, r.stderr[-300:])):
            return
        plans[zero] = json.loads(r.stdout)["categories"]
    ratio = plans[1]["optimizer state"] / plans[0]["optimizer state"]
    check(ratio <= 0.5 + 1e-3, "ZeRO-1 plans %.3f of the optimizer state per rank at dp=2" % ratio)
    check(plans[1]["master weights"] == plans[0]["master weights"] and plans[1]["gradients"] == plans[0]["gradients"],
          "ZeRO-1 leaves weights and gradients whole")


def test_world_size_mismatch():
    path = write_recipe("mismatch", dp_degree=2)
    r = train(path, 1)
    check(r.returncode == 2 and "dp_degree = 2 but the job has 1 process" in r.stderr,
          "dp_degree != world size is a clear error (%s)" % r.stderr.strip())


def test_different_recipes():
    path = write_recipe("differ", dp_degree=2)
    cmd = MPIRUN + ["-np", "1", KEEL, "train", path, ":", "-np", "1", KEEL, "train", path,
                    "--set", "learning_rate=0.1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    check(r.returncode != 0 and "different recipe" in out, "ranks with different recipes are refused (%s)" % out[-300:])


def signal_a_rank(name, sig, comm_timeout_s):
    """Starts an endless dp=2 run, sends `sig` to one rank once steps are being written, and waits
    (60 s at most) for the job to end. Returns (exit status or None, output, seconds it took to end)."""
    path = write_recipe(name, dp_degree=2, max_steps=1000000, comm_timeout_s=comm_timeout_s)
    p = subprocess.Popen(MPIRUN + ["-np", "2", KEEL, "train", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    metrics = os.path.join(WORK, name, "metrics.jsonl")
    start = time.time()
    while time.time() - start < 60 and not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        time.sleep(0.1)
    ranks = subprocess.run(["pgrep", "-f", "keel train %s" % path], capture_output=True, text=True).stdout.split()
    ranks = [int(x) for x in ranks if int(x) != p.pid]
    if not check(len(ranks) >= 2, "%s: two rank processes are running (%s)" % (name, ranks)):
        p.kill()
        return None, "", 0.0
    os.kill(max(ranks), sig)
    sent_at = time.time()
    out = ""
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
    finally:
        for pid in ranks:  # a stopped rank, if the launcher left it behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return p.returncode, out, time.time() - sent_at


def test_killed_rank():
    code, out, took = signal_a_rank("killed", signal.SIGKILL, 20)
    check(code not in (0, None), "the job fails when a rank dies (exit %s)" % code)
    check("rank" in out and ("exited on signal 9" in out or "did not complete" in out),
          "the error names the rank (%s)" % out.strip()[-400:])
    check(took < 45, "the job ended %.1f s after the kill" % took)


def test_hung_rank():
    """A rank that stops responding (SIGSTOP: alive, but never reaching the next collective) ends
    the job within comm_timeout_s with an error naming the waiting rank and the operation."""
    code, out, took = signal_a_rank("hung", signal.SIGSTOP, 10)
    check(code not in (0, None), "the job fails when a rank hangs (exit %s)" % code)
    check("did not complete within 10 s" in out and "another rank died or hangs" in out,
          "the waiting rank names the operation it timed out in (%s)" % [l for l in out.splitlines() if "error:" in l])
    check(took < 45, "the job ended %.1f s after the rank stopped" % took)


def main():
    rng = random.Random(3)
    with open(os.path.join(WORK, "train.jsonl"), "w") as f:
        for _ in range(120):
            n = rng.randrange(4, 24)
            f.write(json.dumps({"input_ids": [rng.randrange(40) for _ in range(n)]}) + "\n")
    print("dp=2 equals dp=1")
    compare_to_dp1(True)
    compare_to_dp1(False)
    for name, fn in sorted(globals().items()):
        if name.startswith("test_"):
            print(name)
            fn()
    shutil.rmtree(WORK, ignore_errors=True)
    if FAILURES:
        print("%d failure(s)" % len(FAILURES))
        sys.exit(1)
    print("all data-parallel checks passed")


if __name__ == "__main__":
    main()
