"""The next global batches prepared while the device computes: a background thread tokenises,
packs and places them (`feed`), up to `depth` ahead, so data preparation overlaps the step.

The data state a checkpoint keeps must be the one after the last batch *trained on*, not after the
last batch read ahead: each batch travels with the iterator's state right after it, and
`get_state()` gives the state of the last batch handed out.
"""

from __future__ import annotations

import queue
import threading

from gattn.config import BACKCOPY
from gattn.data import synthetic

DEPTH = 2  # batches prepared ahead at the least: one in flight to the device, one being built


def depth(cfg) -> int:
    """Batches to prepare ahead for `cfg`: every row stream of the Grain pipeline refills its
    shuffle window (data.shuffle_window packed rows) at the same step, so one batch in every
    `shuffle_window` carries that many steps of tokenising and packing. A queue as deep as the
    window lets the thread work through that burst while the device trains on batches it built
    ahead during the cheap steps. Host memory: shuffle_window batches of this host's rows
    (32 x 64 rows x 4097 tokens x 12 bytes = 100 MB at a preset's shapes on 16 hosts)."""
    grain_pipeline = cfg.data.source not in (synthetic.SOURCE, BACKCOPY)  # (the others make rows on the fly)
    return max(DEPTH, cfg.data.shuffle_window) if grain_pipeline else DEPTH


class Prefetcher:
    """An iterator over `feed(next(data))` computed on a background thread, `depth` batches ahead
    (and no more than `limit` batches in all: a run's last steps do not build batches it never
    trains on). An exception in the thread is raised by the `next()` that would have returned its
    batch."""

    def __init__(self, data, feed=lambda batch: batch, depth: int = DEPTH, limit: int | None = None):
        self.data, self.feed, self.limit = data, feed, limit  # limit: batches the caller will take
        self.state = data.get_state()  # the state before the first batch handed out
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gattn-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            produced = 0
            while not self.stopping.is_set() and (self.limit is None or produced < self.limit):
                produced += 1
                batch = next(self.data)
                self._put((self.feed(batch), self.data.get_state(), None))
        except BaseException as e:  # noqa: BLE001 (handed to the consumer, which raises it)
            self._put((None, None, e))

    def _put(self, item) -> None:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self):
        return self

    def __next__(self):
        batch, state, error = self.queue.get()
        if error is not None:
            self.close()
            raise error
        self.state = state
        return batch

    def get_state(self) -> dict:
        """The data iterator's state after the last batch handed out (what a checkpoint keeps)."""
        return self.state

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
