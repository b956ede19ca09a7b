"""A tiny SentencePiece tokenizer built offline, as Gemma's and Llama 2's are made: sentencepiece
trains a BPE model with byte fallback on a fixed text (tokenizer.model), and transformers'
GemmaTokenizer / LlamaTokenizer converts it to tokenizer.json beside it, as a published directory
holds both. llama.cpp's converter reads tokenizer.model (its "llama" vocabulary with scores), keel
and transformers tokenize with tokenizer.json.

  write_tokenizer(out_dir, "gemma" | "llama") -> the vocabulary's size
"""
import json
import os
import random
import shutil
import tempfile

GEMMA_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<start_of_turn>"
                  "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
                  "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

# kind -> (pad, eos, bos, unk pieces, user-defined pieces, dummy prefix, tokenizer class, tokenizer_config)
KINDS = {
    # Gemma: <pad> 0, <eos> 1, <bos> 2, <unk> 3, then its chat tokens; no dummy prefix, digits split.
    "gemma": (("<pad>", "<eos>", "<bos>", "<unk>"), ("<mask>", "<start_of_turn>", "<end_of_turn>"), False,
              "GemmaTokenizer", {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                                 "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
                                 "chat_template": GEMMA_TEMPLATE}),
    # Llama 2: <unk> 0, <s> 1, </s> 2 (no pad piece), a dummy prefix (a space before the text).
    "llama": ((None, "</s>", "<s>", "<unk>"), (), True, "LlamaTokenizer",
              {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
               "add_eos_token": False}),
}


TEXT = """A tokenizer is trained on text, and this is the text: a few lines about models that people
fine-tune on their own computers and then run where they like. The quick brown fox jumps over the lazy dog.
Hello world! It's 2026, isn't it? Numbers like 3.14159 and 123456789 are split into digits.
Spaces, tabs	and newlines matter; so do accents (naïve café, über) and other scripts (東京)."""


def corpus():
    """TEXT and sentences drawn from its words and a few more, fixed by a seed."""
    words = TEXT.split() + ["don't", "I'LL", "we've", "x=y+1;", "model", "token", "turn", "user"]
    rng = random.Random(5)
    lines = TEXT.splitlines()
    for i in range(400):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + " %d" % (i * 37))
    return "\n".join(lines)


def write_tokenizer(out_dir, kind="gemma", pieces=512):
    import sentencepiece as spm
    from transformers import AutoTokenizer
    (pad, eos, bos, unk), user_defined, dummy_prefix, tokenizer_class, config = KINDS[kind]
    ids = {"pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3} if pad else {"pad_id": -1, "unk_id": 0, "bos_id": 1,
                                                                            "eos_id": 2}
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        text = os.path.join(tmp, "corpus.txt")
        with open(text, "w", encoding="utf-8") as f:
            f.write(corpus())
        spm.SentencePieceTrainer.train(
            input=text, model_prefix=os.path.join(tmp, "tokenizer"), vocab_size=pieces, model_type="bpe",
            byte_fallback=True, character_coverage=1.0, split_digits=True, add_dummy_prefix=dummy_prefix,
            remove_extra_whitespaces=False, normalization_rule_name="identity", hard_vocab_limit=False,
            eos_piece=eos, bos_piece=bos, unk_piece=unk, **(dict(pad_piece=pad) if pad else {}), **ids,
            user_defined_symbols=list(user_defined), num_threads=1, minloglevel=2)
        source = os.path.join(tmp, "source")
        os.makedirs(source)
        shutil.copy(os.path.join(tmp, "tokenizer.model"), os.path.join(source, "tokenizer.model"))
        with open(os.path.join(source, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(dict(config, tokenizer_class=tokenizer_class), f)
        tokenizer = AutoTokenizer.from_pretrained(source)
        tokenizer.save_pretrained(out_dir)
        shutil.copy(os.path.join(tmp, "tokenizer.model"), os.path.join(out_dir, "tokenizer.model"))
    check_same_ids(out_dir)
    return vocab_size(out_dir)


def check_same_ids(tokenizer_dir):
    """The directory holds one tokenizer twice (llama.cpp's converter reads tokenizer.model, keel
    and transformers tokenizer.json): both must give the same ids to TEXT's lines, or the tests
    built on it would compare two different tokenizers. Raises naming the first line that differs."""
    import sentencepiece
    from transformers import AutoTokenizer
    model = sentencepiece.SentencePieceProcessor(model_file=os.path.join(tokenizer_dir, "tokenizer.model"))
    fast = AutoTokenizer.from_pretrained(tokenizer_dir)
    for line in TEXT.splitlines():
        expected, found = model.encode(line), fast.encode(line, add_special_tokens=False)
        if expected != found:
            raise RuntimeError("%s: tokenizer.json and tokenizer.model disagree on %r: %s against %s"
                               % (tokenizer_dir, line, found, expected))


def vocab_size(tokenizer_dir):
    """The number of pieces of tokenizer_dir's tokenizer.model (the model's vocab_size)."""
    import sentencepiece
    return sentencepiece.SentencePieceProcessor(model_file=os.path.join(tokenizer_dir, "tokenizer.model")).vocab_size()
