"""What a run was trained on, kept in WORKDIR/data.json: its tokenizer file with the file's
sha256 (and a tokenizer.json's EOS and BOS ids), and the fingerprint of its data (the corpus, or the Bigram-Backcopy task's tables).

The tokenizer is part of the model: ids mean nothing with another one. The cached SentencePiece
model is named by the corpus fingerprint, so before this record a changed corpus (files added
to data.source, or another Python, whose embedded corpus differs) silently trained a new
tokenizer under an existing run. The rules (docs/training.md#the-run-keeps-its-tokenizer):

- train.py writes the record when a run starts and again on every resume (process 0).
- Every later user of the run (a resume, eval.py, studies, --init-from, the converter) reads
  text with the recorded tokenizer file, whatever the corpus is now, and refuses a file whose
  sha256 is not the recorded one, or EOS or BOS id (a tokenizer.json's tokenizer_config.json).
- A resume refuses a corpus whose fingerprint is not the recorded one (its batches would not
  be the ones the checkpoint's data state points into), unless train.py --allow-corpus-change;
  a reader only notes it (held-out text is read with the run's own tokenizer).
- A run directory from before the record keeps working: its tokenizer is found by the current
  or the legacy fingerprint (`corpus.fingerprints`), or is the only spm-*-VOCAB.model it holds;
  its first resume writes the record.
"""

from __future__ import annotations

import hashlib
import json
import sys

from etils.epath import Path  # local paths, and gs:// or other remote workdirs

from gattn.config import BACKCOPY, SHARDS, TFDS, ConfigError
from gattn.data import backcopy, corpus, shards

RECORD = "data.json"
SYNTHETIC = "synthetic"  # (gattn/data/synthetic.py: no tokenizer, no corpus, nothing to record)


def read(workdir) -> dict | None:
    """WORKDIR/data.json, or None (a run from before the record, or none at all)."""
    path = Path(workdir) / RECORD
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise ConfigError("--workdir", str(workdir), f"its {RECORD} is not valid JSON; restore it, or "
                          "delete it to have the run's tokenizer found as for an older run") from None


def recorded_tokenizer(workdir, rec: dict) -> Path:
    """The recorded tokenizer file: kept relative to the run directory when it is inside it."""
    name = rec["tokenizer"]
    return Path(name) if name.startswith("/") or "://" in name else Path(workdir) / name


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def fingerprint(cfg) -> str | None:
    """The data's fingerprint: the corpus's (`corpus.fingerprint`), or for Bigram-Backcopy one of
    the task's tables (computed from the embedded docs, which differ between Pythons)."""
    data = cfg.data
    if data.source == SYNTHETIC:
        return None
    if data.source.startswith(SHARDS):  # the manifest names every file by its sha256
        return "shards-" + shards.open_shards(data.source).sha256[:12]
    if data.source.startswith(TFDS):
        from gattn.data import tfds_text  # noqa: PLC0415 (TFDS only where a run reads it)

        return tfds_text.fingerprint(data)
    if data.source == BACKCOPY:
        chars, unigram, bigram = backcopy._counts(data.backcopy.chars)
        h = hashlib.sha256(chars.encode())
        for counts in (unigram, bigram):
            h.update(counts.astype("int64").tobytes())
        return "backcopy-" + h.hexdigest()[:12]
    return corpus.fingerprint(data.source, data.code_max_bytes, data.decode_errors)


def specials(cfg, tokenizer_file, tokenizer) -> dict:
    """A Hugging Face tokenizer.json's EOS and BOS ids ({"eos_id", "bos_id"}, read from `tokenizer`,
    the file loaded; {} for other tokenizers, whose file holds them): they come from the
    tokenizer_config.json beside it, which the file's sha256 does not cover."""
    if tokenizer is None or cfg.data.source == BACKCOPY or Path(tokenizer_file).suffix != ".json":
        return {}
    return special_ids(tokenizer)


def special_ids(tokenizer) -> dict:
    """{"eos_id", "bos_id"} of a loaded tokenizer (what `specials` records and the checks compare)."""
    return {"eos_id": tokenizer.eos_id(), "bos_id": tokenizer.bos_id()}


def write(cfg, workdir, tokenizer_file, earlier: list | None = None, tokenizer=None) -> None:
    """Records `tokenizer_file` (relative to the run when inside it) with its sha256 (and, given
    `tokenizer`, the file loaded, a tokenizer.json's EOS and BOS ids: `specials`), and the data's
    fingerprint now; `earlier`: fingerprints a resume was allowed to leave behind."""
    workdir, tokenizer_file = Path(workdir), Path(tokenizer_file)
    name = str(tokenizer_file)
    if name.startswith(str(workdir).rstrip("/") + "/"):
        name = name[len(str(workdir).rstrip("/")) + 1:]
    rec = {"tokenizer": name, "tokenizer_sha256": sha256(tokenizer_file), **specials(cfg, tokenizer_file, tokenizer),
           "data_source": cfg.data.source, "fingerprint": fingerprint(cfg), "earlier_fingerprints": list(earlier or [])}
    if cfg.data.source.startswith(SHARDS):
        rec["manifest_sha256"] = shards.open_shards(cfg.data.source).sha256
    tmp = workdir / (RECORD + ".tmp")
    tmp.write_text(json.dumps(rec, indent=2))
    tmp.replace(workdir / RECORD)


def legacy_fingerprint(tokenizer_file) -> str | None:
    """The fingerprint in a cached tokenizer's name (spm-FINGERPRINT-VOCAB.model), else None."""
    parts = Path(tokenizer_file).name.split("-")
    return parts[1] if len(parts) == 3 and parts[0] == "spm" and parts[2].endswith(".model") else None


def check_resume(cfg, workdir, tokenizer_file, allow_change: bool) -> list:
    """Refuses to resume on other data than the run was trained on (unless `allow_change`);
    returns the earlier fingerprints to keep in the record. A run from before the record is
    judged by the fingerprint in its cached tokenizer's name, where it has one."""
    rec, now = read(workdir), fingerprint(cfg)
    if rec is not None:
        then, earlier = rec.get("fingerprint"), list(rec.get("earlier_fingerprints", []))
    else:
        then, earlier = legacy_fingerprint(tokenizer_file), []
        if then is not None and cfg.data.source not in (BACKCOPY, SYNTHETIC) and then in corpus.fingerprints(
                cfg.data.source, cfg.data.code_max_bytes, cfg.data.decode_errors):
            then = now  # the same corpus, named by the fingerprint of before (no domain)
    if then is None or now is None or then == now:
        return earlier
    if not allow_change:
        raise ConfigError("data.source", cfg.data.source,
                          f"the data changed since this run was trained (fingerprint {then}, now {now}: "
                          "files added, removed or edited, or another Python's embedded corpus): resume "
                          "on the same data, train in a new --workdir, or rerun with --allow-corpus-change "
                          "to continue on the new data with the run's tokenizer")
    print(f"note: the data changed since this run was trained (fingerprint {then}, now {now}); "
          f"continuing on it with the run's tokenizer {tokenizer_file} (--allow-corpus-change)",
          file=sys.stderr, flush=True)
    _noted.add((str(workdir), now))  # (said here: `verify` need not say it again)
    return earlier + [then]


def verify(cfg, workdir, tokenizer_file) -> None:
    """Refuses a tokenizer file that is not the one the run recorded (by sha256), and notes
    (once) when a reader's data differs from the run's."""
    rec = read(workdir)
    if rec is None or not rec.get("tokenizer_sha256"):
        return
    if sha256(tokenizer_file) != rec["tokenizer_sha256"]:
        field, value = ("data.tokenizer", cfg.data.tokenizer) if cfg.data.tokenizer else ("--workdir", str(workdir))
        raise ConfigError(field, value, f"the tokenizer {tokenizer_file} is not the file this run was trained "
                          f"with ({rec['tokenizer']}, sha256 {rec['tokenizer_sha256'][:12]}...): restore that "
                          "file, or name a copy of it with --config.data.tokenizer=PATH")
    now = fingerprint(cfg)
    if rec.get("fingerprint") and now and now != rec["fingerprint"] and (str(workdir), now) not in _noted:
        _noted.add((str(workdir), now))
        print(f"note: data.source={cfg.data.source!r} is not the data {workdir} was trained on "
              f"(fingerprint {rec['fingerprint']}, now {now}); its text is read with the run's own "
              f"tokenizer ({rec['tokenizer']})", file=sys.stderr, flush=True)


_noted: set = set()


def verify_specials(cfg, workdir, tokenizer_file, tokenizer) -> None:
    """Refuses a tokenizer whose EOS or BOS id is not the one the run recorded (`specials`: a
    tokenizer.json's tokenizer_config.json edited, or another beside an identical copy; before,
    every document silently ended with another id). A record without them (written before gattn
    kept them) is taken as it is."""
    rec = read(workdir) or {}
    then = {k: rec[k] for k in ("eos_id", "bos_id") if k in rec}
    now = special_ids(tokenizer)
    changed = [k for k in then if then[k] != now[k]]
    if changed:
        field, value = ("data.tokenizer", cfg.data.tokenizer) if cfg.data.tokenizer else ("--workdir", str(workdir))
        said = ", ".join(f"{k} {now[k]} (the run's: {then[k]})" for k in changed)
        raise ConfigError(field, value, f"the tokenizer {tokenizer_file} has {said}, from the "
                          "tokenizer_config.json beside it: restore the tokenizer_config.json this run was "
                          "trained with, or name a copy of the tokenizer.json with that one beside it "
                          "(--config.data.tokenizer=PATH)")


def legacy_tokenizer(workdir, candidates: list, vocab: int):
    """A run from before the record whose tokenizer is named by no fingerprint of the corpus now:
    its only cached tokenizer of this vocabulary (noted), or None if it has none; several are
    refused (which one the checkpoint was trained with cannot be told)."""
    others = sorted(Path(workdir).glob(f"tokenizer/spm-*-{vocab}.model"))
    others = [p for p in others if p not in candidates]
    if len(others) > 1:
        raise ConfigError("data.tokenizer", "", f"{workdir} has no {RECORD} (a run from before gattn recorded "
                          f"its tokenizer), and holds {len(others)} tokenizers of other corpora "
                          f"({', '.join(p.name for p in others)}): name the one it was trained with, "
                          "--config.data.tokenizer=PATH")
    if others:
        print(f"note: {workdir} has no {RECORD} (a run from before gattn recorded its tokenizer); using its "
              f"tokenizer {others[0].name}, trained on data.source as it was then", file=sys.stderr, flush=True)
        return others[0]
    return None
