#!/usr/bin/env python3
"""Reference test: keel's fine-tuning against the same training done in PyTorch.

    $(scripts/python-env.sh) tests/reference/train_reference.py --keel PATH_TO_KEEL \
        --family {llama,qwen2,qwen3,mistral,gemma2,gemma3,glm,glm_original} --dtype {fp32,bf16} --work WORKDIR

1. Writes a tiny random model of the family in its Hugging Face format to WORKDIR/model
   (config.json + model.safetensors, fp32), WORKDIR/train.jsonl (pre-tokenized records) and
   WORKDIR/recipe.toml.
2. Runs `KEEL train WORKDIR/recipe.toml`; keel must write WORKDIR/out/metrics.jsonl (one JSON
   object per optimizer step: step (1-based), loss, lr (the lr used by that step), grad_norm
   (pre-clip global L2 norm)) and WORKDIR/out/final/ (config.json + model.safetensors or a
   sharded model.safetensors.index.json, the same tensor names as the input, F32).
3. Trains the same model in PyTorch with Hugging Face Trainer semantics (see torch_train) and
   compares the per-step metrics and every final tensor. Exit 0 on success, 1 on any failure.
   Tolerances: see TOL below. Per tensor both the weights and the update (final - init) are
   compared; a bf16 run is compared with torch's fp32 run, within a factor of the distance
   torch's own bf16 autocast runs (sdpa and eager attention) land from it (BF16_GAP_FACTOR).
   With partial RoPE (glm, glm_original) the k-bias channels outside the rotary dims have a
   mathematically zero gradient whose round-off noise AdamW turns into arbitrary ~1e-5 moves;
   those elements are only checked to stay near their initial values (noise_gradient_masks).

--self-check runs no keel: it checks this script's own pieces (safetensors round trip, the
modules against an independent naive implementation, glm vs glm_original equivalence, gradient
accumulation, the LR schedule), then feeds the comparison with "fake keel" outputs (the torch
training redone in another precision, which must pass; deliberately broken outputs, which must
fail).

Only the standard library, torch and numpy are used.
"""
import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hf_models as hf  # noqa: E402

# ---- The recipe (written to recipe.toml and mirrored by torch_train) ------------------------
MAX_SEQ_LEN = 16
BATCH_SIZE = 2
GRAD_ACCUM = 2
LEARNING_RATE = 1e-3
WEIGHT_DECAY = 0.1
MAX_STEPS = 3
WARMUP_STEPS = 1
ADAM_BETA1 = 0.9
ADAM_BETA2 = 0.999
ADAM_EPS = 1e-8
MAX_GRAD_NORM = 0.5
SEED = 1234
MODEL_SEED = 0
PAD_ID = 0
IGNORE = -100

# ---- Tolerances ------------------------------------------------------------------------------
# Per final tensor two relative errors are checked: the weights, ||keel - torch|| / ||torch||,
# and the update, ||keel - torch|| / ||torch - init||. Weight decay and the clipping coefficient
# move weights by only ~1e-4 relative (too little for the weight tolerance to notice) but change
# the update by several percent.
# bf16: keel's bf16 run is measured against torch's **fp32** run (the training both approximate),
# each quantity within BF16_GAP_FACTOR x the distance torch's own bf16 autocast lands from that
# fp32 run, with no fixed floor: per final tensor (weights and update), and per metric the largest
# distance over the steps (one step's can be ~0 by chance). torch's bf16 is not one rounding:
# with sdpa and with eager attention (torch_bf16_runs) its distances differ per tensor by up to
# 3x (mistral's embedding) at a median of 1.0x, so torch's own gap is the larger of the two.
# keel rounds other intermediates than either, and lands at a median 0.9x of that gap.
# TOL["bf16"] is the older, looser rule (keel against torch bf16 at max(base, BF16_NOISE_FACTOR x
# the gap)), still used where keel's bf16-sized differences do not come from bf16 (QLoRA's double
# quantization in fp32, lora_reference.py).
TOL = {
    "fp32": {"loss": 1e-5, "lr": 1e-6, "grad_norm": 1e-5, "weights": 1e-5, "update": 1e-2},
    "bf16": {"loss": 2e-2, "lr": 1e-6, "grad_norm": 5e-2, "weights": 5e-2, "update": 0.2},
}
BF16_NOISE_FACTOR = 5.0
# fp32: a few tensors' updates come from near-zero gradients (the k bias in slowly rotating RoPE
# channels: what a key bias adds to a query's scores barely changes along a 16-token sequence) that
# Adam normalises to full-size steps, so torch's own fp32 lands more than 1e-5 from the same run in
# float64 (qwen2's k_proj.bias: 0.9e-5 and 1.1e-5 with the special ids in the data). Where twice
# that distance is more than 1e-5, keel is measured within FP32_GAP_FACTOR x torch's own fp32
# distance, as bf16 is against torch's bf16 distance.
FP32_GAP_FACTOR = 2.0
# Measured 2026-12-03, what keel needs against that gap over every bf16 reference run (8 families
# x full, LoRA, QLoRA, the reference backend, portable kernels; AVX-512 BF16 and, with KEEL_ISA=avx2
# ONEDNN_MAX_CPU_ISA=AVX2, the AVX2 paths): at most 1.80 (qwen2's q_proj, gemma2 whose only torch
# path is eager); torch's two runs themselves land up to 3.01x apart. (Against the sdpa run alone
# keel needed up to 2.67, and the factor was 4.) Measured again 2026-12-06 (AMD EPYC, AVX2) when
# the data began to hold the special ids (pad, BOS, EOS): 29 bf16 runs, keel needed at most 1.58
# but for one tensor, 2.28 (qlora.glm.bf16.fp4.prequantized, layer 1's k_proj.lora_B; the same
# run in fp32 lands 4e-8 from torch), so the factor is 2.5. Those are MODEL_SEED 0's. Over seeds
# 0-5 (2026-12-07, AVX-512 BF16) glm's full bf16 run needed 1.42-2.70x, seed 3 over 2.5, its worst
# tensor a q/k/v bias on every seed: keel's attention backward took softmax's D as dO . O, which in
# bf16 misses the row's own sum by ~2^-9 |D|, an error that lands on the k bias (the top of
# attention_blocked.cpp). With D the row's own sum: 1.12-1.77x over the same seeds, no bias the
# worst (torch's two runs land 1.73-5.45x apart), and every dense bf16 reference run at
# MODEL_SEED 0 needs at most 1.73 (lora.mistral.bf16).
# KEEL_BF16_GAP_FACTOR overrides it, to measure (a large value passes everything and prints what
# each run needs).
BF16_GAP_FACTOR = float(os.environ.get("KEEL_BF16_GAP_FACTOR", "2.5"))
# How far apart torch's two bf16 runs may land before the yardstick is not trusted (measured: 3.01).
TORCH_SPREAD_LIMIT = 10.0
LR_ABS_TOL_AT_ZERO = 1e-12
MIN_REL_CHANGE = 1e-4  # every tensor must move at least this much from its initial value

# ---- Data --------------------------------------------------------------------------------------
# 14 records; lengths 5..24 (longer ones are truncated to MAX_SEQ_LEN). `labels` kinds:
#   None: no "labels" key (labels = input_ids);  ("prompt", n): input_ids with the first n masked;
#   "other": different token ids (and a masked prefix);  "all": every label in the first
#   MAX_SEQ_LEN masked (a record with no target token);  "scattered": every third label masked;
#   ("both", a, b): first a and last b masked.
RECORD_SPECS = [
    (10, None), (20, ("prompt", 6)), (5, None), (24, None),
    (16, ("prompt", 8)), (7, "other"), (17, "all"), (12, None),
    (9, None), (15, "scattered"), (6, None), (22, ("both", 4, 3)),
    (11, None), (8, ("prompt", 2)),
]


def with_specials(ids, specials, k):
    """ids with every fifth token (from an offset that moves with the record) one of the model's
    special ids in turn: pad, BOS, EOS and end-of-turn stand where real data has them, in input and
    target positions, so that the way a model treats them (the pad row's gradient) is compared."""
    if not specials:
        return ids
    return [specials[(j // 5 + k) % len(specials)] if (j + k) % 5 == 0 else t for j, t in enumerate(ids)]


def make_records(vocab_size, specials=()):
    """specials: the model's special-token ids (hf_models.special_ids), placed in the records."""
    rng = random.Random(SEED)
    records = []
    for k, (length, kind) in enumerate(RECORD_SPECS):
        ids = with_specials([rng.randrange(1, vocab_size) for _ in range(length)], specials, k)
        rec = {"input_ids": ids}
        if kind is not None:
            if kind == "other":
                labels = with_specials([rng.randrange(1, vocab_size) for _ in range(length)], specials, k + 2)
                labels[:2] = [IGNORE] * 2
            elif kind == "all":
                labels = [IGNORE] * MAX_SEQ_LEN + ids[MAX_SEQ_LEN:]
            elif kind == "scattered":
                labels = [IGNORE if i % 3 == 1 else t for i, t in enumerate(ids)]
            elif kind[0] == "prompt":
                labels = [IGNORE] * kind[1] + ids[kind[1]:]
            elif kind[0] == "both":
                labels = [IGNORE] * kind[1] + ids[kind[1]:length - kind[2]] + [IGNORE] * kind[2]
            assert len(labels) == length
            rec["labels"] = labels
        records.append(rec)
    return records


def padding_id(spec):
    """The id keel pads rows with (train/data_sources.h, model_pad_id): the model's pad_token_id
    where it is in the vocabulary, else 0."""
    pad = spec.pad_token_id
    return pad if pad is not None and 0 <= pad < spec.vocab_size else PAD_ID


def micro_batches(records, pad_id=PAD_ID):
    """In file order: micro-batch k = records [k*B, (k+1)*B), truncated to MAX_SEQ_LEN,
    input_ids right-padded with pad_id (keel pads with the model's pad_token_id: padding_id) and
    labels with -100."""
    out = []
    for k in range(len(records) // BATCH_SIZE):
        ids_rows, lab_rows = [], []
        for rec in records[k * BATCH_SIZE:(k + 1) * BATCH_SIZE]:
            ids = rec["input_ids"][:MAX_SEQ_LEN]
            labels = list(rec.get("labels", rec["input_ids"]))[:MAX_SEQ_LEN]
            pad = MAX_SEQ_LEN - len(ids)
            ids_rows.append(ids + [pad_id] * pad)
            lab_rows.append(labels + [IGNORE] * pad)
        out.append((torch.tensor(ids_rows, dtype=torch.long), torch.tensor(lab_rows, dtype=torch.long)))
    return out


# ---- Inputs for keel ---------------------------------------------------------------------------

def toml_str(s):
    return json.dumps(s)  # a TOML basic string for ordinary paths


def write_inputs(work, family, dtype, backend="cpu", config_overrides=None):
    """Writes WORKDIR/model, train.jsonl and recipe.toml; returns (config, spec, init tensors,
    records). config_overrides: make_config arguments (sizes) other than the defaults."""
    model_dir = os.path.join(work, "model")
    out_dir = os.path.join(work, "out")
    for d in (model_dir, out_dir):
        if os.path.isdir(d):
            shutil.rmtree(d)
    os.makedirs(work, exist_ok=True)

    cfg = hf.make_config(family, **(config_overrides or {}))
    spec = hf.spec_from_config(cfg)
    model = hf.random_init(hf.build_model(spec), MODEL_SEED,
                           embed_std=0.1 if spec.tie_word_embeddings else 0.5)
    init = hf.model_tensors(model)
    # The newer families' checkpoints are sharded (model.safetensors.index.json), the others one file.
    hf.save_checkpoint(model_dir, cfg, init, shards=2 if family in ("qwen3", "mistral", "gemma2", "gemma3") else 1)

    records = make_records(spec.vocab_size, hf.special_ids(cfg))
    data_path = os.path.join(work, "train.jsonl")
    with open(data_path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")

    recipe = "\n".join([
        "# keel reference test recipe (written by tests/reference/train_reference.py)",
        "model_name = %s" % toml_str(model_dir),
        "dtype = %s" % toml_str(dtype),
        "data_path = %s" % toml_str(data_path),
        "max_seq_len = %d" % MAX_SEQ_LEN,
        "batch_size = %d" % BATCH_SIZE,
        "gradient_accumulation_steps = %d" % GRAD_ACCUM,
        "learning_rate = %r" % LEARNING_RATE,
        "weight_decay = %r" % WEIGHT_DECAY,
        "max_steps = %d" % MAX_STEPS,
        "warmup_steps = %d" % WARMUP_STEPS,
        'lr_scheduler = "cosine"',
        "adam_beta1 = %r" % ADAM_BETA1,
        "adam_beta2 = %r" % ADAM_BETA2,
        "adam_epsilon = %r" % ADAM_EPS,
        "max_grad_norm = %r" % MAX_GRAD_NORM,
        "seed = %d" % SEED,
        "shuffle = false",
        "output_dir = %s" % toml_str(out_dir),
        "backend = %s" % toml_str(backend),
        "",
    ])
    with open(os.path.join(work, "recipe.toml"), "w") as f:
        f.write(recipe)
    return cfg, spec, init, records


# ---- The PyTorch training -------------------------------------------------------------------

def lr_lambda(current_step):
    """transformers.get_cosine_schedule_with_warmup (num_cycles 0.5)."""
    if current_step < WARMUP_STEPS:
        return float(current_step) / float(max(1, WARMUP_STEPS))
    progress = float(current_step - WARMUP_STEPS) / float(max(1, MAX_STEPS - WARMUP_STEPS))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def torch_train(spec, init, records, mode, variant=None, make_model=None, final_tensors=None):
    """Hugging Face Trainer semantics. mode: "fp32", "bf16" (autocast bf16 forward, fp32 master
    weights, loss in fp32), "fp64" (everything in double) or "bf16emu" (emulated bf16 GEMMs);
    the last two serve --self-check as stand-ins for keel.
    variant (--self-check only: plausible keel bugs the comparison must catch): "no_clip",
    "decay_all" (weight decay on biases and norms too), "no_decay_embed" (none on embedding and
    LM head), "mean_per_micro" (each micro-batch averaged over its own tokens, then / GA),
    "pad_row_trained" (the embedding built without padding_idx: the pad row's lookups train it).

    make_model (optional): builds the model to train instead (a PeftModel: only the parameters that
    require gradients train); final_tensors(model) then gives the "final" tensors.

    Returns {"steps": [{step, loss, lr, grad_norm, clipped, tokens}], "final": {name: fp32}}."""
    pdtype = torch.float64 if mode == "fp64" else torch.float32
    if variant == "pad_row_trained":
        import dataclasses
        make_model = make_model or (lambda: hf.build_model(dataclasses.replace(spec, pad_token_id=None), init))
    model = (make_model() if make_model else hf.build_model(spec, init)).to(pdtype)
    if mode == "bf16emu":
        emulate_bf16_gemms(model)
    no_decay = hf.no_decay_parameter_names(model)
    if variant == "decay_all":
        no_decay = set()
    elif variant == "no_decay_embed":
        no_decay |= {n for n, _ in model.named_parameters()
                     if any(k in n for k in ("embed", "lm_head", "output_layer"))}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n not in no_decay], "weight_decay": WEIGHT_DECAY},
        {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LEARNING_RATE, betas=(ADAM_BETA1, ADAM_BETA2), eps=ADAM_EPS)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    mbs = micro_batches(records, padding_id(spec))
    if len(mbs) < MAX_STEPS * GRAD_ACCUM:
        raise RuntimeError("not enough data for %d steps" % MAX_STEPS)
    steps = []
    for step in range(MAX_STEPS):
        batch = mbs[step * GRAD_ACCUM:(step + 1) * GRAD_ACCUM]
        n_tokens = sum(int((lab[:, 1:] != IGNORE).sum()) for _, lab in batch)
        assert n_tokens > 0
        opt.zero_grad(set_to_none=True)
        loss_total = 0.0
        for ids, labels in batch:
            if mode == "bf16":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = hf.logits(model, ids)
            else:
                logits = hf.logits(model, ids)
            loss_sum, n_micro = hf.causal_lm_loss_sum(logits.to(pdtype), labels)
            if variant == "mean_per_micro":
                loss = loss_sum / max(1, n_micro) / GRAD_ACCUM
                loss.backward()
                loss_total += float(loss) * n_tokens
                continue
            (loss_sum / n_tokens).backward()
            loss_total += float(loss_sum)
        lr = opt.param_groups[0]["lr"]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(
            [p for _, p in named], float("inf") if variant == "no_clip" else MAX_GRAD_NORM))
        opt.step()
        sched.step()
        steps.append({"step": step + 1, "loss": loss_total / n_tokens, "lr": lr,
                      "grad_norm": grad_norm, "clipped": grad_norm > MAX_GRAD_NORM,
                      "tokens": n_tokens})
    return {"steps": steps, "final": final_tensors(model) if final_tensors else hf.model_tensors(model)}


def emulate_bf16_gemms(model):
    """--self-check's stand-in for another bf16 implementation (like keel's): every nn.Linear
    rounds its input and weight to bf16 and accumulates in fp32 with an fp32 output; the
    backward pass rounds the incoming gradient to bf16 (the cast's backward). Attention matmuls,
    norms and the tied LM head stay fp32."""
    def bf16_linear(mod):
        def forward(x):
            return F.linear(x.to(torch.bfloat16).float(), mod.weight.to(torch.bfloat16).float(), mod.bias)
        return forward
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.forward = bf16_linear(mod)


def noise_gradient_masks(spec):
    """Elements whose gradient is mathematically zero but numerically round-off noise: with
    partial rotary, the k bias in the non-rotary channels adds q_pass . b_pass to every score of
    a query, which softmax ignores. AdamW (no weight decay on biases) turns that noise into
    implementation-dependent updates of up to ~lr, so these elements are only checked to stay
    within a noise bound. Returns {tensor name: bool mask}."""
    masks = {}
    if not spec.qkv_bias or spec.rotary_dim >= spec.head_dim:
        return masks
    nh, kv, hd, rot = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rotary_dim
    for i in range(spec.num_layers):
        if spec.family == "glm_original":
            name = "transformer.encoder.layers.%d.self_attention.query_key_value.bias" % i
            mask = torch.zeros((nh + 2 * kv) * hd, dtype=torch.bool)
            base = nh * hd
        else:
            name = "model.layers.%d.self_attn.k_proj.bias" % i
            mask = torch.zeros(kv * hd, dtype=torch.bool)
            base = 0
        for g in range(kv):
            mask[base + g * hd + rot: base + (g + 1) * hd] = True
        masks[name] = mask
    return masks


# ---- Running keel and reading its outputs -----------------------------------------------------

def tail(text, n=40):
    lines = (text or "").rstrip("\n").splitlines()
    return "\n".join(lines[-n:])


def run_keel(keel, work, timeout, keel_env=()):
    recipe = os.path.join(work, "recipe.toml")
    cmd = [keel, "train", recipe]
    print("$ " + " ".join(list(keel_env) + cmd), flush=True)
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in keel_env))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        print("keel stdout (tail):\n" + tail(e.stdout if isinstance(e.stdout, str) else ""))
        print("keel stderr (tail):\n" + tail(e.stderr if isinstance(e.stderr, str) else ""))
        return ["keel train did not finish within %d s" % timeout]
    except OSError as e:
        return ["could not run keel (%s): %s" % (keel, e)]
    dt = time.time() - t0
    with open(os.path.join(work, "keel.log"), "w") as f:  # for checks of what keel said
        f.write((proc.stdout or "") + (proc.stderr or ""))
    if proc.returncode != 0:
        print("keel stdout:\n" + (proc.stdout or ""))
        print("keel stderr:\n" + (proc.stderr or ""))
        return ["keel train exited with status %d" % proc.returncode]
    print("keel train finished in %.1f s; output (tail):" % dt)
    out = tail(proc.stdout, 25)
    err = tail(proc.stderr, 25)
    if out:
        print("  [stdout]\n" + "\n".join("  " + l for l in out.splitlines()))
    if err:
        print("  [stderr]\n" + "\n".join("  " + l for l in err.splitlines()))
    return []


def read_metrics(path, failures):
    """{step: record} from metrics.jsonl (lines without a "step" key are ignored)."""
    by_step = {}
    if not os.path.exists(path):
        failures.append("missing %s" % path)
        return by_step
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                failures.append("%s:%d: not JSON (%s)" % (path, lineno, e))
                continue
            if not isinstance(obj, dict) or "step" not in obj:
                continue
            step = obj["step"]
            if not isinstance(step, int) or isinstance(step, bool):
                failures.append("%s:%d: 'step' is not an integer: %r" % (path, lineno, step))
                continue
            if step in by_step:
                failures.append("%s:%d: step %d appears twice" % (path, lineno, step))
            by_step[step] = obj
    return by_step


def read_keel_outputs(out_dir, failures):
    metrics = read_metrics(os.path.join(out_dir, "metrics.jsonl"), failures)
    final_dir = os.path.join(out_dir, "final")
    config, tensors = None, None
    cfg_path = os.path.join(final_dir, "config.json")
    if not os.path.exists(cfg_path):
        failures.append("missing %s" % cfg_path)
    else:
        try:
            with open(cfg_path) as f:
                config = json.load(f)
        except ValueError as e:
            failures.append("%s: not JSON (%s)" % (cfg_path, e))
    try:
        tensors = hf.load_checkpoint(final_dir)
    except Exception as e:  # noqa: BLE001 - report whatever went wrong reading keel's output
        failures.append("cannot read the weights in %s: %s" % (final_dir, e))
    return metrics, config, tensors


# ---- Comparison ---------------------------------------------------------------------------------

def rel_diff(a, b):
    if b == 0:
        return abs(a - b)
    return abs(a - b) / abs(b)


def num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def weight_errors(a, b, w0, keep):
    """(||a - b|| / ||b||, ||a - b|| / ||b - w0||) over the elements `keep` (float64)."""
    d = (a - b)[keep].norm()
    return (float(d / b[keep].norm().clamp_min(1e-30)),
            float(d / (b - w0)[keep].norm().clamp_min(1e-30)))


def tensor_tolerances(spec, dtype, init, ref, ref_fp32=None, ref_fp64=None):
    """{name: (weight tol, update tol)}; see the Tolerances comment. fp32 with ref_fp64 (the same
    training in float64): a tensor on which FP32_GAP_FACTOR x torch's own fp32 distance from float64
    is more than the base tolerance gets that instead."""
    base = (TOL[dtype]["weights"], TOL[dtype]["update"])
    tol = {}
    masks = noise_gradient_masks(spec)
    for name, b in ref["final"].items():
        if dtype != "bf16":
            tol[name] = base
            if ref_fp64 is not None:
                keep = ~masks[name] if name in masks else torch.ones_like(b, dtype=torch.bool)
                e, u = weight_errors(b.double(), ref_fp64["final"][name].double(), init[name].double(), keep)
                if FP32_GAP_FACTOR * e > base[0]:
                    tol[name] = (FP32_GAP_FACTOR * e, max(base[1], FP32_GAP_FACTOR * u))
                    print("  %s: torch fp32 lands %.2e from float64: tolerance %.2e" % (name, e, tol[name][0]))
            continue
        b = b.double()
        keep = ~masks[name] if name in masks else torch.ones_like(b, dtype=torch.bool)
        e, u = weight_errors(ref_fp32["final"][name].double(), b, init[name].double(), keep)
        tol[name] = (max(base[0], BF16_NOISE_FACTOR * e), max(base[1], BF16_NOISE_FACTOR * u))
    return tol


def torch_bf16_runs(spec, train, sdpa=None):
    """torch's own bf16 autocast runs, {attention: run}: train() with transformers' default sdpa
    attention and with its eager attention (Gemma 2 runs eagerly either way: one run). Both are
    torch's bf16 and round different intermediates, so neither's distance from fp32 alone is
    torch's bf16 gap: measured here, eager lands up to 3x sdpa's distance on one tensor (mistral's
    embedding) and 2.8x on one step's loss (qwen2), at a median of 1.0x. `sdpa`: that run, if
    the caller has it already."""
    runs = {"sdpa": sdpa if sdpa is not None else train()}
    if hf.transformers_family(spec) != "gemma2":
        with hf.attention_implementation("eager"):
            runs["eager"] = train()
    return runs


def bf16_yardstick(spec, init, bf16_runs, fp32):
    """torch's fp32 run as the reference for a bf16 run, with tolerances of BF16_GAP_FACTOR x
    torch bf16's own distance from it (see TOL): per quantity the larger distance of torch's bf16
    runs (torch_bf16_runs), kept for the report with how far apart those runs' distances are."""
    masks = noise_gradient_masks(spec)
    out = dict(fp32)
    out["gap"], out["tol"], spread = {}, {}, []
    for name, f in fp32["final"].items():
        f = f.double()
        keep = ~masks[name] if name in masks else torch.ones_like(f, dtype=torch.bool)
        dist = [weight_errors(run["final"][name].double(), f, init[name].double(), keep)
                for run in bf16_runs.values()]
        e, u = max(d[0] for d in dist), max(d[1] for d in dist)
        spread += [(max(d[i] for d in dist) / max(min(d[i] for d in dist), 1e-30), name) for i in (0, 1)]
        out["gap"][name] = (e, u)
        out["tol"][name] = (BF16_GAP_FACTOR * e, BF16_GAP_FACTOR * u)
    out["step_gap"] = {key: max(rel_diff(b[key], f[key]) for run in bf16_runs.values()
                                for b, f in zip(run["steps"], fp32["steps"]))
                       for key in ("loss", "grad_norm")}
    out["step_tol"] = {key: BF16_GAP_FACTOR * g for key, g in out["step_gap"].items()}
    out["torch_spread"] = (max(spread), "/".join(bf16_runs)) if len(bf16_runs) > 1 else None
    return out


def reference(spec, init, records, dtype):
    """The torch reference run for `dtype` with per-tensor tolerances attached: for bf16, torch's
    fp32 run with tolerances sized by torch's own bf16 runs (bf16_yardstick)."""
    if dtype != "bf16":
        ref = torch_train(spec, init, records, dtype)
        ref["tol"] = tensor_tolerances(spec, dtype, init, ref, ref_fp64=torch_train(spec, init, records, "fp64"))
        return ref
    runs = torch_bf16_runs(spec, lambda: torch_train(spec, init, records, "bf16"))
    return bf16_yardstick(spec, init, runs, torch_train(spec, init, records, "fp32"))


def compare(spec, dtype, input_config, init, ref, metrics, config, tensors, verbose=True):
    """Returns the list of failures (empty: pass); prints tables when verbose."""
    tol = dict(TOL[dtype], **ref.get("step_tol", {}))
    failures = []
    say = print if verbose else (lambda *a, **k: None)
    needs = []  # (keel's distance / torch bf16's, what): the factor keel needs against fp32

    # -- per-step metrics
    say("\nPer-step metrics (keel vs torch%s, %s):" % (" fp32" if "step_tol" in ref else "", dtype))
    say("%4s | %12s %12s %9s | %11s %11s %9s | %11s %11s %9s | %s"
        % ("step", "loss keel", "loss torch", "rel", "lr keel", "lr torch", "rel",
           "gnorm keel", "gnorm torch", "rel", "clipped (torch)"))
    expected_steps = [s["step"] for s in ref["steps"]]
    extra = sorted(set(metrics) - set(expected_steps))
    if extra:
        failures.append("metrics.jsonl has steps beyond max_steps=%d: %s" % (MAX_STEPS, extra))
    for r in ref["steps"]:
        k = metrics.get(r["step"])
        if k is None:
            failures.append("metrics.jsonl: no record for step %d" % r["step"])
            say("%4d | missing" % r["step"])
            continue
        cells = []
        for key in ("loss", "lr", "grad_norm"):
            v = k.get(key)
            if not num(v) or not math.isfinite(v):
                failures.append("metrics.jsonl step %d: %r is %r (expected a finite number)"
                                % (r["step"], key, v))
                cells.append((float("nan"), r[key], float("nan"), "!!"))
                continue
            if key == "lr" and r[key] == 0:
                ok = abs(v) <= LR_ABS_TOL_AT_ZERO
                d = abs(v)
            else:
                d = rel_diff(v, r[key])
                ok = d <= tol[key]
                if key in ref.get("step_gap", {}):
                    needs.append((d / max(ref["step_gap"][key], 1e-30), "step %d %s" % (r["step"], key)))
            if not ok:
                failures.append("step %d %s: keel %.9g vs torch %.9g (%s %.3g > %.3g)"
                                % (r["step"], key, v, r[key],
                                   "abs" if key == "lr" and r[key] == 0 else "rel",
                                   d, LR_ABS_TOL_AT_ZERO if key == "lr" and r[key] == 0 else tol[key]))
            cells.append((v, r[key], d, "  " if ok else "!!"))
        (lk, lt, ld, lf), (rk, rt, rd, rf), (gk, gt, gd, gf) = cells
        say("%4d | %12.7f %12.7f %8.2e%s| %11.4e %11.4e %8.1e%s| %11.6f %11.6f %8.1e%s| %s (norm %.4f vs max %.2f)"
            % (r["step"], lk, lt, ld, lf[0], rk, rt, rd, rf[0], gk, gt, gd, gf[0],
               "yes" if r["clipped"] else "no", r["grad_norm"], MAX_GRAD_NORM))
    say("tolerances: loss rel %.0e, lr rel %.0e (abs %.0e at 0), grad_norm rel %.0e"
        % (tol["loss"], tol["lr"], LR_ABS_TOL_AT_ZERO, tol["grad_norm"]))

    # -- config.json
    if config is not None:
        for key, val in input_config.items():
            if key == "torch_dtype":
                continue
            if key not in config:
                failures.append("final/config.json lacks key %r" % key)
            elif config[key] != val:
                failures.append("final/config.json %r = %r, input had %r" % (key, config[key], val))
        if config.get("torch_dtype") != "float32":
            failures.append("final/config.json torch_dtype = %r, expected 'float32' (fp32 input)"
                            % config.get("torch_dtype"))

    # -- tensors
    if tensors is not None:
        ref_final = ref["final"]
        missing = sorted(set(ref_final) - set(tensors))
        unexpected = sorted(set(tensors) - set(ref_final))
        if missing:
            failures.append("final weights lack tensors: %s" % ", ".join(missing))
        if unexpected:
            failures.append("final weights have unexpected tensors: %s" % ", ".join(unexpected))
        masks = noise_gradient_masks(spec)
        noise_bound = 3.0 * sum(s["lr"] for s in ref["steps"]) + 1e-6
        say("\nFinal tensors (rel err = ||keel - torch|| / ||torch||; upd err = ||keel - torch|| / "
            "||torch - init||; change = ||x - init|| / ||init||):")
        width = max(len(n) for n in ref_final)
        say("%-*s %-12s %17s %17s %11s %11s" % (width, "tensor", "shape", "rel err/tol", "upd err/tol",
                                                 "chg keel", "chg torch"))
        worst = worst_u = 0.0
        for name in sorted(ref_final):
            if name not in tensors:
                continue
            a = tensors[name]
            b = ref_final[name]
            w0 = init[name]
            notes = []
            bad = False
            if a.dtype != torch.float32:
                failures.append("tensor %s: dtype %s, expected F32" % (name, a.dtype))
                bad = True
            if tuple(a.shape) != tuple(b.shape):
                failures.append("tensor %s: shape %s, expected %s" % (name, tuple(a.shape), tuple(b.shape)))
                say("%-*s %-12s shape mismatch (keel %s)" % (width, name, "x".join(map(str, b.shape)),
                                                              tuple(a.shape)))
                continue
            a = a.to(torch.float64)
            b = b.to(torch.float64)
            w0 = w0.to(torch.float64)
            if not torch.isfinite(a).all():
                failures.append("tensor %s: non-finite values" % name)
                say("%-*s non-finite values" % (width, name))
                continue
            keep = ~masks[name] if name in masks else torch.ones_like(a, dtype=torch.bool)
            err, uerr = weight_errors(a, b, w0, keep)
            tol_w, tol_u = ref["tol"][name]
            if name in ref.get("gap", {}):
                e, u = ref["gap"][name]
                needs += [(err / max(e, 1e-30), name + " weights"), (uerr / max(u, 1e-30), name + " update")]
            ch_k = float((a - w0).norm() / w0.norm().clamp_min(1e-30))
            ch_t = float((b - w0).norm() / w0.norm().clamp_min(1e-30))
            worst = max(worst, err)
            worst_u = max(worst_u, uerr)
            if err > tol_w:
                failures.append("tensor %s: rel err %.3g > %.2g" % (name, err, tol_w))
                bad = True
            if uerr > tol_u:
                failures.append("tensor %s: update rel err %.3g > %.2g (the training moved it differently)"
                                % (name, uerr, tol_u))
                bad = True
            if ch_k <= MIN_REL_CHANGE:
                failures.append("tensor %s: keel's final value did not change from the initial one "
                                "(rel change %.3g <= %.0e)" % (name, ch_k, MIN_REL_CHANGE))
                bad = True
            if ch_t <= MIN_REL_CHANGE:
                failures.append("tensor %s: the torch reference did not change it (rel change %.3g); "
                                "the test setup is too weak" % (name, ch_t))
                bad = True
            if name in masks:
                m = masks[name]
                dev = float((a - w0)[m].abs().max())
                notes.append("excludes %d noise-gradient elems: max|keel-init| %.1e (bound %.1e), "
                             "max|keel-torch| %.1e; whole-tensor rel err %.1e"
                             % (int(m.sum()), dev, noise_bound, float((a - b)[m].abs().max()),
                                float((a - b).norm() / b.norm())))
                if dev > noise_bound:
                    failures.append("tensor %s: elements with zero true gradient moved by %.3g > %.3g"
                                    % (name, dev, noise_bound))
                    bad = True
            say("%-*s %-12s %9.2e/%-7.1e %9.2e/%-7.1e %11.2e %11.2e  %s%s"
                % (width, name, "x".join(map(str, b.shape)), err, tol_w, uerr, tol_u, ch_k, ch_t,
                   "FAIL " if bad else "ok ", "; ".join(notes)))
        say("worst rel err %.3g; worst update rel err %.3g" % (worst, worst_u))
    if needs:
        factor, what = max(needs)
        say("bf16 against torch fp32: keel needs %.2f x torch bf16's own distance (%s; allowed %.1f)"
            % (factor, what, BF16_GAP_FACTOR))
        if ref.get("torch_spread"):
            (apart, tensor), runs = ref["torch_spread"]
            say("  (torch's own bf16 runs, %s attention, land up to %.2f x apart in their distance: %s)"
                % (runs, apart, tensor))
            # The yardstick is the farther of the two runs: it must not widen unnoticed. Identical
            # runs mean the eager switch did nothing; runs 10x apart (3x measured) mean one path broke.
            if apart <= 1.0:
                failures.append("torch's %s bf16 runs are identical: the attention switch had no effect" % runs)
            elif apart > TORCH_SPREAD_LIMIT:
                failures.append("torch's own %s bf16 runs land %.1f x apart on %s (> %.0f): the yardstick is "
                                "not torch's bf16 gap" % (runs, apart, tensor, TORCH_SPREAD_LIMIT))
    return failures


# ---- Self-check ----------------------------------------------------------------------------------

class SelfCheckError(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise SelfCheckError(msg)
    print("  ok: " + msg)


def selfcheck_safetensors(work):
    d = os.path.join(work, "st_roundtrip")
    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    ts = {
        "a.f32": torch.randn(3, 5, generator=g),
        "b.bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.f16": torch.randn(2, 3, 4, generator=g).to(torch.float16),
        "d.scalar": torch.tensor(3.25),
        "e.empty": torch.zeros(0, 4),
        "f.i64": torch.arange(5),
    }
    p = os.path.join(d, "x.safetensors")
    hf.save_safetensors(p, ts, {"format": "pt"})
    with open(p, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    check(n % 8 == 0 and raw[8 + n - 1:8 + n] in (b" ", b"}"), "safetensors header padded to 8 bytes (%d)" % n)
    check(header["__metadata__"] == {"format": "pt"}, "safetensors __metadata__ written")
    check(header["b.bf16"]["dtype"] == "BF16" and header["a.f32"]["shape"] == [3, 5],
          "safetensors header dtype/shape fields")
    # raw little-endian bytes of an F32 tensor, decoded independently
    b, e = header["a.f32"]["data_offsets"]
    import struct
    vals = struct.unpack("<15f", raw[8 + n + b:8 + n + e])
    check(torch.equal(torch.tensor(vals).view(3, 5), ts["a.f32"]), "F32 data is raw little-endian")
    b, e = header["b.bf16"]["data_offsets"]
    bits = struct.unpack("<7H", raw[8 + n + b:8 + n + e])
    dec = torch.tensor([struct.unpack("<f", struct.pack("<I", x << 16))[0] for x in bits])
    check(torch.equal(dec, ts["b.bf16"].float()), "BF16 data is the upper half of fp32, little-endian")
    back, meta = hf.load_safetensors(p, with_metadata=True)
    check(set(back) == set(ts) and all(back[k].dtype == ts[k].dtype and torch.equal(back[k], ts[k]) for k in ts)
          and meta == {"format": "pt"}, "safetensors round trip (F32, BF16, F16, scalar, empty, I64)")
    # sharded
    sd = os.path.join(d, "sharded")
    fl = {k: v for k, v in ts.items() if v.is_floating_point()}
    hf.save_checkpoint(sd, {"x": 1}, fl, shards=3)
    back = hf.load_checkpoint(sd)
    check(set(back) == set(fl) and all(torch.equal(back[k], fl[k]) for k in fl), "sharded checkpoint round trip")
    # a corrupt header is rejected
    bad = os.path.join(d, "bad.safetensors")
    hdr = json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    hdr += b" " * ((8 - len(hdr) % 8) % 8)
    with open(bad, "wb") as f:
        f.write(len(hdr).to_bytes(8, "little") + hdr + b"\0" * 12)
    try:
        hf.load_safetensors(bad)
        rejected = False
    except ValueError:
        rejected = True
    check(rejected, "safetensors reader rejects a size/shape mismatch")


def naive_layer(spec, t, i):
    """The layer's weights as plain split matrices, read directly from the family's names."""
    nh, kv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if spec.family == "glm_original":
        p = "transformer.encoder.layers.%d." % i
        qkv = t[p + "self_attention.query_key_value.weight"]
        qkv_b = t.get(p + "self_attention.query_key_value.bias")
        q0, k0, v0 = 0, nh * hd, nh * hd + kv * hd
        h4 = t[p + "mlp.dense_h_to_4h.weight"]
        inter = spec.intermediate_size
        return dict(
            in_norm=t[p + "input_layernorm.weight"], post_norm=t[p + "post_attention_layernorm.weight"],
            wq=qkv[q0:k0], wk=qkv[k0:v0], wv=qkv[v0:],
            bq=qkv_b[q0:k0] if qkv_b is not None else None,
            bk=qkv_b[k0:v0] if qkv_b is not None else None,
            bv=qkv_b[v0:] if qkv_b is not None else None,
            wo=t[p + "self_attention.dense.weight"],
            wg=h4[:inter], wu=h4[inter:], wd=t[p + "mlp.dense_4h_to_h.weight"])
    p = "model.layers.%d." % i
    d = dict(in_norm=t[p + "input_layernorm.weight"], post_norm=t[p + "post_attention_layernorm.weight"],
             wq=t[p + "self_attn.q_proj.weight"], wk=t[p + "self_attn.k_proj.weight"],
             wv=t[p + "self_attn.v_proj.weight"], bq=t.get(p + "self_attn.q_proj.bias"),
             bk=t.get(p + "self_attn.k_proj.bias"), bv=t.get(p + "self_attn.v_proj.bias"),
             wo=t[p + "self_attn.o_proj.weight"], wd=t[p + "mlp.down_proj.weight"])
    if spec.family == "glm":
        gu = t[p + "mlp.gate_up_proj.weight"]
        d["wg"], d["wu"] = gu[:spec.intermediate_size], gu[spec.intermediate_size:]
    else:
        d["wg"], d["wu"] = t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]
    return d


def naive_logits(spec, tensors, ids, interleaved=None, rotary_dim=None):
    """Straightforward float64 re-implementation, one sequence at a time, written from the
    formulas: rotation as complex multiplication of channel pairs, per-head per-query loops
    for attention with GQA by index arithmetic. [T, V]."""
    interleaved = spec.rope_interleaved if interleaved is None else interleaved
    rot = spec.rotary_dim if rotary_dim is None else rotary_dim
    t = {k: v.double() for k, v in tensors.items()}
    nh, kv, hd, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps
    if spec.family == "glm_original":
        emb = t["transformer.embedding.word_embeddings.weight"]
        final_norm = t["transformer.encoder.final_layernorm.weight"]
        head = emb if spec.tie_word_embeddings else t["transformer.output_layer.weight"]
    else:
        emb = t["model.embed_tokens.weight"]
        final_norm = t["model.norm.weight"]
        head = emb if spec.tie_word_embeddings else t["lm_head.weight"]
    T = len(ids)

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    half = rot // 2
    if interleaved:
        i0 = torch.arange(0, rot, 2)
        i1 = i0 + 1
    else:
        i0 = torch.arange(half)
        i1 = i0 + half
    ang = torch.tensor([[pos * spec.rope_theta ** (-2.0 * j / rot) for j in range(half)] for pos in range(T)],
                       dtype=torch.float64)
    rotor = torch.polar(torch.ones_like(ang), ang)  # e^{i angle}, [T, half]

    def rope(x):  # [T, heads, hd]
        z = torch.complex(x[:, :, i0], x[:, :, i1]) * rotor[:, None, :]
        y = x.clone()
        y[:, :, i0] = z.real
        y[:, :, i1] = z.imag
        return y

    def lin(x, w, b=None):
        y = x @ w.T
        return y + b if b is not None else y

    x = emb[torch.tensor(ids)]
    for i in range(spec.num_layers):
        L = naive_layer(spec, t, i)
        a = rms(x, L["in_norm"])
        q = rope(lin(a, L["wq"], L["bq"]).view(T, nh, hd))
        k = rope(lin(a, L["wk"], L["bk"]).view(T, kv, hd))
        v = lin(a, L["wv"], L["bv"]).view(T, kv, hd)
        o = torch.zeros(T, nh, hd, dtype=torch.float64)
        group = nh // kv
        for h in range(nh):
            g = h // group
            for qi in range(T):
                s = torch.stack([(q[qi, h] * k[kj, g]).sum() / math.sqrt(hd) for kj in range(qi + 1)])
                p = torch.exp(s - s.max())
                p = p / p.sum()
                o[qi, h] = (p[:, None] * v[:qi + 1, g]).sum(0)
        x = x + lin(o.reshape(T, nh * hd), L["wo"])
        m = rms(x, L["post_norm"])
        gate, up = lin(m, L["wg"]), lin(m, L["wu"])
        x = x + lin(gate * torch.sigmoid(gate) * up, L["wd"])
    return lin(rms(x, final_norm), head)


def rel_max(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def write_fake_outputs(out_dir, run, config, tensors=None, shards=1, metrics=None):
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        for s in (metrics if metrics is not None else run["steps"]):
            f.write(json.dumps({"step": s["step"], "loss": s["loss"], "lr": s["lr"],
                                "grad_norm": s["grad_norm"], "tokens": s.get("tokens", 0)}) + "\n")
    hf.save_checkpoint(os.path.join(out_dir, "final"), config,
                       tensors if tensors is not None else run["final"], shards=shards)


def self_check(family, dtype, work):
    t0 = time.time()
    print("== safetensors")
    selfcheck_safetensors(work)

    print("== inputs")
    cfg, spec, init, records = write_inputs(work, family, dtype)
    import tomllib
    with open(os.path.join(work, "recipe.toml"), "rb") as f:
        recipe = tomllib.load(f)
    check(recipe["max_steps"] == MAX_STEPS and recipe["learning_rate"] == LEARNING_RATE
          and recipe["shuffle"] is False and os.path.isabs(recipe["model_name"]),
          "recipe.toml parses as TOML: %s" % ", ".join("%s=%r" % kv for kv in recipe.items()
                                                        if kv[0] not in ("model_name", "data_path", "output_dir")))
    with open(os.path.join(work, "train.jsonl")) as f:
        recs = [json.loads(l) for l in f]
    check(len(recs) == 14 and min(len(r["input_ids"]) for r in recs) == 5
          and max(len(r["input_ids"]) for r in recs) == 24
          and all(max(r["input_ids"]) < 256 for r in recs)
          and sum("labels" in r for r in recs) >= 4, "train.jsonl: 14 records, lengths 5..24, some with labels")
    cfg2, spec2, model = hf.load_model(os.path.join(work, "model"))
    check(cfg2 == cfg and spec2 == spec, "config.json round trip -> %s" % spec)
    fresh = hf.random_init(hf.build_model(spec), MODEL_SEED,
                           embed_std=0.1 if spec.tie_word_embeddings else 0.5)
    ids = torch.tensor([records[3]["input_ids"][:MAX_SEQ_LEN], records[1]["input_ids"][:MAX_SEQ_LEN]])
    with torch.no_grad():
        logits = hf.logits(model, ids)
        check(torch.equal(logits, hf.logits(fresh, ids)), "model reloaded from disk gives identical logits")
    expected_names = {
        "llama": 2 + 9 * spec.num_layers + 1, "qwen2": 1 + 12 * spec.num_layers + 1,
        "glm": 2 + 11 * spec.num_layers + 1, "glm_original": 2 + 7 * spec.num_layers + 1,
    }[family]
    check(len(init) == expected_names, "%d tensors: %s ..." % (len(init), sorted(init)[:3]))
    if family == "qwen2":
        check("lm_head.weight" not in init and cfg["tie_word_embeddings"], "qwen2 LM head tied to embed_tokens")

    print("== modules vs an independent naive implementation (float64)")
    for row in range(2):
        naive = naive_logits(spec, init, ids[row].tolist())
        err = rel_max(logits[row], naive)
        check(err < 2e-5, "row %d: module logits match naive (max rel %.2e)" % (row, err))
    alt = naive_logits(spec, init, ids[0].tolist(), interleaved=not spec.rope_interleaved)
    check(rel_max(alt, naive_logits(spec, init, ids[0].tolist())) > 1e-3,
          "the naive check is sensitive to the RoPE pair layout")
    alt = naive_logits(spec, init, ids[0].tolist(), rotary_dim=spec.head_dim if spec.rotary_dim < spec.head_dim
                       else spec.head_dim // 2)
    check(rel_max(alt, naive_logits(spec, init, ids[0].tolist())) > 1e-3,
          "the naive check is sensitive to the rotary dimension")
    with torch.no_grad():
        mb_ids, mb_lab = micro_batches(records)[0]
        lsum, n = hf.causal_lm_loss_sum(hf.logits(model, mb_ids), mb_lab)
    print("  (initial loss of micro-batch 0: %.4f per token; log(V) = %.4f)" % (float(lsum) / n, math.log(spec.vocab_size)))

    if family in ("glm", "glm_original"):
        print("== glm (hf) <-> glm_original equivalence")
        other = "glm_original" if family == "glm" else "glm"
        ocfg = hf.make_config(other)
        ospec = hf.spec_from_config(ocfg)
        conv = hf.glm_to_glm_original(spec, init) if family == "glm" else hf.glm_original_to_glm(spec, init)
        omodel = hf.build_model(ospec, conv)
        with torch.no_grad():
            ologits = hf.logits(omodel, ids)
        err = rel_max(ologits, logits)
        check(err < 1e-6, "%s with the converted weights gives the same logits (max rel %.2e)" % (other, err))
        same = hf.model_tensors(hf.random_init(hf.build_model(ospec), MODEL_SEED))
        check(set(same) == set(conv) and all(torch.equal(same[k], conv[k]) for k in same),
              "random_init gives the same weights in both layouts (fused = concatenated)")
        back = hf.glm_original_to_glm(ospec, conv) if family == "glm" else hf.glm_to_glm_original(ospec, conv)
        check(set(back) == set(init) and all(torch.equal(back[k], init[k]) for k in init),
              "weight conversion round trip")

    print("== gradient accumulation and schedule")
    mbs = micro_batches(records, padding_id(spec))
    check(all(mb[0].shape == (BATCH_SIZE, MAX_SEQ_LEN) for mb in mbs) and len(mbs) == 7,
          "7 micro-batches of [%d, %d]" % (BATCH_SIZE, MAX_SEQ_LEN))
    per_step = [sum(int((lab[:, 1:] != IGNORE).sum()) for _, lab in mbs[s * GRAD_ACCUM:(s + 1) * GRAD_ACCUM])
                for s in range(MAX_STEPS)]
    print("  target tokens per step: %s" % per_step)
    m1 = hf.build_model(spec, init).double()
    m2 = hf.build_model(spec, init).double()
    batch = mbs[GRAD_ACCUM:2 * GRAD_ACCUM]
    n_tok = per_step[1]
    for ids_b, lab_b in batch:
        ls, _ = hf.causal_lm_loss_sum(hf.logits(m1, ids_b), lab_b)
        (ls / n_tok).backward()
    cat_ids = torch.cat([b[0] for b in batch])
    cat_lab = torch.cat([b[1] for b in batch])
    ls, n2 = hf.causal_lm_loss_sum(hf.logits(m2, cat_ids), cat_lab)
    (ls / n2).backward()
    g1 = dict((n, p.grad) for n, p in m1.named_parameters())
    err = max(float((g1[n] - p.grad).abs().max()) for n, p in m2.named_parameters())
    check(n2 == n_tok and err < 1e-12, "accumulated micro-batch gradients == full-step gradient (max diff %.1e)" % err)
    lrs = [LEARNING_RATE * lr_lambda(c) for c in range(MAX_STEPS)]
    check(lrs[0] == 0 and abs(lrs[1] - 1e-3) < 1e-15 and abs(lrs[2] - 5e-4) < 1e-15,
          "cosine schedule with warmup 1 over 3 steps: lrs %s" % lrs)

    print("== torch training (%s)" % dtype)
    ref = reference(spec, init, records, dtype)
    check([s["lr"] for s in ref["steps"]] == lrs, "optimizer used lrs %s" % [s["lr"] for s in ref["steps"]])
    check(any(s["clipped"] and s["lr"] > 0 for s in ref["steps"]),
          "gradient clipping triggers on a step with lr > 0 (norms %s)"
          % ["%.3f" % s["grad_norm"] for s in ref["steps"]])

    print("== comparison against a fake keel (torch in another precision) — must pass")
    fake_mode = "fp64" if dtype == "fp32" else "bf16emu"
    fake = torch_train(spec, init, records, fake_mode)
    out_dir = os.path.join(work, "out")
    write_fake_outputs(out_dir, fake, cfg, shards=2 if family in ("qwen2", "glm") else 1)
    metrics, kcfg, ktensors = read_keel_outputs(out_dir, fails := [])
    fails += compare(spec, dtype, cfg, init, ref, metrics, kcfg, ktensors)
    check(not fails, "torch %s as keel passes the %s comparison%s" % (fake_mode, dtype,
                                                                      "" if not fails else ": %s" % fails))

    print("== broken fake outputs — each must fail")
    tol = dict(TOL[dtype], **ref.get("step_tol", {}))

    def expect_fail(what, kw_optional=False, **kw):
        write_fake_outputs(out_dir, ref, kw.pop("config", cfg), **kw)
        f = []
        metrics, kcfg, ktensors = read_keel_outputs(out_dir, f)
        f += compare(spec, dtype, cfg, init, ref, metrics, kcfg, ktensors, verbose=False)
        if kw_optional:
            print("  %s: %s" % (what, "detected (%d): %s" % (len(f), f[0]) if f else
                                "not detectable at the %s tolerances" % dtype))
            return
        check(bool(f), "%s -> detected (%d): %s" % (what, len(f), f[0] if f else "NOT DETECTED"))

    write_fake_outputs(out_dir, ref, cfg)
    f = []
    m_, c_, t_ = read_keel_outputs(out_dir, f)
    f += compare(spec, dtype, cfg, init, ref, m_, c_, t_, verbose=False)
    check(not f, "the reference itself passes%s" % ("" if not f else ": %s" % f))
    some = sorted(ref["final"])[len(ref["final"]) // 2]
    pert = dict(ref["final"])
    pert[some] = pert[some] * (1 + 3 * ref["tol"][some][0])
    expect_fail("tensor %s scaled by 1+%.1e" % (some, 3 * ref["tol"][some][0]), tensors=pert)
    expect_fail("a tensor missing", tensors={k: v for k, v in ref["final"].items() if k != some})
    expect_fail("an extra tensor", tensors=dict(ref["final"], **{"extra.weight": torch.zeros(2)}))
    expect_fail("bf16 weights", tensors={k: v.to(torch.bfloat16) for k, v in ref["final"].items()})
    expect_fail("unchanged (initial) weights", tensors=init)
    expect_fail("config.json with another hidden_size/num_layers key",
                config=dict(cfg, **{k: cfg[k] + 1 for k in ("hidden_size",)}))
    bad = [dict(s) for s in ref["steps"]]
    bad[1]["loss"] *= 1 + 3 * tol["loss"]
    expect_fail("loss off by %.0e at step 2" % (3 * tol["loss"]), metrics=bad)
    bad = [dict(s) for s in ref["steps"]]
    for i in range(len(bad)):  # HF Trainer's log quirk: the lr after the scheduler step
        bad[i]["lr"] = LEARNING_RATE * lr_lambda(i + 1)
    expect_fail("lr logged after the scheduler step", metrics=bad)
    bad = [dict(s) for s in ref["steps"]]
    for s in bad:
        s["grad_norm"] = min(s["grad_norm"], MAX_GRAD_NORM)  # post-clip norm
    expect_fail("post-clip grad_norm", metrics=bad)
    expect_fail("a missing step", metrics=ref["steps"][:-1])
    variants = ["no_clip", "decay_all", "no_decay_embed", "mean_per_micro"]
    if spec.pad_token_id is not None:  # glm_original has no padding row to get wrong
        variants.append("pad_row_trained")
    for variant in variants:
        run = torch_train(spec, init, records, dtype, variant=variant)
        # In bf16 most are caught since bf16 is measured against fp32 by torch's own bf16 distance
        # (llama: all four; glm, qwen2: not no_decay_embed), so they are reported, not required.
        expect_fail("training variant %s (metrics as the reference)" % variant, tensors=run["final"],
                    kw_optional=(dtype == "bf16"))
    bad = [dict(s) for s in ref["steps"]]
    bad[0]["loss"] = float("nan")
    expect_fail("NaN loss", metrics=bad)
    print("self-check passed (%.1f s)" % (time.time() - t0))


# ---- main ------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keel", help="path to the keel binary")
    ap.add_argument("--family", required=True, choices=hf.FAMILIES)
    ap.add_argument("--dtype", required=True, choices=("fp32", "bf16"))
    ap.add_argument("--work", required=True, help="work directory (model/, out/, ... are (re)created)")
    ap.add_argument("--timeout", type=int, default=540, help="seconds allowed for keel train")
    ap.add_argument("--keel-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for keel only (e.g. KEEL_ISA=portable: torch would read ONEDNN_* too)")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "reference"),
                    help="keel's compute backend (the recipe's `backend` key)")
    ap.add_argument("--self-check", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(SEED)
    work = os.path.abspath(args.work)
    print("reference test: family=%s dtype=%s backend=%s work=%s (torch %s)"
          % (args.family, args.dtype, args.backend, work, torch.__version__))
    if args.self_check:
        try:
            self_check(args.family, args.dtype, work)
        except SelfCheckError as e:
            print("SELF-CHECK FAILED: %s" % e)
            return 1
        return 0
    if not args.keel:
        ap.error("--keel is required (unless --self-check)")
    keel = os.path.abspath(args.keel)

    cfg, spec, init, records = write_inputs(work, args.family, args.dtype, args.backend)
    print("model: %s (%d tensors); data: %d records; recipe: %s"
          % (spec, len(init), len(records), os.path.join(work, "recipe.toml")))
    failures = run_keel(keel, work, args.timeout, args.keel_env)
    if failures:
        print("FAIL: " + failures[0])
        return 1
    ref = reference(spec, init, records, args.dtype)
    metrics, kcfg, ktensors = read_keel_outputs(os.path.join(work, "out"), failures)
    failures += compare(spec, args.dtype, cfg, init, ref, metrics, kcfg, ktensors)
    if failures:
        print("\nFAIL (%s, %s, %s backend): %d problem(s):" % (args.family, args.dtype, args.backend,
                                                            len(failures)))
        for f in failures:
            print("  - " + f)
        return 1
    print("\nPASS (%s, %s, %s backend): keel matches the PyTorch reference"
          % (args.family, args.dtype, args.backend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
