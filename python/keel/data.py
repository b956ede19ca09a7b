"""keel.Dataset and keel.DataLoader: keel's tokenize-once data path for any PyTorch loop.

    dataset = keel.Dataset("train.jsonl", tokenizer_path="models/glm-4-9b", max_seq_len=8192)
    loader = keel.DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, prefetch_factor=4)
    for batch in loader:           # one epoch
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                    attention_mask=batch["attention_mask"], labels=batch["labels"])

Raw JSONL is tokenized with the model's tokenizer and chat template and packed into shards once,
cached by content and settings exactly as `keel train` and `keel prepare` do (the decisions are
printed); a directory made by `keel prepare` is used as is. The batches come from keel's
prefetching loader (background threads fill whole batches ahead), in the order keel's trainer
uses for the same seed: a seeded permutation per epoch.

A batch (torch tensors when torch is installed, else numpy arrays; int64 as transformers wants):
  input_ids       [batch, seq]
  labels          [batch, seq]  transformers' convention: labels[t] = input_ids[t] where token t
                  is trained on, -100 elsewhere (the model shifts them); -100 at every document's
                  first token, so no document is predicted from the one packed before it
  position_ids    [batch, seq]  restarting at 0 at every packed document (what transformers'
                  packed-sequence attention reads)
  attention_mask  [batch, seq]  1 for tokens, 0 for padding
  segment_ids     [batch, seq]  the document each token belongs to (padding: its own), for a
                  block-diagonal causal mask (keel.block_causal_mask builds one)
  cu_seq_lens     [documents + 1] int32 cumulative lengths over the batch flattened row by row
                  (flash-attention's varlen form; padding runs count as segments of their own)
  num_tokens, num_target_tokens   this batch's non-padding and trained tokens
"""
import os

import numpy as np

from . import _native
from ._native import Error


class Dataset:
    """Training records prepared for keel's loader.

    data_path: raw JSONL (.jsonl/.jsonl.gz/.jsonl.zst: text, prompt/response, messages, input_ids)
    or a directory made by `keel prepare`. tokenizer_path: a local model or tokenizer directory
    (tokenizer.json, tiktoken), "" for pre-tokenized records. The other settings are the recipe's
    keys of the same names (docs/recipe.md). preprocess_on_npu is accepted for cann-recipes-train's
    code and changes nothing: keel tokenizes once, up front, on the CPU's cores. vocab_size: the
    model's vocabulary, needed for pre-tokenized records without a tokenizer (ids are checked).
    """

    def __init__(self, data_path, tokenizer_path="", max_seq_len=2048, packing="pack", chat_template="auto",
                 train_on_prompt=False, special_tokens_in_messages=False, cache_dir="", max_bad_fraction=0.01,
                 vocab_size=0, preprocess_on_npu=None):
        if packing not in ("pack", "pad"):
            raise Error("Dataset(packing=%r): packing must be \"pack\" or \"pad\"" % (packing,))
        self.data_path = os.fspath(data_path)
        if not tokenizer_path and not vocab_size and not os.path.isdir(self.data_path):
            raise Error("Dataset(%r): without tokenizer_path the records must be pre-tokenized (input_ids), and "
                        "vocab_size=... gives the model's vocabulary to check their ids against" % self.data_path)
        self.directory = _native.resolve_training_data(self.data_path, os.fspath(tokenizer_path), int(max_seq_len),
                                                       packing, chat_template, bool(train_on_prompt),
                                                       bool(special_tokens_in_messages), os.fspath(cache_dir),
                                                       float(max_bad_fraction), int(vocab_size))
        probe = _native.ShardLoader(self.directory, 1, 0, 0, 1, False, 0, 0, 1)
        self.max_seq_len = probe.seq_len
        self.vocab_size = probe.vocab_size
        self.pad_id = probe.pad_id
        self.fingerprint = probe.fingerprint
        self._sequences = probe.sequences

    def __len__(self):
        """Training sequences (packed rows of up to max_seq_len tokens)."""
        return self._sequences

    def __repr__(self):
        return "keel.Dataset(%r: %d sequences of up to %d tokens, prepared in %s)" % (
            self.data_path, self._sequences, self.max_seq_len, self.directory)


def _distributed_rank():
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    return 0, 1


def block_causal_mask(segment_ids, dtype=None):
    """[batch, 1, seq, seq]: token i attends to token j when j <= i in the same document (what keel's
    attention computes for packed rows). Boolean (True: attend) for transformers' SDPA attention;
    with a floating dtype, additive (0 or the dtype's lowest value) for its eager attention, which
    adds the mask to the scores."""
    import torch
    s = torch.as_tensor(segment_ids)
    same = s[:, :, None] == s[:, None, :]
    causal = torch.ones(s.shape[1], s.shape[1], dtype=torch.bool, device=s.device).tril()
    allowed = (same & causal)[:, None, :, :]
    if dtype is None or dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=s.device).masked_fill(~allowed, torch.finfo(dtype).min)


class DataLoader:
    """Batches of a keel.Dataset for a training loop, prefetched by keel's loader threads.

    Iterating gives one epoch: len(loader) batches. drop_last=True drops the samples that do not
    fill a last batch; False (the default, as torch's) fills the last batch with the next epoch's
    first samples instead of making it short, as keel's trainer does (every batch one shape). The
    samples form one stream across epochs, so state_dict() / load_state_dict() resume at the exact
    next batch, whatever num_workers (0: batches made on the calling thread).

    rank/world_size: this process's share of each global batch (batch_size samples of the
    world_size * batch_size the ranks take together); read from torch.distributed when it is
    initialised. pin_memory: page-locked tensors for faster copies to an accelerator, when torch
    has one (else ignored, said once).
    """

    def __init__(self, dataset, batch_size=1, shuffle=True, seed=42, num_workers=1, prefetch_factor=2,
                 drop_last=False, rank=None, world_size=None, pin_memory=False, return_tensors=None):
        if not isinstance(dataset, Dataset):
            raise TypeError("DataLoader(dataset): a keel.Dataset, got %s" % type(dataset).__name__)
        if batch_size < 1 or num_workers < 0 or prefetch_factor < 1:
            raise Error("DataLoader: batch_size and prefetch_factor must be at least 1, num_workers at least 0 "
                        "(got %d, %d, %d)" % (batch_size, prefetch_factor, num_workers))
        if rank is None or world_size is None:
            rank, world_size = _distributed_rank()
        self.dataset = dataset
        self.batch_size, self.shuffle, self.seed = int(batch_size), bool(shuffle), int(seed)
        self.num_workers, self.prefetch_factor = int(num_workers), int(prefetch_factor)
        self.drop_last, self.rank, self.world_size = bool(drop_last), int(rank), int(world_size)
        self.return_tensors = return_tensors or ("pt" if _has_torch() else "np")
        self.pin_memory = bool(pin_memory) and self.return_tensors == "pt" and _can_pin(pin_memory)
        self._loader = None
        self._position = 0  # global samples consumed by the batches handed out

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def global_batch(self):
        return self.batch_size * self.world_size

    def __len__(self):
        n = len(self.dataset)
        return n // self.global_batch if self.drop_last else -(-n // self.global_batch)

    # -- iteration ------------------------------------------------------------------------------
    def _native_loader(self):
        if self._loader is None:
            self._loader = _native.ShardLoader(self.dataset.directory, self.batch_size, 0, self.rank,
                                               self.world_size, self.shuffle, self.seed, self.num_workers,
                                               self.prefetch_factor)
            self._loader.seek(self._position)
        return self._loader

    def __iter__(self):
        """The rest of the current epoch (all of it, unless resumed or stopped in the middle)."""
        n, per_epoch = len(self.dataset), len(self)
        if per_epoch == 0:
            return
        if self.drop_last:
            # Epoch e's batches start at its first sample, e * n: the samples of a last batch that
            # would not fill up are skipped.
            epoch_start = (self._position // n) * n
            done = (self._position - epoch_start) // self.global_batch
            if done >= per_epoch:
                self._seek(epoch_start + n)
                done = 0
        else:
            # One stream of batches: batch k holds samples k * global_batch onwards.
            done = (self._position // self.global_batch) % per_epoch
        for _ in range(per_epoch - done):
            yield self.next_batch()

    def _seek(self, position):
        self._position = position
        if self._loader is not None:
            self._loader.seek(position)

    def next_batch(self):
        """The next batch of the stream (iteration calls it len(self) times per epoch)."""
        input_ids, targets, positions, segments, tokens, target_tokens = self._native_loader().next()
        self._position += self.global_batch
        return self._batch(input_ids, targets, positions, segments, tokens, target_tokens)

    def _batch(self, input_ids, targets, positions, segments, tokens, target_tokens):
        labels = np.full_like(targets, -100)
        labels[:, 1:] = targets[:, :-1]  # keel's targets are the next token; transformers shifts itself
        attention_mask = _token_mask(segments)
        flat = segments.reshape(-1)
        starts = np.flatnonzero(np.r_[True, flat[1:] != flat[:-1]])
        cu_seq_lens = np.r_[starts, flat.size].astype(np.int32)
        batch = {
            "input_ids": input_ids.astype(np.int64), "labels": labels.astype(np.int64),
            "position_ids": positions.astype(np.int64), "attention_mask": attention_mask.astype(np.int64),
            "segment_ids": segments.astype(np.int64), "cu_seq_lens": cu_seq_lens,
            "num_tokens": int(tokens), "num_target_tokens": int(target_tokens),
        }
        if self.return_tensors == "pt":
            import torch
            for k, v in batch.items():
                if isinstance(v, np.ndarray):
                    t = torch.from_numpy(v)
                    batch[k] = t.pin_memory() if self.pin_memory else t
        return batch

    # -- exact resume ---------------------------------------------------------------------------
    def state_dict(self):
        """Where the stream stands and what it is: load_state_dict continues at the next batch."""
        return {"samples_consumed": self._position, "seed": self.seed, "shuffle": self.shuffle,
                "batch_size": self.batch_size, "world_size": self.world_size,
                "dataset_fingerprint": self.dataset.fingerprint}

    def load_state_dict(self, state):
        for key in ("seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise Error("DataLoader.load_state_dict: the state was saved with %s=%r, this loader has %r; the "
                            "batches would differ" % (key, state.get(key), getattr(self, key)))
        if state.get("dataset_fingerprint") != self.dataset.fingerprint:
            raise Error("DataLoader.load_state_dict: the state was saved for other data (fingerprint %s, this "
                        "dataset's %s)" % (state.get("dataset_fingerprint"), self.dataset.fingerprint))
        self._seek(int(state["samples_consumed"]))


def _token_mask(segments):
    """1 on a row's tokens, 0 on its padding. keel's loader (data/shard_loader.cpp, fill_packed_row)
    numbers a row's documents 0, 1, ..., k-1 and gives its padding the id k+1: the only step of two
    between neighbours is where padding starts."""
    steps = np.diff(segments, axis=1, prepend=-1)
    return np.cumsum(steps >= 2, axis=1) == 0


def _has_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


_PIN_NOTED = []


def _can_pin(requested):
    import torch
    if torch.cuda.is_available() or (hasattr(torch, "npu") and torch.npu.is_available()):
        return True
    if requested and not _PIN_NOTED:
        _PIN_NOTED.append(True)
        print("keel: pin_memory=True ignored: torch has no accelerator to copy to")
    return False
