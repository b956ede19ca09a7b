"""keel.plan, keel.prepare and keel.generate: the CLI's commands as functions."""
import json

from . import _command, _native
from .config import TrainingConfig


def plan(config, dp=None, zero_stage=None, device_memory=None, text=False):
    """`keel plan`: the per-rank memory plan of a TrainingConfig (dp ranks, ZeRO stage, checked
    against device_memory such as "64GB"). Returns the plan as a dict (`keel plan --json`), or the
    report the CLI prints when text=True."""
    if not isinstance(config, TrainingConfig):
        raise TypeError("plan(config): a keel.TrainingConfig, got %s" % type(config).__name__)
    out = _native.plan(config.to_toml(), "TrainingConfig", int(dp or 0), -1 if zero_stage is None else int(zero_stage),
                       device_memory or "", not text)
    return out if text else json.loads(out)


def prepare(data_path, out_dir, tokenizer="", max_seq_len=2048, packing="pack", chat_template="auto",
            train_on_prompt=False, special_tokens_in_messages=False, threads=0, max_bad_fraction=0.01, vocab_size=0):
    """`keel prepare`: tokenizes and packs JSONL into shards in out_dir; returns report.json as a dict
    (records, bad records with their lines and reasons, tokens, the template chosen, ...)."""
    return json.loads(_native.prepare(str(data_path), str(out_dir), str(tokenizer), int(max_seq_len), packing,
                                      chat_template, bool(train_on_prompt), bool(special_tokens_in_messages),
                                      int(threads), float(max_bad_fraction), int(vocab_size)))


def generate(model, prompt, max_new_tokens=64, chat=False, adapter=None, tokenizer=None, temperature=None,
             top_k=None, top_p=None, seed=None, backend=None):
    """`keel generate`: the continuation of `prompt` by the model directory (greedy unless a
    temperature is given), with the model's chat template when chat=True. Returns the text."""
    args = ["generate", "--model", str(model), "--prompt", prompt, "--max-new-tokens", str(int(max_new_tokens))]
    for flag, value in (("--adapter", adapter), ("--tokenizer", tokenizer), ("--temperature", temperature),
                        ("--top-k", top_k), ("--top-p", top_p), ("--seed", seed), ("--backend", backend)):
        if value is not None:
            args += [flag, str(value)]
    if chat:
        args.append("--chat")
    return _command.run(args)
