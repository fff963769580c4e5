"""Orbax's barriers of a multi-process save, through JAX's key-value store, so that a save that
fails on one process fails on every process instead of hanging the slice.

An asynchronous save passes four barriers (Orbax 0.12): its shares written
(`async_write_complete`), process 0's commit done (`async_commit_complete`), and the manager's
"save finished" flag set on every process (`set_value_start`, `set_value_end`, also at the
start of a save). A process whose write fails (a full disk, a lost mount) skips the first two
and goes straight to the flag's barrier to report its failure, while the others wait at the
write barrier for it: with JAX's own barriers both wait until Orbax's timeout (10 minutes), then
at the next barrier, and the run hangs with every thread alive (issue 57).

Here each barrier is a set of keys, one per process that arrived, and each process also writes
which barrier it waits at. A process waiting at a barrier that a peer has left for a *later*
stage of the save (the peer will never come) stops waiting with `SaveAbandoned`: Orbax then
takes the failure path too, which leads it to the barrier where the peer waits, and both
finish the save with an error. `checkpoint.Saves` turns that error into one line naming the step
and the last good checkpoint, on every process, within seconds. A peer that is simply slower is
waited for (it is at an earlier stage, or at none), until Orbax's timeout.
"""

from __future__ import annotations

import collections
import threading
import time

STAGES = ("async_write_complete", "async_commit_complete", "set_value_start", "set_value_end")
POLL_SECONDS = 0.05
ROOT = "gattn/save"


class SaveAbandoned(RuntimeError):
    """A peer left this stage of the save for a later one: it failed its part."""


def stage(key: str) -> int:
    """The rank of barrier `key` in a save's sequence (-1: not one of a save's barriers)."""
    return next((i for i, name in enumerate(STAGES) if name in key), -1)


class Barrier:
    """An Orbax `barrier_sync_fn` (`AsyncOptions.barrier_sync_fn`): called as
    `barrier(key=..., timeout_ms=...)` from Orbax's save threads."""

    # A key may be met many times: each meeting is numbered. The numbers are the process's, not one
    # manager's, so that two managers in turn (a study's cells in one process) never meet the
    # keys the previous one left in the store.
    visits: collections.Counter = collections.Counter()
    passed: collections.deque = collections.deque(maxlen=64)  # the barriers this process passed
    lock = threading.Lock()

    def __init__(self, client, process: int, processes: int):
        self.client, self.process, self.processes = client, process, processes

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        with self.lock:
            self.visits[key] += 1
            here = f"{key}#{self.visits[key]}"
        self.client.key_value_set(f"{ROOT}/at/{self.process}", here, allow_overwrite=True)
        self.client.key_value_set(f"{ROOT}/in/{here}/{self.process}", "1", allow_overwrite=True)
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            # Where the others are, read before who has arrived: a peer writes its arrival before
            # it moves on, so one seen at a later barrier but not arrived here skipped this one.
            at = {int(k.rsplit("/", 1)[-1]): v for k, v in self.client.key_value_dir_get(f"{ROOT}/at/")}
            arrived = {int(k.rsplit("/", 1)[-1]) for k, _ in self.client.key_value_dir_get(f"{ROOT}/in/{here}/")}
            if len(arrived) >= self.processes:
                break
            for peer in sorted(set(range(self.processes)) - arrived):
                there = at.get(peer, "")
                if there and there != here and there not in self.passed and stage(there) > stage(here) >= 0:
                    raise SaveAbandoned(f"process {peer} gave up its part of this save (its own line says why)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sorted(set(range(self.processes)) - arrived)} did not finish their part of the "
                                   f"save within {timeout_ms / 1000:.0f} s")
            time.sleep(POLL_SECONDS)
        with self.lock:
            self.passed.append(here)
            # Every process has passed the barrier before this one, so none reads its keys again.
            old = self.passed[-3] if len(self.passed) >= 3 else None
        if old is not None:
            try:
                self.client.key_value_delete(f"{ROOT}/in/{old}/{self.process}")
            except Exception:  # noqa: BLE001 (a key left behind costs a few bytes)
                pass


def for_this_run():
    """A `Barrier` on JAX's distributed client when several processes run, else None (Orbax's own)."""
    import jax  # noqa: PLC0415
    from jax._src import distributed  # noqa: PLC0415 (the client gattn.cli.start_distributed joined)

    client = distributed.global_state.client
    if jax.process_count() == 1 or client is None:
        return None
    return Barrier(client, jax.process_index(), jax.process_count())
