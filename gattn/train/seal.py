"""Seals of a finished checkpoint: each process writes N/checksums/process_K.json, the size and
sha256 of every file it wrote (`seal`); `unsealed` says whether every process sealed it and
`verify` whether the files still match (each process checks its share). gattn/train/checkpoint.py
decides with them which checkpoint a run may trust (docs/training.md#faults)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re

from etils.epath import Path  # local paths, and gs:// or other remote workdirs
import jax

CHECKSUMS = "checksums"  # N/checksums/process_K.json: what process K wrote, sealed when the save finished
HASH_THREADS = min(8, os.cpu_count() or 1)  # files hashed at once (hashlib releases the GIL)


def _owner(relative: str) -> int:
    """The process that wrote a checkpoint file: its ocdbt.process_K/ or process_K files are
    process K's, everything else process 0's."""
    m = re.search(r"(?:^|/)(?:ocdbt\.)?process_(\d+)(?:/|$)", relative)
    return int(m.group(1)) if m else 0


def _files(folder: Path) -> list[str]:
    """The files of a checkpoint folder (relative, sorted), its checksums left out."""
    def walk(d: Path, prefix: str):
        for p in d.iterdir():
            if p.is_dir():
                if prefix or p.name != CHECKSUMS:
                    yield from walk(p, f"{prefix}{p.name}/")
            else:
                yield prefix + p.name
    return sorted(walk(folder, ""))


def _digest(path: Path) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _digests(folder: Path, names: list[str]) -> dict[str, tuple[int, str]]:
    """{name: (bytes, sha256)} of the files `names` of `folder`, HASH_THREADS at a time."""
    with concurrent.futures.ThreadPoolExecutor(HASH_THREADS) as pool:
        return dict(zip(names, pool.map(lambda name: _digest(folder / name), names)))


def seal(folder: Path, process: int | None = None, processes: int | None = None) -> Path:
    """Writes FOLDER/checksums/process_K.json: the size and sha256 of every file of the finished
    checkpoint `folder` that process K wrote (its own shards; process 0 also the metadata). Each
    process reads back only what it wrote."""
    process = jax.process_index() if process is None else process
    processes = jax.process_count() if processes is None else processes
    files = _digests(folder, [f for f in _files(folder) if processes == 1 or _owner(f) == process])
    out = folder / CHECKSUMS / f"process_{process}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps({"process": process, "processes": processes,
                               "files": {f: {"bytes": n, "sha256": h} for f, (n, h) in files.items()}}))
    tmp.replace(out)
    return out


def _seals(folder: Path) -> dict[int, dict]:
    """{process: its seal} of `folder` ({} if it has none); a seal that does not parse is a ValueError."""
    found = {}
    for seal_file in sorted((folder / CHECKSUMS).glob("process_*.json")) if (folder / CHECKSUMS).is_dir() else []:
        try:
            content = json.loads(seal_file.read_text())
            found[int(content["process"])] = {"processes": int(content["processes"]), "files": dict(content["files"])}
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{seal_file.name} is not a readable seal ({e})") from None
    return found


def unsealed(folder: Path) -> str | None:
    """Why the checkpoint `folder` is not sealed by every process that saved it (a seal missing:
    that process stopped, or was stopped, before its save finished), or None."""
    found = _seals(folder)
    if not found:
        return "it has no seal: its save did not finish"
    processes = {seal["processes"] for seal in found.values()}
    want = max(processes)
    missing = sorted(set(range(want)) - set(found))
    if len(processes) > 1 or missing:
        who = ", ".join(map(str, missing)) or "?"
        return f"the seal of process {who} of {want} is missing: its save did not finish"
    return None


def sealed(folder: Path) -> dict:
    """{file: {bytes, sha256}} over every process's seal of `folder` ({} if it has none)."""
    return {name: want for seal in _seals(folder).values() for name, want in seal["files"].items()}


def verify(folder: Path, process: int | None = None, processes: int | None = None) -> str | None:
    """Why the checkpoint `folder` does not match its seal (a missing, resized or changed file),
    or None. This process checks its share of the files (every Kth); `first_readable` gathers
    every process's answer (and checks first that every process sealed it: `unsealed`)."""
    process = jax.process_index() if process is None else process
    processes = jax.process_count() if processes is None else processes
    files = sealed(folder)
    share = sorted(files)[process::processes]
    for name in share:
        if not (folder / name).is_file():
            return f"its file {name} is missing"
    for name, (size, digest) in _digests(folder, share).items():
        want = files[name]
        if size != want["bytes"]:
            return f"its file {name} has {size} bytes, {want['bytes']} when saved"
        if digest != want["sha256"]:
            return f"its file {name} does not match its checksum (sha256)"
    return None
