"""Orbax checkpoints of a run: model parameters, optimizer state, step and data-iterator state,
saved together (asynchronously) under WORKDIR/checkpoints, the last K kept.

Only complete checkpoints are ever restored (Orbax writes to a temporary folder and renames it
when the save has finished). Restoring takes an abstract target whose leaves may carry shardings
for the devices present now, so a run saved on one mesh resumes on another.

Faults (docs/training.md#faults): a checkpoint that cannot be read back is passed over for the
previous one with a one-line warning (`first_readable`) and is never deleted (a resumed run moves
it to WORKDIR/checkpoints_set_aside/); a failed asynchronous save stops the run at once, naming
the last good checkpoint (`Saves`); steps in a manager's `keep_also` set outlive the keep-K
rotation (the checkpoint kept before a divergence).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
from typing import Callable

from etils.epath import Path  # local paths, and gs:// or other remote workdirs
import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from gattn import cli
from gattn.config import ConfigError

SET_ASIDE = "checkpoints_set_aside"


class CheckpointFailure(cli.Failure):
    """No checkpoint can be read, or a save failed: one line, exit 1."""


@dataclasses.dataclass
class _KeepAlso:
    """An Orbax preservation policy: the steps in `steps` (a set the caller updates) are kept."""

    steps: set

    def should_preserve(self, checkpoints, *, context):
        return [c.step in self.steps for c in checkpoints]


class _QuietOrbax(logging.Filter):
    """Orbax logs a failed read or save as several tracebacks from its threads; gattn reports it as
    one line instead, so they are dropped unless GATTN_DEBUG=1 (--debug)."""

    def filter(self, record):
        return cli.debugging() or "/orbax/" not in record.pathname.replace("\\", "/")


def _quiet_orbax() -> None:
    for name in ("absl", "orbax"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _QuietOrbax) for f in log.filters):
            log.addFilter(_QuietOrbax())
    if not isinstance(sys.unraisablehook, _LateCallbacks):
        sys.unraisablehook = _LateCallbacks(sys.unraisablehook)


class _LateCallbacks:
    """After a failed read, TensorStore completes the rest of the read on an asyncio loop that Orbax
    has already closed; each late callback reports "RuntimeError: Event loop is closed" through
    sys.unraisablehook (tens of tracebacks). They say nothing about the failure, which is
    reported once; GATTN_DEBUG=1 shows them."""

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, unraisable):
        value = unraisable.exc_value
        if cli.debugging() or not (isinstance(value, RuntimeError) and str(value) == "Event loop is closed"):
            self.hook(unraisable)


def manager(workdir: Path, keep: int, every: int, keep_also: set | None = None) -> ocp.CheckpointManager:
    """The manager of WORKDIR/checkpoints: the last `keep` checkpoints are kept, and the steps in
    `keep_also` (a set the caller may update while the run goes on)."""
    _quiet_orbax()
    policy = policies.AnyPreservationPolicy([policies.LatestN(keep), _KeepAlso(keep_also if keep_also is not None
                                                                                else set())])
    options = ocp.CheckpointManagerOptions(preservation_policy=policy, save_interval_steps=every,
                                           enable_async_checkpointing=True, create=True)
    return ocp.CheckpointManager(Path(workdir).absolute() / "checkpoints", options=options,
                                 item_names=("state", "data", "meta"))


def reason(e: BaseException) -> str:
    """Why a read or save failed, as one short line: the innermost cause's first line, without
    TensorStore's driver chain and spec."""
    while e.__cause__ is not None and str(e.__cause__):
        e = e.__cause__
    text = next((line for line in str(e).splitlines() if line.strip()), "")
    text = re.sub(r"\s*\[tensorstore_spec.*", "", text)
    text = re.sub(r'(Error opening "\w+" driver: )+', "", text)
    return f"{type(e).__name__}: {text[:240]}" if text else type(e).__name__


def first_readable(mngr: ocp.CheckpointManager, read: Callable[[int], object], step: int | None = None,
                   flag: str = "--step", then: str = ""):
    """(step, read(step)) for the newest checkpoint that `read` can read (or exactly `step`), with
    a one-line warning for each newer one it passes over (ending with `then`, what the caller does
    with it); None if there is no checkpoint. A ConfigError from `read` (a checkpoint of another
    model) is raised as it is; if no checkpoint can be read, CheckpointFailure. Nothing is moved
    or deleted here. Only the errors of unreadable files pass a checkpoint over (Orbax and
    TensorStore raise ValueError, KeyError or OSError for them): anything else, such as running
    out of device memory while restoring, is raised as it is, so a good checkpoint is never
    taken for a bad one."""
    steps = sorted(mngr.all_steps(), reverse=True)
    if step is not None and step not in steps:
        raise ConfigError(flag, step, f"one of the saved steps {sorted(steps)}")
    if step is not None:
        steps = [step]
    failed = []
    for s in steps:
        try:
            out = read(s)
        except ConfigError:
            raise
        except (ValueError, KeyError, OSError, EOFError) as e:
            if cli.debugging():
                logging.getLogger("gattn").exception("reading checkpoint %s", s)
            failed.append((s, reason(e)))
            continue
        for bad, why in failed:
            print(f"warning: checkpoint step {bad} in {mngr.directory} cannot be read ({why}); "
                  f"using step {s} instead{then}", file=sys.stderr, flush=True)
        return s, out
    if not failed:
        return None
    listed = "; ".join(f"step {s}: {why}" for s, why in failed)
    raise CheckpointFailure(f"no checkpoint in {mngr.directory} can be read ({listed}); they are left "
                            "as they are: use a new --workdir, or restore the files")


def set_aside(mngr: ocp.CheckpointManager, steps: list[int]) -> Path | None:
    """Moves the checkpoints of `steps` out of the manager's folder into WORKDIR/checkpoints_set_aside/
    (never deleted: a resumed run would otherwise not save those steps again, and the rotation
    would delete them); returns that folder. The manager is reloaded. (The metrics rows of those
    steps are set aside by the resumed run's metrics.MetricsLog, on every resume.)"""
    if not steps:
        return None
    folder = Path(mngr.directory).parent / SET_ASIDE
    folder.mkdir(parents=True, exist_ok=True)

    def free(name):  # something set aside before under that name is kept too
        target, n = folder / name, 1
        while target.exists():
            target, n = folder / f"{name}.{n}", n + 1
        return target

    for s in steps:
        (Path(mngr.directory) / str(s)).rename(free(str(s)))
    mngr.reload()
    return folder


class BeforeTrouble:
    """The last checkpoint saved before trouble (a skipped non-finite step or a loss spike), kept
    outside the keep-K rotation: a run that drifts to huge but finite weights before its first
    non-finite step would otherwise rotate every good checkpoint away. A checkpoint qualifies only
    if `clean` trouble-free steps (train.spike_window) came before it, so one saved in the middle
    of the trouble never replaces it. Its step and the last trouble are saved in `meta`."""

    def __init__(self, keep_also: set, meta: dict, clean: int):
        self.keep_also, self.clean = keep_also, clean
        self.step, self.last_trouble = meta.get("kept_step"), meta.get("last_trouble")
        if self.step is not None:
            keep_also.add(self.step)

    def __call__(self, step: int, latest_saved: int | None) -> None:
        """Step `step` was trouble; `latest_saved` is the newest checkpoint (saved before it)."""
        if latest_saved is not None and latest_saved != self.step and (
                self.last_trouble is None or latest_saved - self.last_trouble >= self.clean):
            self.keep_also.clear()
            self.keep_also.add(latest_saved)
            self.step = latest_saved
        self.last_trouble = step

    def meta(self) -> dict:
        return {"kept_step": self.step, "last_trouble": self.last_trouble}


class Saves:
    """The run's asynchronous saves, checked: a save that failed (a full disk, a lost mount) stops
    the run as soon as it is known, with CheckpointFailure naming the last good checkpoint."""

    def __init__(self, mngr: ocp.CheckpointManager, last_good: int | None):
        self.mngr, self.good, self.pending, self.failed = mngr, last_good, None, False

    def save(self, step: int, state, data_state: dict, meta: dict) -> None:
        self.check(wait=True)  # Orbax waits for the previous save here anyway
        try:
            save(self.mngr, step, state, data_state, meta, force=True)
        except Exception as e:  # noqa: BLE001
            raise self._failure(step, e) from None
        self.pending = step

    def check(self, wait: bool = False) -> None:
        """Raises CheckpointFailure if the pending save failed; with `wait`, waits for it first."""
        if self.pending is None or (not wait and self.mngr.is_saving_in_progress()):
            return
        try:
            self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._failure(self.pending, e) from None
        self.good, self.pending = self.pending, None

    def _failure(self, step: int, e: BaseException) -> CheckpointFailure:
        self.failed = True
        good = (f"the last good checkpoint is step {self.good} in {self.mngr.directory}" if self.good is not None
                else "there is no good checkpoint yet")
        return CheckpointFailure(f"saving checkpoint step {step} failed ({reason(e)}); stopping: {good}")

    def close(self) -> None:
        """Waits for the last save (a failure raises, unless one was reported already)."""
        try:
            if not self.failed:
                self.check(wait=True)
        finally:
            try:
                self.mngr.close()
            except Exception:  # noqa: BLE001 (a failure already reported stops the run anyway)
                if not self.failed:
                    raise


def saved_steps(workdir: str | Path) -> list[int]:
    """The steps of the complete checkpoints in WORKDIR/checkpoints, in order (none: [])."""
    if not (Path(workdir) / "checkpoints").is_dir():  # (a manager would create the folder)
        return []
    mngr = manager(Path(workdir), 1, 1)
    try:
        return sorted(mngr.all_steps())
    finally:
        mngr.close()


def save(mngr: ocp.CheckpointManager, step: int, state, data_state: dict, meta: dict,
         force: bool = False) -> bool:
    """Saves (asynchronously) when `step` is on the save interval, or always with `force`.
    The caller may check `mngr.should_save(step)` first to skip building the arguments."""
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              data=ocp.args.JsonSave(json.loads(json.dumps(data_state))),
                              meta=ocp.args.JsonSave(meta))
    return mngr.save(step, args=args, force=force)


def restore(mngr: ocp.CheckpointManager, abstract_state, step: int | None = None):
    """(state, data_state, meta) of `step` (default: the latest complete one), or None if the
    directory holds no checkpoint. `abstract_state`: jax.ShapeDtypeStruct leaves (with
    shardings to restore onto a particular mesh)."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        return None
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                     data=ocp.args.JsonRestore(),
                                                     meta=ocp.args.JsonRestore()))
    return out.state, out.data, out.meta


def restore_meta(mngr: ocp.CheckpointManager, step: int | None = None) -> dict | None:
    """The JSON metadata of `step` (default: the latest) without reading any array."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        return None
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta


def place(tree, abstract_tree):
    """`tree`'s arrays moved onto the shardings of `abstract_tree` (same structure)."""
    return jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), tree, abstract_tree)


def restore_params(mngr: ocp.CheckpointManager, abstract_params, step: int | None = None):
    """Only the model parameters of `step` (default: the latest), whatever optimizer the run used;
    None if there is no checkpoint. For evaluation and analysis."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        return None
    item = {"params": abstract_params}
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), item)
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True)))
    return out.state["params"]


def abstract(tree, sharding=None):
    """ShapeDtypeStructs of `tree`, placed on `sharding` (a Sharding, a tree of them, or None for
    each leaf's current sharding)."""
    if sharding is None or isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=sharding or getattr(x, "sharding", None)),
                            tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sharding)
