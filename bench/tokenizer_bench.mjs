// Tokenizer encode throughput, keel next to npm tiktoken, same corpus, same vocabulary
// (cl100k_base), same run: 1 and 2 threads (tiktoken: worker_threads, one encoder each).
//
// usage: node bench/tokenizer_bench.mjs [--build DIR] [--mb N] [--corpus-only]
//   DIR: the CMake build directory (holding bench/tokenizer_bench; default: build); npm packages go to
//   DIR/npm. The corpus is ~N MB (default 8) of text found on any Debian machine: license and
//   copyright texts (English prose, paragraphs deduplicated) and the Python standard library (code).
//   --corpus-only: write the corpus (DIR/bench_tokenizer/corpus.jsonl), cl100k_base.tiktoken and the
//   same vocabulary as a tokenizer.json (cl100k_base.json, Split + ByteLevel as Llama 3's) and
//   stop: bench/tokenizer_native_bench.py runs the PyPI peers on them.
import fs from "node:fs";
import path from "node:path";
import { execFileSync } from "node:child_process";
import { Worker, isMainThread, parentPort, workerData } from "node:worker_threads";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));

if (!isMainThread) {
  // Worker: encode its share of the documents and report the seconds taken.
  const require = createRequire(path.join(workerData.npmDir, "package.json"));
  const { Tiktoken } = require("tiktoken");
  const encoder = JSON.parse(fs.readFileSync(require.resolve("tiktoken/encoders/cl100k_base.json"), "utf8"));
  const enc = new Tiktoken(encoder.bpe_ranks, encoder.special_tokens, encoder.pat_str);
  enc.encode_ordinary("warm up");
  parentPort.on("message", (docs) => {
    const start = process.hrtime.bigint();
    let tokens = 0;
    for (const d of docs) tokens += enc.encode_ordinary(d).length;
    parentPort.postMessage({ seconds: Number(process.hrtime.bigint() - start) / 1e9, tokens });
  });
} else {
  const { installPeers, ranksFromEncoderJson, writeTiktokenFile, tokenizerJsonFromRanks } = await import(
    path.join(here, "../tests/reference/tokenizer_peers.mjs"));
  const args = Object.fromEntries(process.argv.slice(2).reduce(
    (acc, a, i, all) => (a.startsWith("--") ? [...acc, [a.slice(2), all[i + 1]]] : acc), []));
  const build = path.resolve(args.build ?? "build");
  const npmDir = path.join(build, "npm");
  const work = path.join(build, "bench_tokenizer");
  fs.mkdirSync(work, { recursive: true });
  const peers = installPeers(npmDir);

  // --- corpus -----------------------------------------------------------------------------
  const capBytes = Number(args.mb ?? 8) * 1e6;
  const listFiles = (dir, accept) => {
    const out = [];
    const walk = (d) => {
      let entries;
      try { entries = fs.readdirSync(d, { withFileTypes: true }); } catch { return; }
      for (const e of entries.sort((a, b) => (a.name < b.name ? -1 : 1))) {
        const p = path.join(d, e.name);
        if (e.isDirectory()) walk(p);
        else if (e.isFile() && accept(p)) out.push(p);
      }
    };
    walk(dir);
    return out;
  };
  const prose = [...listFiles("/usr/share/common-licenses", () => true),
                 ...listFiles("/usr/share/doc", (p) => /\/(copyright|README[^/]*|NEWS)$/.test(p))];
  const code = listFiles("/usr/lib/python3.11", (p) => p.endsWith(".py") && !p.includes("/test"));
  const seen = new Set();
  const docs = [];
  let bytes = 0;
  const take = (files, cap) => {
    let taken = 0;
    for (const f of files) {
      if (taken >= cap) break;
      let text;
      try { text = fs.readFileSync(f, "utf8"); } catch { continue; }
      if (text.includes("\uFFFD")) continue;  // not UTF-8
      // Deduplicated paragraphs (copyright files repeat the same licenses), grouped into
      // documents of up to 16 KB.
      let doc = "";
      for (const para of text.split(/\n\s*\n/)) {
        if (para.length < 2 || seen.has(para)) continue;
        seen.add(para);
        doc += para + "\n\n";
        if (doc.length > 16384) { docs.push(doc); taken += Buffer.byteLength(doc); doc = ""; }
      }
      if (doc) { docs.push(doc); taken += Buffer.byteLength(doc); }
    }
    bytes += taken;
  };
  take(prose, capBytes * 0.6);
  take(code, capBytes - bytes);
  const corpusFile = path.join(work, "corpus.jsonl");
  fs.writeFileSync(corpusFile, docs.map((text) => JSON.stringify({ text })).join("\n") + "\n");
  const rankFile = path.join(work, "cl100k_base.tiktoken");
  writeTiktokenFile(rankFile, ranksFromEncoderJson(peers.encoderJson("cl100k_base")));
  console.log(`corpus: ${(bytes / 1e6).toFixed(2)} MB in ${docs.length} documents (prose and Python code), cl100k_base`);
  if (process.argv.includes("--corpus-only")) {
    const encoder = peers.encoderJson("cl100k_base");
    const jsonFile = path.join(work, "cl100k_base.json");
    fs.writeFileSync(jsonFile, JSON.stringify(tokenizerJsonFromRanks(ranksFromEncoderJson(encoder), {
      preTokenizer: { type: "Sequence", pretokenizers: [
        { type: "Split", pattern: { Regex: encoder.pat_str }, behavior: "Isolated", invert: false },
        { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: false }] },
      addedTokens: Object.entries(encoder.special_tokens).map(([content, id]) => ({ id, content })),
    })));
    console.log(`wrote ${corpusFile}, ${rankFile}, ${jsonFile}`);
    process.exit(0);
  }

  // --- npm tiktoken -------------------------------------------------------------------------
  const workers = [0, 1].map(() => new Worker(fileURLToPath(import.meta.url), { workerData: { npmDir } }));
  const runOn = (worker, share) => new Promise((resolve) => { worker.once("message", resolve); worker.postMessage(share); });
  let tiktoken1 = Infinity, tiktoken2 = Infinity, tiktokenTokens = 0;
  for (let r = 0; r < 3; ++r) {
    const one = await runOn(workers[0], docs);
    tiktoken1 = Math.min(tiktoken1, one.seconds);
    tiktokenTokens = one.tokens;
    const start = process.hrtime.bigint();
    await Promise.all([0, 1].map((t) => runOn(workers[t], docs.filter((_, i) => i % 2 === t))));
    tiktoken2 = Math.min(tiktoken2, Number(process.hrtime.bigint() - start) / 1e9);
  }
  await Promise.all(workers.map((w) => w.terminate()));

  // --- keel -------------------------------------------------------------------------------
  const keelOut = JSON.parse(execFileSync(path.join(build, "bench", "tokenizer_bench"), [rankFile, corpusFile, "cl100k", "3"],
                                          { encoding: "utf8" }));
  if (keelOut.tokens !== tiktokenTokens)
    throw new Error(`token counts differ: keel ${keelOut.tokens}, tiktoken ${tiktokenTokens}`);

  const mb = bytes / 1e6;
  const rows = [
    ["1 thread", keelOut.mb_per_s_1, mb / tiktoken1],
    ["2 threads", keelOut.mb_per_s_2, mb / tiktoken2],
  ];
  console.log(`tokens: ${keelOut.tokens} (identical count in both)`);
  console.log("threads     keel MB/s   tiktoken MB/s   keel/tiktoken");
  for (const [name, k, t] of rows)
    console.log(`${name.padEnd(10)} ${k.toFixed(2).padStart(10)} ${t.toFixed(2).padStart(15)} ${(k / t).toFixed(2).padStart(14)}x`);
}
