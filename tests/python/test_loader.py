"""keel.Dataset / keel.DataLoader feeding a plain PyTorch loop (issue: the Python package).

- A transformers Llama trained in a torch loop on the loader's packed chat batches gives the losses
  and gradient norms keel's own trainer logs for the same recipe (fp32, 1e-5).
- state_dict() / load_state_dict() continue with exactly the batches of an uninterrupted loader,
  across an epoch boundary, with 0, 1 and 2 worker threads.
- Rank sharding, drop_last, numpy output and the errors.
"""
import math
import os
import sys

import numpy as np
import pytest
import torch
import transformers

import keel
from conftest import metrics_lines, run_cli, write_counting_data, write_recipe

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
import hf_models as hf  # noqa: E402  (Trainer's weight-decay groups, the loss sum)

SEQ = 64
STEPS, ACCUM, BATCH = 6, 2, 2
LR, WARMUP, DECAY, CLIP = 3e-3, 2, 0.01, 1.0


def packed_dataset(chat_setup, tmp_path, **kw):
    return keel.Dataset(chat_setup["data"], tokenizer_path=chat_setup["model"], max_seq_len=SEQ, packing="pack",
                        chat_template="chatml", cache_dir=str(tmp_path / "cache"), **kw)


def test_transformers_loop_matches_keel_trainer(chat_setup, tmp_path):
    # keel's trainer on the recipe...
    out = tmp_path / "keel"
    recipe = write_recipe(tmp_path / "recipe.toml", {
        "model_name": chat_setup["model"], "data_path": chat_setup["data"], "dtype": "fp32", "max_seq_len": SEQ,
        "packing": "pack", "chat_template": "chatml", "batch_size": BATCH, "gradient_accumulation_steps": ACCUM,
        "learning_rate": LR, "warmup_steps": WARMUP, "weight_decay": DECAY, "max_grad_norm": CLIP,
        "max_steps": STEPS, "seed": 11, "shuffle": True, "output_dir": str(out), "cache_dir": str(tmp_path / "cache")})
    r = run_cli("train", recipe)
    assert r.returncode == 0, r.stderr
    want = metrics_lines(out)

    # ... and a plain torch loop around transformers' model, fed by keel.DataLoader.
    loader = keel.DataLoader(packed_dataset(chat_setup, tmp_path), batch_size=BATCH, shuffle=True, seed=11,
                             num_workers=2)
    model = transformers.LlamaForCausalLM.from_pretrained(chat_setup["model"], dtype=torch.float32,
                                                          attn_implementation="sdpa")
    no_decay = hf.no_decay_parameter_names(model)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if n not in no_decay], "weight_decay": DECAY},
                             {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=1e-8)
    sched = transformers.get_scheduler("cosine", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS)
    batches = iter(loader)
    got = []
    for step in range(1, STEPS + 1):
        micro = [next(batches) for _ in range(ACCUM)]
        targets = sum(b["num_target_tokens"] for b in micro)
        total = 0.0
        for b in micro:
            logits = model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                           attention_mask=keel.block_causal_mask(b["segment_ids"])).logits
            loss_sum, _ = hf.causal_lm_loss_sum(logits, b["labels"])
            (loss_sum / targets).backward()
            total += float(loss_sum.detach())
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        got.append({"step": step, "loss": total / targets, "grad_norm": norm, "target_tokens": targets})

    for g, w in zip(got, want):
        assert g["target_tokens"] == w["target_tokens"], (g, w)
        assert math.isclose(g["loss"], w["loss"], rel_tol=1e-5), (g, w)
        assert math.isclose(g["grad_norm"], w["grad_norm"], rel_tol=1e-5), (g, w)
    assert len(got) == len(want) == STEPS


def test_block_causal_mask_is_each_document_alone(chat_setup, tmp_path):
    """The mask keel.block_causal_mask builds makes transformers' attention (SDPA: boolean; eager:
    additive) compute each packed document as if it were alone."""
    b = next(iter(keel.DataLoader(packed_dataset(chat_setup, tmp_path), batch_size=2, num_workers=0)))
    for impl, dtype in (("sdpa", None), ("eager", torch.float32)):
        model = transformers.LlamaForCausalLM.from_pretrained(chat_setup["model"], dtype=torch.float32,
                                                              attn_implementation=impl)
        with torch.no_grad():
            packed = model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                           attention_mask=keel.block_causal_mask(b["segment_ids"], dtype)).logits
            for row in range(2):
                seg, mask = b["segment_ids"][row], b["attention_mask"][row].bool()
                for s in seg[mask].unique():
                    idx = (seg == s).nonzero().flatten()
                    alone = model(input_ids=b["input_ids"][row, idx][None]).logits[0]
                    assert torch.allclose(alone, packed[row, idx], atol=1e-5), (impl, row, int(s))


def flatten(batch):
    return {k: np.asarray(v) for k, v in batch.items()}


def same(a, b):
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def stream(loader):
    """Batches across epochs, as a training loop's `for epoch ...: for batch in loader` takes them."""
    while True:
        for b in loader:
            yield flatten(b)


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_resume_continues_with_the_same_batches(chat_setup, tmp_path, workers):
    dataset = packed_dataset(chat_setup, tmp_path)
    make = lambda: keel.DataLoader(dataset, batch_size=3, seed=5, num_workers=workers, prefetch_factor=2)  # noqa
    per_epoch = len(make())
    n = per_epoch + 4  # across the epoch boundary
    reference = [b for _, b in zip(range(n), stream(make()))]
    for cut in (1, per_epoch - 1, per_epoch, per_epoch + 1):
        first = make()
        it = stream(first)
        taken = [next(it) for _ in range(cut)]
        state = first.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        rest = [b for _, b in zip(range(n - cut), stream(resumed))]
        for i, b in enumerate(taken + rest):
            assert same(b, reference[i]), "batch %d after resuming at %d (%d workers)" % (i, cut, workers)
    # The epochs differ (a new permutation each), and the loader's epoch is its length.
    assert not same(reference[0], reference[per_epoch])


def test_batch_fields(chat_setup, tmp_path):
    dataset = packed_dataset(chat_setup, tmp_path)
    assert len(dataset) > 0 and dataset.max_seq_len == SEQ
    b = next(iter(keel.DataLoader(dataset, batch_size=4, num_workers=0, return_tensors="np")))
    ids, labels, pos, seg, mask = (b[k] for k in ("input_ids", "labels", "position_ids", "segment_ids",
                                                   "attention_mask"))
    assert ids.shape == (4, SEQ) and ids.dtype == np.int64
    # transformers' labels: the token itself where trained, never a document's first token.
    trained = labels != -100
    assert np.array_equal(labels[trained], ids[trained])
    assert not trained[pos == 0].any()
    assert int(trained.sum()) == b["num_target_tokens"] and int(mask.sum()) == b["num_tokens"]
    # Positions restart at every document; cu_seq_lens are the flattened segments' boundaries.
    flat = seg.reshape(-1)
    assert list(np.diff(b["cu_seq_lens"])) == [len(list(g)) for g in _runs(flat)]
    assert (pos[mask.astype(bool)] == _positions(seg, mask)).all()


def _runs(values):
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            out.append(values[start:i])
            start = i
    return out


def _positions(seg, mask):
    out = []
    for row_seg, row_mask in zip(seg, mask):
        previous, p = None, 0
        for s, m in zip(row_seg, row_mask):
            if not m:
                continue
            p = p + 1 if s == previous else 0
            previous = s
            out.append(p)
    return np.array(out)


def test_a_prepared_directory_gives_the_same_batches(chat_setup, tmp_path):
    """keel.prepare's directory (keel prepare) and the raw JSONL prepared by keel.Dataset itself."""
    keel.prepare(chat_setup["data"], tmp_path / "prepared", tokenizer=chat_setup["model"], max_seq_len=SEQ,
                 chat_template="chatml")
    raw = keel.DataLoader(packed_dataset(chat_setup, tmp_path), batch_size=3, seed=2, num_workers=0)
    prepared = keel.DataLoader(keel.Dataset(str(tmp_path / "prepared")), batch_size=3, seed=2, num_workers=0)
    assert len(raw) == len(prepared)
    for a, b in zip(raw, prepared):
        assert same(flatten(a), flatten(b))


def test_ranks_split_the_global_batch(tmp_path):
    data = write_counting_data(tmp_path / "ids.jsonl", 50, seed=3)
    dataset = keel.Dataset(data, max_seq_len=24, packing="pad", vocab_size=32, cache_dir=str(tmp_path / "cache"))
    whole = keel.DataLoader(dataset, batch_size=4, seed=9, rank=0, world_size=1, return_tensors="np")
    parts = [keel.DataLoader(dataset, batch_size=2, seed=9, rank=r, world_size=2, return_tensors="np")
             for r in (0, 1)]
    assert len(whole) == len(parts[0]) == math.ceil(50 / 4)
    for w, a, b in zip(whole, *parts):
        assert np.array_equal(w["input_ids"], np.concatenate([a["input_ids"], b["input_ids"]]))


def test_drop_last_and_errors(tmp_path):
    data = write_counting_data(tmp_path / "ids.jsonl", 50, seed=3)
    dataset = keel.Dataset(data, max_seq_len=24, packing="pad", vocab_size=32, cache_dir=str(tmp_path / "cache"))
    loader = keel.DataLoader(dataset, batch_size=8, drop_last=True, shuffle=False, return_tensors="np")
    assert len(loader) == 6
    first = [b["input_ids"] for b in loader]
    second = [b["input_ids"] for b in loader]
    assert len(first) == len(second) == 6
    # Unshuffled, each epoch starts again at the first sample: the 2 left over are dropped.
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    state = loader.state_dict()
    other = keel.DataLoader(dataset, batch_size=8, drop_last=True, shuffle=True, return_tensors="np")
    with pytest.raises(keel.Error, match="shuffle"):
        other.load_state_dict(state)
    with pytest.raises(keel.Error, match="missing.jsonl"):
        keel.Dataset(str(tmp_path / "missing.jsonl"), max_seq_len=24, vocab_size=32)
    with pytest.raises(keel.Error, match="vocab_size"):
        keel.Dataset(data, max_seq_len=24)
    with pytest.raises(keel.Error, match="packing"):
        keel.Dataset(data, packing="ragged")
