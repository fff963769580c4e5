"""One writer per run directory: a training run holds WORKDIR/lock.json while it runs.

    {"host": "tpu-vm-0", "pid": 4242, "started": "BOOT_ID/START_TICKS", "token": "...",
     "since": "2026-12-01 21:20:00", "renewed": 1796160000.0}

`hold(workdir)` takes the lease before the run writes anything and gives it back when the run
ends, however it ends (a killed process leaves it behind, and it goes stale). A second
`train.py` on the same directory is refused with one line naming the holder. A lease is stale,
and is taken over, when its process is gone (seen on the holder's host: the pid no longer runs,
or is now another process: `started` differs, as after a container restart), or when it was not
renewed for STALE_SECONDS (its holder renews it every beat: RENEW_SECONDS, or a quarter of a
shorter STALE_SECONDS) and its process cannot be seen (another host's, or a start /proc cannot
tell). On its own host a process that is provably the holder keeps its lease, renewed or not.
The renewal is a thread, so the run keeps long calls that hold the GIL out of its process (the
tokenizer trains in a process of its own: gattn/data/tokenizer.py). With several processes only
process 0 holds it, for the whole run.

Every change of the lease is a compare-and-swap, so of runs starting, or taking over the same
stale lease, at the same instant exactly one wins: on a local or NFS disk the read and the write
happen under an flock of lock.json (the kernel releases it when a process dies); on a gs://
bucket each write names the generation it read (`if_generation_match`, 0 to create).

A run that loses the lease stops before it writes again (`check()`, before each step and save,
raises LeaseLost: one line, exit 1): a renewal found another holder, or the lease went unrenewed
for STALE_SECONDS less a beat (on the monotonic clock: a step of the wall clock is no delay),
after which another host's run may take it. A failed renewal (any error of the store: an
HttpError, a RefreshError) is retried at the next beat. lock.json's `renewed` is wall-clock time,
for the other hosts.

What it does not cover: another remote filesystem (s3://, ...), or a mount without locks (NFS
without lockd), has neither, so two runs starting at the same instant there may both win (the
second is found at the first renewal and stops). Clocks of different hosts are trusted to agree
to well within STALE_SECONDS.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import socket
import sys
import threading
import time
import uuid

from etils.epath import Path  # local paths, and gs:// or other remote workdirs

from gattn import cli
from gattn.config import ConfigError

LOCK = "lock.json"
RENEW_SECONDS = 30.0
STALE_SECONDS = float(os.environ.get("GATTN_LOCK_STALE_SECONDS", "120"))
_DELETE = {}  # what a `decide` of `_swap` returns to remove the lease (None: leave it as it is)


def _beat() -> float:
    """Seconds between renewals: RENEW_SECONDS, or a quarter of a shorter STALE_SECONDS."""
    return min(RENEW_SECONDS, STALE_SECONDS / 4)


class LeaseLost(cli.Failure):
    """This run no longer holds its run directory's lease: it stops before writing again (exit 1)."""


def _started(pid: int) -> str | None:
    """Which start of process `pid` runs now (the boot id and its start time in clock ticks, from
    /proc: a pid reused after a restart reads differently), or None where that cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot, open(f"/proc/{pid}/stat") as stat:
            return f"{boot.read().strip()}/{stat.read().rsplit(')', 1)[1].split()[19]}"  # field 22
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None = None) -> bool:
    """Whether process `pid` runs, and is the one that `started` (a `_started` id) names."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return started is None or _started(pid) in (None, started)


def stale(holder: dict, now: float | None = None) -> bool:
    """Whether a lease `holder` (a lock.json dict) no longer holds. On the holder's host its
    process decides: gone, stale; running and provably the holder (`started`, the same start of
    the same pid), held, renewed or not. Else (another host, or a start /proc cannot tell): stale
    once not renewed for STALE_SECONDS."""
    now = time.time() if now is None else now
    pid, started = holder.get("pid"), holder.get("started")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int):
        if not _alive(pid, started):
            return True
        if started is not None and _started(pid) == started:
            return False
    return now - float(holder.get("renewed", 0)) > STALE_SECONDS


def _parse(text: str | bytes) -> dict | None:
    try:
        found = json.loads(text)
    except ValueError:  # empty, or half-written by a killed process
        return None
    return found if isinstance(found, dict) else None


def _swap(path: Path, decide) -> None:
    """Replaces the lease at `path` by `decide(holder)` (holder: the lock.json dict, or None when
    there is none) atomically: no other `_swap` changes it in between. `decide` returns the dict to
    write, None to leave it, or _DELETE; what it raises is raised."""
    text = str(path)
    if text.startswith("gs://"):
        return _swap_gcs(text, decide)
    if "://" in text:  # another remote filesystem: read, then write (module docstring)
        new = decide(_parse(path.read_text()) if path.exists() else None)
        if new is _DELETE:
            path.unlink(missing_ok=True)
        elif new is not None:
            path.write_text(json.dumps(new))
        return None
    return _swap_local(text, decide)


def _swap_local(path: str, decide) -> None:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # released by os.close, or by the kernel when the process dies
            except OSError as e:  # a filesystem without locks (NFS without lockd): unlocked (module docstring)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                current = False
            if not current:  # a release removed the file this opened: open the one there now
                continue
            new = None
            try:
                new = decide(_parse(os.pread(fd, 1 << 16, 0)))
                if new is not None and new is not _DELETE:
                    data = json.dumps(new).encode()
                    os.pwrite(fd, data, 0)
                    os.ftruncate(fd, len(data))
            finally:  # an empty file (this open created it) is nobody's lease
                if new is _DELETE or os.fstat(fd).st_size == 0:
                    os.unlink(path)
            return
        finally:
            os.close(fd)


@functools.cache
def _bucket(name: str):
    from google.cloud import storage  # noqa: PLC0415 (gattn[gcp]: only for gs:// run directories)

    return storage.Client().bucket(name)


def _swap_gcs(url: str, decide) -> None:
    from google.api_core.exceptions import NotFound, PreconditionFailed  # noqa: PLC0415

    bucket_name, _, name = url.removeprefix("gs://").partition("/")
    bucket = _bucket(bucket_name)
    while True:
        found = bucket.get_blob(name)
        generation = found.generation if found is not None else 0  # 0: only if there is none
        try:
            new = decide(None if found is None else _parse(found.download_as_bytes(if_generation_match=generation)))
            if new is _DELETE and found is not None:
                bucket.blob(name).delete(if_generation_match=generation)
            elif new is not None and new is not _DELETE:
                bucket.blob(name).upload_from_string(json.dumps(new), if_generation_match=generation)
            return
        except (NotFound, PreconditionFailed):  # another run changed it since the read: decide on what it wrote
            continue


def _who(holder: dict) -> str:
    return f"{holder.get('host')} pid {holder.get('pid')}"


class _Taken(Exception):
    """The renewal found the lease held by another run (the holder's dict), or gone (None)."""


class Lease:
    """WORKDIR/lock.json for this process (module docstring)."""

    def __init__(self, workdir: str | Path):
        self.path = Path(workdir) / LOCK
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid()),
                   "token": uuid.uuid4().hex, "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.renewed = 0.0  # when the last renewal that went through began (time.monotonic())
        self.error = ""     # the last failed renewal's error
        self.lost: str | None = None  # why the lease is lost: set by the renewal thread or check()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._renew, name="gattn-lease", daemon=True)

    def _mine(self, holder: dict | None) -> bool:
        return (holder or {}).get("token") == self.me["token"]

    def acquire(self) -> None:
        now, began = time.time(), time.monotonic()

        def take(holder):
            if holder is not None and not self._mine(holder) and not stale(holder):
                ago = time.time() - float(holder.get("renewed", 0))
                raise ConfigError("--workdir", str(self.path.parent),
                                  f"a run directory no other train.py is writing to: {_who(holder)} has held it "
                                  f"since {holder.get('since')} (renewed {ago:.0f} s ago). Stop that run, or wait: "
                                  f"a lease whose process is gone, or (held from another host) not renewed for "
                                  f"{STALE_SECONDS:.0f} s (GATTN_LOCK_STALE_SECONDS), is taken over")
            return {**self.me, "renewed": now}

        if "://" not in str(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
        _swap(self.path, take)
        self.renewed = began
        self.thread.start()

    def renew(self) -> None:
        """Renews the lease once; raises _Taken if another run holds it now, or a store's error."""
        now, began = time.time(), time.monotonic()

        def keep(holder):
            if not self._mine(holder):
                raise _Taken(holder)
            return {**holder, "renewed": now}

        _swap(self.path, keep)
        self.renewed, self.error = began, ""

    def _renew(self) -> None:
        while not self.stopped.wait(_beat()) and self.lost is None:
            try:
                self.renew()
            except _Taken as e:
                holder = e.args[0]
                self.lost = (f"{self.path} was removed, or is unreadable" if holder is None else
                             f"{_who(holder)} took it over at {holder.get('since')}")
            except Exception as e:  # noqa: BLE001 (any error of the store: retried at the next beat, see check)
                self.error = f"{type(e).__name__}: {cli.first_line(e)[:200]}"
                print(f"warning: could not renew {self.path} ({self.error}); retrying in {_beat():.0f} s",
                      file=sys.stderr, flush=True)

    def check(self) -> None:
        """Raises LeaseLost if this run lost the lease: another run took it, or it went unrenewed for
        so long (STALE_SECONDS less a beat) that another run may take it before the next renewal."""
        late = time.monotonic() - self.renewed
        if self.lost is None and late > STALE_SECONDS - _beat():
            self.lost = (f"it could not be renewed for {late:.0f} s ({self.error or 'the store did not answer'}), "
                         f"and another run may take it over after {STALE_SECONDS:.0f} s")
        if self.lost is not None:
            raise LeaseLost(f"this run lost its run directory's lease ({self.path}): {self.lost}; it stopped before "
                            "writing again (rerun to resume once no other train.py writes to this directory)")

    def release(self) -> None:
        self.stopped.set()
        try:
            _swap(self.path, lambda holder: _DELETE if self._mine(holder) else None)
        except Exception as e:  # noqa: BLE001 (the run is ending: the lease goes stale instead)
            print(f"warning: could not remove {self.path} ({type(e).__name__}: {cli.first_line(e)[:200]}); it is "
                  f"taken over once {STALE_SECONDS:.0f} s old", file=sys.stderr, flush=True)


_held: list[Lease] = []  # the leases `hold` holds in this process, for `check`


@contextlib.contextmanager
def hold(workdir: str | Path, *, primary: bool = True):
    """Holds the run directory's lease for the body (only `primary`: process 0 of several), which
    calls `check()` before each write that must be its alone."""
    if not primary:
        yield None
        return
    lease = Lease(workdir)
    lease.acquire()
    _held.append(lease)
    try:
        yield lease
    finally:
        _held.remove(lease)
        lease.release()


def check() -> None:
    """Raises LeaseLost (one line) if this process lost a lease it holds through `hold`."""
    for lease in list(_held):
        lease.check()


def trials(workdir_root: str | Path, n: int = 1000, racers: int = 4, stale_holder: bool = False) -> dict:
    """The guarantee measured: `racers` threads acquire each of `n` run directories under
    `workdir_root` at the same instant (a barrier), fresh ones or (`stale_holder`) ones holding
    a stale lease. {"double_holders": trials more than one won, "no_holder": trials none won, ...}"""
    t0, winners = time.perf_counter(), []
    for i in range(n):
        workdir, barrier, won, leases = Path(workdir_root) / f"trial_{i}", threading.Barrier(racers), [], []
        if stale_holder:  # another host's lease, last renewed long ago
            if "://" not in str(workdir):
                workdir.mkdir(parents=True, exist_ok=True)
            _swap(workdir / LOCK, lambda _: {"host": "gone-host", "pid": 1, "token": "stale", "renewed": 0.0})

        def race():
            lease = Lease(workdir)
            leases.append(lease)
            barrier.wait()
            with contextlib.suppress(ConfigError):
                lease.acquire()
                won.append(lease)

        threads = [threading.Thread(target=race) for _ in range(racers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for lease in leases:
            lease.stopped.set()
        winners.append(len(won))
    return {"trials": n, "racers": racers, "double_holders": sum(w > 1 for w in winners),
            "no_holder": winners.count(0), "seconds": round(time.perf_counter() - t0, 2)}
