"""The Grain pipeline: shuffle documents (seeded) -> one stream per batch row -> tokenize -> pack
-> shuffle each stream's packed rows in a window -> batch (a process reads only its own rows'
streams).

Batches are dicts of int32 numpy arrays of shape [batch, seq_len + 1] (inputs and shifted targets
come from one row): "tokens", "segment_ids" (1, 2, ... per document in the row, 0 = padding) and
"positions" (restarting at 0 with each document, and with each row's piece of a document that
was split across rows). The training iterator is a Grain `DatasetIterator`: `get_state()` / `set_state()`
make the data order part of a checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import grain
import numpy as np
from etils import epath
from grain._src.python.dataset.transformations import shuffle as grain_shuffle  # (grain is pinned)

from gattn.config import BACKCOPY, SHARDS, TFDS, ConfigError
from gattn.data import backcopy, corpus, shards, tfds_text
from gattn.data.tokenizer import document_encoder, load_tokenizer, tokenizer_path


class WindowShuffle(grain.experimental.WindowShuffleIterDataset):
    """Grain's window shuffle (the same windows, iterator state and resume), with each window's
    order drawn by numpy. Grain draws every position with `index_shuffle`, which took 1.25 ms a
    call here: 35 ms per 32-row window, about 70% of a step's data time in bench/overlap.py."""

    def __iter__(self):
        return _WindowShuffleIterator(self._parent.__iter__(), window_size=self._window_size, seed=self._seed)


class _WindowShuffleIterator(grain_shuffle._WindowShuffleDatasetIterator):
    def _fill_and_shuffle_window(self):
        window = []
        try:
            for _ in range(self._window_size):
                window.append(next(self._parent))
        except StopIteration:
            self._parent_exhausted = True
        order = np.random.default_rng([self._global_seed, self._window_index]).permutation(len(window))
        self._window = [window[i] for i in order]


def _specials(tokenizer, bos: bool) -> tuple[list[int], int]:
    """([BOS] with `bos` (data.bos), else [], and EOS): a tokenizer without an EOS, which ends
    every document, is refused, and so is one without a BOS under data.bos: any id put there
    would be an ordinary token's."""
    eos = tokenizer.eos_id()
    if eos < 0:
        raise ConfigError("data.tokenizer", str(getattr(tokenizer, "path", "")) or None,
                          "this tokenizer has no EOS token (a Hugging Face tokenizer.json needs a "
                          "tokenizer_config.json beside it naming eos_token; a SentencePiece model "
                          "needs an eos_id): any id used instead would be an ordinary token's")
    bos_id = getattr(tokenizer, "bos_id", lambda: -1)() if bos else -1
    if bos and bos_id < 0:
        raise ConfigError("data.bos", True, "this tokenizer has no BOS token (a Hugging Face "
                          "tokenizer_config.json without bos_token, or a SentencePiece model with "
                          "bos_id=-1): set data.bos=false")
    return ([bos_id] if bos else []), eos


def _tokenize(tokenizer, bos: bool = False, feature: str = "text"):
    """Text (the example's `feature`) -> ids + [eos], after [bos] with `bos` (`_specials`). A
    document's ids are `document_encoder`'s, the ones `python -m gattn.prepare` stores."""
    start, eos = _specials(tokenizer, bos)
    encode = document_encoder(tokenizer)
    def fn(example) -> dict:
        text = example[feature]
        ids = encode(text.decode("utf-8") if isinstance(text, bytes) else text)
        return {"tokens": np.asarray(start + ids + [eos], np.int32)}
    return fn


def _from_record(tokenizer, bos: bool = False):
    """A pretokenized shard record (gattn/data/shards.py) -> its ids + [eos], after [bos] with
    `bos`: no tokenizer call."""
    start, eos = _specials(tokenizer, bos)
    head, tail = np.asarray(start, np.int32), np.asarray([eos], np.int32)
    def fn(record: bytes) -> dict:
        return {"tokens": np.concatenate([head, shards.decode_record(record)[1], tail])}
    return fn


def documents(cfg, tokenizer, workdir, split: str, domain: str | None = None):
    """(a random-access source of `split`'s documents, the function that makes an element's
    {"tokens"}): the local corpus's TFDS build tokenized on the fly, pretokenized shards
    ("shards:DIR") read as they are, or a named TFDS dataset ("tfds:...") tokenized on the fly.
    `domain`: shards only, one held-out domain's files."""
    data = cfg.data
    if data.source.startswith(SHARDS):
        return shards.open_shards(data.source).source(split, domain), _from_record(tokenizer, data.bos)
    if data.source.startswith(TFDS):
        return tfds_text.named_source(data, split), _tokenize(tokenizer, data.bos, data.text_feature)
    return tfds_text.data_source(data, workdir, split), _tokenize(tokenizer, data.bos)


def _layout(document_resets: bool):
    """Grain's packed example -> the batch fields. Without document resets (data.document_resets
    False) a row is one plain window of concatenated text: one segment, positions 0..S."""
    def fn(ex) -> dict:
        seg, pos = ex["tokens_segment_ids"], ex["tokens_positions"]
        if not document_resets:
            seg, pos = (seg != 0).astype(seg.dtype), np.arange(len(pos), dtype=pos.dtype)
        return {"tokens": ex["tokens"], "segment_ids": seg, "positions": pos}
    return fn


def _pack_and_batch(ds: grain.IterDataset, seq_len: int, batch_size: int,
                    shuffle: tuple[int, int] | None = None, keep_last: bool = False,
                    document_resets: bool = True) -> grain.IterDataset:
    ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len + 1})
    ds = ds.map(_layout(document_resets))
    if shuffle is not None:  # a long document fills many consecutive rows: spread them out
        window, seed = shuffle
        ds = WindowShuffle(ds, window_size=window, seed=seed)
    return ds.batch(batch_size, drop_remainder=not keep_last)


def _pad_rows(batch: dict, rows: int) -> dict:
    """Pads a short last batch with padding rows (segment id 0: they count for nothing)."""
    missing = rows - batch["tokens"].shape[0]
    return {k: np.pad(v, ((0, missing), (0, 0))) for k, v in batch.items()} if missing else batch


# Each row stream reads its documents on the caller's thread, with no read-ahead: Grain's default
# (16 threads and 500 documents per iterator) taken by each of a host's streams tokenised 500
# documents per row before the first batch (8 minutes for 64 rows of the embedded corpus; 10 s
# without) and started 16 threads per row. The trainer prepares the next batch on a thread of its
# own (gattn/train/prefetch.py), so reads still overlap the step.
STREAM_READS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


class Rows:
    """Training batches made of independent row streams: row r of every global batch comes from
    stream r alone (documents r, r + B, r + 2B, ... of the seeded shuffle, packed into rows of
    seq_len + 1 tokens, shuffled in windows of data.shuffle_window consecutive rows of the stream,
    so a long document's rows are spread over that many steps whatever the batch size). A process
    reads only the streams of its own rows, so the global batches are the same for any number of
    processes, and so are the losses. The state is one Grain iterator state per row: a checkpoint
    written by P processes resumes on any other P. Memory: a process holds up to shuffle_window
    packed rows per stream it reads (rows x window x (seq_len + 1) x 12 bytes)."""

    def __init__(self, cfg, tokenizer, workdir: Path, rows: range):
        t, b = cfg.train, cfg.train.batch_size
        source, tokens = documents(cfg, tokenizer, workdir, "train")
        docs = grain.MapDataset.source(source).shuffle(seed=t.seed).repeat()
        self.rows = rows
        self.streams = {}
        for r in rows:
            ds = grain.experimental.ConcatThenSplitIterDataset(
                docs[r::b].map(tokens).to_iter_dataset(STREAM_READS),
                length_struct={"tokens": t.seq_len + 1})
            ds = ds.map(_layout(cfg.data.document_resets))
            seed = (t.seed * b + r) % 2**31  # Grain refuses seeds past ~2^32 (train.seed may be 2^32-1)
            ds = WindowShuffle(ds, window_size=cfg.data.shuffle_window, seed=seed)
            self.streams[r] = iter(ds)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        rows = [next(self.streams[r]) for r in self.rows]
        return {k: np.stack([row[k] for row in rows]) for k in rows[0]}

    def get_state(self) -> dict:
        return {str(r): s.get_state() for r, s in self.streams.items()}

    def set_state(self, state: dict) -> None:
        """Restores the streams of this process's rows from a state of all rows (as checkpoints
        keep it, through JSON: Grain's packing state holds tuples, which JSON made lists)."""
        missing = [r for r in self.rows if str(r) not in state]
        if missing:
            raise ValueError(f"the checkpoint's data state has no stream for rows {missing[:5]} "
                             f"(it holds {len(state)}): was it written with another train.batch_size?")
        for r, stream in self.streams.items():
            stream.set_state(_tuples(state[str(r)]))


def _tuples(x):
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def train_iterator(cfg, tokenizer, workdir: Path, rows: range | None = None) -> Rows:
    """An endless, deterministic iterator over packed training batches: `rows` of each global
    batch (default: all of train.batch_size), see `Rows` (`backcopy.Rows` for Bigram-Backcopy)."""
    if cfg.data.source == BACKCOPY:
        return backcopy.Rows(cfg, range(cfg.train.batch_size) if rows is None else rows)
    return Rows(cfg, tokenizer, workdir, range(cfg.train.batch_size) if rows is None else rows)


def set_state(iterator: Rows, state: dict) -> None:
    """Restores `iterator` from a state that went through JSON (as checkpoints store it)."""
    iterator.set_state(state)


def prepare(cfg, workdir: Path, tokenizer=None) -> None:
    """Builds the run's dataset (both splits) under WORKDIR/tfds if it is not there yet, and says
    what it holds: per domain and in total, the documents and tokens of each split, printed on
    stderr and kept in WORKDIR/corpus_report.json, once per corpus and tokenizer settings (a
    resume finds the file and prints nothing). `tokenizer`: the run's, else loaded (only to count)."""
    if cfg.data.source == BACKCOPY:
        return  # generated on the fly
    if cfg.data.source.startswith(TFDS):
        tfds_text.describe(cfg.data)  # checks the dataset and its text feature; nothing to build
        return
    workdir = epath.Path(workdir)
    folder = shards.open_shards(cfg.data.source) if cfg.data.source.startswith(SHARDS) else None
    name = f"shards-{folder.sha256[:12]}" if folder else tfds_text.prepare(cfg.data, workdir)
    key = {"fingerprint": name, "vocab_size": cfg.model.vocab_size, "tokenizer": cfg.data.tokenizer, "bos": cfg.data.bos}
    path = workdir / corpus.REPORT
    if _reported(path, key):
        return
    if folder:  # counted when the shards were made: nothing to tokenize
        _write_report(path, {"data_source": cfg.data.source, **key, "manifest_sha256": folder.sha256,
                             "tokenizer_pieces": folder.manifest["tokenizer_pieces"],
                             "held_out_rule": folder.manifest["held_out_rule"],
                             "tokens_are": "each document's ids + EOS" + (", after a BOS" if cfg.data.bos else ""),
                             **shards.report(folder.manifest, cfg.data.bos)})
        return
    data, tokenizer = cfg.data, tokenizer if tokenizer is not None else _run_tokenizer(cfg, workdir)
    tokenize = _tokenize(tokenizer, data.bos)
    report = {"data_source": data.source, **key, "tokenizer_pieces": tokenizer.get_piece_size(),
              "held_out_rule": corpus.HELD_OUT_RULE,
              "tokens_are": "each document's ids + EOS" + (", after a BOS" if data.bos else ""),
              **corpus.count(corpus.documents(data.source, data.code_max_bytes, data.decode_errors),
                             lambda text: len(tokenize({"text": text})["tokens"]))}
    _write_report(path, report)


def _write_report(path, report: dict) -> None:
    tmp = path.with_name(corpus.REPORT + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)
    print(corpus.describe(report, str(path)), file=sys.stderr, flush=True)


def _reported(path, key: dict) -> bool:
    """Whether `path` holds the report of these settings (an unreadable one is made again)."""
    try:
        report = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return False
    return isinstance(report, dict) and {k: report.get(k) for k in key} == key


def _run_tokenizer(cfg, workdir: Path):
    """The run's tokenizer as its readers find it (`tokenizer_path`: the recorded one, else this
    corpus's), trained if missing; the record's check is the trainer's (gattn/train/trainer.py)."""
    return load_tokenizer(cfg, workdir, fresh=True, path=tokenizer_path(cfg, workdir))


def validation_batches(cfg, tokenizer, workdir: Path) -> dict[str, list[dict]]:
    """Per held-out domain, up to `data.eval_batches` packed batches in a fixed order; a short
    last batch is padded, so a small domain keeps all of its text. Bigram-Backcopy: one domain
    of held-out sequences (`backcopy.validation_batches`)."""
    if cfg.data.source == BACKCOPY:
        return backcopy.validation_batches(cfg)
    out = {}
    for domain, ds in _held_out(cfg, tokenizer, workdir).items():
        ds = _pack_and_batch(ds.to_iter_dataset(), cfg.train.seq_len, cfg.data.eval_batch_size,
                             keep_last=True, document_resets=cfg.data.document_resets)
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
    if cfg.data.source == BACKCOPY:
        raise ConfigError("data.source", BACKCOPY, "long-context evaluation needs held-out text; "
                          "Bigram-Backcopy rows are single sequences of train.seq_len + 1 tokens")
    if cfg.data.source.startswith((SHARDS, TFDS)):
        return {d: np.concatenate([ex["tokens"] for ex in ds.to_iter_dataset()])
                for d, ds in _held_out(cfg, tokenizer, workdir).items()}
    source = tfds_text.data_source(cfg.data, workdir, "validation")
    tokenize = _tokenize(tokenizer, cfg.data.bos)
    out: dict[str, list] = {}
    for i in range(len(source)):
        ex = source[i]
        out.setdefault(ex["domain"].decode(), []).append(tokenize(ex)["tokens"])
    return {d: np.concatenate(parts) for d, parts in sorted(out.items())}


def _held_out(cfg, tokenizer, workdir) -> dict[str, grain.MapDataset]:
    """Per held-out domain, its documents' {"tokens"} in a fixed order: a shards folder's files
    of that domain; a TFDS dataset's held-out split, one domain named after the dataset; the
    local corpus's held-out split, filtered by domain."""
    data = cfg.data
    if data.source.startswith(SHARDS):
        folder = shards.open_shards(data.source)
        return {d: grain.MapDataset.source(folder.source("validation", d)).map(_from_record(tokenizer, data.bos))
                for d in folder.held_out_domains()}
    source, tokens = documents(cfg, tokenizer, workdir, "validation")
    if data.source.startswith(TFDS):
        return {tfds_text.domain(data): grain.MapDataset.source(source).map(tokens)}
    domains = sorted({(source[i]["domain"]).decode() for i in range(len(source))})
    return {d: grain.MapDataset.source(source).filter(lambda ex, d=d: ex["domain"].decode() == d).map(tokens)
            for d in domains}
