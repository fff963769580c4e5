"""What a run reports while it trains: the loss-spike counter, DIR/metrics.jsonl and TensorBoard
(process 0 writes them), and the progress bar."""

from __future__ import annotations

import collections
import json
import math

import numpy as np
from etils.epath import Path

from gattn.train import hosts


class SpikeCounter:
    """A loss spike: a loss above the median of the previous `window` losses by `margin` (nats)."""

    def __init__(self, window: int, margin: float):
        self.recent, self.margin, self.count = collections.deque(maxlen=window), margin, 0

    def __call__(self, loss: float) -> bool:
        spike = bool(len(self.recent) == self.recent.maxlen
                     and loss > float(np.median(self.recent)) + self.margin)
        self.count += int(spike)
        self.recent.append(loss)
        return spike


class MetricsLog:
    """WORKDIR/metrics.jsonl (and TensorBoard). On resume, entries past the restored step (written
    by the interrupted run after its last checkpoint) are dropped, so each step appears once."""

    def __init__(self, workdir: Path, resumed_step: int):
        self.path, self.tb = workdir / "metrics.jsonl", None
        if not hosts.primary():  # one writer: process 0
            self.path = None
            return
        if self.path.exists():
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= resumed_step:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError):
                    pass  # a line cut short when the previous run was killed
            self.path.write_text("".join(k + "\n" for k in kept))
        try:
            from tensorboardX import SummaryWriter  # noqa: PLC0415

            self.tb = SummaryWriter(str(workdir / "tensorboard"))
        except ImportError:  # TensorBoard is optional; metrics.jsonl is always written
            self.tb = None

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
    """A tqdm bar with step, loss, tokens/s and ETA (or nothing, for tests)."""

    def __init__(self, enabled: bool, start: int, total: int):
        self.bar = None
        if enabled:
            from tqdm import tqdm  # noqa: PLC0415

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, mininterval=2.0)
        self.last = start

    def update(self, step: int, loss: float, tokens_per_sec: float):
        if self.bar is not None:
            self.bar.update(step - self.last)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_sec:,.0f}", refresh=False)
        self.last = step

    def close(self):
        if self.bar is not None:
            self.bar.close()
