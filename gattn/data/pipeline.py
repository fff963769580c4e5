"""The Grain pipeline: shuffle documents (seeded) -> shard per process -> tokenize -> pack ->
shuffle packed rows in a window -> batch.

Batches are dicts of int32 numpy arrays of shape [batch, seq_len + 1] (inputs and shifted targets
come from one row): "tokens", "segment_ids" (1, 2, ... per document in the row, 0 = padding) and
"positions" (restarting at 0 with each document, and with each row's piece of a document that
was split across rows). The training iterator is a Grain `DatasetIterator`: `get_state()` / `set_state()`
make the data order part of a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import grain
import jax
import numpy as np

from gattn.data import tfds_text
from gattn.data.tokenizer import EOS


def _tokenize(tokenizer):
    eos = tokenizer.eos_id() if tokenizer.eos_id() >= 0 else EOS  # a user's model may differ
    def fn(example) -> dict:
        ids = tokenizer.encode(example["text"].decode("utf-8") if isinstance(example["text"], bytes)
                               else example["text"])
        return {"tokens": np.asarray(ids + [eos], np.int32)}
    return fn


def _pack_and_batch(ds: grain.IterDataset, seq_len: int, batch_size: int,
                    shuffle: tuple[int, int] | None = None, keep_last: bool = False) -> grain.IterDataset:
    ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len + 1})
    ds = ds.map(lambda ex: {"tokens": ex["tokens"], "segment_ids": ex["tokens_segment_ids"],
                            "positions": ex["tokens_positions"]})
    if shuffle is not None:  # a long document fills many consecutive rows: spread them out
        window, seed = shuffle
        ds = grain.experimental.WindowShuffleIterDataset(ds, window_size=window, seed=seed)
    return ds.batch(batch_size, drop_remainder=not keep_last)


def _pad_rows(batch: dict, rows: int) -> dict:
    """Pads a short last batch with padding rows (segment id 0: they count for nothing)."""
    missing = rows - batch["tokens"].shape[0]
    return {k: np.pad(v, ((0, missing), (0, 0))) for k, v in batch.items()} if missing else batch


def train_iterator(cfg, tokenizer, workdir: Path) -> grain.DatasetIterator:
    """An endless, deterministic iterator over packed training batches of this process's shard
    (the global batch divided over processes)."""
    n_proc, index = jax.process_count(), jax.process_index()
    if cfg.train.batch_size % n_proc:
        raise ValueError(f"train.batch_size={cfg.train.batch_size} must divide over {n_proc} processes")
    source = tfds_text.data_source(cfg.data, workdir, "train")
    ds = grain.MapDataset.source(source).shuffle(seed=cfg.train.seed).repeat()
    ds = ds[index::n_proc].map(_tokenize(tokenizer))
    ds = _pack_and_batch(ds.to_iter_dataset(), cfg.train.seq_len, cfg.train.batch_size // n_proc,
                         shuffle=(cfg.data.shuffle_window, cfg.train.seed))
    return iter(ds)


def set_state(iterator: grain.DatasetIterator, state: dict) -> None:
    """Restores an iterator state that went through JSON (as checkpoints store it). JSON turns
    the tuples of Grain's packing state into lists, which the packer then misreads; this pipeline's
    states hold no lists of their own, so every list becomes a tuple again."""
    def tuples(x):
        if isinstance(x, dict):
            return {k: tuples(v) for k, v in x.items()}
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x
    iterator.set_state(tuples(state))


def validation_batches(cfg, tokenizer, workdir: Path) -> dict[str, list[dict]]:
    """Per held-out domain, up to `data.eval_batches` packed batches in a fixed order; a short
    last batch is padded, so a small domain keeps all of its text."""
    source = tfds_text.data_source(cfg.data, workdir, "validation")
    domains = sorted({(source[i]["domain"]).decode() for i in range(len(source))})
    out = {}
    for domain in domains:
        ds = grain.MapDataset.source(source).filter(lambda ex, d=domain: ex["domain"].decode() == d)
        ds = _pack_and_batch(ds.map(_tokenize(tokenizer)).to_iter_dataset(), cfg.train.seq_len,
                             cfg.data.eval_batch_size, keep_last=True)
        batches = []
        for batch in ds:
            batches.append(_pad_rows(batch, cfg.data.eval_batch_size))
            if len(batches) == cfg.data.eval_batches:
                break
        if not batches:
            raise ValueError(f"held-out domain {domain!r} has too little text for one batch of "
                             f"{cfg.data.eval_batch_size}x{cfg.train.seq_len + 1} tokens")
        out[domain] = batches
    return out


def held_out_text(cfg, tokenizer, workdir: Path) -> dict[str, np.ndarray]:
    """Per held-out domain, all of its documents tokenised (each followed by eos, as in training)
    and concatenated in a fixed order: long-context evaluation cuts windows of any length from it."""
    source = tfds_text.data_source(cfg.data, workdir, "validation")
    tokenize = _tokenize(tokenizer)
    out: dict[str, list] = {}
    for i in range(len(source)):
        ex = source[i]
        out.setdefault(ex["domain"].decode(), []).append(tokenize(ex)["tokens"])
    return {d: np.concatenate(parts) for d, parts in sorted(out.items())}
