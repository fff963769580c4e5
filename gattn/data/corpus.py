"""Documents with a domain label and a fixed train / validation split.

The embedded default corpus needs no download and exists wherever Python does: CPython's own
documentation (`pydoc_data/topics.py`, domain "docs") and the standard library's top-level `.py`
sources (domain "code"). A user's folder of `.txt` / `.jsonl` files works the same way: a `.txt`
file is one document whose domain is its sub-folder (or "text"); a `.jsonl` line is a document
with a "text" field and an optional "domain" field.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

EMBEDDED = "embedded"


@dataclass(frozen=True)
class Document:
    id: str
    domain: str
    text: str

    @property
    def split(self) -> str:
        """'validation' for a stable ~`HELD_OUT_PERCENT`% of documents (by id hash), else 'train'."""
        bucket = int(hashlib.sha256(self.id.encode()).hexdigest()[:8], 16) % 100
        return "validation" if bucket < HELD_OUT_PERCENT else "train"


HELD_OUT_PERCENT = 10


def embedded_documents(code_max_bytes: int) -> Iterator[Document]:
    import pydoc_data.topics  # noqa: PLC0415

    for name in sorted(pydoc_data.topics.topics):
        yield Document(f"docs/{name}", "docs", pydoc_data.topics.topics[name])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"), key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())
    total = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if total + len(text) > code_max_bytes:
            continue
        total += len(text)
        yield Document(f"code/{path.name}", "code", text)


def folder_documents(folder: Path) -> Iterator[Document]:
    files = sorted(p for p in folder.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
    if not files:
        raise FileNotFoundError(f"data.source={str(folder)!r} holds no .txt or .jsonl files")
    for path in files:
        rel = path.relative_to(folder)
        if path.suffix == ".txt":
            domain = rel.parts[0] if len(rel.parts) > 1 else "text"
            yield Document(str(rel), domain, path.read_text(encoding="utf-8", errors="replace"))
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if line.strip():
                record = json.loads(line)
                if "text" not in record:
                    raise ValueError(f"{path}:{i + 1}: a .jsonl line needs a 'text' field")
                yield Document(f"{rel}:{i}", str(record.get("domain", "text")), record["text"])


def documents(source: str, code_max_bytes: int) -> Iterator[Document]:
    """Every document of `source` ('embedded' or a folder path), in a fixed order."""
    if source == EMBEDDED:
        return embedded_documents(code_max_bytes)
    return folder_documents(Path(source).expanduser())


def fingerprint(source: str, code_max_bytes: int) -> str:
    """A short hash of the corpus content: caches (tokenizer, TFDS files) are keyed by it."""
    h = hashlib.sha256()
    for doc in documents(source, code_max_bytes):
        h.update(doc.id.encode())
        h.update(hashlib.sha256(doc.text.encode()).digest())
    return h.hexdigest()[:12]
