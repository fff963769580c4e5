"""What the host does with each training step's scalars: the non-finite guard, the loss-spike
counter, the checkpoint kept before trouble, metrics.jsonl and the progress bar, read one step
late so that the device never waits for the host (`Reports`)."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time

from etils.epath import Path

from gattn import cli
from gattn.config import Config
from gattn.train import checkpoint, hosts, metrics, rundir


class Startup:
    """The stages before the first step (tokenizer, dataset, model, compile), each announced when
    it starts and timed when it ends, on one stderr line per stage ("compiling the train step ...
    21.3 s"); WORKDIR/startup.json keeps the seconds of the last start (bench/startup.py reads it).
    Silent (but still timed) for other processes and without progress output."""

    def __init__(self, enabled: bool):
        self.enabled, self.seconds, self.t0 = enabled, {}, time.perf_counter()

    @contextlib.contextmanager
    def stage(self, name: str, doing: str, own_lines: bool = False):
        """Times the block as stage `name`. `own_lines`: the block may print (the dataset build
        and the corpus report do), so the stage opens and closes on lines of its own."""
        if self.enabled:
            print(f"{doing} ...", end="\n" if own_lines else "", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        if self.enabled:
            done = f"{name} ready in " if own_lines else " "
            print(f"{done}{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    def write(self, workdir: Path) -> None:
        """WORKDIR/startup.json: {stage: seconds, ..., "total": seconds since the trainer began}."""
        if hosts.primary():
            record = {k: round(v, 3) for k, v in self.seconds.items()}
            (Path(workdir) / "startup.json").write_text(json.dumps(
                {**record, "total": round(time.perf_counter() - self.t0, 3)}, indent=2))


class TrainingStopped(cli.Failure):
    """Too many consecutive non-finite or collapsed steps: the run stops, naming the checkpoint kept
    from before the trouble (checkpoint.BeforeTrouble)."""

    def __init__(self, message: str, step: int | None = None, kept: int | None = None, reason: str = ""):
        super().__init__(message)
        self.step, self.kept, self.reason = step, kept, reason


COLLAPSE_NATS = 0.01  # a collapsed step: its loss within this of ln V (the uniform distribution over the
LEARNED_NATS = 0.5    # vocabulary) after the run had been this far below it, or a zero gradient norm


def collapsed(loss: float, grad_norm: float, lowest: float, vocab_size: int) -> bool:
    """Whether a finite step shows a collapsed model: a zero gradient (nothing left to learn from),
    or a loss back at ln V, the loss of predicting every token uniformly, in a run that had learned
    something (every run starts near ln V, so the first steps never count)."""
    uniform = math.log(vocab_size)
    return grad_norm == 0.0 or (lowest < uniform - LEARNED_NATS and abs(loss - uniform) < COLLAPSE_NATS)


class Reports:
    """What the host does with each step's scalars (loss, finite, grad norm, lr, MoE loads): the
    non-finite guard, the loss-spike counter, the checkpoint kept before trouble, metrics.jsonl
    and the progress bar. A step's scalars are read when the next step has been dispatched
    (`pending`, then `read_previous`), or at once where the host needs them (before a save):
    the device never waits for the host to read a number. A validation step's held-out losses
    (`val`, measured when the step is done) are logged with its scalars."""

    def __init__(self, cfg: Config, workdir: Path, meta: dict, start: int, mngr, keep_also: set, progress: bool):
        t = self.t = cfg.train
        self.cfg, self.mngr, self.waiting, self.val = cfg, mngr, None, {}
        self.log_file = metrics.MetricsLog(workdir, start)
        self.spikes = metrics.SpikeCounter(t.spike_window, t.spike_margin)
        self.spikes.count = meta["loss_spikes"]
        self.spikes.recent.extend(meta["recent_losses"])  # the spike window continues across a resume
        self.before_trouble = checkpoint.BeforeTrouble(keep_also, meta, clean=t.spike_window)
        self.bar = metrics.Progress(progress and hosts.primary(), start, t.steps)
        # The trouble state continues across a resume: a plain rerun of a diverged run stops again.
        self.bad_in_a_row, self.skipped, self.loss, self.finite = (meta.get("bad_in_a_row", 0), meta["skipped_steps"],
                                                                   meta["final_loss"], True)
        self.collapsed_steps, self.lowest = meta.get("collapsed_steps", 0), meta.get("lowest_loss", None)
        self.lowest = math.inf if self.lowest is None else self.lowest
        self.start, self.timed_steps, self.eval_seconds = start, 0, 0.0
        self.clock = time.perf_counter()

    def tokens_per_sec(self) -> float:  # training throughput: compilation and validation time left out
        return self.t.batch_size * self.t.seq_len * self.timed_steps / max(
            time.perf_counter() - self.clock - self.eval_seconds, 1e-9)

    def validates(self, step: int) -> bool:
        """Whether `step` is validated (and logged with its held-out losses)."""
        return step % self.t.eval_every == 0 or step == self.t.steps

    def pending(self, step: int, m: dict) -> None:
        self.waiting = (step, m)

    def read_previous(self) -> None:
        """Reads the waiting step's scalars (blocking until that step is done) and acts on them."""
        if self.waiting is None:
            return
        (step, m), self.waiting = self.waiting, None
        self.loss, self.finite, grad_norm = float(m["loss"]), bool(m["finite"]), float(m["grad_norm"])
        collapse = self.finite and collapsed(self.loss, grad_norm, self.lowest, self.cfg.model.vocab_size)
        if self.finite:
            self.lowest = min(self.lowest, self.loss)
        bad = not self.finite or collapse
        self.bad_in_a_row = self.bad_in_a_row + 1 if bad else 0
        self.skipped += not self.finite
        self.collapsed_steps += collapse
        if bad or self.spikes(self.loss):  # trouble: keep the last checkpoint from before it
            self.before_trouble(step)
        else:
            self.before_trouble.fine(step, self.mngr.latest_step())
        if self.bad_in_a_row >= self.t.max_bad_steps:
            kept = self.before_trouble.step
            what = (f"collapsed (loss {self.loss:.4f}, ln V = {math.log(self.cfg.model.vocab_size):.4f}: uniform "
                    f"predictions; grad norm {grad_norm:.3g})" if collapse
                    else f"non-finite (loss {self.loss:.4g}, grad norm {grad_norm:.3g})")
            why = f"{self.bad_in_a_row} consecutive steps were non-finite or collapsed (last: step {step}, {what})"
            raise TrainingStopped(
                f"{why}; stopping. " + (
                    f"The last checkpoint saved before the trouble began, step {kept}, is kept: lower "
                    f"train.learning_rate or check the data, then rerun with --resume-step {kept}."
                    if kept is not None else "No checkpoint was saved before the trouble began: lower "
                    "train.learning_rate or check the data, then start again in a new --workdir."),
                step=step, kept=kept, reason=why)
        self.timed_steps += step > self.start + 1  # the first step includes compilation
        if step == self.start + 1:
            self.clock = time.perf_counter()
        if step % self.t.log_every == 0 or self.validates(step):
            self.log(step, m)
        self.bar.update(step, self.loss, self.tokens_per_sec())

    def log(self, step: int, m: dict) -> None:
        record = {"loss": self.loss, "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
                  "tokens_per_sec": self.tokens_per_sec() if self.timed_steps else 0.0,
                  "skipped_steps": self.skipped, "collapsed_steps": self.collapsed_steps, "loss_spikes": self.spikes.count,
                  **{k: float(v) for k, v in m.items() if k.startswith(("moe/", "mtp/"))}}
        if self.validates(step):
            record.update(self.val)
        self.log_file.write(step, record)

    def meta(self) -> dict:
        """The run's bookkeeping as a checkpoint keeps it (after the step's scalars are read)."""
        return rundir.meta(self.cfg, skipped_steps=self.skipped, loss_spikes=self.spikes.count,
                           recent_losses=list(self.spikes.recent),
                           final_loss=self.loss if self.finite else None, bad_in_a_row=self.bad_in_a_row,
                           collapsed_steps=self.collapsed_steps, lowest_loss=None if math.isinf(self.lowest) else self.lowest,
                           **self.before_trouble.meta())

    def close(self) -> None:
        self.log_file.close()
        self.bar.close()
