"""PyTorch reference implementations of the decoder-only model families keel supports, plus a
self-contained safetensors reader/writer.

Only the Python standard library, torch and numpy are used (no transformers, no safetensors
package), so the reference tests run with Debian's python3-torch.

Families (tensor names and config keys follow the Hugging Face checkpoints exactly):
  llama         LlamaForCausalLM               rotate_half RoPE, pairs (i, i + d/2)
  qwen2         Qwen2ForCausalLM               llama + q/k/v biases (optionally tied LM head)
  glm           GlmForCausalLM (glm-4-9b-hf)   fused mlp.gate_up_proj, q/k/v biases,
                                               partial (partial_rotary_factor) interleaved RoPE
  glm_original  ChatGLMModel (THUDM/glm-4-9b)  fused query_key_value and dense_h_to_4h, interleaved
                                               RoPE over the first kv_channels/2 channels,
                                               base 10000 * rope_ratio

The modules' parameter names ARE the checkpoint tensor names (model.state_dict() can be written
as is), so optimizer state, weight decay grouping and comparisons work directly on HF names.
"""
import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2", "glm", "glm_original")

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


def make_config(family, vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=64, tie_word_embeddings=None, partial_rotary_factor=0.5,
                rope_ratio=1):
    """config.json (as a dict) of a model of `family` in its Hugging Face format."""
    if family == "llama":
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": vocab_size, "hidden_size": hidden_size,
            "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim, "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta,
            "max_position_embeddings": max_position_embeddings,
            "tie_word_embeddings": bool(tie_word_embeddings) if tie_word_embeddings is not None else False,
            "hidden_act": "silu", "torch_dtype": "float32", "attention_bias": False,
            "mlp_bias": False,
        }
    if family == "qwen2":
        return {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "vocab_size": vocab_size, "hidden_size": hidden_size,
            "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim, "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta,
            "max_position_embeddings": max_position_embeddings,
            "tie_word_embeddings": bool(tie_word_embeddings) if tie_word_embeddings is not None else True,
            "hidden_act": "silu", "torch_dtype": "float32", "use_sliding_window": False,
        }
    if family == "glm":
        return {
            "architectures": ["GlmForCausalLM"], "model_type": "glm",
            "vocab_size": vocab_size, "hidden_size": hidden_size,
            "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim, "partial_rotary_factor": partial_rotary_factor,
            "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta,
            "max_position_embeddings": max_position_embeddings,
            "tie_word_embeddings": bool(tie_word_embeddings) if tie_word_embeddings is not None else False,
            "hidden_act": "silu", "torch_dtype": "float32", "attention_bias": True,
        }
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
            "original_rope": True,
            "tie_word_embeddings": bool(tie_word_embeddings) if tie_word_embeddings is not None else False,
            "torch_dtype": "float32",
        }
    raise ValueError("unknown family %r (expected one of %s)" % (family, ", ".join(FAMILIES)))


def family_of_config(cfg):
    mt = cfg.get("model_type")
    arch = (cfg.get("architectures") or [""])[0]
    if mt == "llama" or arch == "LlamaForCausalLM":
        return "llama"
    if mt == "qwen2" or arch == "Qwen2ForCausalLM":
        return "qwen2"
    if mt == "glm" or arch == "GlmForCausalLM":
        return "glm"
    if mt == "chatglm" or arch in ("ChatGLMModel", "ChatGLMForConditionalGeneration"):
        return "glm_original"
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
            max_position_embeddings=cfg.get("seq_length", 2048))
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
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
        max_position_embeddings=cfg.get("max_position_embeddings", 2048))


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """LlamaRMSNorm: normalize in fp32, cast back to the input dtype, then scale."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        input_dtype = x.dtype
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.eps)
        return self.weight * h.to(input_dtype)


def rope_inv_freq(rotary_dim, theta):
    """HF: 1 / theta ** (arange(0, dim, 2) / dim), in fp32."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def rope_angles(spec, seq_len):
    """[seq_len, rotary_dim/2] fp32 angles position * inv_freq (as HF's fp32 outer product)."""
    inv = rope_inv_freq(spec.rotary_dim, spec.rope_theta)
    pos = torch.arange(seq_len, dtype=torch.int64).float()
    return pos[:, None] * inv[None, :]


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_interleaved(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope_hf(x, angles, rotary_dim, interleaved):
    """x: [B, heads, T, head_dim]. Llama/Qwen2 (rotate_half) or GLM-hf (interleaved, partial)."""
    emb = torch.cat((angles, angles), dim=-1)  # [T, rot]
    cos = emb.cos().to(x.dtype)[None, None]
    sin = emb.sin().to(x.dtype)[None, None]
    if interleaved:
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        out = x_rot * cos + _rotate_half_interleaved(x_rot) * sin
        return torch.cat((out, x_pass), dim=-1)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    out = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat((out, x_pass), dim=-1)


def apply_rope_chatglm(x, angles):
    """modeling_chatglm.apply_rotary_pos_emb: x [B, heads, T, head_dim], cache = (cos, sin) of
    the angles, pairs (2i, 2i+1) over the first 2 * angles.shape[-1] channels."""
    b, nh, sq, _ = x.shape
    cache = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1).to(x.dtype)  # [T, rot/2, 2]
    rot_dim = cache.shape[-2] * 2
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    xshaped = x.reshape(b, nh, sq, rot_dim // 2, 2)
    cache = cache[:sq].view(1, 1, sq, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [xshaped[..., 0] * cache[..., 0] - xshaped[..., 1] * cache[..., 1],
         xshaped[..., 1] * cache[..., 0] + xshaped[..., 0] * cache[..., 1]], -1)
    return torch.cat((x_out2.flatten(3), x_pass), dim=-1)


def repeat_kv(x, n_rep):
    """[B, kv, T, hd] -> [B, kv * n_rep, T, hd]; query head h uses kv head h // n_rep."""
    if n_rep == 1:
        return x
    b, kv, t, hd = x.shape
    return x[:, :, None].expand(b, kv, n_rep, t, hd).reshape(b, kv * n_rep, t, hd)


class Attention(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        h, nh, kv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        if spec.family == "glm_original":
            self.query_key_value = nn.Linear(h, (nh + 2 * kv) * hd, bias=spec.qkv_bias)
            self.dense = nn.Linear(nh * hd, h, bias=False)
        else:
            self.q_proj = nn.Linear(h, nh * hd, bias=spec.qkv_bias)
            self.k_proj = nn.Linear(h, kv * hd, bias=spec.qkv_bias)
            self.v_proj = nn.Linear(h, kv * hd, bias=spec.qkv_bias)
            self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def forward(self, x, angles):
        s = self.spec
        b, t, _ = x.shape
        nh, kv, hd = s.num_heads, s.num_kv_heads, s.head_dim
        if s.family == "glm_original":
            q, k, v = self.query_key_value(x).split([nh * hd, kv * hd, kv * hd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, nh, hd).transpose(1, 2)
        k = k.view(b, t, kv, hd).transpose(1, 2)
        v = v.view(b, t, kv, hd).transpose(1, 2)
        if s.family == "glm_original":
            q, k = apply_rope_chatglm(q, angles), apply_rope_chatglm(k, angles)
        else:
            q = apply_rope_hf(q, angles, s.rotary_dim, s.rope_interleaved)
            k = apply_rope_hf(k, angles, s.rotary_dim, s.rope_interleaved)
        k = repeat_kv(k, nh // kv)
        v = repeat_kv(v, nh // kv)
        scores = torch.matmul(q, k.transpose(2, 3)) * (hd ** -0.5)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, t, nh * hd)
        return self.dense(out) if s.family == "glm_original" else self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.family = spec.family
        h, i = spec.hidden_size, spec.intermediate_size
        if spec.family == "glm_original":
            self.dense_h_to_4h = nn.Linear(h, 2 * i, bias=False)
            self.dense_4h_to_h = nn.Linear(i, h, bias=False)
        elif spec.family == "glm":
            self.gate_up_proj = nn.Linear(h, 2 * i, bias=False)
            self.down_proj = nn.Linear(i, h, bias=False)
        else:
            self.gate_proj = nn.Linear(h, i, bias=False)
            self.up_proj = nn.Linear(h, i, bias=False)
            self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        if self.family == "glm_original":
            gate, up = self.dense_h_to_4h(x).chunk(2, dim=-1)
            return self.dense_4h_to_h(F.silu(gate) * up)
        if self.family == "glm":
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * F.silu(gate))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.attn_name = "self_attention" if spec.family == "glm_original" else "self_attn"
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        setattr(self, self.attn_name, Attention(spec))
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, angles):
        x = x + getattr(self, self.attn_name)(self.input_layernorm(x), angles)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Container(nn.Module):
    pass


class CausalLM(nn.Module):
    """Decoder-only LM whose parameter names are the family's checkpoint tensor names."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        s = spec
        layers = nn.ModuleList([DecoderLayer(s) for _ in range(s.num_layers)])
        if s.family == "glm_original":
            self.transformer = _Container()
            self.transformer.embedding = _Container()
            self.transformer.embedding.word_embeddings = nn.Embedding(s.vocab_size, s.hidden_size)
            self.transformer.encoder = _Container()
            self.transformer.encoder.layers = layers
            self.transformer.encoder.final_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
            if not s.tie_word_embeddings:
                self.transformer.output_layer = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        else:
            self.model = _Container()
            self.model.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
            self.model.layers = layers
            self.model.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
            if not s.tie_word_embeddings:
                self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)

    def _parts(self):
        if self.spec.family == "glm_original":
            t = self.transformer
            head = t.embedding.word_embeddings.weight if self.spec.tie_word_embeddings else t.output_layer.weight
            return t.embedding.word_embeddings, t.encoder.layers, t.encoder.final_layernorm, head
        m = self.model
        head = m.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        return m.embed_tokens, m.layers, m.norm, head

    def forward(self, input_ids):
        """input_ids [B, T] (positions 0..T-1, causal, no padding mask: pad on the right)
        -> logits [B, T, V]."""
        embed, layers, norm, head = self._parts()
        angles = rope_angles(self.spec, input_ids.shape[1]).to(input_ids.device)
        h = embed(input_ids)
        for layer in layers:
            h = layer(h, angles)
        return F.linear(norm(h), head)

    def no_decay_parameter_names(self):
        """Biases and RMSNorm weights (the parameters HF Trainer excludes from weight decay)."""
        names = set()
        for mname, mod in self.named_modules():
            for pname, _ in mod.named_parameters(recurse=False):
                full = (mname + "." if mname else "") + pname
                if isinstance(mod, RMSNorm) or pname == "bias":
                    names.add(full)
        return names


def build_model(spec, tensors=None, strict=True):
    """A CausalLM for `spec`, with weights loaded from {hf_name: tensor} if given (converted to
    the module's dtype, fp32 by default)."""
    model = CausalLM(spec)
    if tensors is not None:
        load_weights(model, tensors, strict=strict)
    return model


def load_weights(model, tensors, strict=True):
    params = dict(model.named_parameters())
    if strict:
        missing = sorted(set(params) - set(tensors))
        unexpected = sorted(set(tensors) - set(params))
        if missing or unexpected:
            raise ValueError("checkpoint names do not match the %s model: missing %s, unexpected %s"
                             % (model.spec.family, missing, unexpected))
    with torch.no_grad():
        for name, p in params.items():
            if name in tensors:
                t = tensors[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError("tensor %r: shape %s, expected %s" % (name, tuple(t.shape), tuple(p.shape)))
                p.copy_(t.to(p.dtype))


def model_tensors(model):
    """{hf_name: detached fp32 clone} of the model's parameters (what a checkpoint holds)."""
    return {n: p.detach().to(torch.float32).clone() for n, p in model.named_parameters()}


def load_model(model_dir):
    """(config dict, ModelSpec, CausalLM) from a HF model directory."""
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

    def randn(shape, std):
        return torch.randn(*shape, generator=gen) * std

    canon = {}  # canonical (llama-like) name -> tensor
    canon["embed"] = randn((s.vocab_size, s.hidden_size), embed_std)
    for i in range(s.num_layers):
        p = "L%d." % i
        canon[p + "in_norm"] = 1 + randn((s.hidden_size,), norm_std)
        canon[p + "q_w"] = randn((nh * hd, s.hidden_size), qk_std)
        canon[p + "k_w"] = randn((kv * hd, s.hidden_size), qk_std)
        canon[p + "v_w"] = randn((kv * hd, s.hidden_size), matrix_std)
        canon[p + "q_b"] = randn((nh * hd,), bias_std)
        canon[p + "k_b"] = randn((kv * hd,), bias_std)
        canon[p + "v_b"] = randn((kv * hd,), bias_std)
        canon[p + "o_w"] = randn((s.hidden_size, nh * hd), matrix_std)
        canon[p + "post_norm"] = 1 + randn((s.hidden_size,), norm_std)
        canon[p + "gate_w"] = randn((s.intermediate_size, s.hidden_size), matrix_std)
        canon[p + "up_w"] = randn((s.intermediate_size, s.hidden_size), matrix_std)
        canon[p + "down_w"] = randn((s.hidden_size, s.intermediate_size), matrix_std)
    canon["final_norm"] = 1 + randn((s.hidden_size,), norm_std)
    canon["head"] = randn((s.vocab_size, s.hidden_size), head_std)
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
        out[p + "self_attn.o_proj.weight"] = canon[c + "o_w"]
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
def greedy_generate(model, prompt_ids, max_new_tokens, eos_token_ids=()):
    """Greedy decoding without a KV cache (recomputes the prefix each step; fine for tiny
    models). Returns the generated ids (without the prompt)."""
    ids = list(prompt_ids)
    out = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids], dtype=torch.long))
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        ids.append(nxt)
        if nxt in eos_token_ids:
            break
    return out
