"""Documents with a domain label and a fixed train / validation split.

The embedded default corpus needs no download and exists wherever Python does: CPython's own
documentation (`pydoc_data/topics.py`, domain "docs") and the standard library's top-level `.py`
sources (domain "code"). A user's folder of `.txt` / `.jsonl` files works the same way: a `.txt`
file is one document whose domain is the first sub-folder on its path (a file at the top of the
folder: "text"); a `.jsonl` line is a document with a "text" field and an optional "domain"
field (default "text", wherever the file lies). Text that gattn cannot use stops the run with
one line naming the file and the byte offset or line (`DataError`): never a silent U+FFFD, unless
data.decode_errors="replace" asks for it (and the count is reported).
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from gattn.config import ConfigError

EMBEDDED = "embedded"


class DataError(ConfigError):
    """Text under data.source that gattn cannot use: one line naming the file (with its line or
    byte offset), what is wrong and what is expected. A ConfigError, so that the entry points
    print it as one line and exit 2."""

    def __init__(self, where: str, problem: str, expected: str, field: str = "data.source"):
        ValueError.__init__(self, f"{where}: {problem}; {expected}")
        self.field, self.value, self.allowed = field, where, expected


@dataclass(frozen=True)
class Document:
    id: str
    domain: str
    text: str
    replaced_bytes: int = 0  # invalid UTF-8 bytes decoded as U+FFFD (data.decode_errors="replace")
    moved: bool = False  # the hash's split turned over, so that its domain keeps both (`balance`)

    @property
    def split(self) -> str:
        """'validation' for a stable ~`HELD_OUT_PERCENT`% of documents (by id hash), else 'train';
        the other one for a document `balance` moved."""
        held = _bucket(self.id) < HELD_OUT_PERCENT
        return "validation" if held != self.moved else "train"


HELD_OUT_PERCENT = 10
HELD_OUT_RULE = (f"~{HELD_OUT_PERCENT}% of the documents, chosen by a hash of each document's id; a domain of "
                 "2 or more documents keeps one of each split: the document the hash ranks nearest the other "
                 "split moves (gattn/data/corpus.py, balance)")


def _bucket(doc_id: str) -> int:
    return int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) % 100


# The split of a small corpus, balanced per domain: the hash alone leaves a domain of 20
# documents with no held-out one about 1 time in 8 (0.9^20). A domain's `tally` is mergeable in
# any order (prepare.py combines it on Beam workers), and it alone decides which documents move,
# so the text path and the shards path hold out the same documents, and a corpus that the hash
# balances already keeps its split (and its fingerprint) unchanged.
def tally(doc_id: str) -> tuple:
    """One document's share of its domain's tally: (documents, held out by the hash, the training
    document nearest the held-out split, the held-out one farthest from it), ranks (bucket, id)."""
    rank = (_bucket(doc_id), doc_id)
    held = rank[0] < HELD_OUT_PERCENT
    return 1, int(held), None if held else rank, rank if held else None


def merge(tallies) -> tuple:
    """The tally of the documents of several tallies (associative and commutative, for Beam)."""
    tallies = list(tallies)
    nearest = [t[2] for t in tallies if t[2] is not None]
    farthest = [t[3] for t in tallies if t[3] is not None]
    return (sum(t[0] for t in tallies), sum(t[1] for t in tallies), min(nearest, default=None),
            max(farthest, default=None))


def moved_ids(t: tuple) -> list[str]:
    """The ids whose split a domain of tally `t` turns over: none, or one."""
    documents, held, nearest, farthest = t
    if documents < 2:  # one document: the hash's split (`check` warns of the split it lacks)
        return []
    if held == 0:
        return [nearest[1]]
    if held == documents:
        return [farthest[1]]
    return []


def balance(index) -> frozenset[str]:
    """The ids of the documents that move split, from (id, domain) of every document."""
    domains: dict[str, tuple] = {}
    for doc_id, domain in index:
        domains[domain] = merge([domains[domain], tally(doc_id)]) if domain in domains else tally(doc_id)
    return frozenset(i for t in domains.values() for i in moved_ids(t))


# A run that reads the embedded corpus more often than this needs a corpus of its own: a paper
# preset's 100k steps read it ~10^5 times over, the CPU presets about once.
EMBEDDED_PASSES_MAX = 1000


def embedded_tokens_at_most(code_max_bytes: int) -> int:
    """A bound on the embedded corpus's tokens without reading it: its bytes (no token is shorter
    than a byte) and an EOS and a BOS a document."""
    import pydoc_data.topics  # noqa: PLC0415

    docs = pydoc_data.topics.topics.values()
    files = sum(1 for _ in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return sum(len(t.encode()) + 2 for t in docs) + code_max_bytes + 2 * files


def check_embedded_suffices(cfg) -> None:
    """Refuses, in one line naming data.source and what to pass, a run on the embedded corpus that
    would read it more than EMBEDDED_PASSES_MAX times over (a paper preset given no corpus)."""
    t = cfg.train
    if cfg.data.source != EMBEDDED:
        return
    bound, tokens = embedded_tokens_at_most(cfg.data.code_max_bytes), t.steps * t.batch_size * t.seq_len
    if tokens <= EMBEDDED_PASSES_MAX * bound:
        return
    most = EMBEDDED_PASSES_MAX * bound // (t.batch_size * t.seq_len)
    raise ConfigError("data.source", EMBEDDED, f"a corpus as large as the run: train.steps x batch_size x seq_len = "
                      f"{t.steps:,} x {t.batch_size:,} x {t.seq_len:,} = {tokens / 1e9:,.1f}B tokens would read "
                      f"the embedded corpus (at most {bound / 1e6:.1f}M tokens) {tokens // bound:,} times over; "
                      "pass --config.data.source=shards:DIR (python -m gattn.prepare; docs/pod-slice.md), a folder "
                      f"of .txt / .jsonl files or tfds:NAME, or --steps {most} or fewer to try it on the embedded one")


def embedded_documents(code_max_bytes: int) -> Iterator[Document]:
    import pydoc_data.topics  # noqa: PLC0415

    for name in sorted(pydoc_data.topics.topics):
        yield Document(f"docs/{name}", "docs", pydoc_data.topics.topics[name])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"), key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())
    total, smallest = 0, None
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        smallest = len(text) if smallest is None else min(smallest, len(text))
        if total + len(text) > code_max_bytes:
            continue
        total += len(text)
        yield Document(f"code/{path.name}", "code", text)
    if total == 0 and code_max_bytes > 0:  # 0: the docs domain only, on purpose (gattn/eval/ruler.py)
        raise ConfigError("data.code_max_bytes", code_max_bytes,
                          f"keeps no file of the 'code' domain, which would be dropped: expected >= "
                          f"{smallest} (the smallest standard-library file)")


def _count_and_replace(e: UnicodeDecodeError):
    _replaced[0] += e.end - e.start
    return "\ufffd", e.end


_replaced = [0]
codecs.register_error("gattn_count_replace", _count_and_replace)


def decode(raw: bytes, where: str, decode_errors: str, offset: int = 0) -> tuple[str, int]:
    """`raw` as text, and how many bytes were replaced: invalid UTF-8 is an error naming `where`
    and the byte offset (`offset`: where `raw` starts in its file) unless `decode_errors` is
    "replace"; a NUL byte means a binary file, which is refused either way."""
    newline = b"\n"

    def at(i: int) -> str:  # the byte offset, and the line in a text of several
        line = f" (line {raw.count(newline, 0, i) + 1})" if newline in raw else ""
        return f"byte offset {offset + i}{line}"

    if (nul := raw.find(b"\0")) >= 0:
        raise DataError(where, f"a NUL byte at byte offset {offset + nul}: a binary file, not text",
                        "expected UTF-8 text (.txt) or JSON lines (.jsonl)")
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if decode_errors != "replace":
            raise DataError(where, f"not valid UTF-8: byte 0x{raw[e.start]:02x} at {at(e.start)}",
                            "convert the file to UTF-8, or set --config.data.decode_errors=replace "
                            "to decode bad bytes as U+FFFD") from None
    _replaced[0] = 0
    text = raw.decode("utf-8", errors="gattn_count_replace")
    return text, _replaced[0]


BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark (Windows editors write one): not text, dropped


def _read(path: Path) -> tuple[bytes, int]:
    """A file's bytes without a leading UTF-8 byte-order mark, and the offset where they start."""
    raw = path.read_bytes()
    return (raw[len(BOM):], len(BOM)) if raw.startswith(BOM) else (raw, 0)


def _jsonl_documents(path: Path, rel: Path, decode_errors: str) -> Iterator[Document]:
    raw_file, offset = _read(path)
    for i, raw in enumerate(raw_file.split(b"\n")):
        where = f"{path}:{i + 1}"
        line, replaced = decode(raw, where, decode_errors, offset)
        offset += len(raw) + 1
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(where, f"not valid JSON ({e.msg} at column {e.colno})",
                            'expected one JSON object per line, e.g. {"text": "...", "domain": "..."}') from None
        if not isinstance(record, dict) or "text" not in record:
            raise DataError(where, f"a .jsonl line needs a 'text' field (got {line.strip()[:40]!r})",
                            'expected one JSON object per line, e.g. {"text": "...", "domain": "..."}')
        for key in ("text", "domain"):
            if key in record and not isinstance(record[key], str):
                raise DataError(where, f"{key!r} is {type(record[key]).__name__} {record[key]!r:.40}",
                                f"expected {key!r} to be a string")
        yield Document(f"{rel}:{i}", record.get("domain", "text"), record["text"], replaced)


def folder_documents(folder: Path, decode_errors: str = "strict") -> Iterator[Document]:
    expected = "expected 'embedded' or a folder of .txt / .jsonl files"
    if not folder.exists():
        raise DataError(f"data.source={str(folder)!r}", "no such folder", expected)
    if not folder.is_dir():
        raise DataError(f"data.source={str(folder)!r}", "a file, not a folder", expected)
    files = sorted(p for p in folder.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
    if not files:
        raise DataError(f"data.source={str(folder)!r}", "the folder holds no .txt or .jsonl files", expected)
    for path in files:
        yield from file_documents(path, path.relative_to(folder), decode_errors)


def file_documents(path, rel, decode_errors: str = "strict") -> Iterator[Document]:
    """The documents of one corpus file (a pathlib or etils.epath path; `rel`: its path under
    the corpus folder, which names its documents and a .txt file's domain)."""
    if path.suffix == ".txt":
        domain = _txt_domain(rel)
        raw, start = _read(path)
        text, replaced = decode(raw, str(path), decode_errors, start)
        yield Document(str(rel), domain, text, replaced)
    else:
        yield from _jsonl_documents(path, rel, decode_errors)


def _txt_domain(rel) -> str:
    """A .txt file's domain: the first sub-folder on its path, "text" at the top of the corpus."""
    return rel.parts[0] if len(rel.parts) > 1 else "text"


MAX_CHARS = 10_000  # pieces of a long document encoded at once where exact (tokenizer.document_encoder)


def documents(source: str, code_max_bytes: int, decode_errors: str = "strict") -> Iterator[Document]:
    """Every document of `source` ('embedded' or a folder path), in a fixed order, its split
    balanced per domain (`balance`: a first pass over the ids, which reads no .txt file)."""
    moved = balance(_index(source, code_max_bytes, decode_errors))
    for doc in _documents(source, code_max_bytes, decode_errors):
        yield dataclasses.replace(doc, moved=True) if doc.id in moved else doc


def _documents(source: str, code_max_bytes: int, decode_errors: str) -> Iterator[Document]:
    if source == EMBEDDED:
        return embedded_documents(code_max_bytes)
    return folder_documents(Path(source).expanduser(), decode_errors)


def _index(source: str, code_max_bytes: int, decode_errors: str) -> Iterator[tuple[str, str]]:
    """(id, domain) of every document: a .txt file's from its path alone."""
    folder = Path(source).expanduser()
    if source == EMBEDDED or not folder.is_dir():  # (a missing folder: said by `folder_documents`)
        yield from ((d.id, d.domain) for d in _documents(source, code_max_bytes, decode_errors))
        return
    for path in sorted(p for p in folder.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file()):
        rel = path.relative_to(folder)
        if path.suffix == ".txt":
            yield str(rel), _txt_domain(rel)
        else:
            yield from ((d.id, d.domain) for d in _jsonl_documents(path, rel, decode_errors))


def fingerprint(source: str, code_max_bytes: int, decode_errors: str = "strict") -> str:
    """A short hash of the corpus content (each document's id, domain and text): caches (tokenizer,
    TFDS files) are keyed by it, and a run records it (gattn/data/record.py). Also where the
    corpus is checked as a whole (`check`)."""
    return fingerprints(source, code_max_bytes, decode_errors)[0]


def fingerprints(source: str, code_max_bytes: int, decode_errors: str = "strict") -> tuple[str, str]:
    """(`fingerprint`, the legacy one): before the domain was hashed too (a relabelled .jsonl
    domain kept its old TFDS build), the fingerprint saw ids and texts only; run directories
    from then name their tokenizer with that one, and still find it by it (gattn/data/record.py)."""
    h, legacy = hashlib.sha256(), hashlib.sha256()
    stats: dict[str, list[int]] = {}  # domain -> [train docs, held-out docs, characters]
    replaced = [0, 0]  # bytes, documents
    moved = []
    for doc in documents(source, code_max_bytes, decode_errors):
        text = hashlib.sha256(doc.text.encode()).digest()
        legacy.update(doc.id.encode())
        legacy.update(text)
        h.update(hashlib.sha256(json.dumps([doc.id, doc.domain]).encode()).digest())  # fixed-length parts
        h.update(text)
        counts = stats.setdefault(doc.domain, [0, 0, 0])
        counts[doc.split == "validation"] += 1
        counts[2] += len(doc.text)
        replaced[0] += doc.replaced_bytes
        replaced[1] += doc.replaced_bytes > 0
        moved += [doc.id] * doc.moved
    if moved:  # the split is part of the data (caches and runs are keyed by it); unmoved: as before
        for each in (h, legacy):
            each.update(json.dumps({"moved": moved}).encode())
    name = h.hexdigest()[:12]
    check(source, name, stats, replaced)
    return name, legacy.hexdigest()[:12]


_reported: set[str] = set()  # corpora already reported on by this process


class CorpusProblems(DataError):
    """Every problem the corpus checks found, said at once in one line: (problem, what fixes it)
    pairs. `also` adds one found later (the tokenizer's vocabulary, gattn/data/tokenizer.py)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source, self.problems = source, list(problems)
        where = f"data.source={source!r}"
        if len(problems) == 1:
            super().__init__(where, *problems[0])
        else:
            ValueError.__init__(self, f"{where}: {len(problems)} problems: "
                                + "; ".join(f"({i}) {p}: {fix}" for i, (p, fix) in enumerate(problems, 1)))
            self.field, self.value, self.allowed = "data.source", where, "fix each of them"

    def also(self, problem: tuple[str, str] | None) -> "CorpusProblems":
        return self if problem is None else CorpusProblems(self.source, [*self.problems, problem])


def check(source: str, name: str, stats: dict[str, list[int]], replaced: list[int]) -> None:
    """Empty domains, and a split with no document at all, are errors, all said at once
    (`CorpusProblems`); a domain without held-out (or without training) documents, and replaced
    bytes, are reported once per process on stderr."""
    problems = []
    empty = [d for d, (_, _, chars) in sorted(stats.items()) if chars == 0]
    if empty:
        names = ", ".join(map(repr, empty))
        problems.append((f"domain {names} holds no text" if len(empty) == 1 else f"domains {names} hold no text",
                         "give each domain some text, or remove its empty documents"))
    for i, split in enumerate(("training", "held-out")):  # a split the dataset cannot be written without
        if stats and not any(counts[i] for counts in stats.values()):
            n = sum(c[0] + c[1] for c in stats.values())
            problems.append((f"none of its {n} documents is in the {split} split (~{HELD_OUT_PERCENT}% are held "
                             "out, chosen by a hash of each document's id; a domain of 2 or more documents keeps "
                             "one of each split)",
                             "give it more documents, e.g. split the text into more files or .jsonl lines"))
    if problems:
        raise CorpusProblems(source, problems)
    if name in _reported:
        return
    _reported.add(name)
    if replaced[0]:
        print(f"warning: data.source={source!r}: replaced {replaced[0]} invalid UTF-8 bytes with "
              f"U+FFFD in {replaced[1]} documents (data.decode_errors='replace')", file=sys.stderr)
    for domain, (train, held_out, _) in sorted(stats.items()):
        if not train or not held_out:
            missing = "held-out" if not held_out else "training"
            fix = "; raise data.code_max_bytes" if source == EMBEDDED and domain == "code" else ""
            print(f"warning: data.source={source!r}: domain {domain!r} has no {missing} documents "
                  f"({train + held_out} in all): it is {'not evaluated' if not held_out else 'never trained on'}"
                  f"{fix}", file=sys.stderr)


REPORT = "corpus_report.json"  # WORKDIR/corpus_report.json: the corpus report (gattn/data/pipeline.py)
SPLITS = {"train": "train", "validation": "held_out"}  # Document.split -> the report's name
COUNTS = ("documents", "bytes", "tokens")


def count(docs, count_tokens) -> dict:
    """The corpus report's numbers: per domain and in total, the documents, UTF-8 bytes and tokens
    (`count_tokens(text)`) of each split, {"domains": {domain: {split: {...}}}, "total": {split: {...}}}."""
    domains: dict[str, dict] = {}
    for doc in docs:
        splits = domains.setdefault(doc.domain, {s: dict.fromkeys(COUNTS, 0) for s in SPLITS.values()})
        c = splits[SPLITS[doc.split]]
        c["documents"] += 1
        c["bytes"] += len(doc.text.encode())
        c["tokens"] += count_tokens(doc.text)
    total = {s: {k: sum(d[s][k] for d in domains.values()) for k in COUNTS} for s in SPLITS.values()}
    return {"domains": dict(sorted(domains.items())), "total": total}


def describe(report: dict, where: str) -> str:
    """The corpus report as a few lines for stderr: one row per domain and the totals."""
    head = ("domain", "train docs", "train tokens", "held-out docs", "held-out tokens")
    rows = [(d, *(f"{c[s][k]:,}" for s in SPLITS.values() for k in ("documents", "tokens")))
            for d, c in [*report["domains"].items(), ("all domains", report["total"])]]
    w = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"corpus report, data.source={report['data_source']!r} ({where}):"]
    lines += ["  " + "  ".join([r[0].ljust(w[0]), *(x.rjust(n) for x, n in zip(r[1:], w[1:]))])
              for r in [head, *rows]]
    lines.append(f"  held out: ~{HELD_OUT_PERCENT}% of the documents, chosen by a hash of each one's id (a domain "
                 f"of 2 or more keeps one of each split); tokens: {report['tokens_are']}, as training reads them")
    return "\n".join(lines)
