"""The reference models of the decoder-only families keel supports -- transformers' own classes,
built from a config.json and a {tensor name: tensor} dict -- plus a self-contained safetensors
reader/writer (kept independent of the safetensors package, so that a bug shared by keel and that
package's reading cannot hide).

Families (tensor names and config keys follow the Hugging Face checkpoints exactly):
  llama         LlamaForCausalLM               rotate_half RoPE, pairs (i, i + d/2)
  qwen2         Qwen2ForCausalLM               llama + q/k/v biases (optionally tied LM head)
  glm           GlmForCausalLM (glm-4-9b-hf)   fused mlp.gate_up_proj, q/k/v biases,
                                               partial (partial_rotary_factor) interleaved RoPE
  glm_original  ChatGLMModel (THUDM/glm-4-9b)  fused query_key_value and dense_h_to_4h, interleaved
                                               RoPE over the first kv_channels/2 channels,
                                               base 10000 * rope_ratio
  qwen3         Qwen3ForCausalLM               llama + q_norm/k_norm (RMSNorm of each head before
                                               RoPE), head_dim independent of hidden/heads
  mistral       MistralForCausalLM             llama + sliding-window attention
  gemma2        Gemma2ForCausalLM              (1 + w) RMSNorms, also on each branch's output
                                               (sandwich), GeGLU, embeddings x sqrt(hidden),
                                               query_pre_attn_scalar, attention-logit and final-logit
                                               soft-capping, alternating sliding/full layers, tied
  gemma3        Gemma3ForCausalLM (text)       gemma2's layout + (1 + w) q/k norms, a local RoPE base
                                               for the sliding layers, no caps by default

build_model/load_weights/model_tensors speak the family's checkpoint names; the model's parameter
names are transformers' (the same, except glm_original, which runs as GlmForCausalLM).
"""
import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np

# Nothing is downloaded at run time, and the tests' logs are not progress bars.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import torch
import torch.nn.functional as F
import transformers

FAMILIES = ("llama", "qwen2", "glm", "glm_original", "qwen3", "mistral", "gemma2", "gemma3")

# --------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------

# safetensors dtype string -> (torch dtype, little-endian numpy dtype used to (de)serialize)
_ST_DTYPES = {
    "F64": (torch.float64, "<f8"),
    "F32": (torch.float32, "<f4"),
    "F16": (torch.float16, "<f2"),
    "BF16": (torch.bfloat16, "<i2"),  # raw bits through int16
    "I64": (torch.int64, "<i8"),
    "I32": (torch.int32, "<i4"),
    "I16": (torch.int16, "<i2"),
    "I8": (torch.int8, "i1"),
    "U8": (torch.uint8, "u1"),
    "BOOL": (torch.bool, "?"),
}
_TORCH_TO_ST = {v[0]: k for k, v in _ST_DTYPES.items()}


def safetensors_dtype(t):
    """The safetensors dtype string ("F32", "BF16", ...) of a torch tensor."""
    if t.dtype not in _TORCH_TO_ST:
        raise ValueError("unsupported dtype for safetensors: %s" % t.dtype)
    return _TORCH_TO_ST[t.dtype]


def _tensor_bytes(t):
    t = t.detach().cpu().contiguous()
    st = safetensors_dtype(t)
    np_dtype = _ST_DTYPES[st][1]
    if t.dtype == torch.bfloat16:
        arr = t.view(torch.int16).numpy()
    else:
        arr = t.numpy()
    return np.ascontiguousarray(arr.astype(np_dtype, copy=False)).tobytes()


def save_safetensors(path, tensors, metadata=None):
    """Writes {name: tensor} to `path` in safetensors format (tensors in sorted name order).

    The JSON header is padded with spaces to a multiple of 8 bytes, as the reference
    implementation does; metadata (str -> str) goes into "__metadata__".
    """
    header = {}
    chunks = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        data = _tensor_bytes(t)
        header[name] = {
            "dtype": safetensors_dtype(t),
            "shape": [int(s) for s in t.shape],
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((8 - len(hjson) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for c in chunks:
            f.write(c)
    os.replace(tmp, path)


def load_safetensors(path, with_metadata=False):
    """Reads a safetensors file into {name: torch tensor} (copies, in the stored dtype).

    Checks the header thoroughly (sizes, offsets inside the data section, contiguous
    non-overlapping ranges) and raises ValueError naming the file and tensor otherwise.
    """
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError("%s: file too short for a safetensors header" % path)
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError("%s: header length %d exceeds file size %d" % (path, n, len(raw)))
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("%s: header is not a JSON object" % path)
    data = memoryview(raw)[8 + n:]
    metadata = header.pop("__metadata__", None) or {}
    out = {}
    ranges = []
    for name, info in header.items():
        st = info.get("dtype")
        if st not in _ST_DTYPES:
            raise ValueError("%s: tensor %r has unsupported dtype %r" % (path, name, st))
        tdtype, np_dtype = _ST_DTYPES[st]
        shape = [int(s) for s in info["shape"]]
        b, e = (int(x) for x in info["data_offsets"])
        numel = 1
        for s in shape:
            if s < 0:
                raise ValueError("%s: tensor %r has a negative dimension" % (path, name))
            numel *= s
        itemsize = np.dtype(np_dtype).itemsize
        if not (0 <= b <= e <= len(data)) or e - b != numel * itemsize:
            raise ValueError("%s: tensor %r: bad data_offsets [%d, %d] for shape %s %s (data %d bytes)"
                             % (path, name, b, e, shape, st, len(data)))
        ranges.append((b, e, name))
        arr = np.frombuffer(data[b:e], dtype=np_dtype).reshape(shape)
        t = torch.from_numpy(arr.astype(np.dtype(np_dtype).newbyteorder("="), copy=True))
        if st == "BF16":
            t = t.view(torch.bfloat16)
        out[name] = t
    ranges.sort()
    pos = 0
    for b, e, name in ranges:
        if b != pos:
            raise ValueError("%s: tensor %r data is not contiguous with the previous one" % (path, name))
        pos = e
    if pos != len(data):
        raise ValueError("%s: %d trailing bytes after the last tensor" % (path, len(data) - pos))
    return (out, metadata) if with_metadata else out


def load_checkpoint(model_dir):
    """All tensors of a HF model directory: model.safetensors or a sharded
    model.safetensors.index.json ({"weight_map": {name: file}})."""
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(single):
        return load_safetensors(single)
    if not os.path.exists(index):
        raise FileNotFoundError("%s: neither model.safetensors nor model.safetensors.index.json" % model_dir)
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        tensors = load_safetensors(os.path.join(model_dir, shard))
        for name, t in tensors.items():
            if weight_map.get(name) != shard:
                raise ValueError("%s: tensor %r is in %s but the index maps it to %r"
                                 % (model_dir, name, shard, weight_map.get(name)))
            out[name] = t
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise ValueError("%s: index lists tensors missing from the shards: %s" % (model_dir, missing))
    return out


def save_checkpoint(model_dir, config, tensors, shards=1):
    """Writes config.json and the weights (one file, or `shards` files plus an index)."""
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    names = sorted(tensors)
    if shards <= 1:
        save_safetensors(os.path.join(model_dir, "model.safetensors"), tensors, {"format": "pt"})
        return
    weight_map = {}
    per = int(math.ceil(len(names) / shards))
    total = 0
    for i in range(shards):
        part = names[i * per:(i + 1) * per]
        fname = "model-%05d-of-%05d.safetensors" % (i + 1, shards)
        save_safetensors(os.path.join(model_dir, fname), {n: tensors[n] for n in part}, {"format": "pt"})
        for n in part:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------

@dataclass
class ModelSpec:
    """The architecture, family-independent (what keel's ModelConfig holds)."""
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_interleaved: bool
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    qk_norm: bool = False      # qwen3, gemma3
    sliding_window: int = 0    # mistral (0: none)
    extra: tuple = ()          # gemma: the config keys beyond the shared ones, as (key, value) pairs
    # The model's nn.Embedding(padding_idx=...): config.pad_token_id as the family's config class
    # reads it (None: no padding row; glm_original's ChatGLM has none whatever its config says).
    pad_token_id: int = None

    @property
    def gemma(self):
        return self.family in ("gemma2", "gemma3")


# The special tokens of the tiny models, placed as the real checkpoints place them (ids below 8,
# so every family's data can hold them): where pad is a token the model also reads and predicts
# (EOS or end-of-turn, as many instruct models and their fine-tunes set it) transformers' padding
# row semantics matter, and the reference data holds all of these ids in input and target positions.
SPECIAL_IDS = {
    "llama": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},              # pad = EOS
    "qwen2": {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 3},         # pad = end of turn
    "glm": {"bos_token_id": 1, "eos_token_id": [2, 4, 5], "pad_token_id": 2},        # GLM-4: pad = eos[0]
    "glm_original": {"bos_token_id": 1, "eos_token_id": [2, 4, 5], "pad_token_id": 2},
    "qwen3": {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 3},
    "mistral": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},
    "gemma2": {"bos_token_id": 2, "eos_token_id": [1, 6], "pad_token_id": 0},        # Gemma: <pad> 0, <eos> 1, <bos> 2
    "gemma3": {"bos_token_id": 2, "eos_token_id": [1, 6], "pad_token_id": 0},
}
# The config classes' pad_token_id where config.json has none (transformers' defaults).
_PAD_DEFAULTS = {"gemma2": 0, "gemma3": 0, "glm": 151329}


def special_ids(cfg):
    """The distinct special-token ids a config.json names (bos, eos, pad), sorted."""
    ids = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = cfg.get(key)
        ids.update(v if isinstance(v, list) else [] if v is None else [v])
    return sorted(ids)


# The transformers families' own keys beside the shared ones (defaults where tie_word_embeddings
# is None: the family's usual small-model choice).
_TRANSFORMERS_FAMILY_KEYS = {
    "llama": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
               "mlp_bias": False}, False),
    "qwen2": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False}, True),
    "glm": ({"architectures": ["GlmForCausalLM"], "model_type": "glm", "attention_bias": True}, False),
    "qwen3": ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
               "use_sliding_window": False}, True),
    "mistral": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, False),
    # Caps far below Gemma 2's 50 / 30 and a scalar other than head_dim, so that each matters at
    # these sizes; windows shorter than the tests' sequences; layers of both kinds.
    "gemma2": ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_act": "gelu_pytorch_tanh",
                "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "query_pre_attn_scalar": 24,
                "attn_logit_softcapping": 1.5, "final_logit_softcapping": 3.0, "sliding_window": 5}, True),
    "gemma3": ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                "query_pre_attn_scalar": 24, "sliding_window": 5, "rope_local_base_freq": 100.0,
                "final_logit_softcapping": 3.0, "attn_logit_softcapping": None}, True),
}
# The keys of a gemma config the spec carries as they are (ModelSpec.extra).
_GEMMA_KEYS = ("hidden_act", "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
               "final_logit_softcapping", "sliding_window", "rope_local_base_freq", "layer_types")


def make_config(family, vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=None, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=64, tie_word_embeddings=None, partial_rotary_factor=0.5,
                rope_ratio=1, sliding_window=5):
    """config.json (as a dict) of a model of `family` in its Hugging Face format. head_dim
    defaults to 16 (hidden / heads), for qwen3 to 32: independent of hidden / heads, as in the real
    Qwen3 configs. mistral's sliding_window defaults to 5, shorter than the tests' sequences."""
    if head_dim is None:
        head_dim = 32 if family == "qwen3" else 16
    if family == "glm_original":
        return {
            "architectures": ["ChatGLMModel"], "model_type": "chatglm",
            "num_layers": num_layers, "padded_vocab_size": vocab_size,
            "hidden_size": hidden_size, "ffn_hidden_size": intermediate_size,
            "kv_channels": head_dim, "num_attention_heads": num_heads,
            "multi_query_attention": True, "multi_query_group_num": num_kv_heads,
            "layernorm_epsilon": rms_norm_eps, "rmsnorm": True, "add_qkv_bias": True,
            "add_bias_linear": False, "apply_residual_connection_post_layernorm": False,
            "post_layer_norm": True, "rope_ratio": rope_ratio, "seq_length": max_position_embeddings,
            "original_rope": True, **SPECIAL_IDS[family],
            "tie_word_embeddings": bool(tie_word_embeddings) if tie_word_embeddings is not None else False,
            "torch_dtype": "float32",
        }
    if family not in _TRANSFORMERS_FAMILY_KEYS:
        raise ValueError("unknown family %r (expected one of %s)" % (family, ", ".join(FAMILIES)))
    own, tied_default = _TRANSFORMERS_FAMILY_KEYS[family]
    cfg = {
        "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": bool(tie_word_embeddings) if tie_word_embeddings is not None else tied_default,
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    cfg.update(own)
    cfg.update(SPECIAL_IDS[family])
    if family == "glm":
        cfg["partial_rotary_factor"] = partial_rotary_factor
    if family == "mistral":
        cfg["sliding_window"] = sliding_window
    if family in ("gemma2", "gemma3"):
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    return cfg


def family_of_config(cfg):
    mt = cfg.get("model_type")
    arch = (cfg.get("architectures") or [""])[0]
    known = {f: (keys["model_type"], keys["architectures"]) for f, (keys, _) in _TRANSFORMERS_FAMILY_KEYS.items()}
    known["glm_original"] = ("chatglm", ["ChatGLMModel", "ChatGLMForConditionalGeneration"])
    for family, (model_type, architectures) in known.items():
        if mt == model_type or arch in architectures:
            return family
    raise ValueError("unsupported config: model_type=%r architectures=%r" % (mt, arch))


def spec_from_config(cfg):
    """ModelSpec from a config.json dict, interpreting keys exactly as transformers (or, for
    glm_original, THUDM's modeling_chatglm.py) does."""
    family = family_of_config(cfg)
    if family == "glm_original":
        if not cfg.get("rmsnorm", True) or cfg.get("apply_residual_connection_post_layernorm", False) \
                or not cfg.get("post_layer_norm", True) or cfg.get("add_bias_linear", False):
            raise ValueError("glm_original: only rmsnorm, pre-norm, post_layer_norm, no linear biases")
        heads = cfg["num_attention_heads"]
        hd = cfg.get("kv_channels") or cfg["hidden_size"] // heads
        kv = cfg["multi_query_group_num"] if cfg.get("multi_query_attention", False) else heads
        return ModelSpec(
            family=family, vocab_size=cfg["padded_vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["ffn_hidden_size"], num_layers=cfg["num_layers"],
            num_heads=heads, num_kv_heads=kv, head_dim=hd, rotary_dim=hd // 2,
            rope_interleaved=True, rope_theta=10000.0 * cfg.get("rope_ratio", 1),
            rms_norm_eps=cfg["layernorm_epsilon"], qkv_bias=bool(cfg.get("add_qkv_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("seq_length", 2048), pad_token_id=None)
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or (128 if family == "qwen3" else 256 if family.startswith("gemma")
                                 else cfg["hidden_size"] // heads)
    rot = hd
    if family == "glm":
        rot = int(hd * cfg.get("partial_rotary_factor", 0.5))
    if family == "qwen2":
        qkv_bias = True
    else:
        qkv_bias = bool(cfg.get("attention_bias", False))
    return ModelSpec(
        family=family, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads, head_dim=hd,
        rotary_dim=rot, rope_interleaved=(family == "glm"),
        rope_theta=float(cfg.get("rope_theta", 10000.0)), rms_norm_eps=cfg["rms_norm_eps"],
        qkv_bias=qkv_bias, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        qk_norm=family in ("qwen3", "gemma3"),
        sliding_window=(cfg.get("sliding_window", 4096) or 0) if family == "mistral" else 0,
        extra=tuple((k, cfg[k]) for k in _GEMMA_KEYS if k in cfg) if family.startswith("gemma") else (),
        pad_token_id=cfg["pad_token_id"] if "pad_token_id" in cfg else _PAD_DEFAULTS.get(family))


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------

# The reference models are transformers' own classes. The ChatGLM original format has no class in
# transformers (its modeling file is remote code); it is converted to GlmForCausalLM exactly as
# transformers' convert_glm_weights_to_hf.py does (glm_original_to_glm below) and converted back
# for comparison, so it is checked through the same class.
TRANSFORMERS_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "glm": transformers.GlmForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
    "gemma3": transformers.Gemma3ForCausalLM,
}


def transformers_family(spec):
    return "glm" if spec.family == "glm_original" else spec.family


# The attention implementation build_model gives the models (transformers' default, "sdpa"); the
# bf16 yardstick also trains with "eager" (train_reference.torch_bf16_runs), since torch's two
# attention paths round differently and the distance of either from fp32 is torch's own bf16 gap.
ATTENTION = {"implementation": "sdpa"}


class attention_implementation:
    """`with attention_implementation("eager"):` models built inside use that attention."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.saved, ATTENTION["implementation"] = ATTENTION["implementation"], self.name

    def __exit__(self, *exc):
        ATTENTION["implementation"] = self.saved


def transformers_config(spec, attn_implementation=None):
    """The transformers config object of `spec` (glm_original: the GlmConfig it converts to)."""
    attn_implementation = attn_implementation or ATTENTION["implementation"]
    family = transformers_family(spec)
    cfg = make_config(family, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                      intermediate_size=spec.intermediate_size, num_layers=spec.num_layers,
                      num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                      head_dim=spec.head_dim, rms_norm_eps=spec.rms_norm_eps,
                      rope_theta=spec.rope_theta,
                      max_position_embeddings=spec.max_position_embeddings,
                      tie_word_embeddings=spec.tie_word_embeddings,
                      partial_rotary_factor=spec.rotary_dim / spec.head_dim,
                      sliding_window=spec.sliding_window or None)
    if family == "llama":
        cfg["attention_bias"] = spec.qkv_bias
    cfg.update(dict(spec.extra))
    cfg.pop("torch_dtype", None)
    # The padding row as the checkpoint's own class builds it: nn.Embedding(padding_idx=pad_token_id)
    # gives that row no gradient from its lookups (keel: ModelConfig::embedding_padding_idx).
    # ChatGLM's remote code builds no padding row, so its converted GlmForCausalLM has none either.
    cfg["pad_token_id"] = None if spec.family == "glm_original" else spec.pad_token_id
    config = TRANSFORMERS_CLASSES[family].config_class(**cfg)
    # sdpa has no soft-capping: transformers runs Gemma 2 eagerly
    config._attn_implementation = "eager" if family == "gemma2" else attn_implementation
    return config


def build_model(spec, tensors=None, strict=True):
    """The transformers model of `spec` (fp32), with weights loaded from {name: tensor} in the
    family's checkpoint names if given. model.spec is `spec`."""
    family = transformers_family(spec)
    model = TRANSFORMERS_CLASSES[family](transformers_config(spec))
    model.spec = spec
    model.eval()  # no dropout (none configured anyway); training mode does not change the math
    if tensors is not None:
        load_weights(model, tensors, strict=strict)
    return model


def _glm_spec(spec):
    import dataclasses
    return dataclasses.replace(spec, family="glm")


def load_weights(model, tensors, strict=True):
    """Copies {name: tensor} (the family's checkpoint names) into the model's parameters."""
    spec = model.spec
    if spec.family == "glm_original":
        tensors = glm_original_to_glm(spec, tensors)
    params = dict(model.named_parameters())
    if strict:
        missing = sorted(set(params) - set(tensors))
        unexpected = sorted(set(tensors) - set(params))
        if missing or unexpected:
            raise ValueError("checkpoint names do not match the %s model: missing %s, unexpected %s"
                             % (spec.family, missing, unexpected))
    with torch.no_grad():
        for name, p in params.items():
            if name in tensors:
                t = tensors[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError("tensor %r: shape %s, expected %s" % (name, tuple(t.shape), tuple(p.shape)))
                p.copy_(t.to(p.dtype))


def model_tensors(model):
    """{checkpoint name: detached fp32 clone} of the model's parameters (what a checkpoint of the
    model's family holds; a tied LM head is the embedding and is not listed)."""
    out = {n: p.detach().to(torch.float32).clone() for n, p in model.named_parameters()}
    if model.spec.family == "glm_original":
        out = glm_to_glm_original(_glm_spec(model.spec), out)
    return out


def logits(model, input_ids):
    """[B, T] ids (positions 0..T-1, causal, no padding mask: pad on the right) -> [B, T, V]."""
    return model(input_ids=input_ids, use_cache=False).logits


def no_decay_parameter_names(model):
    """The parameters transformers' Trainer excludes from weight decay (its own rule:
    Trainer.get_decay_parameter_names -- biases and norm weights)."""
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    return {n for n, _ in model.named_parameters() if n not in decay}


def load_model(model_dir):
    """(config dict, ModelSpec, model) from a HF model directory."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    spec = spec_from_config(cfg)
    return cfg, spec, build_model(spec, load_checkpoint(model_dir))


def random_init(model, seed, matrix_std=0.02, qk_std=0.15, embed_std=0.5, head_std=0.1,
                norm_std=0.1, bias_std=0.02):
    """Deterministic random weights: matrices N(0, matrix_std) (q/k projections qk_std, so that
    attention is far from uniform and RoPE matters; LM head head_std), embeddings N(0,
    embed_std), RMSNorm weights 1 + N(0, norm_std), biases N(0, bias_std).

    Values are drawn per parameter in sorted-name order from a torch.Generator seeded with
    `seed`, in the family-independent llama layout, so glm and glm_original models with the
    same seed hold the same weights (fused tensors are concatenations of the split ones)."""
    s = model.spec
    gen = torch.Generator().manual_seed(seed)
    nh, kv, hd = s.num_heads, s.num_kv_heads, s.head_dim
    one = 0.0 if s.gemma else 1.0  # Gemma's norms scale by 1 + w: the same scales, stored as w

    def randn(shape, std):
        return torch.randn(*shape, generator=gen) * std

    canon = {}  # canonical (llama-like) name -> tensor
    canon["embed"] = randn((s.vocab_size, s.hidden_size), embed_std)
    for i in range(s.num_layers):
        p = "L%d." % i
        canon[p + "in_norm"] = one + randn((s.hidden_size,), norm_std)
        canon[p + "q_w"] = randn((nh * hd, s.hidden_size), qk_std)
        canon[p + "k_w"] = randn((kv * hd, s.hidden_size), qk_std)
        canon[p + "v_w"] = randn((kv * hd, s.hidden_size), matrix_std)
        canon[p + "q_b"] = randn((nh * hd,), bias_std)
        canon[p + "k_b"] = randn((kv * hd,), bias_std)
        canon[p + "v_b"] = randn((kv * hd,), bias_std)
        canon[p + "o_w"] = randn((s.hidden_size, nh * hd), matrix_std)
        canon[p + "post_norm"] = one + randn((s.hidden_size,), norm_std)
        canon[p + "gate_w"] = randn((s.intermediate_size, s.hidden_size), matrix_std)
        canon[p + "up_w"] = randn((s.intermediate_size, s.hidden_size), matrix_std)
        canon[p + "down_w"] = randn((s.hidden_size, s.intermediate_size), matrix_std)
    canon["final_norm"] = one + randn((s.hidden_size,), norm_std)
    canon["head"] = randn((s.vocab_size, s.hidden_size), head_std)
    if s.qk_norm:  # drawn last, so the other families' weights stay what they were
        for i in range(s.num_layers):
            canon["L%d.q_norm" % i] = one + randn((hd,), norm_std)
            canon["L%d.k_norm" % i] = one + randn((hd,), norm_std)
    if s.gemma:  # the sandwich norms on each branch's output
        for i in range(s.num_layers):
            canon["L%d.attn_out_norm" % i] = randn((s.hidden_size,), norm_std)
            canon["L%d.mlp_out_norm" % i] = randn((s.hidden_size,), norm_std)
    load_weights(model, canonical_to_hf(s, canon))
    return model


def canonical_to_hf(spec, canon):
    """Family tensor names from canonical split weights (see random_init)."""
    s = spec
    out = {}
    if s.family == "glm_original":
        out["transformer.embedding.word_embeddings.weight"] = canon["embed"]
        for i in range(s.num_layers):
            c, p = "L%d." % i, "transformer.encoder.layers.%d." % i
            out[p + "input_layernorm.weight"] = canon[c + "in_norm"]
            out[p + "self_attention.query_key_value.weight"] = torch.cat(
                [canon[c + "q_w"], canon[c + "k_w"], canon[c + "v_w"]], 0)
            if s.qkv_bias:
                out[p + "self_attention.query_key_value.bias"] = torch.cat(
                    [canon[c + "q_b"], canon[c + "k_b"], canon[c + "v_b"]], 0)
            out[p + "self_attention.dense.weight"] = canon[c + "o_w"]
            out[p + "post_attention_layernorm.weight"] = canon[c + "post_norm"]
            out[p + "mlp.dense_h_to_4h.weight"] = torch.cat([canon[c + "gate_w"], canon[c + "up_w"]], 0)
            out[p + "mlp.dense_4h_to_h.weight"] = canon[c + "down_w"]
        out["transformer.encoder.final_layernorm.weight"] = canon["final_norm"]
        if not s.tie_word_embeddings:
            out["transformer.output_layer.weight"] = canon["head"]
        return out
    out["model.embed_tokens.weight"] = canon["embed"]
    for i in range(s.num_layers):
        c, p = "L%d." % i, "model.layers.%d." % i
        out[p + "input_layernorm.weight"] = canon[c + "in_norm"]
        for x in "qkv":
            out[p + "self_attn.%s_proj.weight" % x] = canon[c + x + "_w"]
            if s.qkv_bias:
                out[p + "self_attn.%s_proj.bias" % x] = canon[c + x + "_b"]
        if s.qk_norm:
            out[p + "self_attn.q_norm.weight"] = canon[c + "q_norm"]
            out[p + "self_attn.k_norm.weight"] = canon[c + "k_norm"]
        out[p + "self_attn.o_proj.weight"] = canon[c + "o_w"]
        if s.gemma:  # post_attention_layernorm is on the attention's output; the MLP's input norm is "pre"
            out[p + "post_attention_layernorm.weight"] = canon[c + "attn_out_norm"]
            out[p + "pre_feedforward_layernorm.weight"] = canon[c + "post_norm"]
            out[p + "post_feedforward_layernorm.weight"] = canon[c + "mlp_out_norm"]
        else:
            out[p + "post_attention_layernorm.weight"] = canon[c + "post_norm"]
        if s.family == "glm":
            out[p + "mlp.gate_up_proj.weight"] = torch.cat([canon[c + "gate_w"], canon[c + "up_w"]], 0)
        else:
            out[p + "mlp.gate_proj.weight"] = canon[c + "gate_w"]
            out[p + "mlp.up_proj.weight"] = canon[c + "up_w"]
        out[p + "mlp.down_proj.weight"] = canon[c + "down_w"]
    out["model.norm.weight"] = canon["final_norm"]
    if not s.tie_word_embeddings:
        out["lm_head.weight"] = canon["head"]
    return out


def glm_to_glm_original(spec, tensors):
    """Converts GLM-hf tensors to the original ChatGLM layout (fusing q/k/v)."""
    assert spec.family == "glm"
    out = {}
    rename = {"model.embed_tokens.weight": "transformer.embedding.word_embeddings.weight",
              "model.norm.weight": "transformer.encoder.final_layernorm.weight",
              "lm_head.weight": "transformer.output_layer.weight"}
    for k, v in rename.items():
        if k in tensors:
            out[v] = tensors[k]
    for i in range(spec.num_layers):
        a, b = "model.layers.%d." % i, "transformer.encoder.layers.%d." % i
        out[b + "input_layernorm.weight"] = tensors[a + "input_layernorm.weight"]
        out[b + "post_attention_layernorm.weight"] = tensors[a + "post_attention_layernorm.weight"]
        out[b + "self_attention.query_key_value.weight"] = torch.cat(
            [tensors[a + "self_attn.%s_proj.weight" % x] for x in "qkv"], 0)
        if spec.qkv_bias:
            out[b + "self_attention.query_key_value.bias"] = torch.cat(
                [tensors[a + "self_attn.%s_proj.bias" % x] for x in "qkv"], 0)
        out[b + "self_attention.dense.weight"] = tensors[a + "self_attn.o_proj.weight"]
        out[b + "mlp.dense_h_to_4h.weight"] = tensors[a + "mlp.gate_up_proj.weight"]
        out[b + "mlp.dense_4h_to_h.weight"] = tensors[a + "mlp.down_proj.weight"]
    return out


def glm_original_to_glm(spec, tensors):
    """Converts original ChatGLM tensors to GLM-hf (splitting query_key_value), like
    transformers' convert_glm_weights_to_hf.py."""
    assert spec.family == "glm_original"
    nh, kv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    out = {}
    rename = {"transformer.embedding.word_embeddings.weight": "model.embed_tokens.weight",
              "transformer.encoder.final_layernorm.weight": "model.norm.weight",
              "transformer.output_layer.weight": "lm_head.weight"}
    for k, v in rename.items():
        if k in tensors:
            out[v] = tensors[k]
    for i in range(spec.num_layers):
        a, b = "transformer.encoder.layers.%d." % i, "model.layers.%d." % i
        out[b + "input_layernorm.weight"] = tensors[a + "input_layernorm.weight"]
        out[b + "post_attention_layernorm.weight"] = tensors[a + "post_attention_layernorm.weight"]
        qkv = tensors[a + "self_attention.query_key_value.weight"].split([nh * hd, kv * hd, kv * hd], 0)
        for x, t in zip("qkv", qkv):
            out[b + "self_attn.%s_proj.weight" % x] = t
        if spec.qkv_bias:
            qkv_b = tensors[a + "self_attention.query_key_value.bias"].split([nh * hd, kv * hd, kv * hd], 0)
            for x, t in zip("qkv", qkv_b):
                out[b + "self_attn.%s_proj.bias" % x] = t
        out[b + "self_attn.o_proj.weight"] = tensors[a + "self_attention.dense.weight"]
        out[b + "mlp.gate_up_proj.weight"] = tensors[a + "mlp.dense_h_to_4h.weight"]
        out[b + "mlp.down_proj.weight"] = tensors[a + "mlp.dense_4h_to_h.weight"]
    return out


# --------------------------------------------------------------------------------------------
# Loss and generation helpers
# --------------------------------------------------------------------------------------------

def causal_lm_loss_sum(logits, labels, ignore_index=-100):
    """(sum of shifted token cross-entropies in fp32, number of target tokens): logits at
    position t predict labels[t + 1]; ignore_index targets are skipped (HF ForCausalLMLoss with
    reduction="sum")."""
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    loss = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                           shift_labels.reshape(-1), ignore_index=ignore_index, reduction="sum")
    return loss, int((shift_labels != ignore_index).sum())


@torch.no_grad()
def greedy_generate(model, prompt_ids, max_new_tokens, eos_token_ids=None):
    """transformers' model.generate, greedy, with its KV cache. Returns the generated ids
    (without the prompt); stops after an id in eos_token_ids, by default the model config's
    eos_token_id, as generate does for a model loaded from its directory (and keel generate does
    from config.json)."""
    if eos_token_ids is None:
        eos = model.config.eos_token_id
        eos_token_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    out = model.generate(torch.tensor([list(prompt_ids)], dtype=torch.long),
                         attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
                         num_beams=1, eos_token_id=list(eos_token_ids) or None, pad_token_id=0)
    return [int(x) for x in out[0, len(prompt_ids):]]
