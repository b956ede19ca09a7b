#!/usr/bin/env python3
"""ZeRO stages 2 and 3 over MPI against replicated training (stage 0), at dp = 2 and dp = 4 (ranks
oversubscribed on this machine), fp32 and bf16, with shuffling, clipping, gradient accumulation,
gradient checkpointing, evaluation, LoRA (stages 2 and 3) and checkpoints: the same losses, gradient
norms, evaluation losses, final weights and checkpointed weights and moments; ZeRO-2 bit-identical
to ZeRO-1 and ZeRO-3 to ZeRO-2 where the sums are the same additions (one micro-batch per step,
rank-ordered reductions); resumed across stages and world sizes; and the plans of `keel plan
--zero 2` and `--zero 3` holding a shard of the gradients, and of the weights.

    $(scripts/python-env.sh) tests/integration/zero_test.py KEEL [--only NAME]
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reference"))
import hf_models  # noqa: E402  (safetensors reader)
from harness import FAILURES, check, checkpoint_tensors, max_rel_l2, run_tests, write_data, write_recipe_file  # noqa: E402

KEEL = os.path.abspath(sys.argv[1])
WORK = tempfile.mkdtemp(prefix="keel_zero_test_")
DATA = os.path.join(WORK, "train.jsonl")
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-x", "OMP_NUM_THREADS=1"]
MODEL = {"vocab_size": 40, "hidden_size": 32, "intermediate_size": 48, "num_layers": 3, "num_heads": 4,
         "num_kv_heads": 2}


def write_recipe(name, **overrides):
    keys = {"data_path": DATA, "output_dir": os.path.join(WORK, name), "dtype": "fp32", "max_seq_len": 16,
            "batch_size": 2, "gradient_accumulation_steps": 2, "learning_rate": 3e-3, "warmup_steps": 1,
            "max_steps": 5, "seed": 11, "shuffle": True, "weight_decay": 0.1, "max_grad_norm": 0.5,
            "log_interval": 1, "dp_degree": 2, "overlap_grad_sync": True,
            # Small buckets: several per gradient group, so a group's reductions are waited for
            # bucket by bucket.
            "bucket_size_mb": 0.004}
    model = overrides.pop("model", {})
    model = None if model is None else dict(MODEL, **model)  # None: the recipe's model_name is loaded
    keys.update(overrides)
    # llama without q/k/v biases: see data_parallel_test.py (the k bias's gradient is pure rounding).
    return write_recipe_file(os.path.join(WORK, name + ".toml"), keys,
                             None if model is None else dict(family="llama", **model))


def train(path, ranks, *extra):
    cmd = ([KEEL] if ranks == 1 else MPIRUN + ["-np", str(ranks), KEEL]) + ["train", path] + list(extra)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    r.why = "" if r.returncode == 0 else " (%s)" % (r.stdout + r.stderr)[-800:]
    return r


def metrics(name):
    with open(os.path.join(WORK, name, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f if l.strip()]


def final_weights(name, adapter=False):
    final = os.path.join(WORK, name, "final")
    if adapter:
        return hf_models.load_safetensors(os.path.join(final, "adapter_model.safetensors"))
    return hf_models.load_checkpoint(final)


def final_bytes(name):
    with open(os.path.join(WORK, name, "final", "model.safetensors"), "rb") as f:
        return f.read()


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def compare_stages(tag, ranks, lora=False, stage=2, **keys):
    """ZeRO-`stage` against replicated training on `ranks` ranks: losses, gradient norms, evaluation
    losses, final weights (or adapter) and the checkpoint's weights and moments agree to 1e-6 (the
    sums differ in order only: each micro-batch's gradients are reduced on their own, then
    accumulated)."""
    runs = {}
    sharded = stage
    for stage in (0, sharded):
        name = "%s_zero%d" % (tag, stage)
        r = train(write_recipe(name, dp_degree=ranks, zero_stage=stage, checkpoint_dir=os.path.join(WORK, name, "ck"),
                               save_interval=2, **keys), ranks)
        if not check(r.returncode == 0, "%s: ZeRO-%d on %d ranks%s" % (tag, stage, ranks, r.why)):
            return
        # Sharded (dp > 1: checkpoint_layout = "auto"): each rank wrote its shard, at stage 0 its
        # 1/dp of the replicated state.
        optimizer = checkpoint_tensors(os.path.join(WORK, name, "ck", "step-00000005"))
        runs[stage] = (r.stdout, metrics(name), final_weights(name, lora), optimizer)
    # bf16 full fine-tuning shards the fp32 masters from stage 1 on (DeepSpeed's ZeRO-1/2).
    masters = keys.get("dtype") == "bf16" and not lora
    says = {1: ("ZeRO-1: AdamW moments and fp32 masters sharded over %d ranks" if masters else
                "ZeRO-1: AdamW moments sharded over %d ranks") % ranks,
            2: ("ZeRO-2: AdamW moments, fp32 masters and gradients sharded over %d ranks" if masters else
                "ZeRO-2: AdamW moments and gradients sharded over %d ranks") % ranks,
            3: ("ZeRO-3: the frozen base weights sharded over %d ranks" if lora else
                "ZeRO-3: fp32 weights, AdamW moments and gradients sharded over %d ranks") % ranks}[sharded]
    check(says in runs[sharded][0], "%s: the run says what ZeRO-%d shards" % (tag, sharded))
    (_, m0, w0, o0), (_, m2, w2, o2) = runs[0], runs[sharded]
    check([x["step"] for x in m2] == [1, 2, 3, 4, 5], "%s: five steps" % tag)
    # bf16 with accumulation: the first step's sums differ in order only (1e-6), but from then on a
    # master weight one fp32 ulp apart can round to a neighbouring bf16 value, and AdamW turns tiny
    # gradients into full-size updates; on CPUs with native bf16 dot products (AVX-512 BF16, where
    # oneDNN accumulates in another order) five steps drift to ~1e-5 in the loss and ~3e-3 in the
    # weights. A staging buffer overwritten or summed twice is off at step 1 by the gradients' size.
    drift = keys.get("dtype") == "bf16" and keys.get("gradient_accumulation_steps", 2) > 1
    loss_tol, norm_tol, weight_tol = (1e-4, 1e-3, 1e-2) if drift else (1e-6, 1e-6, 1e-6)
    check(rel(m2[0]["loss"], m0[0]["loss"]) <= 1e-6 and rel(m2[0]["grad_norm"], m0[0]["grad_norm"]) <= 1e-6,
          "%s: step 1's loss and gradient norm equal replicated (%s vs %s)" % (tag, m2[0], m0[0]))
    worst = max(rel(a["loss"], b["loss"]) for a, b in zip(m2, m0))
    check(worst <= loss_tol, "%s: losses equal replicated (worst %.2e)" % (tag, worst))
    worst = max(rel(a["grad_norm"], b["grad_norm"]) for a, b in zip(m2, m0))
    check(worst <= norm_tol, "%s: gradient norms equal replicated (worst %.2e)" % (tag, worst))
    evals = [(a["eval_loss"], b["eval_loss"]) for a, b in zip(m2, m0) if "eval_loss" in b]
    check(all("eval_loss" in b for b in m0[1::2]) == ("eval_data_path" in keys) and
          all(rel(a, b) <= loss_tol for a, b in evals), "%s: evaluation losses equal replicated (%s)" % (tag, evals))
    worst, where = max_rel_l2(w2, w0)
    check(set(w2) == set(w0) and worst <= weight_tol,
          "%s: final weights equal replicated (worst %.2e, %s)" % (tag, worst, where))
    worst, where = max_rel_l2(o2, o0)
    check(set(o2) == set(o0) and worst <= weight_tol,
          "%s: the checkpoint's weights and moments equal replicated (worst %.2e, %s)" % (tag, worst, where))
    print("  %s: ZeRO-%d against replicated within %.1e" % (tag, sharded, worst))


def test_zero2_fp32_dp2():
    compare_stages("fp32_dp2", 2)


def test_zero2_bf16_dp2_async_save():
    compare_stages("bf16_dp2", 2, dtype="bf16", async_save=True)


def test_zero2_dp4_checkpointing():
    compare_stages("fp32_dp4", 4, gradient_accumulation_steps=1, use_gradient_checkpointing=True)


def test_zero2_bf16_dp4_no_overlap():
    """Without overlap each bucket is reduced as soon as it is final (the staging cannot wait)."""
    compare_stages("bf16_dp4", 4, dtype="bf16", overlap_grad_sync=False, gradient_accumulation_steps=1)


def test_zero2_lora():
    compare_stages("lora_dp2", 2, lora=True, finetuning_type="lora", lora_rank=4, lora_target="all",
                   lora_dropout=0.1)


def test_zero1_bf16_dp2_tied_evaluation():
    """bf16 ZeRO-1 shards the fp32 masters: the weights the step reads are gathered after each
    optimizer step into resident buffers (the tied embedding twice: looked up in fp32, read by the
    LM head in bf16), waited for where the next step or the evaluation first reads them."""
    compare_stages("bf16_dp2_z1", 2, stage=1, dtype="bf16", eval_data_path=DATA, eval_interval=2,
                   model={"tie_word_embeddings": True})


def test_zero1_bf16_dp4_no_overlap():
    compare_stages("bf16_dp4_z1", 4, stage=1, dtype="bf16", overlap_grad_sync=False, gradient_accumulation_steps=1)


def test_zero3_fp32_dp2_evaluation():
    compare_stages("fp32_dp2_z3", 2, stage=3, eval_data_path=DATA, eval_interval=2)


def test_zero3_bf16_dp2_async_save():
    compare_stages("bf16_dp2_z3", 2, stage=3, dtype="bf16", async_save=True)


def test_zero3_dp4_checkpointing():
    compare_stages("fp32_dp4_z3", 4, stage=3, gradient_accumulation_steps=1, use_gradient_checkpointing=True)


def test_zero3_bf16_dp4_no_overlap_tied():
    compare_stages("bf16_dp4_z3", 4, stage=3, dtype="bf16", overlap_grad_sync=False, gradient_accumulation_steps=1,
                   model={"tie_word_embeddings": True})


LORA = dict(finetuning_type="lora", lora_rank=4, lora_target="all")


def test_zero3_lora_bf16_dp2():
    """LoRA under ZeRO-3: the frozen base (bf16 matrices, fp32 norms) sharded and gathered per
    position, the adapter synchronised as in ZeRO-2."""
    compare_stages("lora_bf16_dp2_z3", 2, lora=True, stage=3, dtype="bf16", lora_dropout=0.1, **LORA)


def test_zero3_lora_fp32_dp4_checkpointing_evaluation():
    compare_stages("lora_fp32_dp4_z3", 4, lora=True, stage=3, gradient_accumulation_steps=1,
                   use_gradient_checkpointing=True, eval_data_path=DATA, eval_interval=2, **LORA)


def test_zero3_lora_bit_identical_to_zero2():
    """The base weights a position reads are the same bytes whether held whole (ZeRO-2) or gathered
    (ZeRO-3), and the adapter's path is ZeRO-2's: the adapters are the same bytes, in bf16 with
    accumulation, from a model loaded from its files (each rank keeping its part of each tensor),
    for LoRA and QLoRA (quantized whole tensor by tensor either way) on tied embeddings, and for
    modules_to_save (whose trained copies are taken from each whole tensor as it loads)."""
    bases = {}
    for tied in (True, False):
        bases[tied] = "lora_exact_base_%s" % ("tied" if tied else "untied")
        r = train(write_recipe(bases[tied], dp_degree=1, max_steps=1, dtype="bf16",
                               model={"tie_word_embeddings": tied, "hidden_size": 64, "intermediate_size": 128}), 1)
        if not check(r.returncode == 0, "the base model for LoRA%s" % r.why):
            return
    for variant, tied, keys in (("lora", True, {}), ("qlora", True, {"quantization_bit": 4}),
                                ("saved", False, {"additional_target": "embed_tokens,lm_head"})):
        finals = {}
        for stage in (2, 3):
            name = "%s_exact_zero%d" % (variant, stage)
            r = train(write_recipe(name, zero_stage=stage, dtype="bf16", model=None,
                                   model_name=os.path.join(WORK, bases[tied], "final"), **LORA, **keys), 2)
            if not check(r.returncode == 0, "%s ZeRO-%d run%s" % (variant, stage, r.why)):
                return
            check(stage == 2 or "ZeRO-3: the frozen base weights sharded over 2 ranks" in r.stdout,
                  "the %s ZeRO-3 run says it shards the base" % variant)
            with open(os.path.join(WORK, name, "final", "adapter_model.safetensors"), "rb") as f:
                finals[stage] = f.read()
        check(finals[2] == finals[3], "%s trains bit-identically under ZeRO-3 and ZeRO-2" % variant)


def test_zero3_qlora_bf16_dp2():
    """QLoRA under ZeRO-3: the blocks' NF4 codes and absmax values sharded and gathered per
    position (the embedding and LM head as bf16), against replicated QLoRA."""
    compare_stages("qlora_bf16_dp2_z3", 2, lora=True, stage=3, dtype="bf16", quantization_bit=4,
                   model={"hidden_size": 64, "intermediate_size": 128}, **LORA)


def test_zero3_qlora_fp4_dp4_checkpointing():
    compare_stages("qlora_fp32_dp4_z3", 4, lora=True, stage=3, quantization_bit=4, quantization_type="fp4",
                   gradient_accumulation_steps=1, use_gradient_checkpointing=True,
                   model={"hidden_size": 64, "intermediate_size": 128}, **LORA)


def moe_model(family):
    """A directory holding a tiny mixture of experts' config.json alone (keel draws it from the
    recipe's seed, every rank the same draws): 4 experts of width 16, top 2, the load-balancing loss
    added (output_router_logits); Qwen3-MoE with its last layer dense (mlp_only_layers)."""
    path = os.path.join(WORK, "model_" + family)
    os.makedirs(path, exist_ok=True)
    config = {"model_type": family, "vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts_per_tok": 2,
              "output_router_logits": True, "router_aux_loss_coef": 0.02, "tie_word_embeddings": False}
    if family == "qwen3_moe":
        config.update(architectures=["Qwen3MoeForCausalLM"], intermediate_size=48, num_experts=4,
                      moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2])
    elif family == "glm4_moe":  # a dense first layer, a shared expert, 2 groups of 2 experts, one kept
        config.update(architectures=["Glm4MoeForCausalLM"], intermediate_size=48, n_routed_experts=4,
                      moe_intermediate_size=16, n_shared_experts=1, n_group=2, topk_group=1,
                      first_k_dense_replace=1, routed_scaling_factor=1.5, attention_bias=True)
    else:
        config.update(architectures=["MixtralForCausalLM"], intermediate_size=16, num_local_experts=4)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def test_zero3_moe_fp32_dp2():
    """Mixtures of experts under ZeRO-3: the router and experts gathered per position with their
    block, the load-balancing loss in the loss, against replicated training."""
    compare_stages("moe_fp32_dp2_z3", 2, stage=3, model=None, model_name=moe_model("qwen3_moe"),
                   eval_data_path=DATA, eval_interval=2)


def test_zero3_glm45_bf16_dp2():
    """GLM-4.5 in bf16 under ZeRO-3: its sigmoid router's correction bias (never trained) and the
    shared experts gathered with their block."""
    compare_stages("glm45_bf16_dp2_z3", 2, stage=3, model=None, model_name=moe_model("glm4_moe"), dtype="bf16",
                   gradient_accumulation_steps=1)


def test_zero2_moe_bf16_dp2():
    """Mixtral in bf16 under ZeRO-2: fp32 masters sharded, their bf16 copies gathered resident."""
    compare_stages("moe_bf16_dp2_z2", 2, stage=2, model=None, model_name=moe_model("mixtral"), dtype="bf16",
                   gradient_accumulation_steps=1)


def test_zero3_moe_qlora_dp2():
    """QLoRA on a mixture of experts under ZeRO-3: the 4-bit experts sharded and gathered."""
    compare_stages("moe_qlora_dp2_z3", 2, lora=True, stage=3, model=None, model_name=moe_model_64("qwen3_moe"),
                   quantization_bit=4, gradient_accumulation_steps=1, **LORA)


def test_moe_dp2_equals_dp1_accumulating():
    """A mixture of experts on 2 ranks trains as on one rank accumulating twice the micro-batches:
    each rank's load-balancing loss joins the loss unscaled, so the ranks' add up as micro-batches
    do. That is transformers' Trainer under DDP with its default average_tokens_across_devices: it
    multiplies each rank's loss (the tokens' mean plus coef x that rank's aux loss) by the number of
    ranks before DDP averages the gradients, so the aux losses' gradients are summed over ranks. One
    rank with accumulation is checked against the Trainer itself by moe_reference.py."""
    runs = {}
    for ranks, accumulation in ((1, 4), (2, 2)):
        name = "moe_dp%d" % ranks
        r = train(write_recipe(name, dp_degree=ranks, gradient_accumulation_steps=accumulation, model=None,
                               model_name=moe_model("qwen3_moe")), ranks)
        if not check(r.returncode == 0, "%s%s" % (name, r.why)):
            return
        runs[ranks] = (metrics(name), final_weights(name))
    (m1, w1), (m2, w2) = runs[1], runs[2]
    check(all("aux_loss" in m for m in m1 + m2), "both runs report aux_loss")
    worst = max(max(rel(a["loss"], b["loss"]), rel(a["aux_loss"], b["aux_loss"])) for a, b in zip(m2, m1))
    check(len(m1) == len(m2) == 5 and worst <= 1e-6,
          "dp=2 losses and aux losses equal dp=1 accumulating twice as many (worst %.2e)" % worst)
    worst, where = max_rel_l2(w2, w1)
    check(worst <= 1e-5, "dp=2 final weights equal dp=1's (worst %.2e, %s)" % (worst, where))
    print("  dp=2 against dp=1 with twice the accumulation: weights within %.1e" % worst)


def test_zero3_moe_expert_lora_dp2():
    """LoRA on the experts under ZeRO-3: the frozen experts sharded and gathered, one adapter pair
    per expert training beside them, against replicated training."""
    compare_stages("moe_expert_lora_dp2_z3", 2, lora=True, stage=3, model=None, model_name=moe_model("qwen3_moe"),
                   gradient_accumulation_steps=1, finetuning_type="lora", lora_rank=4,
                   lora_target="q_proj, v_proj, experts")


def moe_model_64(family):
    """moe_model with 4-bit blocks of whole rows: hidden 64, the experts' width 64."""
    path = moe_model(family)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, head_dim=16)
    path += "_64"
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def test_zero3_lora_modules_to_save_dp2():
    """modules_to_save under ZeRO-3: the trained copies of the embedding and LM head start from the
    whole tensors (taken as each passes through memory) and train as in ZeRO-2."""
    # One micro-batch per step: the same additions as replicated. With accumulation the copies' large
    # gradients sum in another order, and AdamW turns that rounding (~1e-7) into ~1e-6 in lora_A,
    # whose first gradients are tiny (B starts at zero).
    compare_stages("saved_fp32_dp2_z3", 2, lora=True, stage=3, additional_target="embed_tokens,lm_head",
                   gradient_accumulation_steps=1, **LORA)


def test_zero2_bit_identical_to_zero1():
    """One micro-batch per step and rank-ordered sums: ZeRO-2 adds exactly what ZeRO-1 adds (each
    gradient reduced once, into zero), so the final model is the same bytes; in fp32, and in bf16,
    where ZeRO-1/2 hold a shard of the masters and gather the bf16 weights after each step and
    ZeRO-3 gathers them where each position reads them."""
    for dtype in ("fp32", "bf16"):
        finals = {}
        for stage in (1, 2, 3):
            name = "exact_%s_zero%d" % (dtype, stage)
            r = train(write_recipe(name, zero_stage=stage, dtype=dtype, gradient_accumulation_steps=1,
                                   deterministic_reduce=True), 2)
            if not check(r.returncode == 0, "%s ZeRO-%d deterministic run%s" % (dtype, stage, r.why)):
                return
            finals[stage] = final_bytes(name)
        check(finals[1] == finals[2], "%s: ZeRO-2 trains bit-identically to ZeRO-1 with one micro-batch per step" % dtype)
        check(finals[3] == finals[2], "%s: ZeRO-3 trains bit-identically to ZeRO-2 with one micro-batch per step" % dtype)


def test_resume_bf16_sharded_masters():
    """bf16 ZeRO-1 on 2 ranks stopped after step 2 resumes as ZeRO-2 on 2 ranks: the resident weights
    are gathered from the loaded shards, and the run ends on the uninterrupted ZeRO-2 run's bytes
    (one micro-batch per step, rank-ordered sums: the same additions)."""
    keys = dict(dtype="bf16", gradient_accumulation_steps=1, deterministic_reduce=True)
    whole = "resume_bf16_whole"
    r = train(write_recipe(whole, zero_stage=2, **keys), 2)
    if not check(r.returncode == 0, "uninterrupted bf16 ZeRO-2 run" + r.why):
        return
    name = "resume_bf16_zero1_to_zero2"
    ck = {"checkpoint_dir": os.path.join(WORK, name, "ck"), "save_interval": 1}
    r = train(write_recipe(name, zero_stage=1, **keys, **ck), 2, "--stop-after", "2")
    if not check(r.returncode == 0, "bf16 ZeRO-1 first part" + r.why):
        return
    r = train(write_recipe(name, zero_stage=2, **keys, **ck), 2, "--resume", "auto")
    if not check(r.returncode == 0 and "resumed from" in r.stdout, "bf16 ZeRO-2 resumed" + r.why):
        return
    check(final_bytes(name) == final_bytes(whole), "the resumed bf16 run ends on the uninterrupted run's bytes")


def test_resume_across_stages_and_world_sizes():
    """A ZeRO-1 run on 2 ranks stopped after step 2 resumes as ZeRO-2 on 4 ranks (accumulation
    halved to keep the global batch), and a ZeRO-2 run on 2 ranks resumes replicated on 1: both end
    where the uninterrupted run does, up to the reduction order."""
    whole = "resume_whole"
    r = train(write_recipe(whole, dp_degree=1, gradient_accumulation_steps=4), 1)
    if not check(r.returncode == 0, "uninterrupted run" + r.why):
        return
    m0, w0 = metrics(whole), final_weights(whole)
    plans = (("zero1_dp2_to_zero2_dp4", dict(dp_degree=2, gradient_accumulation_steps=2, zero_stage=1),
              dict(dp_degree=4, gradient_accumulation_steps=1, zero_stage=2)),
             ("zero2_dp2_to_dp1", dict(dp_degree=2, gradient_accumulation_steps=2, zero_stage=2),
              dict(dp_degree=1, gradient_accumulation_steps=4, zero_stage=0)),
             ("zero2_dp2_to_zero3_dp4", dict(dp_degree=2, gradient_accumulation_steps=2, zero_stage=2),
              dict(dp_degree=4, gradient_accumulation_steps=1, zero_stage=3)),
             ("zero3_dp4_to_zero1_dp2", dict(dp_degree=4, gradient_accumulation_steps=1, zero_stage=3),
              dict(dp_degree=2, gradient_accumulation_steps=2, zero_stage=1)))
    for name, first, then in plans:
        ck = {"checkpoint_dir": os.path.join(WORK, name, "ck"), "save_interval": 1}
        r = train(write_recipe(name, **first, **ck), first["dp_degree"], "--stop-after", "2")
        if not check(r.returncode == 0, "%s: first part%s" % (name, r.why)):
            continue
        r = train(write_recipe(name, **then, **ck), then["dp_degree"], "--resume", "auto")
        if not check(r.returncode == 0 and "resumed from" in r.stdout, "%s: resumed%s" % (name, r.why)):
            continue
        m, w = metrics(name), final_weights(name)
        worst = max(rel(a["loss"], b["loss"]) for a, b in zip(m, m0))
        check([x["step"] for x in m] == [1, 2, 3, 4, 5] and worst <= 1e-6,
              "%s: the uninterrupted run's losses (worst %.2e)" % (name, worst))
        worst, where = max_rel_l2(w, w0)
        check(worst <= 1e-5, "%s: the uninterrupted run's final weights (worst %.2e, %s)" % (name, worst, where))


def test_sharded_checkpoints_resume_bit_exactly():
    """The sharded layout (checkpoint_layout = "auto" at dp > 1): a run stopped after step 2 and
    resumed with --resume auto at the same world size and ZeRO stage ends on the uninterrupted
    run's bytes, at dp 2 with ZeRO 0-3 (fp32, and bf16 with asynchronous saves staged through a
    buffer smaller than a rank's shard) and at dp 4 with ZeRO-1 (fp32), ZeRO-2 (bf16) and ZeRO-3
    (bf16, asynchronous: the reference article's shape).
    Each rank wrote only its own shard file, and the manifest names every piece."""
    plans = [(2, stage, dict()) for stage in (0, 1, 2, 3)]
    plans += [(4, 1, dict(gradient_accumulation_steps=1)), (4, 2, dict(dtype="bf16", gradient_accumulation_steps=1))]
    # 0.02 MiB of staging: less than a rank's ~0.07 MB of weights, m and v, so the writer writes
    # part of the state from the live buffers and the next optimizer step may wait for it.
    plans += [(2, 2, dict(dtype="bf16", async_save=True, checkpoint_staging_mb=0.02)),
              (4, 3, dict(dtype="bf16", async_save=True, gradient_accumulation_steps=1, checkpoint_staging_mb=0.02))]
    for ranks, stage, keys in plans:
        keys = dict(keys, dp_degree=ranks, zero_stage=stage, deterministic_reduce=True)
        tag = "sharded_dp%d_zero%d_%s%s" % (ranks, stage, keys.get("dtype", "fp32"), "_async" if keys.get("async_save") else "")
        whole = tag + "_whole"
        r = train(write_recipe(whole, **keys), ranks)
        if not check(r.returncode == 0, "%s: uninterrupted run%s" % (tag, r.why)):
            continue
        ck = os.path.join(WORK, tag, "ck")
        path = write_recipe(tag, checkpoint_dir=ck, save_interval=1, **keys)
        r = train(path, ranks, "--stop-after", "2")
        if not check(r.returncode == 0 and "checkpoints sharded" in r.stdout, "%s: first part%s" % (tag, r.why)):
            continue
        step = os.path.join(ck, "step-00000002")
        files = sorted(os.listdir(step))
        expected = sorted(["manifest.json", "recipe.toml", "trainer_state.json"] +
                          ["shard-%05d-of-%05d.bin" % (i, ranks) for i in range(ranks)])
        check(files == expected, "%s: one shard file per rank and the manifest (%s)" % (tag, files))
        with open(os.path.join(step, "manifest.json")) as f:
            manifest = json.load(f)
        check(manifest["layout"] == "sharded" and manifest["world_size"] == ranks and
              {p["shard"] for p in manifest["pieces"]} == set(range(ranks)),
              "%s: the manifest places pieces in every rank's file" % tag)
        r = train(path, ranks, "--resume", "auto")
        if not check(r.returncode == 0 and "resumed from %s at step 2" % step in r.stdout, "%s: resumed%s" % (tag, r.why)):
            continue
        check(final_bytes(tag) == final_bytes(whole), "%s: the resumed run ends on the uninterrupted run's bytes" % tag)
        if keys.get("async_save"):
            m = metrics(tag)
            check(all("checkpoint_s" in x for x in m), "%s: metrics.jsonl reports checkpoint_s every step" % tag)


def rank_pids(path):
    """{MPI rank: pid} of the processes of `keel train path` (Open MPI's OMPI_COMM_WORLD_RANK)."""
    out = {}
    for pid in subprocess.run(["pgrep", "-f", "train %s" % path], capture_output=True, text=True).stdout.split():
        try:
            with open("/proc/%s/environ" % pid, "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for var in env:
            if var.startswith(b"OMPI_COMM_WORLD_RANK="):
                out[int(var.split(b"=")[1])] = int(pid)
    return out


def last_logged_step(metrics_path):
    """The last step metrics.jsonl records (0 before the first), read as it is being written."""
    try:
        with open(metrics_path) as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("step", 0))
        except ValueError:  # a line half written
            continue
    return 0


def test_sharded_crash_recovery_dp2():
    """kill -9 of a random rank at 6 random moments of a dp 2 ZeRO-2 bf16 run with asynchronous
    sharded saves every 3 steps (some kills land in a save: a rank's shard half written, or
    written but not yet agreed on); each time --resume auto continues from the newest published
    checkpoint, and the final model is the uninterrupted run's bytes."""
    import random
    import signal
    import time
    keys = dict(dtype="bf16", zero_stage=2, gradient_accumulation_steps=1, deterministic_reduce=True, max_steps=300,
                async_save=True, checkpoint_staging_mb=0.02, log_interval=5)
    whole = "crash_dp2_whole"
    t0 = time.time()
    r = train(write_recipe(whole, **keys), 2)
    duration = time.time() - t0
    if not check(r.returncode == 0, "uninterrupted run" + r.why):
        return
    name = "crash_dp2"
    path = write_recipe(name, checkpoint_dir=os.path.join(WORK, name, "ck"), save_interval=3, keep_last_n=2, **keys)
    rng = random.Random(5)
    kills = 0
    for attempt in range(40):
        p = subprocess.Popen(MPIRUN + ["-np", "2", KEEL, "train", path, "--resume", "auto"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        if kills < 6:
            # Kill at a step chosen by progress, not by time (a loaded machine stretches time): 5 to
            # 40 steps past the step this attempt resumed at, as metrics.jsonl shows it, and then a
            # few random milliseconds, so that some kills land inside a save. Six such kills cannot
            # finish a 300-step run.
            metrics_path = os.path.join(WORK, name, "metrics.jsonl")
            target = last_logged_step(metrics_path) + rng.randint(5, 40)
            deadline = time.time() + 300
            while p.poll() is None and time.time() < deadline and last_logged_step(metrics_path) < target:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.05))
            pids = rank_pids(path)
            if p.poll() is None and pids:
                os.kill(pids[rng.choice(sorted(pids))], signal.SIGKILL)
                kills += 1
                p.communicate(timeout=120)
                for pid in rank_pids(path).values():  # a rank the launcher left behind
                    os.kill(pid, signal.SIGKILL)
                continue
        out, _ = p.communicate(timeout=600)
        if p.returncode == 0:
            break
        check(False, "a resumed dp 2 run failed after a kill: %s" % out[-1500:])
        return
    print("  killed %d times; the uninterrupted run took %.1f s" % (kills, duration))
    check(kills == 6, "the dp 2 run was killed %d times (6 planned; the uninterrupted run took %.1f s)" % (
        kills, duration))
    check(final_bytes(name) == final_bytes(whole), "after the kills, the final model is the uninterrupted run's bytes")


def test_plan_shards_gradients():
    """keel plan --zero 2: the gradients are a 1/dp shard plus the groups in flight, below ZeRO-1's
    whole buffer; the optimizer state is ZeRO-1's. --zero 3: the master weights a 1/dp shard too,
    the gradients and moments ZeRO-2's."""
    path = write_recipe("plan", dp_degree=4)
    plans = {}
    for stage in (1, 2, 3):
        r = subprocess.run([KEEL, "plan", path, "--json", "--zero", str(stage)], capture_output=True, text=True)
        if not check(r.returncode == 0, "keel plan --zero %d (%s)" % (stage, r.stderr[-300:])):
            return
        plans[stage] = json.loads(r.stdout)["categories"]
    g1, g2 = plans[1]["gradients"], plans[2]["gradients"]
    check(g1 / 4 < g2 < g1, "ZeRO-2 plans %.2f of ZeRO-1's gradients per rank at dp = 4" % (g2 / g1))
    check(plans[2]["optimizer state"] == plans[1]["optimizer state"], "ZeRO-2's optimizer state is ZeRO-1's")
    r = subprocess.run([KEEL, "plan", path, "--zero", "2"], capture_output=True, text=True)
    check(r.returncode == 0 and "1/4 shard accumulated" in r.stdout, "the report says what the gradients hold")
    p2, p3 = plans[2], plans[3]
    check(p3["master weights"] <= p2["master weights"] / 4 + 256 and p3["gradients"] == p2["gradients"] and
          p3["optimizer state"] == p2["optimizer state"],
          "ZeRO-3 plans a quarter of the master weights at dp = 4, ZeRO-2's gradients and moments (%s vs %s)"
          % (p3, p2))
    # bf16: from ZeRO-1 on the fp32 masters are a quarter (as ZeRO-3's), the bf16 weights whole.
    path = write_recipe("plan_bf16", dp_degree=4, dtype="bf16")
    for stage in (0, 1, 2, 3):
        r = subprocess.run([KEEL, "plan", path, "--json", "--zero", str(stage)], capture_output=True, text=True)
        if not check(r.returncode == 0, "keel plan bf16 --zero %d (%s)" % (stage, r.stderr[-300:])):
            return
        plans[stage] = json.loads(r.stdout)["categories"]
    for stage in (1, 2):
        check(plans[stage]["master weights"] == plans[3]["master weights"] and
              plans[0]["master weights"] / 4 <= plans[stage]["master weights"] <= plans[0]["master weights"] / 4 + 256,
              "bf16 ZeRO-%d plans ZeRO-3's quarter of the masters (%s vs %s)" % (stage, plans[stage], plans[0]))
        check(plans[stage]["compute weights"] >= plans[0]["compute weights"],
              "bf16 ZeRO-%d keeps the weights the step reads whole (%s vs %s)" % (stage, plans[stage], plans[0]))
    r = subprocess.run([KEEL, "plan", path, "--zero", "1"], capture_output=True, text=True)
    check(r.returncode == 0 and "fp32 master, 1/4 shard (ZeRO-1)" in r.stdout and
          "whole, gathered after each optimizer step" in r.stdout, "the bf16 ZeRO-1 report says what is sharded")


if __name__ == "__main__":
    write_data(DATA, 120, seed=3, vocab=40, lo=4, hi=24)
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    run_tests(globals(), "ZeRO", WORK, FAILURES, only=only)
