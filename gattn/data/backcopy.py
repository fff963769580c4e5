"""Bigram-Backcopy (Guo et al. 2024): synthetic sequences that make attention sinks form in small
models (docs/sinks.md), as a data source (`data.source = "bigram_backcopy"`, `data.backcopy`).

Token 0 is the start token <s>, tokens 1..chars the embedded docs' most frequent characters by
rank (token 1 = rank 0, a space). Each row is one sequence of seq_len + 1 tokens:

    x_0 = <s>;  x_1 ~ the character frequencies (triggers excluded);
    x_{t+1} = x_{t - offset_j}       if x_t is a trigger of set j, t - offset_j >= 1 and
                                     x_{t - offset_j} is no trigger
    x_{t+1} ~ bigram(x_t)            otherwise (`background`: or the docs' character frequencies,
                                     or uniform, whatever x_t)

(A trigger is never copied: with offset 1, " e" would otherwise repeat as " e e e ..." forever.)

Row r of batch i is drawn from its own generator, seeded by (train.seed, r, i): every batch is the
same for any number of processes, and the iterator's state is one counter.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import numpy as np

from gattn.config import ConfigError
from gattn.data import corpus

START = 0
HELD_OUT_KEY = 1 << 30  # the held-out sequences' spawn key (`held_out_seed`)


def held_out_seed(i: int, r: int) -> np.random.SeedSequence:
    """The seed of held-out row r of batch i. A training row's seed (train.seed, r, batch) is three
    32-bit words; the spawn key makes this one five ((i, r) padded to numpy's pool of four, then
    the key), so it is never a training row's, whatever train.seed (0..2**32-1). A plain tuple is
    not enough: (2**30, i, r) was row r of batch i's own seed under train.seed = 2**30, and numpy
    splits 2**32 into the words (0, 1) and pads short seeds with zeros, so (2**32, i, 0) is the
    training seed (0, 1, i)."""
    return np.random.SeedSequence((i, r), spawn_key=(HELD_OUT_KEY,))


@dataclass(frozen=True)
class Task:
    """The task's tables: `chars[k]` is token k + 1's character; `unigram_V` [V] and `bigram_VxV`
    [V, V] are probabilities over tokens (row <s> unused); `copy_from_V` [V] is each token's copy
    offset (0: not a trigger)."""

    chars: str
    unigram_V: np.ndarray
    bigram_VxV: np.ndarray
    copy_from_V: np.ndarray

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1


@functools.lru_cache(maxsize=4)
def _counts(chars: int) -> tuple[str, np.ndarray, np.ndarray]:
    """The docs' `chars` most frequent characters (by count, then code point) and their unigram
    and bigram counts (pairs of two kept characters only)."""
    text = "".join(d.text for d in corpus.embedded_documents(code_max_bytes=0))  # the docs only
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    values, counts = np.unique(codes, return_counts=True)
    if len(values) < chars:
        raise ConfigError("data.backcopy.chars", chars, f"the embedded docs have only {len(values)} characters")
    order = np.lexsort((values, -counts))[:chars]
    kept = values[order]
    token = np.full(int(values.max()) + 1, -1, np.int64)
    token[kept] = np.arange(chars)
    ids = token[codes]
    pair = (ids[:-1] >= 0) & (ids[1:] >= 0)
    bigram = np.zeros((chars, chars))
    np.add.at(bigram, (ids[:-1][pair], ids[1:][pair]), 1)
    return "".join(map(chr, kept)), counts[order].astype(float), bigram


def task(spec) -> Task:
    """The tables of a `BackcopySpec` (computed from the embedded docs, deterministic)."""
    chars, uni, bi = _counts(spec.chars)
    v = spec.chars + 1
    copy_from = np.zeros(v, np.int64)
    for ranks, offset in zip(spec.trigger_sets, spec.offset_list):
        copy_from[np.asarray(ranks) + 1] = offset
    background = spec.background
    if background == "uniform":
        uni = np.ones_like(uni)
    unigram = np.concatenate([[0.0], uni])
    unigram[copy_from > 0] = 0.0  # x_1 is never a trigger (it has nothing before it to copy)
    bigram = np.zeros((v, v))
    # (a character never followed by a kept one: near-uniform)
    bigram[1:, 1:] = bi + 1e-9 if background == "bigram" else uni[None, :]
    bigram[START] = unigram  # (never used: <s> is followed by x_1)
    return Task(chars, unigram / unigram.sum(), bigram / bigram.sum(axis=1, keepdims=True), copy_from)


def sample(t: Task, seeds: list, length: int) -> np.ndarray:
    """[len(seeds), length] int32: one sequence per seed (a seed is anything np.random accepts)."""
    u_BxL = np.stack([np.random.default_rng(s).random(length) for s in seeds])
    b = len(seeds)
    x = np.zeros((b, length), np.int64)  # x[:, 0] = START
    cdf_uni, cdf_bi = np.cumsum(t.unigram_V), np.cumsum(t.bigram_VxV, axis=1)
    v = t.vocab_size
    if length > 1:
        x[:, 1] = np.minimum(np.searchsorted(cdf_uni, u_BxL[:, 1], side="right"), v - 1)
    rows = np.arange(b)
    for i in range(1, length - 1):
        cur = x[:, i]
        drawn = np.minimum((cdf_bi[cur] <= u_BxL[:, i + 1, None]).sum(axis=1), v - 1)
        offset = t.copy_from_V[cur]
        src = i - offset
        source = x[rows, np.maximum(src, 0)]
        copy = (offset > 0) & (src >= 1) & (t.copy_from_V[source] == 0)
        x[:, i + 1] = np.where(copy, source, drawn)
    return x.astype(np.int32)


def is_copy_target(t: Task, tokens_BxL: np.ndarray) -> np.ndarray:
    """[B, L] True where the token was copied: it follows a trigger whose source is no trigger."""
    tokens_BxL = np.asarray(tokens_BxL)
    b, n = tokens_BxL.shape
    offset_BxL = t.copy_from_V[tokens_BxL[:, :-1]]
    src = np.arange(n - 1) - offset_BxL
    source = tokens_BxL[np.arange(b)[:, None], np.maximum(src, 0)]
    out = np.zeros(tokens_BxL.shape, bool)
    out[:, 1:] = (offset_BxL > 0) & (src >= 1) & (t.copy_from_V[source] == 0)
    return out


def trigger_mask(t: Task, tokens_BxL: np.ndarray) -> np.ndarray:
    """[B, L] True at trigger tokens (the queries a copy head works at)."""
    return t.copy_from_V[np.asarray(tokens_BxL)] > 0


def _batch(tokens_BxL: np.ndarray) -> dict:
    b, n = tokens_BxL.shape
    return {"tokens": tokens_BxL, "segment_ids": np.ones((b, n), np.int32),
            "positions": np.broadcast_to(np.arange(n, dtype=np.int32), (b, n)).copy()}


class Rows:
    """Endless training batches (the pipeline's interface: iterate, get_state, set_state)."""

    def __init__(self, cfg, rows: range):
        self.task, self.rows, self.seed = task(cfg.data.backcopy), rows, cfg.train.seed
        self.length, self.index = cfg.train.seq_len + 1, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        tokens = sample(self.task, [(self.seed, r, self.index) for r in self.rows], self.length)
        self.index += 1
        return _batch(tokens)

    def get_state(self) -> dict:
        return {"backcopy_batches": self.index}

    def set_state(self, state: dict) -> None:
        if "backcopy_batches" not in state:
            raise ValueError("the checkpoint's data state is not a Bigram-Backcopy one (data.source changed?)")
        self.index = int(state["backcopy_batches"])


def validation_batches(cfg) -> dict[str, list[dict]]:
    """{"backcopy": `data.eval_batches` batches of `data.eval_batch_size` held-out sequences}."""
    t, d = task(cfg.data.backcopy), cfg.data
    return {"backcopy": [_batch(sample(t, [held_out_seed(i, r) for r in range(d.eval_batch_size)],
                                       cfg.train.seq_len + 1)) for i in range(d.eval_batches)]}


class Tokenizer:
    """The task's vocabulary as a gattn tokenizer (gattn.data.tokenizer.Tokenizer): <s> is its
    BOS (every sequence opens with it) and decodes as '^'; it has no end-of-text token."""

    def __init__(self, chars: str):
        self.chars = chars
        self.index = {c: i + 1 for i, c in enumerate(chars)}

    def encode(self, text: str) -> list[int]:
        return [self.index[c] for c in text if c in self.index]

    def decode(self, ids) -> str:
        return "".join("^" if int(i) == START else self.chars[int(i) - 1] for i in ids)

    def eos_id(self) -> int:
        return -1

    def bos_id(self) -> int:
        return START

    def get_piece_size(self) -> int:
        return len(self.chars) + 1

    def to_json(self) -> str:
        return json.dumps({"bigram_backcopy_chars": self.chars})

    @classmethod
    def from_json(cls, text: str) -> "Tokenizer":
        return cls(json.loads(text)["bigram_backcopy_chars"])
