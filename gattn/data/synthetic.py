"""Synthetic tokens for timing (`data.source = "synthetic"`): uniform random ids, one document per
row, no corpus, no tokenizer, no Grain and no TFDS, so a training run can be timed on a machine
that has only JAX, Flax, Optax and Orbax (the GPU check, docs/gpu.md). The loss means nothing.

The module has `pipeline`'s interface (train_iterator, set_state, prepare, validation_batches),
so the trainer picks one or the other. Row r of batch i is drawn from its own generator, seeded
by (train.seed, r, i): the same batches for any number of processes; the state is one counter.
"""

from __future__ import annotations

import numpy as np

SOURCE = "synthetic"
HELD_OUT_KEY = 1 << 30  # held-out rows are seeded SeedSequence((i, r), spawn_key=(HELD_OUT_KEY,)): five
# words, never a training row's three (train.seed, r, i), whatever train.seed (backcopy.held_out_seed)


def _batch(cfg, rows: range, index: int, held_out: bool = False) -> dict:
    t = cfg.train
    seed = (lambda r: np.random.SeedSequence((index, r), spawn_key=(HELD_OUT_KEY,))) if held_out else (
        lambda r: (t.seed, r, index))
    tokens = np.stack([np.random.default_rng(seed(r)).integers(
        0, cfg.model.vocab_size, t.seq_len + 1, dtype=np.int32) for r in rows])
    return {"tokens": tokens, "segment_ids": np.ones_like(tokens),
            "positions": np.broadcast_to(np.arange(t.seq_len + 1, dtype=np.int32), tokens.shape).copy()}


class Rows:
    """Endless synthetic batches of this process's `rows`."""

    def __init__(self, cfg, rows: range):
        self.cfg, self.rows, self.index = cfg, rows, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        self.index += 1
        return _batch(self.cfg, self.rows, self.index - 1)

    def get_state(self) -> dict:
        return {"synthetic_batches": self.index}

    def set_state(self, state: dict) -> None:
        self.index = int(state["synthetic_batches"])


def train_iterator(cfg, tokenizer=None, workdir=None, rows: range | None = None) -> Rows:
    del tokenizer, workdir  # no text
    return Rows(cfg, range(cfg.train.batch_size) if rows is None else rows)


def set_state(iterator: Rows, state: dict) -> None:
    iterator.set_state(state)


def prepare(cfg, workdir) -> None:
    del cfg, workdir  # generated on the fly


def validation_batches(cfg, tokenizer=None, workdir=None) -> dict[str, list[dict]]:
    """One domain, "synthetic": data.eval_batches batches of data.eval_batch_size rows."""
    del tokenizer, workdir
    rows = range(cfg.data.eval_batch_size)
    return {SOURCE: [_batch(cfg, rows, i, held_out=True) for i in range(cfg.data.eval_batches)]}
