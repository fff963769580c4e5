"""What a run trains on: `DataConfig` (text source, tokenizer, batching of held-out data) and
the synthetic Bigram-Backcopy task's `BackcopySpec`."""

from __future__ import annotations

from dataclasses import dataclass, field

from gattn.config.checks import DECODE_ERRORS, ConfigError, _bool, _choice, _integer


BACKCOPY = "bigram_backcopy"  # data.source of the synthetic Bigram-Backcopy task (gattn/data/backcopy.py)
BACKGROUNDS = ("bigram", "unigram", "uniform")  # BackcopySpec.background
SHARDS = "shards:"  # data.source="shards:DIR": pretokenized shards from python -m gattn.prepare (gattn/data/shards.py)
TFDS = "tfds:"      # data.source="tfds:NAME[/CONFIG][:VERSION]": a prepared TFDS dataset (gattn/data/tfds_text.py)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


@dataclass(frozen=True)
class BackcopySpec:
    """Bigram-Backcopy (Guo et al. 2024), the task that makes attention sinks form in small models
    (docs/sinks.md): each row is one sequence `<s> x1 x2 ...` over the `chars` most frequent
    characters of the embedded docs. After a trigger character of set j the next token copies the
    token offsets[j] places before the trigger; after any other character it is drawn from the
    docs' character bigrams.

    chars:    vocabulary size besides <s>.
    triggers: trigger sets as character frequency ranks (0 = the most frequent, a space), a set's
              ranks separated by ',' and sets by '|': "0,1,2" is Guo's one set of the top 3;
              "0|1|2|3" four one-character sets.
    offsets:  per trigger set, how far before the trigger the copied token is (1 = the token
              just before it, Guo's task), separated by ','.
    background: what follows a token that is no trigger (and x1): "bigram" (the docs' character
              bigrams, Guo's task), "unigram" (the docs' character frequencies, independent of the
              token before) or "uniform" (every character alike). With bigrams the context is a
              useful prior, so a head that spreads its attention is no worse than one parked on
              <s> (docs/sinks.md).
    """

    chars: int = 63
    triggers: str = "0,1,2"
    offsets: str = "1"
    background: str = "bigram"

    def __post_init__(self):
        _integer("chars", self.chars)
        if self.chars < 2:
            raise ConfigError("chars", self.chars, "expected at least 2 characters")
        try:
            sets = self.trigger_sets
        except (AttributeError, ValueError):
            raise ConfigError("triggers", self.triggers, "expected ranks like '0,1,2' or sets like '0|1|2'") from None
        ranks = [r for s in sets for r in s]
        if any(not 0 <= r < self.chars for r in ranks) or len(set(ranks)) != len(ranks):
            raise ConfigError("triggers", self.triggers,
                              f"expected distinct character ranks in 0..{self.chars - 1}, each in one set")
        if len(ranks) >= self.chars:
            raise ConfigError("triggers", self.triggers, f"expected fewer triggers than chars ({self.chars})")
        try:
            offsets = self.offset_list
        except (AttributeError, ValueError):
            offsets = []
        if len(offsets) != len(sets) or any(o < 1 for o in offsets):
            raise ConfigError("offsets", self.offsets,
                              f"expected one integer >= 1 per trigger set ({len(sets)}), separated by ','")
        _choice("background", self.background, BACKGROUNDS)

    @property
    def trigger_sets(self) -> list[list[int]]:
        return [_int_list(s) for s in self.triggers.split("|")]

    @property
    def offset_list(self) -> list[int]:
        return _int_list(self.offsets)


@dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it becomes tokens (gattn/data)."""

    # "embedded" (CPython docs + stdlib sources), a folder path, "shards:DIR" (pretokenized shards
    # written by python -m gattn.prepare; DIR local or gs://) or "tfds:NAME[/CONFIG][:VERSION]" (a
    # TFDS dataset prepared under tfds_data_dir, read with random access and tokenized on the fly)
    source: str = "embedded"
    code_max_bytes: int = 1_500_000  # how much stdlib source the embedded corpus takes
    # a SentencePiece .model or a Hugging Face tokenizer.json (tokenizer_config.json beside it); ""
    # trains a SentencePiece model of model.vocab_size on the corpus (shards: their own tokenizer)
    tokenizer: str = ""
    # Packed rows each batch row's stream shuffles together (gattn/data/pipeline.Rows): a long
    # document's consecutive rows are spread over that many steps, at any batch size. Memory: a
    # process holds up to this many rows per stream it reads, 32 x 49 KB = 1.6 MB per stream at
    # seq_len 4096 (100 MB for 64 streams, 1.6 GB for 1024).
    shuffle_window: int = 32
    eval_batches: int = 4           # held-out batches per domain for validation
    eval_batch_size: int = 8
    # A folder's text that is not valid UTF-8: "strict" refuses it, naming the file and the byte
    # offset; "replace" decodes it with U+FFFD and reports how many bytes were replaced.
    decode_errors: str = "strict"
    # Natural text: a fixed BOS token opens each document (a fixed first token, the literature's
    # strongest attention-sink recipe; docs/sinks.md). document_resets: positions restart and
    # attention stops at each document start (True), or each row is a plain window of
    # concatenated text read as one sequence (False; Gu et al.'s setup).
    bos: bool = False
    document_resets: bool = True
    backcopy: BackcopySpec = field(default_factory=BackcopySpec)  # used when source is 'bigram_backcopy'
    # source "tfds:...": where the prepared dataset lies ("": TFDS's default, ~/tensorflow_datasets;
    # gs:// allowed), the text feature, and the training and held-out splits (TFDS split syntax,
    # e.g. "train[:99%],train[99%:]" for a dataset with a train split only).
    tfds_data_dir: str = ""
    text_feature: str = "text"
    tfds_splits: str = "train,validation"

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source:
            raise ConfigError("source", self.source, "expected 'embedded' or a folder path")
        for prefix, form in ((SHARDS, "'shards:DIR'"), (TFDS, "'tfds:NAME[/CONFIG][:VERSION]'")):
            if self.source.startswith(prefix) and not self.source[len(prefix):].strip():
                raise ConfigError("source", self.source, f"expected {form} with a non-empty name")
        for name in ("tfds_data_dir", "text_feature", "tfds_splits"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(name, getattr(self, name), "expected a string")
        if not self.text_feature:
            raise ConfigError("text_feature", self.text_feature, "expected the name of a text feature, e.g. 'text'")
        splits = [s.strip() for s in self.tfds_splits.split(",") if s.strip()]
        if len(splits) != 2:
            raise ConfigError("tfds_splits", self.tfds_splits,
                              "expected 'TRAIN,HELD_OUT' (two TFDS splits, e.g. 'train,validation')")
        if splits[0] == splits[1]:  # (before: accepted, and validation ran on training documents)
            raise ConfigError("tfds_splits", self.tfds_splits, "expected two different splits, TRAIN,HELD_OUT: "
                              "validation on the training split measures memorization; e.g. "
                              "'train[:99%],train[99%:]' for a dataset with a train split only")
        _choice("decode_errors", self.decode_errors, DECODE_ERRORS)
        if not isinstance(self.tokenizer, str):
            raise ConfigError("tokenizer", self.tokenizer, "expected a path or ''")
        for name in ("code_max_bytes", "shuffle_window", "eval_batches", "eval_batch_size"):
            _integer(name, getattr(self, name))
        _bool("bos", self.bos)
        _bool("document_resets", self.document_resets)
        if not isinstance(self.backcopy, BackcopySpec):
            raise ConfigError("backcopy", self.backcopy, "expected a BackcopySpec")
        if self.source == BACKCOPY:
            for name, natural in (("bos", False), ("document_resets", True), ("tokenizer", "")):
                if getattr(self, name) != natural:
                    raise ConfigError(name, getattr(self, name), f"source {BACKCOPY!r} has its own <s> start "
                                      f"token, one sequence per row and its own vocabulary: leave it {natural!r}")
