#!/usr/bin/env python3
"""keel export end to end: checkpoints of tiny trained models written as HF model directories.

Checks the exported tensors against the checkpoint's fp32 master weights (fp32 exactly; bf16 and
fp16 rounded to nearest even, computed here with numpy), sharding with an index, the default dtype
and bytes equal to the trainer's own output_dir/final, the glm <-> glm-original conversion, the
tokenizer files (in keel export and in output_dir/final), that the exports load again in keel
(train and generate) and in the PyTorch reference implementation (tests/reference/hf_models.py,
when torch is installed), and clear errors for a corrupt checkpoint and bad arguments.

    $(scripts/python-env.sh) tests/integration/export_test.py KEEL [--only NAME]
"""
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile

from harness import check, run_tests, toml_lines, write_data

import numpy as np

KEEL = os.path.abspath(sys.argv[1])
ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
WORK = tempfile.mkdtemp(prefix="keel_export_test_")
VOCAB = 320  # room for the test tokenizer (300 ids); the training data uses ids below 32


def recipe(name, family="llama", scratch=True, model_keys=(), **overrides):
    """A tiny run writing checkpoints to NAME/ckpt; a model from [model_config] (plus model_keys
    lines) unless scratch=False (then model_name must be among the overrides)."""
    d = os.path.join(WORK, name)
    os.makedirs(d, exist_ok=True)
    keys = {
        "data_path": os.path.join(WORK, "train.jsonl"), "output_dir": os.path.join(d, "out"),
        "checkpoint_dir": os.path.join(d, "ckpt"), "save_interval": 2, "keep_last_n": 5,
        "dtype": "fp32", "max_seq_len": 16, "batch_size": 4, "learning_rate": 3e-3, "warmup_steps": 1,
        "max_steps": 4, "seed": 5, "log_interval": 2,
    }
    keys.update(overrides)
    lines = toml_lines(keys)  # None: key left out
    if scratch:  # model_keys ("key = value") add to or replace the tiny model's keys
        model = ['family = "%s"' % family, "vocab_size = %d" % VOCAB, "hidden_size = 32", "intermediate_size = 64",
                 "num_layers = 2", "num_heads = 4", "num_kv_heads = 2"]
        replaced = {k.split("=")[0].strip() for k in model_keys}
        lines += ["[model_config]"] + [k for k in model if k.split("=")[0].strip() not in replaced] + list(model_keys)
    path = os.path.join(d, "recipe.toml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path, d


def run(args):
    # errors="replace": a tiny random model can generate bytes that are not UTF-8
    return subprocess.run([KEEL] + args, capture_output=True, text=True, errors="replace")


def train(path, what):
    r = run(["train", path])
    check(r.returncode == 0, "%s trains (%s)" % (what, r.stderr.strip()))
    return r


def export(*args):
    return run(["export"] + [str(a) for a in args])


# --- safetensors, read here with numpy only -------------------------------------------------------

NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # bf16 kept as raw bits


def read_safetensors(path):
    """{name: (safetensors dtype, numpy array)} and the metadata."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    metadata = header.pop("__metadata__", {})
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        arr = np.frombuffer(raw[8 + n + b:8 + n + e], dtype=NP_DTYPES[info["dtype"]]).reshape(info["shape"])
        out[name] = (info["dtype"], arr)
    return out, metadata


def read_model_dir(d):
    """All tensors of an HF model directory (single file or shards via the index)."""
    single = os.path.join(d, "model.safetensors")
    if os.path.exists(single):
        return read_safetensors(single)[0]
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        tensors, _ = read_safetensors(os.path.join(d, shard))
        for name, t in tensors.items():
            check(weight_map.get(name) == shard, "%s: index maps %s to %s" % (d, name, shard))
            out[name] = t
    check(set(out) == set(weight_map), "%s: the index lists exactly the tensors of the shards" % d)
    return out


def bf16_bits(x):
    """Round to nearest even, as torch's .to(torch.bfloat16) (no NaNs in trained weights)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def expected_tensors(master, family, cfg):
    """The HF tensors of keel's internal (fused) parameters, written out here independently of
    hf_weights.cpp: {hf name: fp32 array}."""
    I, L = cfg["intermediate"], cfg["layers"]
    Q, KV = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    m = {k: v[1] for k, v in master.items()}
    out = {}
    if family == "glm_original":
        out["transformer.embedding.word_embeddings.weight"] = m["embed"]
        out["transformer.encoder.final_layernorm.weight"] = m["final_norm"]
        out["transformer.output_layer.weight"] = m["lm_head"]
        for l in range(L):
            p, i = "transformer.encoder.layers.%d." % l, "layers.%d." % l
            out[p + "input_layernorm.weight"] = m[i + "input_norm"]
            out[p + "self_attention.query_key_value.weight"] = m[i + "qkv.weight"]
            out[p + "self_attention.query_key_value.bias"] = m[i + "qkv.bias"]
            out[p + "self_attention.dense.weight"] = m[i + "o.weight"]
            out[p + "post_attention_layernorm.weight"] = m[i + "post_attention_norm"]
            out[p + "mlp.dense_h_to_4h.weight"] = m[i + "gate_up.weight"]
            out[p + "mlp.dense_4h_to_h.weight"] = m[i + "down.weight"]
        return out
    out["model.embed_tokens.weight"] = m["embed"]
    out["model.norm.weight"] = m["final_norm"]
    out["lm_head.weight"] = m["lm_head"]
    for l in range(L):
        p, i = "model.layers.%d." % l, "layers.%d." % l
        out[p + "input_layernorm.weight"] = m[i + "input_norm"]
        for proj, (lo, hi) in (("q_proj", (0, Q)), ("k_proj", (Q, Q + KV)), ("v_proj", (Q + KV, Q + 2 * KV))):
            out[p + "self_attn.%s.weight" % proj] = m[i + "qkv.weight"][lo:hi]
            if i + "qkv.bias" in m:
                out[p + "self_attn.%s.bias" % proj] = m[i + "qkv.bias"][lo:hi]
        if i + "q_norm" in m:  # qwen3
            out[p + "self_attn.q_norm.weight"] = m[i + "q_norm"]
            out[p + "self_attn.k_norm.weight"] = m[i + "k_norm"]
        out[p + "self_attn.o_proj.weight"] = m[i + "o.weight"]
        if i + "attention_output_norm" in m:  # Gemma: a norm on each branch's output
            out[p + "post_attention_layernorm.weight"] = m[i + "attention_output_norm"]
            out[p + "pre_feedforward_layernorm.weight"] = m[i + "post_attention_norm"]
            out[p + "post_feedforward_layernorm.weight"] = m[i + "mlp_output_norm"]
        else:
            out[p + "post_attention_layernorm.weight"] = m[i + "post_attention_norm"]
        if family == "glm":
            out[p + "mlp.gate_up_proj.weight"] = m[i + "gate_up.weight"]
        else:
            out[p + "mlp.gate_proj.weight"] = m[i + "gate_up.weight"][:I]
            out[p + "mlp.up_proj.weight"] = m[i + "gate_up.weight"][I:]
        out[p + "mlp.down_proj.weight"] = m[i + "down.weight"]
    return out


TINY = {"hidden": 32, "intermediate": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 8}


def check_weights(export_dir, step_dir, family, dtype, what, shape=None):
    """The exported tensors are the checkpoint's master weights in `dtype`, bit for bit."""
    master, _ = read_safetensors(os.path.join(step_dir, "weights.safetensors"))
    expected = expected_tensors(master, family, shape or TINY)
    got = read_model_dir(export_dir)
    if not check(set(got) == set(expected), "%s: tensor names %s" % (what, sorted(set(got) ^ set(expected)))):
        return
    st = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}[dtype]
    bad = []
    for name, want in expected.items():
        got_dtype, arr = got[name]
        if got_dtype != st or list(arr.shape) != list(want.shape):
            bad.append("%s: %s %s" % (name, got_dtype, list(arr.shape)))
        elif dtype == "fp32" and not np.array_equal(arr.view(np.uint32), want.view(np.uint32)):
            bad.append(name)
        elif dtype == "bf16" and not np.array_equal(arr, bf16_bits(want)):
            bad.append(name)
        elif dtype == "fp16" and not np.array_equal(arr.view(np.uint16), want.astype(np.float16).view(np.uint16)):
            bad.append(name)
    check(not bad, "%s: %s tensors equal the master weights (%s)" % (what, dtype, bad[:3]))


def config_of(d):
    with open(os.path.join(d, "config.json")) as f:
        return json.load(f)


def generate_ids(model_dir, prompt="1,2,3,4", n=6):
    r = run(["generate", "--model", model_dir, "--prompt-ids", prompt, "--max-new-tokens", str(n), "--ids"])
    check(r.returncode == 0, "keel generate loads %s (%s)" % (model_dir, r.stderr.strip()))
    return [int(x) for x in r.stdout.split()]


def torch_reference():
    """tests/reference/hf_models.py: transformers' model classes and an independent safetensors
    reader (the reference environment always has them: a missing import fails the test)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
    import hf_models
    return hf_models


def check_torch_loads(model_dir, what):
    """The export loads with transformers' from_pretrained (its own config and weight reading;
    the original ChatGLM format, which transformers has no class for, through the reference's
    conversion), gives the logits of the reference model built from the tensors as read
    independently, and continues a prompt with the same greedy tokens as keel."""
    hm = torch_reference()
    import torch
    import transformers
    with open(os.path.join(model_dir, "config.json")) as f:
        family = hm.family_of_config(json.load(f))
    _, _, ref = hm.load_model(model_dir)  # strict: every tensor name and shape must match
    if family == "glm_original":
        model = ref
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()
        ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
        with torch.no_grad():
            got, want = model(input_ids=ids).logits, hm.logits(ref, ids)
        err = float((got - want).abs().max() / want.abs().max())
        check(err == 0.0, "%s: from_pretrained gives the reference's logits (max rel diff %.1e)" % (what, err))
    prompt = [1, 2, 3, 4]
    expected = hm.greedy_generate(model, prompt, 6)
    check(generate_ids(model_dir, ",".join(map(str, prompt))) == expected,
          "%s: keel and transformers' generate continue the prompt identically (%s)" % (what, expected))


# --- tests -----------------------------------------------------------------------------------------


def test_weights_dtypes_and_shards():
    path, d = recipe("llama", dtype="bf16")
    train(path, "the llama run")
    ck = os.path.join(d, "ckpt")
    step2, step4 = os.path.join(ck, "step-00000002"), os.path.join(ck, "step-00000004")

    out = os.path.join(d, "fp32")
    r = export(step2, "--to", out, "--dtype", "fp32")
    if check(r.returncode == 0, "export of a step directory in fp32 (%s)" % r.stderr.strip()):
        check_weights(out, step2, "llama", "fp32", "step 2, fp32")
        import torch  # the rounding computed here is torch's
        w = read_safetensors(os.path.join(step2, "weights.safetensors"))[0]["embed"][1]
        t = torch.from_numpy(w.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        check(np.array_equal(t, bf16_bits(w)), "bf16 rounding here equals torch's .to(torch.bfloat16)")
        check(config_of(out)["torch_dtype"] == "float32", "config.json says float32")
        check("step 2" in r.stdout, "the output names the step exported (%s)" % r.stdout.strip())
        check_torch_loads(out, "llama fp32 export")

    # The checkpoint_dir: its `latest` (step 4, the last step), in the run's dtype by default (bf16
    # for a new model trained in bf16) -- the very bytes the trainer wrote to output_dir/final.
    latest = os.path.join(d, "latest")
    r = export(ck, "--to", latest)
    if check(r.returncode == 0, "export of a checkpoint_dir (%s)" % r.stderr.strip()):
        check_weights(latest, step4, "llama", "bf16", "latest, default dtype")
        final = os.path.join(d, "out", "final")
        for name in ("model.safetensors", "config.json"):
            with open(os.path.join(latest, name), "rb") as a, open(os.path.join(final, name), "rb") as b:
                check(a.read() == b.read(), "latest export: %s equals output_dir/final's" % name)
        _, meta = read_safetensors(os.path.join(latest, "model.safetensors"))
        check(meta.get("format") == "pt", "safetensors metadata has format=pt (transformers needs it)")
        check(generate_ids(latest) == generate_ids(final), "the export generates as output_dir/final does")

    out = os.path.join(d, "fp16")
    r = export(step4, "--to", out, "--dtype", "fp16")
    if check(r.returncode == 0, "export in fp16 (%s)" % r.stderr.strip()):
        check_weights(out, step4, "llama", "fp16", "step 4, fp16")
        check(config_of(out)["torch_dtype"] == "float16", "config.json says float16")
        generate_ids(out)

    # Sharded: every tensor is ~2-40 KiB in fp32, so 16KB makes several shards and an index.
    out = os.path.join(d, "sharded")
    r = export(step4, "--to", out, "--dtype", "fp32", "--max-shard-size", "16KB")
    if check(r.returncode == 0, "sharded export (%s)" % r.stderr.strip()):
        shards = sorted(f for f in os.listdir(out) if f.startswith("model-"))
        check(len(shards) > 1 and shards[0].endswith("-of-%05d.safetensors" % len(shards)),
              "several shards named as transformers names them (%s)" % shards)
        check(not os.path.exists(os.path.join(out, "model.safetensors")), "no single file next to the shards")
        for shard in shards:
            tensors, _ = read_safetensors(os.path.join(out, shard))
            size = sum(a.nbytes for _, a in tensors.values())
            check(size <= 16 * 1024 or len(tensors) == 1, "%s holds %d bytes: within the limit" % (shard, size))
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            index = json.load(f)
        total = sum(a.nbytes for _, a in read_model_dir(out).values())
        check(index["metadata"]["total_size"] == total, "index total_size is the tensors' bytes")
        check_weights(out, step4, "llama", "fp32", "sharded fp32")
        # Exporting again into the same directory unsharded leaves no stale shard behind.
        r = export(step4, "--to", out)
        check(r.returncode == 0 and sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"],
              "re-export replaces the shards by one file (%s)" % os.listdir(out))

    # The exported directory is a model keel fine-tunes again.
    path2, d2 = recipe("reload", scratch=False, model_name=latest, max_steps=1, save_interval=None,
                       checkpoint_dir=None)
    train(path2, "a run starting from the export")


def test_sharded_checkpoint():
    """A sharded checkpoint (checkpoint_layout = "sharded", here on one rank) exports to the same
    bytes as the single-file checkpoint of the same run, and as the run's own final model; a
    corrupt piece stops the export naming it, and nothing is written."""
    finals = {}
    for layout in ("single_file", "sharded"):
        path, d = recipe("layout_" + layout, checkpoint_layout=layout)
        if not check(train(path, "the %s run" % layout).returncode == 0, "%s run" % layout):
            return
        out = os.path.join(d, "export")
        r = export(os.path.join(d, "ckpt"), "--to", out)
        if not check(r.returncode == 0, "export of the %s checkpoint (%s)" % (layout, r.stderr.strip())):
            return
        with open(os.path.join(out, "model.safetensors"), "rb") as f:
            finals[layout] = f.read()
        with open(os.path.join(d, "out", "final", "model.safetensors"), "rb") as f:
            check(f.read() == finals[layout], "%s: the export equals the run's final model" % layout)
    step = os.path.join(WORK, "layout_sharded", "ckpt", "step-00000004")
    check(os.path.exists(os.path.join(step, "shard-00000-of-00001.bin")), "the sharded run wrote a shard file")
    check(finals["sharded"] == finals["single_file"], "the sharded checkpoint exports the single file's bytes")
    with open(os.path.join(step, "manifest.json")) as f:
        piece = [p for p in json.load(f)["pieces"] if p["kind"] == "weights"][2]
    with open(os.path.join(step, "shard-00000-of-00001.bin"), "r+b") as f:
        f.seek(piece["offset"])
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    out = os.path.join(WORK, "layout_sharded", "corrupt_export")
    r = export(step, "--to", out)
    name = "%s[%d:%d]" % (piece["tensor"], piece["begin"], piece["end"])
    check(r.returncode == 2 and name in r.stderr and "corrupt" in r.stderr and not os.path.exists(out),
          "a corrupt piece stops the export, naming %s (%s)" % (name, r.stderr.strip()))


def test_tokenizer_files():
    # A base model directory with a tokenizer: a tiny model's final/ plus a keel-trained tokenizer.
    corpus = os.path.join(WORK, "corpus.jsonl")
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "export", "keel", "model", "tokens", "the", "a"]
    with open(corpus, "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(12))}) + "\n")
    base_path, base_d = recipe("base", max_steps=1, save_interval=None, checkpoint_dir=None)
    train(base_path, "the base model")
    base = os.path.join(base_d, "out", "final")
    r = run(["tokenizer", "train", "--data", corpus, "--vocab-size", "300", "--special", "<|endoftext|>",
             "--out", os.path.join(base, "tokenizer.json")])
    check(r.returncode == 0, "tokenizer train (%s)" % r.stderr.strip())
    extra = {
        "tokenizer_config.json": json.dumps({"eos_token": "<|endoftext|>", "model_max_length": 16}),
        "special_tokens_map.json": json.dumps({"eos_token": "<|endoftext|>"}),
        "generation_config.json": json.dumps({"eos_token_id": 0, "max_new_tokens": 8}),
        "merges.txt": "#version: 0.2\n",
    }
    for name, text in extra.items():
        with open(os.path.join(base, name), "w") as f:
            f.write(text)
    copied = ["tokenizer.json"] + sorted(extra)

    path, d = recipe("tuned", scratch=False, model_name=base)
    train(path, "a fine-tuning run of the base model")
    final = os.path.join(d, "out", "final")
    out = os.path.join(d, "export")
    r = export(os.path.join(d, "ckpt"), "--to", out)
    check(r.returncode == 0, "export of the fine-tuned model (%s)" % r.stderr.strip())
    check(config_of(out)["torch_dtype"] == "float32", "default dtype: that of the base model's weights (fp32)")
    for where in (final, out):
        for name in copied:
            src, dst = os.path.join(base, name), os.path.join(where, name)
            same = os.path.exists(dst) and open(src, "rb").read() == open(dst, "rb").read()
            check(same, "%s is copied into %s" % (name, where))
    check("tokenizer.json" in r.stdout, "keel export lists the tokenizer files (%s)" % r.stdout.strip())
    # The export is self-contained: keel generate reads its tokenizer for a text prompt.
    g = run(["generate", "--model", out, "--prompt", "alpha beta gamma", "--max-new-tokens", "4"])
    check(g.returncode == 0, "keel generate with the exported tokenizer (%s)" % g.stderr.strip())

    # A base model that moved: the recipe's model_name no longer exists.
    moved = base + ".moved"
    shutil.move(base, moved)
    r = export(os.path.join(d, "ckpt"), "--to", os.path.join(d, "export2"))
    check(r.returncode == 2 and base in r.stderr and "--set model_name" in r.stderr,
          "a missing base model is named, with the way out (%s)" % r.stderr.strip())
    r = export(os.path.join(d, "ckpt"), "--to", os.path.join(d, "export2"), "--set", "model_name=" + moved)
    check(r.returncode == 0, "--set model_name points at the moved base model (%s)" % r.stderr.strip())
    shutil.move(moved, base)


def test_glm_formats():
    path, d = recipe("glm", family="glm")
    train(path, "the glm run")
    step4 = os.path.join(d, "ckpt", "step-00000004")
    hf, orig = os.path.join(d, "hf"), os.path.join(d, "original")
    r = export(step4, "--to", hf, "--dtype", "fp32")
    check(r.returncode == 0 and config_of(hf)["architectures"] == ["GlmForCausalLM"], "glm export (%s)" % r.stderr)
    check_weights(hf, step4, "glm", "fp32", "glm, fp32")
    r = export(step4, "--to", orig, "--dtype", "fp32", "--format", "glm-original")
    if not check(r.returncode == 0, "glm export in the original format (%s)" % r.stderr.strip()):
        return
    cfg = config_of(orig)
    check(cfg["architectures"] == ["ChatGLMModel"] and cfg["model_type"] == "chatglm" and
          cfg["padded_vocab_size"] == VOCAB and cfg["kv_channels"] == 8 and cfg["add_qkv_bias"] is True,
          "ChatGLM config.json (%s)" % cfg)
    check_weights(orig, step4, "glm_original", "fp32", "glm-original, fp32")
    check(generate_ids(orig) == generate_ids(hf), "both formats generate the same tokens in keel")
    check_torch_loads(orig, "glm-original export")
    check_torch_loads(hf, "glm export")

    # A run that starts from the original format exports as it was loaded, or --format hf.
    path2, d2 = recipe("chatglm", scratch=False, model_name=orig, max_steps=2)
    train(path2, "a run starting from the ChatGLM export")
    step = os.path.join(d2, "ckpt", "step-00000002")
    r = export(step, "--to", os.path.join(d2, "same"))
    check(r.returncode == 0 and config_of(os.path.join(d2, "same"))["architectures"] == ["ChatGLMModel"],
          "default format: as trained (%s)" % r.stderr.strip())
    r = export(step, "--to", os.path.join(d2, "hf"), "--format", "hf")
    check(r.returncode == 0 and config_of(os.path.join(d2, "hf"))["architectures"] == ["GlmForCausalLM"],
          "--format hf turns ChatGLM into GlmForCausalLM (%s)" % r.stderr.strip())
    check_weights(os.path.join(d2, "hf"), step, "glm", "fp32", "ChatGLM run exported as hf")


def test_newer_families():
    """New models of the families keel added last: their generated config.json is read by
    transformers as keel read it (Qwen3's q/k norms and head_dim, Mistral's sliding window,
    Gemma's layout, scalar, caps, window pattern and RoPE bases)."""
    for family, keys in (("qwen3", ["head_dim = 16"]), ("mistral", ["sliding_window = 3"]),
                         ("gemma2", ["head_dim = 8", "sliding_window = 3"]),
                         ("gemma3", ["head_dim = 8", "sliding_window = 3", "num_layers = 6"])):
        path, d = recipe(family, family=family, model_keys=keys)
        train(path, "the %s run" % family)
        step4 = os.path.join(d, "ckpt", "step-00000004")
        out = os.path.join(d, "hf")
        r = export(step4, "--to", out, "--dtype", "fp32")
        if not check(r.returncode == 0, "%s export (%s)" % (family, r.stderr.strip())):
            continue
        cfg = config_of(out)
        if family == "qwen3":
            check(cfg["head_dim"] == 16 and cfg["use_sliding_window"] is False, "Qwen3 config.json (%s)" % cfg)
            check_weights(out, step4, family, "fp32", "qwen3, fp32", dict(TINY, head_dim=16))
        elif family == "mistral":
            check(cfg["sliding_window"] == 3, "Mistral config.json keeps the window (%s)" % cfg)
            check_weights(out, step4, family, "fp32", "mistral, fp32")
        else:
            expected_types = (["sliding_attention", "full_attention"] if family == "gemma2" else
                              ["sliding_attention"] * 5 + ["full_attention"])
            check(cfg["sliding_window"] == 3 and cfg["layer_types"] == expected_types and
                  cfg["query_pre_attn_scalar"] == 256, "%s config.json (%s)" % (family, cfg))
            check_weights(out, step4, family, "fp32", family + ", fp32",
                          dict(TINY, layers=2 if family == "gemma2" else 6))
        check_torch_loads(out, "%s export" % family)


def test_errors():
    path, d = recipe("errors", max_steps=2)
    train(path, "the errors run")
    ck = os.path.join(d, "ckpt")
    step = os.path.join(ck, "step-00000002")
    to = os.path.join(d, "to")

    def fails(args, expected, label):
        r = export(*args)
        ok = r.returncode == 2 and all(e in r.stderr for e in expected)
        check(ok, "%s: exit 2 and a message containing %s (got %d: %s)" % (label, expected, r.returncode,
                                                                           r.stderr.strip()))

    missing = os.path.join(d, "no-such-checkpoint")
    fails([missing, "--to", to], [missing, "does not exist"], "a missing checkpoint")
    fails([os.path.join(d, "out"), "--to", to], ["manifest.json", "latest"], "a directory that is no checkpoint")
    fails([step, "--to", to, "--dtype", "int8"], ["--dtype", "int8", "bf16, fp16 or fp32"], "an unknown dtype")
    fails([step, "--to", to, "--format", "onnx"], ["--format", "onnx", "glm-original", "gguf"], "an unknown format")
    fails([step, "--to", to, "--format", "gguf"], ["--to", "ending in .gguf"], "a GGUF export to a directory")
    fails([step, "--to", to + ".gguf", "--outtype", "q8_0"], ["--outtype", "--format gguf"], "--outtype without gguf")
    fails([step, "--to", to + ".gguf", "--format", "gguf"], ["GGUF", "tokenizer"], "a GGUF export without a tokenizer")
    fails([step, "--to", to, "--max-shard-size", "lots"], ["--max-shard-size", "lots"], "a bad shard size")
    blocker = os.path.join(d, "a-file")
    open(blocker, "w").close()
    fails([step, "--to", os.path.join(blocker, "sub")], [blocker, "not a directory"], "a destination under a file")
    if os.geteuid() != 0:  # root writes anywhere
        ro = os.path.join(d, "read-only")
        os.makedirs(ro)
        os.chmod(ro, 0o500)
        fails([step, "--to", ro], [ro, "not writable"], "a read-only destination")
        os.chmod(ro, 0o700)
    fails([step, "--to", step], ["is the input checkpoint"], "the checkpoint as destination")
    fails([step, "--to", to, "--format", "glm-original"], ["llama", "glm_original"],
          "--format glm-original of a llama model")
    check(not os.path.exists(to), "a failed export leaves no directory behind")

    # A flipped byte in the master weights, reached directly and through `latest`.
    with open(os.path.join(step, "weights.safetensors"), "r+b") as f:
        size = os.path.getsize(f.name)
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0x40]))
    weights = os.path.join(step, "weights.safetensors")
    fails([step, "--to", to], [weights, "checksum"], "a corrupt weights.safetensors")
    fails([ck, "--to", to], [weights, "checksum"], "a corrupt latest checkpoint")
    check(not os.path.exists(to), "a failed export leaves no directory behind")


def main():
    write_data(os.path.join(WORK, "train.jsonl"), 100, seed=1)
    run_tests(globals(), "export", WORK, only=ONLY, skip=None)


if __name__ == "__main__":
    main()
