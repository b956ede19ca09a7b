#!/usr/bin/env python3
"""Planned memory (`keel plan`) next to the measured peak RSS of `keel train`, on the same model.

Builds the bench model of train_vs_pytorch.py (random Llama: hidden 768, 12 layers, 12 heads,
intermediate 2048, vocab 32000, sequence 1024, micro-batch 2), then for bf16 and fp32, with and
without gradient checkpointing: plans it with `keel plan --json`, trains a few steps with
`keel train`, and prints the plan, the measured peak RSS of the process (its VmHWM, from summary.json), their
difference, and the median step time (the throughput cost of checkpointing). The plan's "steps"
figure (the arena and what the trainer holds once steps run) is compared with the most RSS sampled
during the steps, apart from the setup, where weight files are mapped while they load. With --torch, also
PyTorch's peak RSS on the same model and batch (bf16 autocast), as train_vs_pytorch.py runs it.

    $(scripts/python-env.sh) bench/memory_vs_plan.py --keel build/keel [--steps 3] [--small] [--torch] [--dp 2 [--zero 1|2|3]] [--save sync|async]
"""
import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("train_vs_pytorch", os.path.join(HERE, "train_vs_pytorch.py"))
tvp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tvp)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keel", required=True)
    p.add_argument("--work", default="/tmp/keel_bench_memory")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--family", choices=tvp.FAMILIES, default="llama",
                   help="the checkpoint's architecture (train_vs_pytorch.py --family)")
    p.add_argument("--experts", type=int, default=16, help="mixtures of experts: experts per layer")
    p.add_argument("--top-k", type=int, default=4, help="mixtures of experts: experts per token")
    p.add_argument("--moe-intermediate", type=int, default=512, help="mixtures of experts: an expert's width")
    p.add_argument("--sliding-window", type=int, default=0, help="mistral: the attention window (0: none)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps; the first is warm-up")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--checkpointing", default="false,true")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (mpirun -np DP, one thread each)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                   help="ZeRO stage (1: AdamW moments sharded; 2: and the gradients)")
    p.add_argument("--save", choices=["none", "sync", "async"], default="none",
                   help="write a checkpoint after every step (synchronously or with async_save)")
    p.add_argument("--small", action="store_true", help="a quick smoke-size model")
    p.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA of this rank on every linear layer")
    p.add_argument("--qlora", action="store_true", help="with --lora: the projections in NF4 (quantization_bit = 4)")
    p.add_argument("--prequantized", action="store_true", help="with --qlora: train on the model as transformers + "
                   "bitsandbytes save it in 4 bits (NF4, double quantization), its codes read as they are")
    p.add_argument("--torch", action="store_true", help="also measure PyTorch's peak RSS (bf16 autocast)")
    a = p.parse_args()
    a.work = os.path.abspath(a.work)  # recipe paths resolve against the recipe file, not the cwd
    if a.small:
        a.hidden, a.layers, a.heads, a.intermediate, a.vocab, a.seq = 256, 4, 4, 704, 8000, 256
    a.kv_heads = a.heads
    a.dtype = "bf16"
    return a


def keel_processes(keel_cmd):
    """PIDs of the processes running exactly keel_cmd (the ranks, when mpirun starts them)."""
    want = "\0".join(keel_cmd) + "\0"
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if open("/proc/%s/cmdline" % pid).read() == want:
                    pids.append(int(pid))
            except OSError:
                pass
    return pids


def run_sampling_rss(cmd, keel_cmd, metrics_path):
    """Runs cmd; returns (exit code, output, most RSS of any keel_cmd process sampled once training
    steps have begun, i.e. once metrics_path has a line: the step loop's memory, apart from the
    setup's)."""
    import tempfile
    import time
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        training_rss, pids = 0, []
        while proc.poll() is None:
            try:
                pids = pids or keel_processes(keel_cmd)
                if os.path.exists(metrics_path) and os.path.getsize(metrics_path) > 0:
                    for pid in pids:
                        for line in open("/proc/%d/status" % pid):
                            if line.startswith("VmRSS:"):
                                training_rss = max(training_rss, int(line.split()[1]) * 1024)
            except OSError:
                pass
            time.sleep(0.02)
        log.seek(0)
        return proc.returncode, log.read(), training_rss


def write_recipe(a, model_dir, dtype, checkpointing, tag):
    out_dir = os.path.join(a.work, "out_" + tag)
    path = os.path.join(a.work, "recipe_%s.toml" % tag)
    with open(path, "w") as f:
        f.write('model_name = "%s"\ndata_path = "%s"\noutput_dir = "%s"\n' %
                (model_dir, os.path.join(a.work, "train.jsonl"), out_dir))
        f.write('dtype = "%s"\nmax_seq_len = %d\nbatch_size = %d\nmax_steps = %d\nlearning_rate = 1e-4\n'
                'weight_decay = 0.01\nshuffle = false\nlog_interval = 1\nuse_gradient_checkpointing = %s\n'
                'dp_degree = %d\nzero_stage = %d\n' % (dtype, a.seq, a.batch, a.steps, "true" if checkpointing else "false",
                                                   a.dp, a.zero))
        if a.lora:
            f.write('finetuning_type = "lora"\nlora_rank = %d\nlora_target = "all"\n' % a.lora)
            if a.qlora and not a.prequantized:  # a 4-bit checkpoint decides by itself
                f.write('quantization_bit = 4\n')
        if a.save != "none":
            f.write('checkpoint_dir = "%s"\nsave_interval = 1\nkeep_last_n = 1\nasync_save = %s\n' %
                    (os.path.join(out_dir, "checkpoints"), "true" if a.save == "async" else "false"))
    return path, out_dir


def save_in_4_bits(model_dir, out_dir):
    """The model as transformers + bitsandbytes save it after loading it in 4 bits on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    quantized = AutoModelForCausalLM.from_pretrained(
        model_dir, device_map="cpu", quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16))
    quantized.save_pretrained(out_dir)
    for name in os.listdir(model_dir):  # the tokenizer
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(model_dir, name), out_dir)
    return out_dir


def main():
    a = parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    a.steps = max(a.steps, 2)
    model_dir = tvp.make_workload(a)
    if a.prequantized:
        model_dir = save_in_4_bits(model_dir, os.path.join(a.work, "model_4bit"))
    if tvp.is_moe(a):
        print("experts: %d per layer of width %d, top-%d per token, %s" %
              (a.experts, a.moe_intermediate, a.top_k, tvp.sparse_layers_text(a)))
    print("model: %s hidden %d, %d layers, %d heads, intermediate %d, vocab %d; seq %d x batch %d, %d steps, dp %d, "
          "ZeRO-%d, checkpoints: %s%s" % (a.family + (" window %d" % a.sliding_window if a.sliding_window else ""),
                                          a.hidden, a.layers, a.heads, a.intermediate, a.vocab, a.seq, a.batch, a.steps,
                                          a.dp, a.zero, a.save, "; %s rank %d, all linear layers" % (
                                              "QLoRA (NF4%s)" % (", saved in 4 bits by bitsandbytes" if a.prequantized else "")
                                              if a.qlora else "LoRA", a.lora) if a.lora else ""))
    print("%-5s %-5s %10s %10s %8s   %10s %10s %8s %8s %12s" %
          ("dtype", "ckpt", "plan GiB", "peak GiB", "error", "steps plan", "steps RSS", "error", "step s",
           "activations"))
    gib = float(1 << 30)
    results = {}
    for dtype in a.dtypes.split(","):
        for ckpt in [c == "true" for c in a.checkpointing.split(",")]:
            tag = "%s_%s" % (dtype, "ckpt" if ckpt else "full")
            recipe, out_dir = write_recipe(a, model_dir, dtype, ckpt, tag)
            plan = json.loads(subprocess.check_output([a.keel, "plan", recipe, "--json"]))
            keel_cmd = [a.keel, "train", recipe]
            cmd = keel_cmd
            if a.dp > 1:  # rank 0 writes summary.json with its own peak
                cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-x", "OMP_NUM_THREADS=1", "-np",
                       str(a.dp)] + keel_cmd
            code, out, train_rss = run_sampling_rss(cmd, keel_cmd, os.path.join(out_dir, "metrics.jsonl"))
            if code != 0:
                sys.exit("keel failed:\n" + out)
            # The process's own VmHWM (summary.json): wait4's ru_maxrss would include this Python
            # parent's pages, which the child inherits until exec.
            rss = json.load(open(os.path.join(out_dir, "summary.json")))["peak_memory_bytes"]
            steps = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))]
            step_s = statistics.median([s["step_time_s"] for s in steps[1:]] or [steps[0]["step_time_s"]])
            planned = plan["total_bytes"]
            results[tag] = (planned, rss, step_s)
            step_plan = plan["training_bytes"]
            print("%-5s %-5s %10.3f %10.3f %+7.2f%%   %10.3f %10.3f %+7.2f%% %8.2f %10.3f G" %
                  (dtype, "on" if ckpt else "off", planned / gib, rss / gib, 100.0 * (rss - planned) / planned,
                   step_plan / gib, train_rss / gib, 100.0 * (train_rss - step_plan) / step_plan, step_s,
                   plan["categories"]["activations"] / gib))
    for dtype in a.dtypes.split(","):
        full, ckpt = results.get(dtype + "_full"), results.get(dtype + "_ckpt")
        if full and ckpt:
            print("%s: gradient checkpointing saves %.2f GiB measured (%.2f planned) for %.1f%% more step time"
                  % (dtype, (full[1] - ckpt[1]) / gib, (full[0] - ckpt[0]) / gib, 100.0 * (ckpt[2] / full[2] - 1)))
    if a.torch:
        # The worker reports its own VmHWM at exit: wait4's ru_maxrss would also count this
        # parent's pages (a forked child inherits its parent's high-water mark through exec).
        worker = ("import runpy, sys\nsys.argv = %r\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
                  "finally:\n    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
                  "    print('VMHWM', int(hwm.split()[1]) * 1024)\n") % (
            [os.path.join(HERE, "train_vs_pytorch.py"), "--torch-worker", "--work", a.work, "--steps", str(a.steps),
             "--batch", str(a.batch), "--dtype", "bf16", "--keel", a.keel],)
        proc = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit("PyTorch worker failed:\n" + proc.stdout + proc.stderr)
        torch_rss = int([l for l in proc.stdout.splitlines() if l.startswith("VMHWM")][0].split()[1])
        keel_bf16 = results.get("bf16_full")
        print("PyTorch bf16 autocast peak RSS: %.3f GiB" % (torch_rss / gib))
        if keel_bf16:
            print("keel/PyTorch peak memory (bf16, no checkpointing): %.2fx" % (keel_bf16[1] / torch_rss))


if __name__ == "__main__":
    main()
