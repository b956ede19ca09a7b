#!/usr/bin/env python3
"""Training-step throughput of keel next to PyTorch on the same model and the same data.

Builds a random Llama-architecture checkpoint (default: the reference workload of the speed
issue: hidden 768, 12 layers, 12 heads, intermediate 2048, vocab 32000, sequence 1024,
micro-batch 2), trains it for a few steps in keel (`keel train`) and in PyTorch (bf16 autocast,
fused q/k/v and gate/up projections, torch.optim.AdamW) in separate processes, and prints
tokens/s of each, their ratio, keel's MFU against the bf16 matmul peak measured in the same run,
and the peak RSS of both processes.

    $(scripts/python-env.sh) bench/train_vs_pytorch.py --keel build/keel [--steps 4] [--small]
"""
import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keel", required=True)
    p.add_argument("--matmul-peak", default=None, help="path of build/bench/matmul_peak")
    p.add_argument("--work", default="/tmp/keel_bench_train")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps; the first is warm-up")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--small", action="store_true", help="a quick smoke-size model")
    p.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--skip-torch", action="store_true")
    a = p.parse_args()
    if a.small:
        a.hidden, a.layers, a.heads, a.intermediate, a.vocab, a.seq = 256, 4, 4, 704, 8000, 256
    a.kv_heads = a.kv_heads or a.heads
    return a


def matmul_parameters(a):
    d, hd = a.hidden, a.hidden // a.heads
    per_layer = d * (a.heads * hd) + 2 * d * (a.kv_heads * hd) + (a.heads * hd) * d + 3 * d * a.intermediate
    return a.layers * per_layer + a.vocab * d


def flops_per_token(a):
    # 6N for the matmuls (forward + backward) plus 12·L·T·d for attention scores and values.
    return 6 * matmul_parameters(a) + 12 * a.layers * a.seq * a.hidden


def make_workload(a):
    import torch
    import hf_models as hm
    model_dir = os.path.join(a.work, "model")
    cfg = hm.make_config("llama", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads,
                         head_dim=a.hidden // a.heads, max_position_embeddings=a.seq)
    spec = hm.spec_from_config(cfg)
    model = hm.random_init(hm.build_model(spec), seed=1)
    hm.save_checkpoint(model_dir, cfg, hm.model_tensors(model))
    gen = torch.Generator().manual_seed(2)
    with open(os.path.join(a.work, "train.jsonl"), "w") as f:
        for _ in range(a.steps * a.batch):
            ids = torch.randint(0, a.vocab, (a.seq,), generator=gen).tolist()
            f.write(json.dumps({"input_ids": ids}) + "\n")
    return model_dir


def run_with_peak_rss(cmd):
    """Runs cmd to completion; returns (exit code, output, peak RSS in bytes of that process)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, out, usage.ru_maxrss * 1024


def run_keel(a, model_dir):
    out_dir = os.path.join(a.work, "keel_out")
    recipe = os.path.join(a.work, "recipe.toml")
    with open(recipe, "w") as f:
        f.write('model_name = "%s"\ndata_path = "%s"\noutput_dir = "%s"\n' %
                (model_dir, os.path.join(a.work, "train.jsonl"), out_dir))
        f.write('dtype = "%s"\nmax_seq_len = %d\nbatch_size = %d\nmax_steps = %d\nlearning_rate = 1e-4\n'
                'weight_decay = 0.01\nshuffle = false\nlog_interval = 1\n' % (a.dtype, a.seq, a.batch, a.steps))
    code, out, rss = run_with_peak_rss([a.keel, "train", recipe])
    if code != 0:
        sys.exit("keel failed:\n" + out)
    steps = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))]
    times = [s["step_time_s"] for s in steps[1:]] or [steps[0]["step_time_s"]]
    # The process's own VmHWM (summary.json): wait4's ru_maxrss of a forked child inherits the
    # parent Python's high-water mark and overstates small processes.
    with open(os.path.join(out_dir, "summary.json")) as f:
        rss = json.load(f)["peak_memory_bytes"]
    return a.batch * a.seq / statistics.median(times), rss


def torch_worker(a):
    """Runs in its own process: trains the same checkpoint in PyTorch, prints JSON."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import hf_models as hm
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    cfg, spec, ref = hm.load_model(os.path.join(a.work, "model"))
    d, nh, kv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim

    class Block(nn.Module):  # fused q/k/v and gate/up: the strongest plain-PyTorch baseline
        def __init__(self):
            super().__init__()
            self.n1 = hm.RMSNorm(d, spec.rms_norm_eps)
            self.qkv = nn.Linear(d, (nh + 2 * kv) * hd, bias=False)
            self.o = nn.Linear(nh * hd, d, bias=False)
            self.n2 = hm.RMSNorm(d, spec.rms_norm_eps)
            self.gate_up = nn.Linear(d, 2 * spec.intermediate_size, bias=False)
            self.down = nn.Linear(spec.intermediate_size, d, bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).split([nh * hd, kv * hd, kv * hd], dim=-1)
            q = q.view(B, T, nh, hd).transpose(1, 2)
            k = k.view(B, T, kv, hd).transpose(1, 2)
            v = v.view(B, T, kv, hd).transpose(1, 2)
            def rot(t):
                t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
                return t * cos + torch.cat((-t2, t1), -1) * sin
            q, k = rot(q), rot(k)
            if kv != nh:
                k = k.repeat_interleave(nh // kv, dim=1)
                v = v.repeat_interleave(nh // kv, dim=1)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            mask = torch.full((T, T), float("-inf")).triu(1)
            p = torch.softmax(s.float() + mask, dim=-1).to(q.dtype)
            x = x + self.o((p @ v).transpose(1, 2).reshape(B, T, nh * hd))
            g, u = self.gate_up(self.n2(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(g) * u)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(spec.vocab_size, d)
            self.blocks = nn.ModuleList([Block() for _ in range(spec.num_layers)])
            self.norm = hm.RMSNorm(d, spec.rms_norm_eps)
            self.head = nn.Linear(d, spec.vocab_size, bias=False)

        def forward(self, ids):
            T = ids.shape[1]
            inv = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
            f = torch.outer(torch.arange(T).float(), inv)
            emb = torch.cat((f, f), -1)
            cos, sin = emb.cos(), emb.sin()
            x = self.embed(ids)
            for b in self.blocks:
                x = b(x, cos, sin)
            return self.head(self.norm(x))

    model = Model()
    ids_all = [json.loads(l)["input_ids"] for l in open(os.path.join(a.work, "train.jsonl"))]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    times = []
    for step in range(a.steps):
        batch = torch.tensor(ids_all[step * a.batch:(step + 1) * a.batch])
        t0 = time.time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            logits = model(batch)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, spec.vocab_size), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.time() - t0)
    with open("/proc/self/status") as f:  # this process's own high-water mark
        peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
    print(json.dumps({"times": times, "peak_rss": peak}))


def main():
    a = parse_args()
    if a.torch_worker:
        torch_worker(a)
        return
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    print("model: llama hidden %d, %d layers, %d heads, intermediate %d, vocab %d; seq %d x batch %d, %s, %d steps"
          % (a.hidden, a.layers, a.heads, a.intermediate, a.vocab, a.seq, a.batch, a.dtype, a.steps))
    model_dir = make_workload(a)

    peak_tool = a.matmul_peak or os.path.join(os.path.dirname(os.path.abspath(a.keel)), "bench", "matmul_peak")
    peak = json.loads(subprocess.check_output([peak_tool]))
    peak_flops = peak["bf16_flops"] if a.dtype == "bf16" else peak["f32_flops"]

    keel_tps, keel_rss = run_keel(a, model_dir)

    torch_tps = torch_rss = None
    if not a.skip_torch:
        code, out, torch_rss = run_with_peak_rss(
            [sys.executable, os.path.abspath(__file__), "--torch-worker", "--work", a.work, "--steps", str(a.steps),
             "--batch", str(a.batch), "--dtype", a.dtype, "--keel", a.keel])
        if code != 0:
            sys.exit("PyTorch worker failed:\n" + out)
        res = json.loads(out.strip().splitlines()[-1])
        times = res["times"][1:] or res["times"]
        torch_tps = a.batch * a.seq / statistics.median(times)
        torch_rss = res["peak_rss"]

    fpt = flops_per_token(a)
    print("matmul peak (%s, oneDNN %d^3): %.1f GFLOP/s" % (a.dtype, peak["size"], peak_flops / 1e9))
    print("keel    : %8.1f tokens/s   MFU %5.1f%%   peak RSS %.2f GB" %
          (keel_tps, 100 * keel_tps * fpt / peak_flops, keel_rss / 1e9))
    if torch_tps:
        print("PyTorch : %8.1f tokens/s   MFU %5.1f%%   peak RSS %.2f GB" %
              (torch_tps, 100 * torch_tps * fpt / peak_flops, torch_rss / 1e9))
        print("ratio keel/PyTorch: %.2fx" % (keel_tps / torch_tps))


if __name__ == "__main__":
    main()
