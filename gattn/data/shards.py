"""Pretokenized shards (`data.source="shards:DIR"`): what `python -m gattn.prepare` writes and
training reads (gattn/data/prepare.py writes them).

DIR holds ArrayRecord files of one record per document (its domain and its token ids, no EOS:
the reader adds EOS, and BOS with data.bos), the tokenizer they were made with, and
`manifest.json`: the tokenizer's sha256, the documents and tokens per split and domain, the
source's fingerprint and every file with its record count and sha256. A run records the
manifest's sha256 (gattn/data/record.py), so a resume on other shards is refused as a changed
corpus is. Training files are `train-K-of-N`, held-out files `validation-DOMAIN-K-of-N` (per
domain, so validation reads only its domain); a document's file is chosen by a hash of its id and
its place in the file by its id, so the files are the same for any number of workers.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import numpy as np
from etils import epath

from gattn.config import SHARDS, ConfigError

MANIFEST = "manifest.json"
FORMAT = "gattn-shards/1"


def encode_record(domain: str, ids) -> bytes:
    """One document: the domain's UTF-8 length (2 bytes), the domain, its ids as int32 (little-endian)."""
    name = domain.encode()
    return len(name).to_bytes(2, "little") + name + np.asarray(ids, "<i4").tobytes()


def decode_record(record: bytes) -> tuple[str, np.ndarray]:
    n = int.from_bytes(record[:2], "little")
    return record[2:2 + n].decode(), np.frombuffer(record, "<i4", offset=2 + n)


def file_name(split: str, domain: str, shard: int, num_shards: int) -> str:
    """train-00003-of-00016.array_record; validation-DOMAIN-00003-of-00016.array_record (a domain
    that is not a plain name gets its hash beside a cleaned one)."""
    if split == "train":
        return f"train-{shard:05d}-of-{num_shards:05d}.array_record"
    slug = re.sub(r"[^A-Za-z0-9_.]+", "_", domain)[:40]
    if slug != domain:
        slug += "_" + hashlib.sha256(domain.encode()).hexdigest()[:8]
    return f"validation-{slug}-{shard:05d}-of-{num_shards:05d}.array_record"


def directory(source: str) -> epath.Path:
    """The folder of data.source="shards:DIR"."""
    return epath.Path(source[len(SHARDS):]).expanduser()


@dataclass(frozen=True)
class Shards:
    """A prepared folder as training reads it: its manifest, and the manifest file's sha256."""

    root: epath.Path
    manifest: dict
    sha256: str

    @property
    def tokenizer_file(self) -> epath.Path:
        return self.root / self.manifest["tokenizer"]

    def files(self, split: str, domain: str | None = None) -> list[dict]:
        return [f for f in self.manifest["files"] if f["split"] == split
                and (domain is None or f["domain"] == domain)]

    def held_out_domains(self) -> list[str]:
        return sorted({f["domain"] for f in self.files("validation")})

    def source(self, split: str, domain: str | None = None):
        """A random-access source of the split's (or one held-out domain's) records, in the
        manifest's order. The record counts come from the manifest: no file is opened until read."""
        from array_record.python import array_record_data_source as ards  # noqa: PLC0415

        files = self.files(split, domain)
        if not files:
            raise ConfigError("data.source", f"{SHARDS}{self.root}",
                              f"its {MANIFEST} lists no {split} files" + (f" of domain {domain!r}" if domain else ""))
        return ards.ArrayRecordDataSource([_Instruction(str(self.root / f["path"]), 0, f["records"], f["records"])
                                           for f in files])


@dataclass(frozen=True)
class _Instruction:  # array_record's FileInstruction protocol: a whole file, its length known
    filename: str
    skip: int
    take: int
    examples_in_shard: int


_opened: dict[str, Shards] = {}


def open_shards(source: str) -> Shards:
    """The shards of data.source="shards:DIR", checked: a manifest of this format whose files
    are all there. Read once per process."""
    root = directory(source)
    key = str(root)
    path = root / MANIFEST
    expected = f"a folder written by python -m gattn.prepare (holding {MANIFEST})"
    if not path.is_file():
        raise ConfigError("data.source", source, f"{expected}; {path} does not exist")
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if key in _opened and _opened[key].sha256 == digest:
        return _opened[key]
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise ConfigError("data.source", source, f"{expected}; its {MANIFEST} is not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError("data.source", source, f"{expected} in format {FORMAT!r}; its {MANIFEST} says "
                          f"{manifest.get('format') if isinstance(manifest, dict) else None!r}")
    missing = [f["path"] for f in manifest["files"] if not (root / f["path"]).exists()]
    if missing:
        raise ConfigError("data.source", source, f"{expected}; {len(missing)} of the files its {MANIFEST} "
                          f"lists are missing ({', '.join(missing[:3])})")
    _opened[key] = Shards(root, manifest, digest)
    return _opened[key]


def report(manifest: dict, bos: bool) -> dict:
    """The corpus report's numbers (corpus.count's shape) from the manifest: tokens as training
    reads them (the manifest counts each document's ids + EOS; a BOS adds one per document)."""
    def add_bos(c: dict) -> dict:
        return {**c, "tokens": c["tokens"] + (c["documents"] if bos else 0)}
    domains = {d: {s: add_bos(c) for s, c in splits.items()} for d, splits in manifest["counts"]["domains"].items()}
    total = {s: add_bos(c) for s, c in manifest["counts"]["total"].items()}
    return {"domains": domains, "total": total}
