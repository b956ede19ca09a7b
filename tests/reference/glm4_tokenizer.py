"""A GLM-4-style tokenizer directory for the GGUF references, built offline.

No published GLM-4 tokenizer.json is available offline, so this one is assembled from what is:
Llama 3's byte-level BPE (the npm @lenml package the keel_npm fixture installs), cut to its first
VOCAB tokens (the merges kept where both parts and the result are among them, so the vocabulary is
consistent), with GLM-4's own pieces around it, as glm-4-9b-hf's tokenizer files have them:

- the pre-tokenizer: a Split on GLM-4's regex (the cl100k regex: Llama 3's is the same text, and
  llama.cpp's "glm4" splits by it, LLAMA_VOCAB_PRE_TYPE_CHATGLM4), isolated, then ByteLevel;
- GLM-4's added tokens, in GLM-4's order after the vocabulary (<|endoftext|>, [MASK], [gMASK],
  [sMASK], <sop>, <eop>, <|system|>, <|user|>, <|assistant|>, <|observation|>, and the image and
  video markers), all special; EOS and PAD <|endoftext|>, no BOS;
- a GLM-4 chat template ([gMASK]<sop>, then <|role|>\\n and the content of each message);
- an embedding a few rows wider than the tokenizer (GLM-4's is padded too).

Its ids of the converter's test text are not a published model's, so llama.cpp's converter does not
find its hash in get_vocab_base_pre's table (keel names it by its GLM-4 rule instead): the converter
is run with that one lookup supplied, see converter_command.
"""
import json
import os

VOCAB = 6000  # Llama 3's first tokens kept (the bytes among them)
SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
            "<|end_of_video|>"]
PADDED_VOCAB = VOCAB + len(SPECIALS) + 2  # the model's embedding rows
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for item in messages %}{% if item['role'] in ['system', 'user', 'assistant', 'observation'] %}"
    "<|{{ item['role'] }}|>\n{{ item['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def bytes_to_unicode():
    """The 256 printable stand-ins ByteLevel (GPT-2's bytes_to_unicode) gives the bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            chars.append(256 + n)
            n += 1
    return [chr(c) for c in chars]


def special_id(token):
    return VOCAB + SPECIALS.index(token)


def config_ids():
    """config.json's special ids as GlmConfig has them for GLM-4: EOS <|endoftext|>, <|user|>,
    <|observation|>; PAD <|endoftext|>; no BOS."""
    return {"bos_token_id": None, "pad_token_id": special_id("<|endoftext|>"),
            "eos_token_id": [special_id(t) for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]}


def write_tokenizer(out, llama3_dir):
    """Writes tokenizer.json and tokenizer_config.json into `out`."""
    tj = json.load(open(os.path.join(llama3_dir, "tokenizer.json"), encoding="utf-8"))
    vocab = {token: i for token, i in tj["model"]["vocab"].items() if i < VOCAB}
    merges = []
    for merge in tj["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        if left in vocab and right in vocab and left + right in vocab:
            merges.append("%s %s" % (left, right))
    # The cut must leave a tokenizer that encodes any text: all 256 byte-level symbols kept (ByteLevel
    # BPE falls back to them; Llama 3's first 256 ranks are the bytes), merges among the kept tokens,
    # and GLM-4's added tokens after the vocabulary, clear of it. A Llama 3 tokenizer.json of another
    # layout fails here rather than as a mysterious converter or llama.cpp mismatch later.
    byte_symbols = set(bytes_to_unicode())
    missing = sorted(byte_symbols - set(vocab))
    if missing or len(vocab) != VOCAB or not merges:
        raise SystemExit("glm4_tokenizer: %s does not cut to a usable tokenizer: %d of %d tokens kept, %d merges, "
                         "byte symbols missing: %s" % (llama3_dir, len(vocab), VOCAB, len(merges), missing[:8]))
    tj["model"]["vocab"] = vocab
    tj["model"]["merges"] = merges
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                                               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    added = [{"id": special_id(t), "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for t in SPECIALS]
    tj["added_tokens"] = added
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    config = {
        "added_tokens_decoder": {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                                  "single_word", "special")} for t in added},
        "additional_special_tokens": SPECIALS[1:],
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "do_lower_case": False,
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 128000,
        "padding_side": "left", "remove_space": False, "tokenizer_class": "PreTrainedTokenizerFast"}
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)


# The one substitution in the converter's run: get_vocab_base_pre names a pre-tokenizer only by the
# hash of a published tokenizer's ids, and this tokenizer is not a published one. ChatGLMModel (GLM-4)
# and Glm4MoeModel (GLM-4.5) are given "glm4" for a tokenizer whose hash the table lacks (anything
# else as the table says), and everything else -- keys, tensors, the rest of the vocabulary -- is the
# converter's own.
_CONVERTER = r"""
import runpy, sys
script = sys.argv[1]
sys.path.insert(0, __import__("os").path.dirname(script))
from conversion.chatglm import ChatGLMModel
from conversion.glm import Glm4MoeModel
for cls in (ChatGLMModel, Glm4MoeModel):
    def get_vocab_base_pre(self, tokenizer, original=cls.get_vocab_base_pre):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            return "glm4"
    cls.get_vocab_base_pre = get_vocab_base_pre
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def converter_command(python, script):
    """The command line that runs llama.cpp's `script` (convert_hf_to_gguf.py or
    convert_lora_to_gguf.py) with GLM-4's pre-tokenizer supplied; its arguments follow."""
    return [python, "-c", _CONVERTER, script]
