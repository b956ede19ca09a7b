#!/usr/bin/env python3
"""Training-step throughput of keel next to the PyTorch stacks a user would run instead, on the
same checkpoint, the same data and the same cores, in one run.

Builds a random Llama-architecture checkpoint (default: the reference workload of the speed
issue: hidden 768, 12 layers, 12 heads, intermediate 2048, vocab 32000, sequence 1024,
micro-batch 2) and random token ids (one train.jsonl, read by every peer in file order), then
trains it for --steps optimizer steps, each peer in its own process:

  keel             `keel train` (dtype bf16: fp32 master weights, bf16 GEMM inputs)
  HF Trainer       transformers' Trainer on AutoModelForCausalLM.from_pretrained(...,
                   attn_implementation="sdpa"), TrainingArguments(bf16=True, use_cpu=True,
                   optim="adamw_torch_fused", falling back to "adamw_torch")
  torch eager      a plain loop on the same transformers model: bf16 autocast, sdpa,
                   torch.optim.AdamW(fused=True) (foreach where fused does not run on the CPU)
  torch.compile    the same loop on torch.compile(model) (inductor), under --compile-timeout
  torchtune        its full_finetune_single_device recipe, in scripts/torchtune-env.sh's
                   environment (torchtune's own Llama-2 model class, FullModelHFCheckpointer on the
                   same checkpoint, torch.optim.AdamW(fused=True),
                   CEWithChunkedOutputLoss, activation checkpointing with --checkpointing) on
                   device "cpu" with dtype bf16: torchtune's bf16 is pure bf16 (weights, gradients
                   and AdamW state in bf16, no fp32 masters), lighter than every other row's mixed
                   precision. Llama full fine-tuning only (not with --lora or another --family).

--family qwen3_moe | mixtral | glm4_moe: a mixture of experts of the same hidden size, layers and
attention (glm4_moe: GLM-4.5's layer 0 dense of width --intermediate, one shared expert of width
--moe-intermediate on the others, a sigmoid router, q/k/v biases and half-rotated heads), else
every layer sparse, --experts (16) experts of width --moe-intermediate (512), --top-k (4) per token:
the routed MLP computes what the dense model's 2048-wide one does, over 4x its weights. Written by
transformers' own save_pretrained. The torch eager loop runs once per experts implementation of
transformers (--experts-impl: grouped_mm, its default, and eager), the Trainer and torch.compile
with grouped_mm; MFU counts the active parameters (the router and top-k experts), the header both.

Every peer: AdamW lr 1e-4 (constant), weight decay 0.01 except biases and norm weights, gradient
clipping at 1.0, gradient checkpointing with --checkpointing, torch.set_num_threads(--threads)
and OMP_NUM_THREADS=--threads for keel.

--checkpointing-layers K: with --checkpointing, only keel's first K blocks recompute
(gradient_checkpointing_layers); the peers' checkpointing recomputes every block. Compare peak RSS:
`keel plan --device-memory` names the fewest that fit a given memory.

--lora R: LoRA fine-tuning instead, rank R, alpha 2R, on every linear layer of the blocks: keel's
finetuning_type = "lora" against PEFT (get_peft_model, LoraConfig target_modules "all-linear") in
every PyTorch peer; keel's full fine-tuning runs as one more row, for the LoRA/full step ratio.
MFU then counts 4 FLOPs per frozen weight (no weight gradient) and 6 per adapter weight.

Reported per peer: tokens/s = batch x seq / the median step time after the first (warm-up) step
(with --rounds N, every row runs N times in turn, and tokens/s and keel/peer are medians over the
rounds, keel/peer of the ratios within each round);
peak RSS = ru_maxrss of the peer's process tree (os.wait4 on that child; this parent never
imports torch, so the high-water mark a child inherits from it across fork/exec is 10-20 MB; the
JSON line adds each process's own VmHWM, read right after its last step, as a cross-check);
MFU = tokens/s x (6 N + 12 L T d) / the machine's bf16 (or fp32) GEMM peak measured in the same run:
the larger of keel's oneDNN (build/bench/matmul_peak) and torch's own matmul on the same 2048^3
problem (with AMX, torch's library is ~2x keel's oneDNN 2.6) (PaLM's model FLOPs: N counts the matmul weights, the LM
head included and the embedding lookup excluded; recomputation under checkpointing is not
counted); beside it the same with attention's causal half only (6 L T d: the keys each query
sees, what keel's and SDPA's causal kernels compute); and keel's tokens/s over the peer's.

The peers run at their best: with --dtype bf16 on a CPU without native bf16 matmul (no AVX-512
BF16 or AMX: an AVX2 Zen 3 runs torch 2.15's bf16 matmul at ~1 GFLOP/s against 175 in fp32),
--torch-dtype auto runs the PyTorch peers in fp32 and says so; keel stays in bf16 (its oneDNN
widens bf16 operands to fp32 there, at the fp32 rate). The header lists the versions of everything
compared; the last line is the table as one JSON object (for docs/performance.md).

    $(scripts/python-env.sh) bench/train_vs_pytorch.py --keel build/keel [--steps 4] [--small] \\
        [--checkpointing] [--peers trainer,eager,compile,torchtune] [--compile-timeout 900] [--rounds 3]
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))

PEERS = ("trainer", "eager", "compile", "torchtune")
FAMILIES = ("llama", "qwen3", "mistral", "gemma2", "gemma3", "qwen3_moe", "mixtral", "glm4_moe")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe")
# transformers 5's ways of running a sparse layer's experts (integrations/moe.py): grouped_mm (its
# default where torch has the kernel: one grouped GEMM over tokens sorted by expert) and eager (a
# loop over the experts that were hit). Its third, batched_mm, gathers every routed row's expert
# weights into one batched GEMM: on the --small model it ran 5.6x slower than eager in 10.7 GB
# (2026-12-06, EPYC AVX-512 BF16), and on the bench model its gathered weights alone (rows x
# top-k x 3 x hidden x width, bf16) pass the machine's 24 GB: ask for it with --experts-impl.
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager")
PEER_NAMES = {"keel": "keel", "keel_full": "keel (full FT)", "trainer": "HF Trainer", "eager": "torch eager",
              "compile": "torch.compile", "torchtune": "torchtune"}


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
    p.add_argument("--family", choices=FAMILIES, default="llama",
                   help="the checkpoint's architecture at the same shape (qwen3: q/k norms; mistral: a sliding "
                        "window; gemma2/3: sandwich norms, GeGLU, soft caps 50/30 for gemma2, window 4096; "
                        "qwen3_moe, mixtral, glm4_moe: mixtures of experts, every layer sparse (glm4_moe: "
                        "but the first), --experts of width "
                        "--moe-intermediate, --top-k per token)")
    p.add_argument("--experts", type=int, default=16, help="mixtures of experts: experts per layer")
    p.add_argument("--top-k", type=int, default=4, help="mixtures of experts: experts per token")
    p.add_argument("--moe-intermediate", type=int, default=512,
                   help="mixtures of experts: an expert's width (default 512: top-4 of them compute what the "
                        "dense bench model's 2048-wide MLP does)")
    p.add_argument("--experts-impl", default=",".join(EXPERTS_IMPLEMENTATIONS),
                   help="mixtures of experts: transformers' experts implementations the torch eager peer runs, "
                        "one row each (the HF Trainer and torch.compile peers run the first)")
    p.add_argument("--sliding-window", type=int, default=0,
                   help="mistral: the attention window (0: none, sliding_window = null); gemma: of its "
                        "sliding layers (0: 4096)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps; the first is warm-up")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--torch-dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="the PyTorch peers' dtype; auto: --dtype, but fp32 where torch's own bf16 matmul "
                        "is slower than its fp32 one on this CPU (the peers at their best)")
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing in every peer")
    p.add_argument("--checkpointing-layers", type=int, default=0, metavar="K",
                   help="with --checkpointing: only keel's first K blocks recompute (gradient_checkpointing_layers; "
                        "keel plan with a memory limit names the fewest that fit); the peers recompute every block")
    p.add_argument("--zero3", action="store_true",
                   help="keel's full fine-tuning with zero_stage = 3 on its one rank: no whole bf16 copy of the "
                        "weights, each position casts its own (the memory it frees buys fewer recomputed blocks)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="threads of every peer (default: the cores this process may run on)")
    p.add_argument("--peers", default=",".join(PEERS), help="PyTorch peers to run, of: " + ",".join(PEERS))
    p.add_argument("--compile-timeout", type=float, default=900,
                   help="seconds the torch.compile peer may take in all (compilation included)")
    p.add_argument("--small", action="store_true", help="a quick smoke-size model")
    p.add_argument("--lora", type=int, default=0, metavar="RANK", help="LoRA of this rank instead of full fine-tuning")
    p.add_argument("--skip-torch", action="store_true", help="keel only")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every row this many times, alternating; figures are medians over rounds")
    # workload, or a peer; a mixture of experts' peer as PEER@IMPLEMENTATION (its experts' implementation)
    p.add_argument("--role", help=argparse.SUPPRESS)
    # The plain-torch peer on the workload in --work (bench/memory_vs_plan.py --torch runs it).
    p.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.work = os.path.abspath(a.work)  # recipe paths resolve against the recipe file, not the cwd
    if a.small:
        a.hidden, a.layers, a.heads, a.intermediate, a.vocab, a.seq = 256, 4, 4, 704, 8000, 256
    a.kv_heads = a.kv_heads or a.heads
    if a.checkpointing_layers and not (a.checkpointing and 0 < a.checkpointing_layers <= a.layers):
        p.error("--checkpointing-layers needs --checkpointing and at most --layers blocks")
    if a.torch_worker:
        a.role = "eager"
    if a.role and a.role != "workload" and a.role.partition("@")[0] not in PEERS:
        p.error("--role: unknown peer %s" % a.role)
    a.experts_impl = [x for x in a.experts_impl.split(",") if x]
    if is_moe(a) and a.lora:
        p.error("--lora: the bench's mixtures of experts run full fine-tuning only")
    return a


def peer_name(name):
    """The table's name of a row: keel, keel_full, a peer, or PEER@IMPLEMENTATION (mixture of experts)."""
    base, _, impl = name.partition("@")
    return PEER_NAMES[base] + (" [%s]" % impl if impl else "")


def expand_moe_peers(a, peers):
    """A mixture of experts' peers: the torch eager loop once per experts implementation of
    --experts-impl, the other peers with the first (transformers' default, grouped_mm)."""
    if not is_moe(a):
        return peers
    out = []
    for p in peers:
        out += ["%s@%s" % (p, impl) for impl in (a.experts_impl if p == "eager" else a.experts_impl[:1])]
    return out


def is_moe(a):
    return getattr(a, "family", "llama") in MOE_FAMILIES


def sparse_layers_text(a):
    return ("layer 0 dense, the others sparse with a shared expert" if getattr(a, "family", "") == "glm4_moe"
            else "every layer sparse")


def glm4_moe(a):
    return getattr(a, "family", "llama") == "glm4_moe"


def matmul_parameters(a):
    """The matmul weights a token meets: of a mixture of experts, the router and its top-k experts
    only (the active parameters), not every expert; GLM-4.5's shared expert and dense first layer."""
    d, hd = a.hidden, a.hidden // a.heads
    dense = 3 * d * a.intermediate
    mlp = d * a.experts + a.top_k * 3 * d * a.moe_intermediate if is_moe(a) else dense
    if glm4_moe(a):
        mlp += 3 * d * a.moe_intermediate  # the shared expert
    attention = d * (a.heads * hd) + 2 * d * (a.kv_heads * hd) + (a.heads * hd) * d
    if glm4_moe(a):  # layer 0 dense (first_k_dense_replace 1)
        return attention + dense + (a.layers - 1) * (attention + mlp) + a.vocab * d
    return a.layers * (attention + mlp) + a.vocab * d


def total_parameters(a):
    """Every matmul weight (a mixture of experts: all experts), for the header."""
    if not is_moe(a):
        return matmul_parameters(a)
    sparse = a.layers - 1 if glm4_moe(a) else a.layers
    return matmul_parameters(a) + sparse * (a.experts - a.top_k) * 3 * a.hidden * a.moe_intermediate


def lora_parameters(a):
    """The adapter of --lora on every linear layer of the blocks: r x (in + out) per module."""
    d, hd = a.hidden, a.hidden // a.heads
    q, kv, i = a.heads * hd, a.kv_heads * hd, a.intermediate
    per_layer = (d + q) + 2 * (d + kv) + (q + d) + 2 * (d + i) + (i + d)
    return a.lora * a.layers * per_layer


def attention_keys(a):
    """The T of attention's 12·L·T·d, averaged over the layers. PaLM's convention counts every key
    of the sequence, twice the keys a causal query sees on average; with a sliding window, the same
    convention is twice the keys each query sees on average (its window, or fewer at the start).
    Mistral slides on every layer, Gemma 2 on the even ones, Gemma 3 on five of six."""
    window = getattr(a, "sliding_window", 0)
    family = getattr(a, "family", "llama")
    if not window or window >= a.seq:
        return a.seq
    windowed = 2.0 * sum(min(i + 1, window) for i in range(a.seq)) / a.seq
    sliding = [family == "mistral" or (family == "gemma2" and l % 2 == 0) or (family == "gemma3" and (l + 1) % 6 != 0)
               for l in range(a.layers)]
    return sum(windowed if s else a.seq for s in sliding) / a.layers


def flops_per_token(a, lora=None, causal=False):
    # 6N for the matmuls (forward + backward) plus 12·L·T·d for attention scores and values; under
    # LoRA 4 per frozen weight (forward and input gradient) and 6 per adapter weight. causal: the
    # attention keel (and SDPA's causal kernels) compute, the keys each query sees: half of PaLM's.
    lora = a.lora if lora is None else lora
    attention = 12 * a.layers * attention_keys(a) * a.hidden / (2 if causal else 1)
    if not lora:
        return 6 * matmul_parameters(a) + attention
    return 4 * matmul_parameters(a) + 6 * lora_parameters(a) + attention


def moe_config(a):
    """config.json of the mixture-of-experts bench model: Qwen3-30B-A3B's and Mixtral's own
    settings (softmax top-k renormalised, every layer sparse, the load-balancing loss off in
    training as their published configs have it) at the bench's shape."""
    common = {"vocab_size": a.vocab, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
              "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.hidden // a.heads,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": a.seq,
              "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32",
              "num_experts_per_tok": a.top_k, "output_router_logits": False, "router_aux_loss_coef": 0.001,
              "bos_token_id": 1, "eos_token_id": 2}
    if a.family == "glm4_moe":  # GLM-4.5-Air's settings: a dense first layer, one shared expert, one group
        common = {k: v for k, v in common.items() if k not in ("router_aux_loss_coef",)}
        return dict(common, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe",
                    intermediate_size=a.intermediate, moe_intermediate_size=a.moe_intermediate,
                    n_routed_experts=a.experts, n_shared_experts=1, n_group=1, topk_group=1,
                    routed_scaling_factor=1.0, norm_topk_prob=True, first_k_dense_replace=1,
                    partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=0)
    if a.family == "mixtral":
        return dict(common, architectures=["MixtralForCausalLM"], model_type="mixtral",
                    intermediate_size=a.moe_intermediate, num_local_experts=a.experts, sliding_window=None,
                    router_jitter_noise=0.0)
    return dict(common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                intermediate_size=a.intermediate, moe_intermediate_size=a.moe_intermediate, num_experts=a.experts,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False,
                use_sliding_window=False)


def make_moe_model(a, model_dir):
    """A random mixture-of-experts checkpoint, written by transformers' own save_pretrained (the
    layout a user's checkpoint has): matrices N(0, 0.02), norms 1, the router N(0, 0.02)."""
    import torch
    import transformers
    cfg = moe_config(a)
    cls = {"mixtral": transformers.MixtralForCausalLM, "glm4_moe": transformers.Glm4MoeForCausalLM}.get(
        a.family, transformers.Qwen3MoeForCausalLM)
    config = cls.config_class(**{k: v for k, v in cfg.items() if k not in ("torch_dtype", "model_type")})
    torch.manual_seed(1)
    model = cls(config).to(torch.float32)  # transformers' _init_weights: N(0, initializer_range = 0.02)
    model.save_pretrained(model_dir)


def make_workload(a):
    import torch
    import hf_models as hm
    model_dir = os.path.join(a.work, "model")
    family = getattr(a, "family", "llama")
    if is_moe(a):
        make_moe_model(a, model_dir)
        write_token_ids(a)
        return model_dir
    cfg = hm.make_config(family, vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads,
                         head_dim=a.hidden // a.heads, max_position_embeddings=a.seq, tie_word_embeddings=False)
    if family == "mistral":
        cfg["sliding_window"] = getattr(a, "sliding_window", 0) or None
    if family.startswith("gemma"):  # the real models' settings, not the tests' small caps and windows
        cfg.update({"sliding_window": getattr(a, "sliding_window", 0) or 4096,
                    "query_pre_attn_scalar": a.hidden // a.heads, "layer_types": None,
                    "attn_logit_softcapping": 50.0 if family == "gemma2" else None,
                    "final_logit_softcapping": 30.0 if family == "gemma2" else None})
    spec = hm.spec_from_config(cfg)
    model = hm.random_init(hm.build_model(spec), seed=1)
    hm.save_checkpoint(model_dir, cfg, hm.model_tensors(model))
    write_token_ids(a)
    return model_dir


def write_token_ids(a):
    """train.jsonl: random token ids, --steps x --batch records of --seq tokens."""
    import torch
    gen = torch.Generator().manual_seed(2)
    with open(os.path.join(a.work, "train.jsonl"), "w") as f:
        for _ in range(a.steps * a.batch):
            ids = torch.randint(0, a.vocab, (a.seq,), generator=gen).tolist()
            f.write(json.dumps({"input_ids": ids}) + "\n")


# --------------------------------------------------------------------------------------------
# Versions (printed in the header: a ratio means little without what it was measured against)
# --------------------------------------------------------------------------------------------

def keel_version(keel):
    try:
        out = subprocess.run([keel, "--version"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except OSError:
        pass
    root = os.path.join(HERE, "..")
    try:
        commit = subprocess.check_output(["git", "-C", root, "rev-parse", "--short", "HEAD"], text=True).strip()
        dirty = subprocess.check_output(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                        text=True).strip()
        return "git " + commit + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def python_versions():
    """Runs in the workload child (the parent stays torch-free): the Python side's versions."""
    import importlib.util
    import platform
    import numpy
    import torch
    import transformers
    import accelerate
    import peft
    cfg = torch.__config__.show()
    blas = next((l.strip(" -") for l in cfg.splitlines()
                 if "Math Kernel Library" in l or "OpenBLAS" in l or "BLIS" in l), None)
    if blas is None:
        m = re.search(r"BLAS_INFO=([^,\s]+)", cfg)
        blas = "BLAS_INFO=" + m.group(1) if m else "none listed"
    m = re.search(r"MKL-DNN (v[\w.]+)", cfg)
    onednn = m.group(1) if m else ("available" if torch.backends.mkldnn.is_available() else "absent")
    try:
        np_blas = numpy.show_config(mode="dicts")["Build Dependencies"]["blas"]
        np_blas = "%s %s" % (np_blas.get("name"), np_blas.get("version"))
    except Exception as e:  # numpy < 1.25 has no mode="dicts"
        np_blas = "unknown (%s)" % e
    try:
        import threadpoolctl
        np_blas += "; threadpoolctl: " + ", ".join(
            "%s %s" % (i.get("internal_api"), i.get("version")) for i in threadpoolctl.threadpool_info())
    except ImportError:
        pass
    torchtune = importlib.util.find_spec("torchtune")
    return {
        "torch": torch.__version__ + (" (CUDA %s build, run on the CPU)" % torch.version.cuda
                                      if torch.version.cuda else ""),
        "torch_blas": blas, "torch_onednn": onednn, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "transformers": transformers.__version__, "accelerate": accelerate.__version__, "peft": peft.__version__,
        "numpy": numpy.__version__, "numpy_blas": np_blas,
        "python": platform.python_version(),
        "torchtune": getattr(__import__("torchtune"), "__version__", "installed") if torchtune else None,
    }


def cpu_model():
    flags = set()
    name = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and name == "unknown":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    isa = [x for x in ("avx512f", "avx512_bf16", "amx_bf16") if x in flags]
    return "%s (%s)" % (name, ", ".join(isa) or "no AVX-512")


# --------------------------------------------------------------------------------------------
# Running a peer: its own process, its own peak RSS
# --------------------------------------------------------------------------------------------

def run_child(cmd, env=None, timeout=None):
    """Runs cmd to completion or `timeout` seconds; returns (exit code or None on timeout,
    output, ru_maxrss in bytes of the child's tree -- the largest of the child and the
    descendants it waited for; a child killed on timeout is reaped with its whole session)."""
    with tempfile.TemporaryFile(mode="w+") as log:  # a file, not a pipe: no reader thread needed
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        deadline = time.time() + timeout if timeout else None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                code = os.waitstatus_to_exitcode(status)
                break
            if deadline and time.time() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)  # the peer and its compile workers
                _, status, usage = os.wait4(proc.pid, 0)
                code = None
                break
            time.sleep(0.05)
        proc.returncode = -1 if code is None else code  # reaped here: Popen must not wait again
        log.seek(0)
        return code, log.read(), usage.ru_maxrss * 1024


def peer_env(a):
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error",
               TOKENIZERS_PARALLELISM="false",
               # a cold inductor cache per run: the compile time reported is what a first run pays
               TORCHINDUCTOR_CACHE_DIR=os.path.join(a.work, "inductor_cache"))
    return env


def run_keel(a, model_dir, lora):
    out_dir = os.path.join(a.work, "keel_out_lora" if lora else "keel_out")
    shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run each round, not a resume of the last
    recipe = os.path.join(a.work, "recipe_lora.toml" if lora else "recipe.toml")
    with open(recipe, "w") as f:
        f.write('model_name = "%s"\ndata_path = "%s"\noutput_dir = "%s"\n' %
                (model_dir, os.path.join(a.work, "train.jsonl"), out_dir))
        f.write('dtype = "%s"\nmax_seq_len = %d\nbatch_size = %d\nmax_steps = %d\nlearning_rate = 1e-4\n'
                'lr_scheduler = "constant"\nweight_decay = 0.01\nmax_grad_norm = 1.0\nshuffle = false\n'
                'log_interval = 1\nuse_gradient_checkpointing = %s\ngradient_checkpointing_layers = %d\n'
                % (a.dtype, a.seq, a.batch, a.steps, "true" if a.checkpointing else "false", a.checkpointing_layers))
        if lora:
            f.write('finetuning_type = "lora"\nlora_rank = %d\nlora_target = "all"\n' % lora)
        elif a.zero3:
            f.write('zero_stage = 3\n')
    code, out, rss = run_child([a.keel, "train", recipe], env=peer_env(a))
    if code != 0:
        sys.exit("keel failed:\n" + out)
    m = re.search(r"keel: (\d+) thread\(s\) per rank", out)
    if m and int(m.group(1)) != a.threads:
        print("warning: keel ran %s threads, the PyTorch peers %d" % (m.group(1), a.threads))
    steps = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))]
    with open(os.path.join(out_dir, "summary.json")) as f:  # keel's own VmHWM, a cross-check of rss
        vmhwm = json.load(f)["peak_memory_bytes"]
    # The blocks keel recomputes, as its start-up line says (without --checkpointing-layers keel
    # decides: every block, or all but the last).
    m = re.search(r"gradient checkpointing \((\d+) of (\d+) blocks recompute", out)
    recomputed = int(m.group(1)) if m else 0
    checkpointing = ", checkpointing (%d of %s blocks recompute)" % (recomputed, m.group(2)) if m else ""
    if "bf16 weights cast per position" in out:  # keel's own start-up line: ZeRO-3 on one rank
        checkpointing = ", ZeRO-3 (one rank: bf16 cast per position)" + checkpointing
    return {"times": [s["step_time_s"] for s in steps], "rss": rss, "vmhwm": vmhwm, "recomputed": recomputed,
            "settings": "%s%s, flash-style attention, AdamW%s" % ("LoRA r=%d, " % lora if lora else "", a.dtype,
                                                                  checkpointing)}


def run_peer(a, role):
    """One PyTorch peer in its own process (this same file with --role); its result or why not.
    torchtune runs in its own environment, layered on this one (scripts/torchtune-env.sh: PEFT
    refuses the torchao that torchtune 0.6.1 imports, so the two cannot share one)."""
    python = sys.executable
    if role == "torchtune":
        script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "torchtune-env.sh")
        made = subprocess.run([script], capture_output=True, text=True)
        if made.returncode != 0:
            return {"error": "not run: scripts/torchtune-env.sh failed: " + (made.stderr.strip().splitlines() or ["?"])[-1]}
        python = made.stdout.strip().splitlines()[-1]
    cmd = [python, os.path.abspath(__file__)] + [x for x in sys.argv[1:]] + ["--dtype", a.torch_dtype, "--role", role]
    timeout = a.compile_timeout if role == "compile" else None
    t0 = time.time()
    code, out, rss = run_child(cmd, env=peer_env(a), timeout=timeout)
    if code is None:
        return {"error": "killed after %.0f s (--compile-timeout): compilation had not finished" % (time.time() - t0)}
    lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
    if code != 0 or not lines:
        tail = [l for l in out.strip().splitlines() if l.strip()][-1:] or ["no output"]
        return {"error": "exit %d: %s" % (code, tail[0][:300]), "log": out}
    res = json.loads(lines[-1][len("RESULT "):])
    res["rss"] = rss
    return res


# --------------------------------------------------------------------------------------------
# The PyTorch peers (each runs in its own process: `--role trainer|eager|compile`)
# --------------------------------------------------------------------------------------------

def load_peer_inputs(a, checkpointing):
    """The transformers model from the checkpoint (fp32 master weights, sdpa attention) and the
    token ids of train.jsonl as one [records, seq] tensor (the sequence length is the data's, so
    that --torch-worker runs on whatever workload --work holds)."""
    import torch
    import transformers
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    impl = (a.role or "").partition("@")[2]  # a mixture of experts: the experts' implementation
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(a.work, "model"), attn_implementation="sdpa", dtype=torch.float32,
        **({"experts_implementation": impl} if impl else {}))
    model.config.use_cache = False
    if checkpointing:
        # non-reentrant: the variant torch recommends, and the one torch.compile traces.
        # (transformers 5 renamed gradient_checkpointing_enable; the old name warns.)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if a.lora:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=a.lora, lora_alpha=2 * a.lora, lora_dropout=0.0,
                                                           target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    ids = torch.tensor([json.loads(l)["input_ids"] for l in open(os.path.join(a.work, "train.jsonl"))])
    return model, ids


def fused_adamw_runs():
    """Whether torch.optim.AdamW(fused=True) steps on CPU tensors (torch >= 2.4 has the kernel)."""
    import torch
    try:
        p = torch.nn.Parameter(torch.zeros(8))
        p.grad = torch.ones(8)
        torch.optim.AdamW([p], lr=1e-3, fused=True).step()
        return True, None
    except Exception as e:  # RuntimeError on builds without the CPU kernel
        return False, "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")


def peak_vmhwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))


def trainer_peer(a):
    import torch
    import transformers
    model, ids = load_peer_inputs(a, checkpointing=False)  # TrainingArguments turns it on

    class Rows(torch.utils.data.Dataset):  # ready tensors: the data loader costs nothing
        def __len__(self):
            return ids.shape[0]

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}  # the model shifts the labels itself

    class StepTimes(transformers.TrainerCallback):
        # on_step_end to on_step_end: a whole optimizer step as the Trainer runs it, its data
        # fetch, clipping, scheduler and callbacks included; the first step from on_step_begin.
        def __init__(self):
            self.begin, self.ends = None, []

        def on_step_begin(self, args, state, control, **kw):
            if self.begin is None:
                self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    fused, why = fused_adamw_runs()
    optim = "adamw_torch_fused" if fused else "adamw_torch"
    kw = dict(output_dir=os.path.join(a.work, "trainer_out"), use_cpu=True, bf16=a.dtype == "bf16",
              optim=optim, per_device_train_batch_size=a.batch, max_steps=a.steps, learning_rate=1e-4,
              lr_scheduler_type="constant", weight_decay=0.01, max_grad_norm=1.0,
              dataloader_num_workers=0, dataloader_pin_memory=False, logging_strategy="no",
              save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, seed=0)
    fields = transformers.TrainingArguments.__dataclass_fields__
    # transformers 5 calls it activation checkpointing; gradient_checkpointing is its deprecated alias
    ckpt = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    kw[ckpt] = a.checkpointing
    if a.checkpointing:
        kw[ckpt + "_kwargs"] = {"use_reentrant": False}
    if "train_sampling_strategy" in fields:
        kw["train_sampling_strategy"] = "sequential"  # file order, as keel's shuffle = false
    # (Without it the Trainer samples the rows at random: other batches of the same random
    # tokens, the same shapes -- the same work for a speed benchmark.)
    args = transformers.TrainingArguments(**kw)
    timer = StepTimes()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(),
                                   data_collator=lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]},
                                   callbacks=[timer])
    trainer.train()
    times = [b - a_ for a_, b in zip([timer.begin] + timer.ends[:-1], timer.ends)]
    note = "optim %s" % optim + ("" if fused else " (fused AdamW did not run: %s)" % why)
    if "train_sampling_strategy" not in kw:
        note += "; rows in random order"
    return {"times": times, "vmhwm": peak_vmhwm(), "note": note,
            "settings": "%s%s, sdpa, %s%s" % ("PEFT LoRA r=%d, " % a.lora if a.lora else "",
                                              "bf16=True" if a.dtype == "bf16" else "fp32", optim,
                                              ", checkpointing" if a.checkpointing else "")}


def loop_peer(a, compiled):
    import torch
    import hf_models as hm
    model, ids = load_peer_inputs(a, a.checkpointing)
    # Trainer's weight-decay rule (no decay for biases and norm weights), as keel's
    no_decay = hm.no_decay_parameter_names(model)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # PEFT: the adapter
    groups = [{"params": [p for n, p in trained if n not in no_decay], "weight_decay": 0.01},
              {"params": [p for n, p in trained if n in no_decay], "weight_decay": 0.0}]
    fused, why = fused_adamw_runs()
    opt = torch.optim.AdamW(groups, lr=1e-4, **({"fused": True} if fused else {"foreach": True}))
    optim = "AdamW(fused=True)" if fused else "AdamW(foreach=True)"
    step_model = model
    if compiled:
        # The whole model, default mode (inductor, C++/OpenMP kernels on the CPU): what
        # `torch.compile(model)` gives a user. Forward and backward graphs compile in step 1.
        step_model = torch.compile(model)
    times = []
    for step in range(a.steps):
        batch = ids[step * a.batch:(step + 1) * a.batch]
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = step_model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in trained], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    note = optim + ("" if fused else " (fused did not run: %s)" % why)
    if compiled:
        note += "; step 1 (compilation) %.1f s" % times[0]
    return {"times": times, "vmhwm": peak_vmhwm(), "note": note,
            "settings": "%s%s, sdpa, %s%s%s" % ("PEFT LoRA r=%d, " % a.lora if a.lora else "",
                                                "bf16 autocast" if a.dtype == "bf16" else "fp32", optim,
                                              ", checkpointing" if a.checkpointing else "",
                                              ", inductor" if compiled else "")
                        + (", experts %s" % a.role.partition("@")[2] if "@" in (a.role or "") else "")}


class TorchtuneTokens:
    """torchtune's dataset component for the bench: train.jsonl's token ids in file order, labels
    the same ids (the recipe shifts them), as every other peer reads them."""

    def __init__(self, tokenizer, path):
        self.rows = [json.loads(line)["input_ids"] for line in open(path)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"tokens": self.rows[i], "labels": list(self.rows[i])}


class TorchtunePadOnly:
    """The recipe's tokenizer component: the data is token ids already, and every sequence has the
    same length, so only the collate's pad id is read."""
    pad_id = 0

    def __init__(self, max_seq_len):
        self.max_seq_len = max_seq_len


class TorchtuneStepClock:
    """torchtune's metric logger component: the time of each log call (one per optimizer step,
    log_every_n_steps = 1), from which the step times follow."""
    stamps = []

    def __init__(self, **_):
        pass

    def log_config(self, config):
        pass

    def log(self, name, data, step):
        pass

    def log_dict(self, payload, step):
        TorchtuneStepClock.stamps.append(time.perf_counter())

    def close(self):
        pass


def torchtune_peer(a):
    """torchtune's full_finetune_single_device recipe, run in this process on the CPU."""
    if a.lora or a.family != "llama":
        raise SystemExit("torchtune peer: Llama full fine-tuning only (not with --lora or --family %s)" % a.family)
    import torch
    from omegaconf import OmegaConf
    import importlib.util
    import torchtune
    # The recipes ship beside the package as scripts (`tune run` executes them; their package
    # refuses imports): load the recipe's file as a module of its own.
    path = os.path.join(os.path.dirname(os.path.dirname(torchtune.__file__)), "recipes",
                        "full_finetune_single_device.py")
    spec = importlib.util.spec_from_file_location("torchtune_full_finetune_single_device", path)
    recipe_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe_module)
    FullFinetuneRecipeSingleDevice = recipe_module.FullFinetuneRecipeSingleDevice
    torch.set_num_threads(a.threads)
    me = "train_vs_pytorch"  # this file, importable as a module: the bench directory is on sys.path
    out = os.path.join(a.work, "torchtune_out")
    cfg = OmegaConf.create({
        "output_dir": out,
        "model": {"_component_": "torchtune.models.llama2.llama2", "vocab_size": a.vocab, "num_layers": a.layers,
                  "num_heads": a.heads, "num_kv_heads": a.kv_heads or a.heads, "embed_dim": a.hidden,
                  "max_seq_len": a.seq, "intermediate_dim": a.intermediate},
        "tokenizer": {"_component_": me + ".TorchtunePadOnly", "max_seq_len": a.seq},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                         "checkpoint_dir": os.path.join(a.work, "model"), "checkpoint_files": ["model.safetensors"],
                         "output_dir": out, "model_type": "LLAMA2", "recipe_checkpoint": None},
        "resume_from_checkpoint": False,
        "dataset": {"_component_": me + ".TorchtuneTokens", "path": os.path.join(a.work, "train.jsonl")},
        "seed": 0, "shuffle": False, "batch_size": a.batch, "epochs": 1, "max_steps_per_epoch": a.steps,
        "gradient_accumulation_steps": 1,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4, "weight_decay": 0.01, "fused": True},
        "optimizer_in_bwd": False,
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "clip_grad_norm": 1.0, "compile": False, "device": "cpu", "dtype": a.dtype,
        "enable_activation_checkpointing": a.checkpointing, "enable_activation_offloading": False,
        "metric_logger": {"_component_": me + ".TorchtuneStepClock"},
        "log_every_n_steps": 1, "log_peak_memory_stats": False})
    import train_vs_pytorch as module  # the components' module (not __main__): its class holds the stamps
    recipe = FullFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    start = time.perf_counter()
    recipe.train()
    stamps = [start] + module.TorchtuneStepClock.stamps
    times = [t1 - t0 for t0, t1 in zip(stamps, stamps[1:])]
    vmhwm = peak_vmhwm()
    recipe.cleanup()
    return {"times": times, "vmhwm": vmhwm,
            "note": "torchtune %s; weight decay on every weight (torchtune's AdamW groups); the final "
                    "checkpoint save after the last step is in the peak RSS" % torchtune.__version__,
            "settings": "pure %s (torchtune), torchtune Llama-2 attention (sdpa), AdamW(fused=True), "
                        "chunked CE%s" % (a.dtype, ", checkpointing" if a.checkpointing else "")}


def torch_matmul_peak(dtype, size=2048, repeats=5):
    """torch's own best GEMM rate on the same square problem (its MKL / oneDNN, in this process's
    threads): keel's oneDNN 2.6 is not the fastest GEMM on every CPU (with AMX, torch's is ~2x),
    and MFU should divide by what the machine can do, not by what keel's library does. A product
    that takes over a second (bf16 without hardware support) is timed once, not `repeats` times."""
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t = torch.bfloat16 if dtype == "bf16" else torch.float32
    x, y = torch.ones(size, size, dtype=t), torch.ones(size, size, dtype=t)
    start = time.perf_counter()
    torch.matmul(x, y)
    best = time.perf_counter() - start
    for _ in range(repeats if best < 1.0 else 0):
        start = time.perf_counter()
        torch.matmul(x, y)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size ** 3 / best


def worker(a):
    if a.role == "workload":
        make_workload(a)
        res = python_versions()
        # --dtype's, fp32 (what auto compares it with) and a forced --torch-dtype's
        wanted = {a.dtype, "fp32"} | ({a.torch_dtype} - {"auto"})
        res["torch_matmul_peak"] = {d: torch_matmul_peak(d) for d in sorted(wanted)}
    elif a.role.startswith("trainer"):
        res = trainer_peer(a)
    elif a.role == "torchtune":
        res = torchtune_peer(a)
    else:
        res = loop_peer(a, compiled=a.role.startswith("compile"))
    print("RESULT " + json.dumps(res), flush=True)


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------

def main():
    a = parse_args()
    if a.role:
        worker(a)
        return
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    peers = [] if a.skip_torch else [p for p in a.peers.split(",") if p]
    unknown = set(peers) - set(PEERS)
    if unknown:
        sys.exit("unknown peer(s) %s; known: %s" % (", ".join(sorted(unknown)), ", ".join(PEERS)))
    peers = expand_moe_peers(a, peers)

    # The checkpoint and the versions come from a child, so that this process stays small (its
    # high-water mark is what every child's ru_maxrss starts from).
    code, out, _ = run_child([sys.executable, os.path.abspath(__file__)] + sys.argv[1:] + ["--role", "workload"],
                             env=peer_env(a))
    if code != 0:
        sys.exit("building the workload failed:\n" + out)
    versions = json.loads([l for l in out.splitlines() if l.startswith("RESULT ")][-1][len("RESULT "):])
    model_dir = os.path.join(a.work, "model")
    versions["keel"] = keel_version(a.keel)

    peak_tool = a.matmul_peak or os.path.join(os.path.dirname(os.path.abspath(a.keel)), "bench", "matmul_peak")
    peak = json.loads(subprocess.check_output([peak_tool], env=peer_env(a)))
    keel_peak = peak["bf16_flops"] if a.dtype == "bf16" else peak["f32_flops"]
    torch_peaks = versions.pop("torch_matmul_peak")
    if a.torch_dtype != "auto":
        a.torch_dtype_reason = "--torch-dtype %s" % a.torch_dtype
    elif a.dtype == "bf16" and torch_peaks["bf16"] < torch_peaks["fp32"]:
        a.torch_dtype = "fp32"
        a.torch_dtype_reason = ("torch's bf16 matmul on this CPU runs at %.1f GFLOP/s against %.1f in fp32: the "
                                "PyTorch peers run in fp32, their best here" % (torch_peaks["bf16"] / 1e9,
                                                                                torch_peaks["fp32"] / 1e9))
    else:
        a.torch_dtype = a.dtype
        a.torch_dtype_reason = ""
    torch_peak = torch_peaks[a.torch_dtype]
    peak_flops = max(keel_peak, torch_peak)  # the machine's best measured GEMM, whichever library ran it

    print("keel %s | torch %s | transformers %s | accelerate %s | peft %s | numpy %s | Python %s"
          % (versions["keel"], versions["torch"], versions["transformers"], versions["accelerate"], versions["peft"],
             versions["numpy"], versions["python"]))
    print("torch BLAS: %s | torch oneDNN (MKL-DNN): %s | torch CPU capability: %s | numpy BLAS: %s"
          % (versions["torch_blas"], versions["torch_onednn"], versions["torch_cpu_capability"],
             versions["numpy_blas"]))
    print("CPU: %s, %d cores (%d usable), %d threads per peer"
          % (cpu_model(), os.cpu_count(), len(os.sched_getaffinity(0)), a.threads))
    print("model: %s hidden %d, %d layers, %d heads, intermediate %d, vocab %d; seq %d x batch %d, %s, %d steps%s%s"
          % (a.family + (" (window %d)" % a.sliding_window if a.sliding_window else ""), a.hidden, a.layers, a.heads,
             a.intermediate, a.vocab, a.seq, a.batch, a.dtype, a.steps,
             (", gradient checkpointing" + (" (keel: the first %d blocks)" % a.checkpointing_layers
                                            if a.checkpointing_layers else "")) if a.checkpointing else "",
             "; LoRA rank %d, alpha %d, all linear layers (%.2fM adapter weights)" % (a.lora, 2 * a.lora,
                                                                                     lora_parameters(a) / 1e6)
             if a.lora else ""))
    if is_moe(a):
        print("experts: %d per layer of width %d, top-%d per token, %s; %.1fM matmul weights in all, "
              "%.1fM active per token (MFU counts the active ones)"
              % (a.experts, a.moe_intermediate, a.top_k, sparse_layers_text(a), total_parameters(a) / 1e6,
                 matmul_parameters(a) / 1e6))
    print("matmul peak (%s, %d^3): keel's oneDNN %.1f GFLOP/s, torch (%s) %.1f GFLOP/s; MFU divides by %.1f; "
          "%.3f GFLOP per token (%s, N = %.1fM); the causal column counts only the causal half of attention "
          "(%.3f GFLOP, 6LTd), what keel computes"
          % (a.dtype, peak["size"], keel_peak / 1e9, a.torch_dtype, torch_peak / 1e9, peak_flops / 1e9, flops_per_token(a) / 1e9,
             "4N + 6 x adapter + 12LTd" if a.lora else "6N + 12LTd", matmul_parameters(a) / 1e6,
             flops_per_token(a, causal=True) / 1e9))
    if a.torch_dtype_reason:
        print("torch peers in %s: %s" % (a.torch_dtype, a.torch_dtype_reason))
    sys.stdout.flush()

    # Every row once per round, in the same order, so that each ratio compares runs a few minutes
    # apart: on a shared machine the speed drifts by more than the differences measured, and a
    # ratio per round, its median over rounds, is steadier than one run of each.
    names = ["keel"] + (["keel_full"] if a.lora else []) + peers  # keel_full: what LoRA saves
    rounds = {name: [] for name in names}
    for i in range(a.rounds):
        if a.rounds > 1:
            print("round %d of %d" % (i + 1, a.rounds), flush=True)
        for name in names:
            if rounds[name] and "error" in rounds[name][-1]:
                continue  # a peer that failed once is not retried
            if name in ("keel", "keel_full"):
                rounds[name].append(run_keel(a, model_dir, a.lora if name == "keel" else 0))
            else:
                rounds[name].append(run_peer(a, name))

    def round_tps(r):  # step 1 warms up (and compiles, for torch.compile)
        return a.batch * a.seq / statistics.median(r["times"][1:] or r["times"])

    fpt = flops_per_token(a)
    rows = []
    results = {name: rs[-1] for name, rs in rounds.items()}  # for the failed peers' logs below
    for name, rs in rounds.items():
        r = rs[-1]
        row = {"peer": peer_name(name), "settings": r.get("settings", ""), "note": r.get("note", "")}
        if "error" in r:
            row.update(status=r["error"])
            rows.append(row)
            continue
        per_round = [round_tps(x) for x in rs]
        tps = statistics.median(per_round)
        ratios = [k / p for k, p in zip((round_tps(x) for x in rounds["keel"]), per_round)]
        row_fpt = flops_per_token(a, lora=0) if name == "keel_full" else fpt
        row.update(status="ok", tokens_per_s=round(tps, 2), step_time_s=round(a.batch * a.seq / tps, 4),
                   # the highest of the rounds, for the cross-check as for the peak
                   peak_rss_bytes=max(x["rss"] for x in rs), vmhwm_bytes=max((x.get("vmhwm") or 0) for x in rs) or None,
                   mfu=round(tps * row_fpt / peak_flops, 4),
                   mfu_causal=round(tps * flops_per_token(a, lora=0 if name == "keel_full" else None, causal=True)
                                    / peak_flops, 4),
                   keel_over_peer=round(statistics.median(ratios), 3),
                   step_times_s=[round(t, 4) for t in r["times"]])  # the last round's
        if a.rounds > 1:
            row.update(tokens_per_s_rounds=[round(t, 2) for t in per_round],
                       keel_over_peer_rounds=[round(q, 3) for q in ratios])
        rows.append(row)

    print()
    print("%-26s %10s %9s %9s %7s %7s %9s   %s" % ("peer", "tokens/s", "step s", "peak RSS", "MFU", "causal",
                                                  "keel/peer", "settings"))
    for row in rows:
        if row["status"] == "ok":
            print("%-26s %10.1f %9.3f %7.2f GB %6.1f%% %6.1f%% %8.2fx   %s" %
                  (row["peer"], row["tokens_per_s"], row["step_time_s"], row["peak_rss_bytes"] / 1e9,
                   100 * row["mfu"], 100 * row["mfu_causal"], row["keel_over_peer"], row["settings"]))
        else:
            print("%-26s %s" % (row["peer"], row["status"]))
    ran = [row for row in rows if row["status"] == "ok" and not row["peer"].startswith("keel")]
    if ran:
        best = max(ran, key=lambda row: row["tokens_per_s"])
        print("keel over the fastest PyTorch peer (%s): %.2fx" % (best["peer"], best["keel_over_peer"]))
    if a.rounds > 1:
        print("\nmedians over %d rounds; per round, tokens/s and keel/peer:" % a.rounds)
        for row in rows:
            if row["status"] == "ok":
                print("  %-26s %s   %s" % (row["peer"], " ".join("%.1f" % t for t in row["tokens_per_s_rounds"]),
                                         " ".join("%.2fx" % q for q in row["keel_over_peer_rounds"])))
    # What the LoRA/full ratio can reach: the step's product FLOPs alone (the causal column's counts),
    # as if everything that is not a product (norms, softmax, casts, the optimizer) took no time.
    # LoRA saves the frozen weights' gradient products, 2 of 6 FLOPs per weight, and nothing of
    # attention's: its bound is well under 1.5x wherever attention or the adapters are not tiny.
    lora_bound = flops_per_token(a, lora=0, causal=True) / flops_per_token(a, causal=True) if a.lora else None
    full = next((row for row in rows if row["peer"] == PEER_NAMES["keel_full"] and row["status"] == "ok"), None)
    if full:
        print("\nLoRA/full step ratio %.2fx; the products' FLOPs bound it at %.3fx (full %.3f GFLOP per token, "
              "LoRA %.3f)" % (full["keel_over_peer"], lora_bound, flops_per_token(a, lora=0, causal=True) / 1e9,
                              flops_per_token(a, causal=True) / 1e9))
    for row in rows:
        if row["note"]:
            print("  %s: %s" % (row["peer"], row["note"]))
    for name, r in results.items():
        if "log" in r:  # a failed peer: enough of its log to see why
            print("\n--- %s log (last 40 lines) ---\n%s" % (peer_name(name), "\n".join(r["log"].splitlines()[-40:])))
    print(json.dumps({
        "bench": "train_vs_pytorch", "date": time.strftime("%Y-%m-%d"),
        "model": {"family": a.family, "sliding_window": a.sliding_window, "hidden": a.hidden, "layers": a.layers,
                  "heads": a.heads, "kv_heads": a.kv_heads,
                  "intermediate": a.intermediate, "vocab": a.vocab, "seq": a.seq, "batch": a.batch},
        "dtype": a.dtype, "steps": a.steps, "rounds": a.rounds, "checkpointing": a.checkpointing,
        "keel_recomputed_blocks": rounds["keel"][-1].get("recomputed", 0) if rounds["keel"] else 0,
        "keel_zero_stage": 3 if a.zero3 and not a.lora else 0,
        "threads": a.threads, "lora_rank": a.lora,
        "cpu": cpu_model(), "versions": versions, "peak_flops": peak_flops, "keel_peak_flops": keel_peak,
        "torch_peak_flops": torch_peak, "torch_dtype": a.torch_dtype, "flops_per_token": fpt,
        "lora_full_flop_bound": round(lora_bound, 4) if lora_bound else None,
        "peers": rows}))


if __name__ == "__main__":
    main()
