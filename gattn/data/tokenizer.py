"""A SentencePiece tokenizer trained locally on the training split, cached in the work directory;
or a converted model's own Hugging Face tokenizer (WORKDIR/tokenizer/hf/tokenizer.json)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import uuid
from typing import Protocol, runtime_checkable

from etils.epath import Path  # local paths, and gs:// or other remote workdirs
import sentencepiece as spm

from gattn import cli
from gattn.config import BACKCOPY, SHARDS, TFDS, ConfigError
from gattn.data import backcopy, corpus, record, shards

PAD, BOS, EOS, UNK = 0, 1, 2, 3
INIT_FROM_TOKENIZER = "init_from.model"  # a continued run's copy of its source's (gattn/init_from.py)
HF_TOKENIZER_DIR = "hf"  # WORKDIR/tokenizer/hf/: a converted model's tokenizer.json (gattn/interop/convert.py)


@runtime_checkable
class Tokenizer(Protocol):
    """What gattn calls on a tokenizer: SentencePiece's processor's methods, which `HFTokenizer`
    and `backcopy.Tokenizer` also have. Special ids are -1 where the tokenizer has none."""

    def encode(self, text: str) -> list[int]:
        """The text's token ids, no special tokens added."""

    def decode(self, ids) -> str:
        """The text of token ids (special tokens included)."""

    def eos_id(self) -> int:
        """The end-of-text id (-1: none)."""

    def bos_id(self) -> int:
        """The id that opens a document (-1: none)."""

    def get_piece_size(self) -> int:
        """The number of ids, special tokens included."""


class HFTokenizer:
    """A Hugging Face tokenizer.json as a `Tokenizer`: encode adds no special tokens; eos_id and
    bos_id come from tokenizer_config.json beside it (-1 if none: Qwen's names no bos_token).
    `encode_document` reads a training document's text as text, special tokens' included."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer  # noqa: PLC0415

        self.path, self.tok = Path(path), Tokenizer.from_str(Path(path).read_text())
        tc_path = self.path.with_name("tokenizer_config.json")
        tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}

        def special(name):  # "<s>", {"content": "<s>", ...} or null, or an explicit NAME_id
            token = tc.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            return tc.get(f"{name}_id", self.tok.token_to_id(token) if token else None)

        self._eos, self._bos = special("eos_token"), special("bos_token")

    def encode(self, text: str) -> list[int]:
        """Special tokens' text ("<|im_end|>") is their id: prompts and chat templates use it."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_document(self, text: str) -> list[int]:
        """A document's ids (`document_encoder`): never a special token's, whatever its text holds
        (before: "a </s> b" ended the document in its middle with the EOS id)."""
        return self._documents.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _documents(self):
        spec = self.tok.to_str()
        special = {t["id"] for t in json.loads(spec).get("added_tokens") or [] if t.get("special")}
        return _text_only(spec, special | {i for i in (self.eos_id(), self.bos_id()) if i >= 0})

    def decode(self, ids) -> str:
        return self.tok.decode(list(map(int, ids)), skip_special_tokens=False)

    def eos_id(self) -> int:
        return -1 if self._eos is None else int(self._eos)

    def bos_id(self) -> int:
        return -1 if self._bos is None else int(self._bos)

    def get_piece_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)


def _text_only(spec: str, special: set):
    """tokenizer.json `spec` as a tokenizers.Tokenizer that gives none of the ids in `special`
    (but the model's unknown token) to any text. Two ways text reaches such an id: the added
    tokens' matching ("</s>" as a whole; off with encode_special_tokens, once they are marked
    special), and the model's own vocabulary where it holds them (SentencePiece-converted ones
    hold "<s>", "</s>": a Unigram model matches "</s>" at score 0, a WordLevel or ignore_merges
    BPE model a word "</s>"), renamed here out of any text's reach, and the BPE merges that
    make or use them dropped."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    spec = json.loads(spec)
    for added in spec.get("added_tokens") or []:
        added["special"] = added.get("special") or added["id"] in special
    model = spec.get("model") or {}
    vocab, unk = model.get("vocab"), model.get("unk_token")
    hidden = set()

    def out_of_reach(i):
        return f"\0gattn-special-{i}\0"  # (no pre-tokenizer hands a model this whole)

    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], unk by its index
        for i in special - {model.get("unk_id")}:
            if 0 <= i < len(vocab):
                vocab[i] = [out_of_reach(i), *vocab[i][1:]]
    elif isinstance(vocab, dict):  # BPE, WordLevel, WordPiece: {piece: id}, unk by its piece
        hidden = {piece for piece, i in vocab.items() if i in special and piece != unk}
        model["vocab"] = {(out_of_reach(i) if piece in hidden else piece): i for piece, i in vocab.items()}
    if hidden and isinstance(model.get("merges"), list):
        def keep(merge):
            a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
            return not {a, b, a + b} & hidden
        model["merges"] = [m for m in model["merges"] if keep(m)]
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.encode_special_tokens = True
    return tok


# Below this many bytes of training text per piece, many learned pieces are rare: training a
# 4096-piece tokenizer on samples of the embedded corpus, 59% of the learned pieces occurred fewer
# than 10 times in its own training text at 100 bytes per piece, 23% at 200 and 12% at 300 (1024
# pieces: 11%, 6%, 4%); a rare piece's embedding is barely trained.
MIN_BYTES_PER_PIECE = 200


def train_tokenizer(source: str, code_max_bytes: int, vocab_size: int, path: Path,
                    decode_errors: str = "strict") -> Path:
    """BPE with byte fallback (so code, whitespace and any Unicode round-trip) on the train split;
    one warning line on stderr when the text is small for the vocabulary (`MIN_BYTES_PER_PIECE`)."""
    model, size = _trained(source, code_max_bytes, vocab_size, decode_errors)
    if size < MIN_BYTES_PER_PIECE * vocab_size:
        fits = size // MIN_BYTES_PER_PIECE
        smaller = f"model.vocab_size <= {fits}" if fits >= 260 else "the smallest model.vocab_size, 260,"
        print(f"warning: trained a {vocab_size}-piece tokenizer on {size / 1e3:,.0f} KB of text "
              f"({size / vocab_size:.0f} bytes per piece, under {MIN_BYTES_PER_PIECE}; data.source={source!r}): "
              f"many pieces are rare, their embeddings barely trained; {smaller} or more text would "
              "fix it", file=sys.stderr, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    # atomic: a killed run never leaves a half-written model behind; the name is this process's
    # own, for processes that train the same tokenizer side by side (a study's --part K/N)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_bytes(model.getvalue())
    try:
        tmp.rename(path)
    except FileExistsError:  # another process trained it meanwhile: the first one stands
        tmp.unlink()
    return path


def _trained(source: str, code_max_bytes: int, vocab_size: int, decode_errors: str) -> tuple[io.BytesIO, int]:
    """(the SentencePiece model trained on the train split, the bytes of text it read); a
    vocabulary larger than this text allows is a ConfigError naming model.vocab_size."""
    size = [0]  # bytes of training text, counted as the trainer reads it

    def lines():
        for doc in corpus.documents(source, code_max_bytes, decode_errors):
            if doc.split == "train":
                size[0] += len(doc.text.encode())
                yield from (line for line in doc.text.splitlines() if line.strip())

    model = io.BytesIO()
    try:
        _train_spm(lines(), model, vocab_size)
    except RuntimeError as e:  # the one limit a user meets: more pieces than this corpus has to offer
        most = re.search(r"<=\s*(\d+)", str(e))
        if "Vocabulary size too high" not in str(e) or not most:
            raise
        raise ConfigError("model.vocab_size", vocab_size,
                          f"at most {most.group(1)} to train a tokenizer on this corpus (data.source={source!r}): "
                          "a smaller vocabulary, a larger corpus, or a trained tokenizer (data.tokenizer)") from None
    return model, size[0]


def vocabulary_problem(cfg) -> tuple[str, str] | None:
    """For a corpus with other problems (`corpus.CorpusProblems`), whether the tokenizer gattn
    would train on it can have model.vocab_size pieces, so that a first run says every problem
    at once: a (problem, fix) pair, or None. Tried only on text small for the vocabulary
    (`MIN_BYTES_PER_PIECE`), where too large a vocabulary happens and the training takes seconds."""
    data, vocab = cfg.data, cfg.model.vocab_size
    if data.tokenizer or data.source.startswith((TFDS, SHARDS)) or data.source in (BACKCOPY, record.SYNTHETIC):
        return None
    docs = [d for d in corpus.documents(data.source, data.code_max_bytes, data.decode_errors) if d.split == "train"]
    if not docs or sum(len(d.text.encode()) for d in docs) >= MIN_BYTES_PER_PIECE * vocab:
        return None
    try:
        _trained(data.source, data.code_max_bytes, vocab, data.decode_errors)
    except ConfigError as e:
        if e.field != "model.vocab_size":
            raise
        return f"model.vocab_size = {vocab} is too large", e.allowed
    return None


def _train_spm(lines, model, vocab_size: int) -> None:
    """Trains gattn's SentencePiece model on `lines` (an iterator of str) and writes it to `model`
    (a file object). The training runs in a child interpreter fed through a pipe: SentencePiece
    holds the GIL from start to end (a 5 s training starves every other thread for 5 s), and this
    process's threads must keep running, the lease's renewal (gattn/train/lease.py) and the
    watch's beats (gattn/cluster.py), or the run is taken over or declared lost. Not a fork (it may
    hang in a process with JAX's threads), nor multiprocessing's spawn (it runs the caller's
    __main__ again); the child imports SentencePiece alone and dies with this process."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(os.getpid())], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        outcome = _feed(child, {**SPM_OPTIONS, "vocab_size": vocab_size}, lines)
    except BaseException:  # the corpus's DataError, a Ctrl-C: the training is of no use any more
        child.kill()
        raise
    finally:
        with contextlib.suppress(OSError):  # (a child gone with bytes unsent)
            child.stdin.close()
        child.stdout.close()
        code = child.wait()
    if outcome is None:
        raise cli.Failure("the process training the tokenizer ended without a result ("
                          + (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}")
                          + "; out of memory?)")
    if outcome[0] == "raised":  # SentencePiece's RuntimeError, with the child's traceback for --debug
        error = RuntimeError(outcome[1])
        error.add_note(f"raised in the process training the tokenizer:\n{outcome[2]}")
        raise error
    model.write(outcome[1])


SPM_OPTIONS = dict(  # gattn's tokenizer: SentencePieceTrainer.train's options, but the vocabulary size
    model_type="bpe", byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
    remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True, pad_id=PAD, bos_id=BOS,
    eos_id=EOS, unk_id=UNK, input_sentence_size=2_000_000, shuffle_input_sentence=True, max_sentence_length=16384,
    num_threads=2, minloglevel=2)

# `_train_spm`'s child. Reads (from stdin) the options, then lists of lines, then None; writes (to
# stdout) ("ok", the model's bytes) or ("raised", the error's text, its traceback).
_CHILD = """
import ctypes, io, os, pickle, sys, traceback
import sentencepiece as spm
if sys.platform.startswith("linux"):
    ctypes.CDLL("libc.so.6").prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: it dies with its parent
if os.getppid() != int(sys.argv[1]):  # the parent died before that took effect
    os._exit(1)
answer, options = os.fdopen(os.dup(1), "wb"), pickle.load(sys.stdin.buffer)
os.dup2(2, 1)  # what else writes to stdout goes to stderr, not into the answer

def received():
    while (batch := pickle.load(sys.stdin.buffer)) is not None:
        yield from batch

lines, model = received(), io.BytesIO()
try:
    spm.SentencePieceTrainer.train(sentence_iterator=lines, model_writer=model, **options)
    outcome = ("ok", model.getvalue())
except Exception as e:
    outcome = ("raised", str(e), traceback.format_exc())
for _ in lines:  # what the training left unread: the parent sends all before it reads the answer
    pass
pickle.dump(outcome, answer)
answer.close()
"""


def _feed(child: subprocess.Popen, options: dict, lines):
    """Sends the options and `lines` to `_CHILD` and returns its answer, or None if it is gone
    (killed: out of memory, or crashed). What reading `lines` raises is raised."""
    try:
        pickle.dump(options, child.stdin)
        for batch in _batches(lines):
            pickle.dump(batch, child.stdin)
        pickle.dump(None, child.stdin)
        child.stdin.close()
        return pickle.load(child.stdout)  # (waits without the GIL)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _batches(lines, size: int = 1 << 20):
    """`lines` in lists of about `size` characters (one message each through the pipe)."""
    batch, chars = [], 0
    for line in lines:
        batch.append(line)
        chars += len(line)
        if chars >= size:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def read_tokenizer(path: Path, field: str = "data.tokenizer") -> Tokenizer:
    """A Hugging Face tokenizer.json (by its suffix) or a SentencePiece .model; a file that is
    neither is one line naming `field` and what the file is not (not sentencepiece's INTERNAL
    error)."""
    kind = "a Hugging Face tokenizer.json" if path.suffix == ".json" else "a SentencePiece .model"
    try:
        tok = HFTokenizer(path) if path.suffix == ".json" else spm.SentencePieceProcessor(model_proto=path.read_bytes())
        # SentencePiece takes an empty file as a model of no pieces, whose first id lookup crashes
        # the process (a segmentation fault); the tokenizers library raises a bare Exception
        pieces = tok.get_piece_size()
    except Exception as e:  # noqa: BLE001 (whatever the library raises, the user gets one line)
        why = (cli.first_line(e) or type(e).__name__)[:160]
        raise ConfigError(field, str(path), f"{kind} (judged by its name); this file does not read as one "
                          f"({why}). A .json is read as tokenizer.json, any other name as a SentencePiece model") from None
    if pieces < 1:
        raise ConfigError(field, str(path), f"{kind} with pieces; this one has none (an empty file?)")
    return tok


def document_encoder(tokenizer: Tokenizer, max_chars: int = corpus.MAX_CHARS):
    """A function: a whole document's text -> its ids, exactly `tokenizer.encode(text)`, or a
    tokenizer.json's `HFTokenizer.encode_document` (no special id from a document's text), token
    for token (what the text path calls on each document, gattn/data/pipeline.py).

    A document of more than `max_chars` characters is encoded in pieces only by a SentencePiece
    BPE model that normalizes character by character (gattn's own: `_train_spm`), and only where
    that is provably the same (`_sentencepiece_cuts`); any other tokenizer (a tokenizer.json, a
    model with a normalization rule) encodes it whole. A cut anywhere else is not: SentencePiece's
    dummy prefix (a tokenizer.json's Prepend normalizer, Metaspace prepend_scheme="always") puts
    a "▁" at each cut, and a pre-tokenizer regex may split differently there. Encoding whole
    takes ~170 bytes of memory per character, with SentencePiece and tokenizers alike (measured:
    1.7 GB for a 10M-character document), and is 1.5-3x slower on documents of megabytes."""
    cuts = _sentencepiece_cuts(tokenizer)
    if cuts is None:  # (SentencePiece never matches its control pieces, "</s>", in text)
        return getattr(tokenizer, "encode_document", tokenizer.encode)
    rest, safe = cuts

    def encode(text: str) -> list[int]:
        if len(text) <= max_chars:
            return tokenizer.encode(text)
        at_cut = safe(text)
        ids, start = [], 0
        while start < len(text):
            end = (len(text) if len(text) - start <= max_chars
                   else _cut(at_cut, start, start + max_chars, len(text)))
            ids += (tokenizer if start == 0 else rest).encode(text[start:end])
            start = end
        return ids

    return encode


def _cut(at_cut, start: int, end: int, size: int) -> int:
    """The last place in (start, end] where `at_cut` allows a cut, else the first after end, else
    `size` (the rest of the text in one piece)."""
    for c in range(end, start, -1):
        if at_cut(c):
            return c
    return next((c for c in range(end + 1, size) if at_cut(c)), size)


def _sentencepiece_cuts(tokenizer):
    """(the same model without the dummy prefix, for the pieces after the first; text -> a test of
    "a cut before character c is exact") for a SentencePiece BPE model whose normalizer works
    character by character: no normalization rule (gattn trains with "identity"), extra
    whitespace kept, the dummy prefix (if any) at the start. Else None.

    Why a cut there is exact: the normalized text is then the dummy "▁" + each character as it is
    (" " as "▁"), so the whole text's is the first piece's followed by the other pieces' without
    their dummy prefix. BPE (sentencepiece's bpe_model.cc) starts from single characters
    (user-defined symbols matched whole) and only merges two adjacent symbols into a piece of the
    vocabulary; at a cut between two characters that are pieces of their own (no unknown or byte
    fallback there) and that are adjacent in no piece of the vocabulary, no merge ever spans the
    cut, so each side's merges, and their order (score, then position), are the ones that side
    makes alone."""
    if not isinstance(tokenizer, spm.SentencePieceProcessor):
        return None
    from sentencepiece import sentencepiece_model_pb2  # noqa: PLC0415 (protobuf)

    proto = sentencepiece_model_pb2.ModelProto
    model = proto.FromString(tokenizer.serialized_model_proto())
    norm, trainer = model.normalizer_spec, model.trainer_spec
    if (trainer.model_type != sentencepiece_model_pb2.TrainerSpec.BPE or norm.precompiled_charsmap
            or norm.remove_extra_whitespaces or trainer.treat_whitespace_as_suffix):
        return None
    kinds = (proto.SentencePiece.NORMAL, proto.SentencePiece.USER_DEFINED)
    chars = {p.piece for p in model.pieces if len(p.piece) == 1 and p.type in kinds}
    pairs = {s[i:i + 2] for p in model.pieces for s in {p.piece, p.piece.replace("▁", " ")}
             for i in range(len(s) - 1)}
    model.normalizer_spec.add_dummy_prefix = False
    rest = spm.SentencePieceProcessor(model_proto=model.SerializeToString())
    escape = norm.escape_whitespaces

    def safe(text: str):
        seen = text.replace(" ", "▁") if escape else text  # the characters as the model sees them
        return lambda c: seen[c - 1] in chars and seen[c] in chars and seen[c - 1:c + 1] not in pairs

    return rest, safe


def tokenizer_path(cfg, workdir: Path, *, fresh: bool = False) -> Path:
    """The tokenizer file a run uses: the user's (data.tokenizer: a SentencePiece .model or a
    Hugging Face tokenizer.json); a converted model's (WORKDIR/tokenizer/hf/tokenizer.json, also
    what a run continued from one copies); for a continued run (train.init_from) the copy of its
    source's in WORKDIR/tokenizer; or the cached one in WORKDIR/tokenizer: the one the run
    recorded (gattn/data/record.py), whatever the corpus is now, else the one for this corpus and
    model.vocab_size (which may not exist yet). `fresh`: a run that starts (it has no checkpoint),
    which chooses its tokenizer anew."""
    data, vocab = cfg.data, cfg.model.vocab_size
    if data.source.startswith(SHARDS):  # the shards' own tokenizer; yours only if it is that file
        return _shards_tokenizer(cfg)
    if data.tokenizer:
        path = Path(data.tokenizer).expanduser()
        if not path.is_file():
            raise ConfigError("data.tokenizer", data.tokenizer,
                              "expected an existing SentencePiece .model or Hugging Face tokenizer.json file")
        return path
    if data.source.startswith(TFDS):
        raise ConfigError("data.tokenizer", "", f"a tokenizer file for data.source={data.source!r} (a TFDS "
                          "dataset is tokenized as it is read; gattn trains one only on a local corpus): e.g. "
                          "Qwen's tokenizer.json with its tokenizer_config.json beside it")
    if data.source == BACKCOPY:  # the task's character vocabulary (gattn/data/backcopy.py)
        return Path(workdir) / "tokenizer" / f"backcopy-{data.backcopy.chars}.json"
    if (Path(workdir) / "tokenizer" / HF_TOKENIZER_DIR / "tokenizer.json").is_file():
        return Path(workdir) / "tokenizer" / HF_TOKENIZER_DIR / "tokenizer.json"
    if cfg.train.init_from:
        path = Path(workdir) / "tokenizer" / INIT_FROM_TOKENIZER
        if not path.is_file():
            raise ConfigError("train.init_from", cfg.train.init_from,
                              f"this run's copy of its source's tokenizer ({path}) is missing")
        return path
    if vocab < 260:
        raise ConfigError("model.vocab_size", vocab,
                          "expected >= 260 to train a tokenizer (256 byte pieces + 4 specials)")
    rec = None if fresh else record.read(workdir)
    if rec and rec.get("tokenizer"):
        return record.recorded_tokenizer(workdir, rec)
    names = corpus.fingerprints(data.source, data.code_max_bytes, data.decode_errors)
    paths = [Path(workdir) / "tokenizer" / f"spm-{name}-{vocab}.model" for name in names]
    if fresh:
        return paths[0]
    # A run from before the record: named by the fingerprint now, or by the one of before.
    found = next((p for p in paths if p.is_file()), None) or record.legacy_tokenizer(workdir, paths, vocab)
    return found or paths[0]


def _shards_tokenizer(cfg) -> Path:
    """The tokenizer file a shards folder was made with; data.tokenizer, where set, must be the
    same file (by sha256): ids mean nothing under another tokenizer."""
    folder = shards.open_shards(cfg.data.source)
    if cfg.data.tokenizer:
        path = Path(cfg.data.tokenizer).expanduser()
        if not path.is_file() or record.sha256(path) != folder.manifest["tokenizer_sha256"]:
            raise ConfigError("data.tokenizer", cfg.data.tokenizer,
                              f"the tokenizer {cfg.data.source} was made with (sha256 "
                              f"{folder.manifest['tokenizer_sha256'][:12]}..., {folder.tokenizer_file}), or '' "
                              "to use that file")
        return path
    return folder.tokenizer_file


def load_tokenizer(cfg, workdir: Path, *, fresh: bool = False, path: Path | None = None) -> Tokenizer:
    """The tokenizer of `tokenizer_path` (or `path`: the file process 0 chose): a SentencePiece
    processor, trained on first use when it is the cached one, or a Hugging Face tokenizer.json
    (`HFTokenizer`). Unless `fresh`, a file that is not the one the run recorded is refused
    (`record.verify`)."""
    try:
        path = tokenizer_path(cfg, workdir, fresh=fresh) if path is None else Path(path)
    except corpus.CorpusProblems as e:  # with the vocabulary's, if it is one too: all at once
        raise e.also(vocabulary_problem(cfg)) from None
    if cfg.data.source == BACKCOPY:
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(backcopy.Tokenizer(backcopy.task(cfg.data.backcopy).chars).to_json())
    elif not path.is_file():
        train_tokenizer(cfg.data.source, cfg.data.code_max_bytes, cfg.model.vocab_size, path,
                        cfg.data.decode_errors)
    if not fresh:
        record.verify(cfg, workdir, path)
    if cfg.data.source == BACKCOPY:
        sp = backcopy.Tokenizer.from_json(path.read_text())
    else:
        sp = read_tokenizer(path, "data.tokenizer" if cfg.data.tokenizer else "tokenizer file")
    if not fresh:
        record.verify_specials(cfg, workdir, path, sp)
    if cfg.data.source.startswith(SHARDS):
        _check_shards_specials(cfg, path, sp)
    if sp.get_piece_size() > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", cfg.model.vocab_size,
                          f"expected >= the tokenizer's {sp.get_piece_size()} pieces ({path})")
    return sp


def _check_shards_specials(cfg, path: Path, tokenizer) -> None:
    """The shards' EOS and BOS ids (their manifest's) must be the tokenizer's: a tokenizer.json's
    come from the tokenizer_config.json beside it, which the sha256 check (`_shards_tokenizer`)
    does not cover (before: an identical tokenizer.json in another folder, or an edited config,
    ended every document with another id than the one the shards were made with)."""
    manifest = shards.open_shards(cfg.data.source).manifest
    changed = [f"{k} {now} (the shards': {manifest[k]})" for k, now in record.special_ids(tokenizer).items()
               if k in manifest and manifest[k] != now]
    if changed:
        field, value = ("data.tokenizer", cfg.data.tokenizer) if cfg.data.tokenizer else ("data.source", cfg.data.source)
        raise ConfigError(field, value, f"a tokenizer with the EOS and BOS ids {cfg.data.source} was made with; "
                          f"{path} has {', '.join(changed)}, from the tokenizer_config.json beside it: "
                          "use the shards' own tokenizer folder (data.tokenizer '') or restore that file")
