"""A SentencePiece tokenizer trained locally on the training split, cached in the work directory."""

from __future__ import annotations

import io
from pathlib import Path

import sentencepiece as spm

from gattn.config import ConfigError
from gattn.data import corpus

PAD, BOS, EOS, UNK = 0, 1, 2, 3
INIT_FROM_TOKENIZER = "init_from.model"  # a continued run's copy of its source's (gattn/init_from.py)


def train_tokenizer(source: str, code_max_bytes: int, vocab_size: int, path: Path) -> Path:
    """BPE with byte fallback (so code, whitespace and any Unicode round-trip) on the train split."""
    lines = (line for doc in corpus.documents(source, code_max_bytes) if doc.split == "train"
             for line in doc.text.splitlines() if line.strip())
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=model, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        pad_id=PAD, bos_id=BOS, eos_id=EOS, unk_id=UNK, input_sentence_size=2_000_000,
        shuffle_input_sentence=True, max_sentence_length=16384, num_threads=2, minloglevel=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(model.getvalue())
    tmp.rename(path)  # atomic: a killed run never leaves a half-written model behind
    return path


def tokenizer_path(cfg, workdir: Path) -> Path:
    """The SentencePiece file a run uses: the user's (data.tokenizer); for a continued run
    (train.init_from) the copy of its source's in WORKDIR/tokenizer; or the one cached in
    WORKDIR/tokenizer for this corpus and model.vocab_size (which may not exist yet)."""
    data, vocab = cfg.data, cfg.model.vocab_size
    if data.tokenizer:
        path = Path(data.tokenizer).expanduser()
        if not path.is_file():
            raise ConfigError("data.tokenizer", data.tokenizer, "expected an existing SentencePiece .model file")
        return path
    if cfg.train.init_from:
        path = Path(workdir) / "tokenizer" / INIT_FROM_TOKENIZER
        if not path.is_file():
            raise ConfigError("train.init_from", cfg.train.init_from,
                              f"this run's copy of its source's tokenizer ({path}) is missing")
        return path
    if vocab < 260:
        raise ConfigError("model.vocab_size", vocab,
                          "expected >= 260 to train a tokenizer (256 byte pieces + 4 specials)")
    return Path(workdir) / "tokenizer" / f"spm-{corpus.fingerprint(data.source, data.code_max_bytes)}-{vocab}.model"


def load_tokenizer(cfg, workdir: Path) -> spm.SentencePieceProcessor:
    """The user's model file (data.tokenizer), or the cached one for this corpus with
    model.vocab_size pieces, trained on first use."""
    path = tokenizer_path(cfg, workdir)
    if not path.is_file():
        train_tokenizer(cfg.data.source, cfg.data.code_max_bytes, cfg.model.vocab_size, path)
    sp = spm.SentencePieceProcessor(model_file=str(path))
    if sp.get_piece_size() > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", cfg.model.vocab_size,
                          f"expected >= the tokenizer's {sp.get_piece_size()} pieces ({path})")
    return sp
