#!/usr/bin/env python3
"""Reference test: keel's LoRA fine-tuning against PEFT on transformers' model, in torch.

    $(scripts/python-env.sh) tests/reference/lora_reference.py --keel PATH_TO_KEEL \
        --family {llama,qwen2,glm,qwen3,mistral,gemma2,gemma3} --dtype {fp32,bf16} --work WORKDIR

1. The tiny model, data and recipe of train_reference.py, plus finetuning_type = "lora" with the
   family's targets (FAMILY_LORA: every linear layer, a subset as a TOML list, rsLoRA).
2. PEFT builds the adapter (get_peft_model with the same LoraConfig) on transformers' model and
   saves it with save_pretrained; keel starts from it (adapter_name_or_path). PEFT initialises B
   to zero, which makes A's first gradient zero and would hide a wrong dA: B gets random values.
3. keel trains; the same training runs in torch on the PeftModel with Hugging Face Trainer
   semantics (train_reference.torch_train: only the LoRA matrices train, with weight decay, the
   base model frozen). Compared: per-step loss, lr and gradient norm, and every tensor of keel's
   final/adapter_model.safetensors, with train_reference's tolerances (fp32: 1e-5; bf16: 5x the
   torch bf16 vs fp32 gap per tensor).
4. keel's final/ is an adapter the ecosystem loads: adapter_config.json holds the keys PEFT and
   vLLM read with vLLM's rules (peft_type LORA, bias "none", no DoRA, no modules_to_save, every
   tensor named base_model.model.<module>.lora_{A,B}.weight of a module the model has);
   PeftModel.from_pretrained loads it with no missing or unexpected key and gives the logits of
   the torch-trained PeftModel; `keel generate --adapter` continues prompts greedily exactly as
   transformers' generate on that PeftModel does.
5. The run's checkpoint: `keel export` writes the same adapter; `keel export --merge` writes the
   model PEFT's merge_and_unload makes of keel's adapter (fp32 rounding); a run stopped after step
   1 and resumed ends with the uninterrupted run's adapter, bit for bit.

--qlora nf4 | nf4-dq: QLoRA. keel quantizes the model's projections to NF4 at load
(quantization_bit = 4, double_quantization off or on); the reference trains PEFT on transformers'
model whose projections are what bitsandbytes makes of them: dequantize_4bit(quantize_4bit(W,
blocksize 64, "nf4", compress_statistics)), in fp32 (a QLoRA GEMM computes with exactly these
weights; bitsandbytes' Linear4bit, which would do the same inside the module, does not train on
the CPU). Sizes are multiples of the 64-element NF4 block (intermediate 128). With double
quantization keel takes the nearest code for each absmax (bitsandbytes' native CPU kernel a
neighbour for ~0.1%: tests/reference/nf4_reference.py), so that mode is compared in bf16's
tolerance only. Merge and generate use the full-precision base, as a QLoRA adapter is deployed.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import hf_models as hf  # noqa: E402
import train_reference as tr  # noqa: E402

import peft  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

RANK = 4
ALPHA = 8
B_INIT_STD = 0.05
# Per family: keel's lora_target (as written in the recipe), PEFT's target_modules, rsLoRA.
FAMILY_LORA = {
    "llama": ('"all"', ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "qwen2": ('["q_proj", "v_proj"]', ["q_proj", "v_proj"], False),
    "glm": ('"k_proj, o_proj, gate_up_proj, down_proj"', ["k_proj", "o_proj", "gate_up_proj", "down_proj"], True),
    "qwen3": ('"all"', ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "mistral": ('["self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj"]', ["self_attn.q_proj", "self_attn.k_proj",
                                                                           "mlp.up_proj"], False),
    "gemma2": ('"all"', ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "gemma3": ('"q_proj, o_proj, down_proj"', ["q_proj", "o_proj", "down_proj"], True),
}
ADAPTER_KEYS = ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "bias",
                "base_model_name_or_path", "modules_to_save")
PEFT_NAME = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


SAVED = None  # --modules-to-save: PEFT's modules_to_save, keel's additional_target


def lora_config(family):
    _, targets, rslora = FAMILY_LORA[family]
    return LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets, use_rslora=rslora,
                      bias="none", task_type="CAUSAL_LM", modules_to_save=SAVED)


def write_initial_adapter(spec, init, family, model_dir, out):
    """PEFT's adapter with random B; returns its tensors {PEFT name: fp32}."""
    torch.manual_seed(tr.SEED)
    model = get_peft_model(hf.build_model(spec, init), lora_config(family))
    g = torch.Generator().manual_seed(tr.SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * B_INIT_STD)
    model.peft_config["default"].base_model_name_or_path = model_dir
    model.save_pretrained(out)
    return {k: v.detach().float().clone() for k, v in get_peft_model_state_dict(model).items()}


def peft_model(spec, init, adapter_dir, trainable):
    return PeftModel.from_pretrained(hf.build_model(spec, init), adapter_dir, is_trainable=trainable)


def adapter_tensors(model):
    return {k: v.detach().float().clone() for k, v in get_peft_model_state_dict(model).items()}


def check_adapter_files(final_dir, spec, init, family, model_dir, failures):
    """vLLM's and PEFT's rules for an adapter directory."""
    path = os.path.join(final_dir, "adapter_config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        failures.append("%s: %s" % (path, e))
        return
    for key in ADAPTER_KEYS:
        if key not in config:
            failures.append("adapter_config.json lacks %r" % key)
    _, targets, rslora = FAMILY_LORA[family]
    expect = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "bias": "none",
              "use_rslora": rslora, "base_model_name_or_path": model_dir}
    if sorted(config.get("modules_to_save") or []) != sorted(SAVED or []):
        failures.append("adapter_config.json modules_to_save = %r, expected %r" % (config.get("modules_to_save"), SAVED))
    for key, value in expect.items():
        if config.get(key) != value:
            failures.append("adapter_config.json %r = %r, expected %r" % (key, config.get(key), value))
    model_modules = {n for n, _ in hf.build_model(spec, init).named_modules()}

    def selected(target_list):  # PEFT's rule: a module matches a target equal to it or to a suffix after "."
        return {n for n in model_modules if any(n == t or n.endswith("." + t) for t in target_list)}
    written = config.get("target_modules") or []
    if selected(written) != selected(targets):
        failures.append("adapter_config.json target_modules = %r selects other modules than %r" % (written, targets))
    if config.get("use_dora"):
        failures.append("adapter_config.json use_dora is set (vLLM refuses DoRA)")
    tensors = hf.load_safetensors(os.path.join(final_dir, "adapter_model.safetensors"))
    for name, t in tensors.items():
        if SAVED and name.startswith("base_model.model.") and name.endswith(".weight") and \
                name.split(".")[-2] in SAVED:  # a module trained fully: vLLM takes lm_head / embed_tokens
            continue
        m = PEFT_NAME.match(name)
        if not m:
            failures.append("adapter tensor %r is not named base_model.model.<module>.lora_{A,B}.weight" % name)
            continue
        if m.group(1) not in model_modules:
            failures.append("adapter tensor %r: the model has no module %r" % (name, m.group(1)))
        if m.group(1) not in selected(written):
            failures.append("adapter tensor %r: module outside target_modules" % name)
        rows, cols = t.shape
        if (m.group(2) == "A" and rows != RANK) or (m.group(2) == "B" and cols != RANK):
            failures.append("adapter tensor %r: shape %s does not have rank %d where PEFT has it" % (name, tuple(t.shape), RANK))
    print("adapter_config.json and tensor names: %d tensors checked" % len(tensors))


def check_peft_loads(spec, init, final_dir, ref_model_tensors, records, failures):
    """PeftModel.from_pretrained on keel's adapter: nothing missing, the reference's logits."""
    model = peft_model(spec, init, final_dir, trainable=False).eval()
    loaded = adapter_tensors(model)
    missing = sorted(set(ref_model_tensors) - set(loaded))
    if missing:
        failures.append("PeftModel.from_pretrained: adapter tensors not loaded: %s" % missing[:4])
    ref = peft_model(spec, init, final_dir, trainable=False).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            key = name.replace(".default", "")
            if key in ref_model_tensors:
                p.copy_(ref_model_tensors[key])
        ids, _ = tr.micro_batches(records)[0]
        a = hf.logits(model, ids).double()
        b = hf.logits(ref, ids).double()
    err = float((a - b).norm() / b.norm())
    print("logits of PEFT with keel's adapter vs the torch-trained adapter: rel err %.2e" % err)
    return err


def check_generate(keel, work, spec, init, final_dir, model_dir, failures):
    """`keel generate --adapter` vs transformers' generate on the PeftModel (greedy)."""
    model = peft_model(spec, init, final_dir, trainable=False).eval()
    prompt = [5, 17, 33, 2, 41]
    expected = hf.greedy_generate(model, prompt, 8)
    cmd = [keel, "generate", "--model", model_dir, "--adapter", final_dir, "--prompt-ids", ",".join(map(str, prompt)),
           "--max-new-tokens", "8", "--ids"]
    print("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        failures.append("keel generate --adapter failed (%d): %s" % (proc.returncode, proc.stderr.strip()[-400:]))
        return
    got = [int(x) for x in proc.stdout.split()]
    print("keel generate --adapter: %s; transformers + PEFT: %s" % (got, expected))
    if got != expected:
        failures.append("keel generate --adapter %s != PEFT's greedy continuation %s" % (got, expected))


def keel_cli(keel, work, args, failures):
    print("$ keel " + " ".join(args))
    proc = subprocess.run([keel] + args, cwd=work, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        failures.append("keel %s failed (%d): %s" % (args[0], proc.returncode, proc.stderr.strip()[-600:]))
    return proc.returncode == 0


def check_export_and_resume(keel, work, spec, init, failures):
    out = os.path.join(work, "out")
    final = hf.load_safetensors(os.path.join(out, "final", "adapter_model.safetensors"))
    ckpt = os.path.join(work, "checkpoints")
    exported = os.path.join(work, "exported_adapter")
    if keel_cli(keel, work, ["export", ckpt, "--to", exported, "--overwrite"], failures):
        again = hf.load_safetensors(os.path.join(exported, "adapter_model.safetensors"))
        if set(again) != set(final) or any(not torch.equal(again[k], final[k]) for k in final):
            failures.append("keel export of the last checkpoint is not the run's final adapter")
    merged_dir = os.path.join(work, "merged")
    if keel_cli(keel, work, ["export", ckpt, "--to", merged_dir, "--merge", "--overwrite"], failures):
        merged = hf.load_checkpoint(merged_dir)
        want = hf.model_tensors(peft_model(spec, init, os.path.join(out, "final"), trainable=False).merge_and_unload())
        worst = 0.0
        for name, t in want.items():
            if name not in merged:
                failures.append("keel export --merge lacks %s" % name)
                continue
            err = float((merged[name].double() - t.double()).norm() / t.double().norm())
            worst = max(worst, err)
        print("keel export --merge vs PEFT merge_and_unload of keel's adapter: worst rel err %.2e" % worst)
        if worst > 1e-6:
            failures.append("keel export --merge differs from PEFT's merge_and_unload by %.3g > 1e-6" % worst)
    resumed = os.path.join(work, "resumed")
    common = ["--set", "output_dir=" + resumed, "--set", "checkpoint_dir=" + os.path.join(work, "resumed_ckpt")]
    if keel_cli(keel, work, ["train", "recipe.toml", "--stop-after", "1", "--overwrite"] + common, failures) and \
            keel_cli(keel, work, ["train", "recipe.toml", "--resume", "auto"] + common, failures):
        again = hf.load_safetensors(os.path.join(resumed, "final", "adapter_model.safetensors"))
        same = set(again) == set(final) and all(torch.equal(again[k], final[k]) for k in final)
        print("stopped after step 1 and resumed: adapter %s the uninterrupted run's" % ("equals" if same else "differs from"))
        if not same:
            failures.append("a LoRA run stopped after step 1 and resumed does not end with the same adapter")


def bnb_round_trip(spec, init, double_quantization):
    """The model's projections as bitsandbytes' NF4 holds them (fp32), other tensors unchanged."""
    import bitsandbytes.functional as F
    out = dict(init)
    for name, t in init.items():
        if t.dim() == 2 and ".layers." in name and "embed" not in name:
            packed, state = F.quantize_4bit(t.float().contiguous(), blocksize=64, quant_type="nf4",
                                            compress_statistics=double_quantization)
            out[name] = F.dequantize_4bit(packed, state).float()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keel", required=True)
    ap.add_argument("--family", required=True, choices=sorted(FAMILY_LORA))
    ap.add_argument("--dtype", required=True, choices=("fp32", "bf16"))
    ap.add_argument("--work", required=True)
    ap.add_argument("--backend", default="cpu", choices=("cpu", "reference"))
    ap.add_argument("--timeout", type=int, default=540)
    ap.add_argument("--qlora", choices=("none", "nf4", "nf4-dq"), default="none")
    ap.add_argument("--modules-to-save", default="", help="comma-separated: PEFT's modules_to_save (keel's "
                    "additional_target), e.g. lm_head,embed_tokens")
    args = ap.parse_args()
    global SAVED
    SAVED = [m for m in args.modules_to_save.split(",") if m] or None
    torch.set_num_threads(2)
    work = os.path.abspath(args.work)
    keel = os.path.abspath(args.keel)
    print("LoRA reference test: family=%s dtype=%s backend=%s qlora=%s (torch %s, transformers %s, peft %s)"
          % (args.family, args.dtype, args.backend, args.qlora, torch.__version__, hf.transformers.__version__,
             peft.__version__))

    for stale in ("checkpoints", "resumed", "resumed_ckpt", "merged", "exported_adapter", "initial_adapter"):
        shutil.rmtree(os.path.join(work, stale), ignore_errors=True)  # an earlier run's
    qlora = args.qlora != "none"
    cfg, spec, init, records = tr.write_inputs(work, args.family, args.dtype, args.backend,
                                               {"intermediate_size": 128} if qlora else None)
    # What the trained model computes with: the weights, or under QLoRA bitsandbytes' NF4 of them.
    base = bnb_round_trip(spec, init, args.qlora == "nf4-dq") if qlora else init
    model_dir = os.path.join(work, "model")
    adapter_dir = os.path.join(work, "initial_adapter")
    initial = write_initial_adapter(spec, base, args.family, model_dir, adapter_dir)
    target, _, rslora = FAMILY_LORA[args.family]
    with open(os.path.join(work, "recipe.toml"), "a") as f:
        f.write("finetuning_type = \"lora\"\nlora_rank = %d\nlora_alpha = %d\nlora_target = %s\nuse_rslora = %s\n"
                "adapter_name_or_path = %s\ncheckpoint_dir = %s\n"
                % (RANK, ALPHA, target, "true" if rslora else "false", json.dumps(adapter_dir),
                   json.dumps(os.path.join(work, "checkpoints"))))
        if qlora:
            f.write("quantization_bit = 4\ndouble_quantization = %s\n" % ("true" if args.qlora == "nf4-dq" else "false"))
        if SAVED:
            f.write("additional_target = %s\n" % json.dumps(",".join(SAVED)))
    failures = tr.run_keel(keel, work, args.timeout)
    if failures:
        print("FAIL: " + failures[0])
        return 1

    def train(mode):
        return tr.torch_train(spec, base, records, mode, make_model=lambda: peft_model(spec, base, adapter_dir, True),
                              final_tensors=adapter_tensors)

    ref = train(args.dtype)
    ref_fp32 = train("fp32") if args.dtype == "bf16" else None
    # Double quantization: keel's absmax codes are the nearest, bitsandbytes' native kernel's not
    # always (the docstring): bf16's tolerance, sized by a bf16 run, whatever the dtype.
    tol_dtype = "bf16" if args.qlora == "nf4-dq" else args.dtype
    if tol_dtype == "bf16" and ref_fp32 is None:
        ref_fp32, ref_bf16 = ref, train("bf16")
        ref["tol"] = tr.tensor_tolerances(spec, "bf16", initial, ref_bf16, ref_fp32)
    else:
        ref["tol"] = tr.tensor_tolerances(spec, args.dtype, initial, ref, ref_fp32)
    out_dir = os.path.join(work, "out")
    metrics = tr.read_metrics(os.path.join(out_dir, "metrics.jsonl"), failures)
    final_dir = os.path.join(out_dir, "final")
    try:
        tensors = hf.load_safetensors(os.path.join(final_dir, "adapter_model.safetensors"))
    except Exception as e:  # noqa: BLE001 - report whatever went wrong reading keel's output
        failures.append("cannot read keel's adapter: %s" % e)
        tensors = None
    failures += tr.compare(spec, tol_dtype, {}, initial, ref, metrics, None, tensors)
    if tensors is not None:
        check_adapter_files(final_dir, spec, init, args.family, model_dir, failures)
        err = check_peft_loads(spec, base, final_dir, ref["final"], records, failures)
        bound = tr.TOL[tol_dtype]["weights"] if tol_dtype == "fp32" else 5 * max(t[0] for t in ref["tol"].values())
        if not err <= bound:
            failures.append("PEFT's logits with keel's adapter differ from the reference's by %.3g > %.2g" % (err, bound))
        if args.dtype == "fp32":  # greedy tokens are only stable where the weights agree to fp32 rounding
            check_generate(keel, work, spec, init, final_dir, model_dir, failures)
        check_export_and_resume(keel, work, spec, init, failures)
    if failures:
        print("\nFAIL (LoRA, %s, %s): %d problem(s):" % (args.family, args.dtype, len(failures)))
        for f in failures:
            print("  - " + f)
        return 1
    print("\nPASS (%s, %s, %s): keel matches PEFT" % ("QLoRA " + args.qlora if qlora else "LoRA", args.family,
                                                    args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
