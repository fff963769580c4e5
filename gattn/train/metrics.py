"""What a run reports while it trains: the loss-spike counter, DIR/metrics.jsonl and TensorBoard
(process 0 writes them), and the progress bar."""

from __future__ import annotations

import collections
import json
import math
import sys

import numpy as np
from etils.epath import Path

from gattn.config import ConfigError
from gattn.train import hosts


# Losses a spike is judged against at the least: a blow-up in a run's first steps must count (the
# checkpoint kept before trouble depends on it), yet the median of fewer losses is too noisy.
MIN_PRIOR = 8


class SpikeCounter:
    """A loss spike: a loss above the median of the previous `window` losses by `margin` (nats).
    Judging starts once MIN_PRIOR losses (or `window`, if smaller) are known, with the median of
    those present so far. Only a rise counts: early training, where the loss falls fast, sits
    below the median of the steps before it, so it is never a spike."""

    def __init__(self, window: int, margin: float):
        self.recent, self.margin, self.count = collections.deque(maxlen=window), margin, 0

    def __call__(self, loss: float) -> bool:
        spike = bool(len(self.recent) >= min(MIN_PRIOR, self.recent.maxlen)
                     and loss > float(np.median(self.recent)) + self.margin)
        self.count += int(spike)
        self.recent.append(loss)
        return spike


SET_ASIDE = "metrics.set_aside.jsonl"


def set_aside_rows(path: Path, resumed_step: int) -> int:
    """Cuts `path` (metrics.jsonl) back to the rows of steps <= `resumed_step`, so each step appears
    once in the resumed run; the later rows (logged by an interrupted run after its last checkpoint,
    or past a --resume-step) are appended to SET_ASIDE beside it, each tagged with
    "resumed_from", never dropped. Returns how many were set aside."""
    kept, later = [], []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            if row["step"] <= resumed_step:
                kept.append(line)
            else:
                later.append(row)
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a line cut short when the previous run was killed
    if later:
        with (path.parent / SET_ASIDE).open("a") as f:
            f.write("".join(json.dumps({**row, "resumed_from": resumed_step}) + "\n" for row in later))
    tmp = path.with_suffix(".jsonl.tmp")  # (replaced atomically: a kill here loses no row)
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
    return len(later)


def summary_writer():
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch, when it is
    installed (the test extra has it), only to accept torch tensors, and that costs ~3 s of every
    start; gattn logs plain floats. (Nothing else imports in the meantime: the trainer's threads
    start later.)"""
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX loads
        try:
            import tensorboardX  # noqa: F401, PLC0415
        finally:
            del sys.modules["torch"]
    from tensorboardX import SummaryWriter  # noqa: PLC0415

    return SummaryWriter


class MetricsLog:
    """WORKDIR/metrics.jsonl (and TensorBoard). On resume, the rows past the restored step are
    moved to WORKDIR/metrics.set_aside.jsonl (`set_aside_rows`), with one line saying so."""

    def __init__(self, workdir: Path, resumed_step: int):
        self.path, self.tb = workdir / "metrics.jsonl", None
        if not hosts.primary():  # one writer: process 0
            self.path = None
            return
        if self.path.exists() and (n := set_aside_rows(self.path, resumed_step)):
            print(f"note: this run continues from step {resumed_step}: the {n} metrics row(s) logged after "
                  f"it by the earlier run are moved to {workdir / SET_ASIDE}", file=sys.stderr, flush=True)
        try:
            self.tb = summary_writer()(str(workdir / "tensorboard"))
        except ImportError as e:  # a remote workdir's backend (cli.check_workdir checks it first)
            raise ConfigError("--workdir", str(workdir), f"a directory TensorBoard can write to: {e}") from None

    def write(self, step: int, metrics: dict):
        if self.path is None:
            return
        # Non-finite values (a skipped step's loss) are written as null: NaN is not JSON.
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                 for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and v == v:
                    self.tb.add_scalar(k, v, step)

    def close(self):
        if self.tb is not None:
            self.tb.close()


class Progress:
    """A tqdm bar with step, loss, tokens/s and ETA (or nothing, for tests), begun at the first step
    read: the ETA is the training steps' alone, not the compile before them."""

    def __init__(self, enabled: bool, start: int, total: int):
        self.bar, self.enabled, self.total = None, enabled, total
        self.last = start

    def update(self, step: int, loss: float, tokens_per_sec: float):
        if self.enabled and self.bar is None:  # the bar's clock starts after the first step: its ETA
            from tqdm import tqdm  # noqa: PLC0415   (tqdm's rate) leaves the compile out

            self.bar = tqdm(total=self.total, initial=step, unit="step", dynamic_ncols=True, mininterval=2.0)
            self.last = step
        if self.bar is not None:
            self.bar.update(step - self.last)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_sec:,.0f}", refresh=False)
        self.last = step

    def close(self):
        if self.bar is not None:
            self.bar.close()
