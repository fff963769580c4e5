"""Several processes, one run: who writes, who waits, and what they share.

A pod slice runs one JAX process per host (`gattn.cli.start_distributed` joins them). Process 0
is the primary: it alone writes metrics, summaries and the run's config, and it does one-time
preparation first while the others wait at a barrier. Everything here is a no-op with one process.
"""

from __future__ import annotations

import json

from etils.epath import Path  # local paths, and gs:// or other remote workdirs
import jax
import numpy as np
from jax.experimental import multihost_utils


def count() -> int:
    return jax.process_count()


def primary() -> bool:
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here until all have arrived."""
    if count() > 1:
        multihost_utils.sync_global_devices(f"gattn:{name}")


def _broadcast_bytes(data: bytes | None) -> bytes:
    """Process 0's `data` on every process."""
    size = multihost_utils.broadcast_one_to_all(np.asarray(len(data or b""), np.int64))
    buf = np.frombuffer((data or b"").ljust(int(size), b"\0"), np.uint8)
    return np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8).tobytes()


def broadcast_json(value):
    """Process 0's `value` (JSON-serialisable) on every process; the others pass anything."""
    if count() == 1:
        return value
    return json.loads(_broadcast_bytes(json.dumps(value).encode() if primary() else None))


def share_file(path: Path, *, optional: bool = False) -> None:
    """Process 0's file `path` on every host: a no-op on a shared filesystem, a copy where each
    host has its own disk (written atomically, only where it is missing). `optional`: a file
    process 0 may lack; then none is written anywhere."""
    if count() == 1:
        return
    if optional and _broadcast_bytes(b"1" if primary() and path.exists() else b"0") != b"1":
        return
    data = _broadcast_bytes(path.read_bytes() if primary() else None)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{jax.process_index()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)


def gather_json(value) -> list:
    """Every process's `value` (JSON-serialisable), in process order, on every process."""
    if count() == 1:
        return [value]
    data = json.dumps(value).encode()
    sizes = multihost_utils.process_allgather(np.asarray(len(data), np.int64))
    longest = int(np.max(sizes))
    rows = multihost_utils.process_allgather(np.frombuffer(data.ljust(longest, b" "), np.uint8))
    return [json.loads(np.asarray(r, np.uint8).tobytes()[:int(n)]) for r, n in zip(rows, sizes)]


def code_version() -> str:
    """A hash of the gattn package's source files (what each host runs)."""
    import hashlib  # noqa: PLC0415
    import pathlib  # noqa: PLC0415 (the installed package is local: no etils)

    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def check_same_run(config: dict) -> None:
    """Every process compares its resolved config (a run's config.json dict) and its code version
    with process 0's before any work; a difference raises ConfigError on every process, naming
    the first differing field and both values (so every host exits 2, none trains a wrong run)."""
    if count() == 1:
        return
    from gattn.config import ConfigError, flat_fields  # noqa: PLC0415

    mine = {"config": flat_fields(config), "code": code_version()}
    everyone = gather_json(mine)
    for index, theirs in enumerate(everyone[1:], start=1):
        if theirs["code"] != everyone[0]["code"]:
            raise ConfigError("code version", f"process {index}: {theirs['code']}",
                              f"process 0's {everyone[0]['code']}: every host must run the same gattn source")
        for field in sorted(set(theirs["config"]) | set(everyone[0]["config"])):
            a, b = everyone[0]["config"].get(field), theirs["config"].get(field)
            if a != b:
                raise ConfigError(field, b, f"the same value on every host: process {index} has {b!r}, "
                                  f"process 0 has {a!r}")
