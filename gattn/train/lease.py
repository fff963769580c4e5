"""One writer per run directory: a training run holds WORKDIR/lock.json while it runs.

    {"host": "tpu-vm-0", "pid": 4242, "since": "2026-12-01 21:20:00", "renewed": 1796160000.0}

`hold(workdir)` takes the lease before the run writes anything and gives it back when the run
ends, however it ends (a killed process leaves it behind, and it goes stale). A second
`train.py` on the same directory is refused with one line naming the holder. A lease is stale,
and is taken over, when its process is gone (same host: the pid no longer runs) or when it was
not renewed for STALE_SECONDS (another host: the holder renews it every RENEW_SECONDS). With
several processes only process 0 holds it, for the whole run.

What it does not cover: two runs started within the same instant on a filesystem without
atomic replace (a bucket). The second writer is then found at its first renewal.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid

from etils.epath import Path  # local paths, and gs:// or other remote workdirs

from gattn.config import ConfigError

LOCK = "lock.json"
RENEW_SECONDS = 30.0
STALE_SECONDS = float(os.environ.get("GATTN_LOCK_STALE_SECONDS", "120"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def stale(holder: dict, now: float | None = None) -> bool:
    """Whether a lease `holder` (a lock.json dict) no longer holds: its process is gone (on this
    host), or it was not renewed for STALE_SECONDS."""
    now = time.time() if now is None else now
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        return not _alive(holder["pid"])
    return now - float(holder.get("renewed", 0)) > STALE_SECONDS


class Lease:
    """WORKDIR/lock.json for this process (module docstring)."""

    def __init__(self, workdir: str | Path):
        self.path = Path(workdir) / LOCK
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
                   "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._renew, name="gattn-lease", daemon=True)

    def _read(self) -> dict | None:
        try:
            found = json.loads(self.path.read_text())
        except (OSError, ValueError):  # absent, or half-written by a killed process
            return None
        return found if isinstance(found, dict) else None

    def _write(self) -> None:
        tmp = self.path.with_name(f".{LOCK}.{self.me['token']}.tmp")
        tmp.write_text(json.dumps({**self.me, "renewed": time.time()}))
        tmp.replace(self.path)

    def acquire(self) -> None:
        holder = self._read()
        if holder is not None and holder.get("token") != self.me["token"] and not stale(holder):
            ago = time.time() - float(holder.get("renewed", 0))
            raise ConfigError("--workdir", str(self.path.parent),
                              f"a run directory no other train.py is writing to: {holder.get('host')} pid "
                              f"{holder.get('pid')} has held it since {holder.get('since')} (renewed {ago:.0f} s "
                              f"ago). Stop that run, or wait: a lease whose process is gone, or that is not "
                              f"renewed for {STALE_SECONDS:.0f} s (GATTN_LOCK_STALE_SECONDS), is taken over")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        if (self._read() or {}).get("token") != self.me["token"]:  # another run took it at the same instant
            raise ConfigError("--workdir", str(self.path.parent), "a run directory no other train.py is writing "
                              "to: another run took it at the same moment")
        self.thread.start()

    def _renew(self) -> None:
        while not self.stopped.wait(RENEW_SECONDS):
            holder = self._read()
            if holder is not None and holder.get("token") != self.me["token"]:
                print(f"warning: {self.path} is now held by {holder.get('host')} pid {holder.get('pid')}: "
                      "two runs write to this directory", flush=True)
                return
            with contextlib.suppress(OSError):
                self._write()

    def release(self) -> None:
        self.stopped.set()
        if (self._read() or {}).get("token") == self.me["token"]:
            with contextlib.suppress(OSError):
                self.path.unlink()


@contextlib.contextmanager
def hold(workdir: str | Path, *, primary: bool = True):
    """Holds the run directory's lease for the body (only `primary`: process 0 of several)."""
    if not primary:
        yield
        return
    lease = Lease(workdir)
    lease.acquire()
    try:
        yield
    finally:
        lease.release()
