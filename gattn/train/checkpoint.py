"""Orbax checkpoints of a run: model parameters, optimizer state, step and data-iterator state,
saved together (asynchronously) under WORKDIR/checkpoints, the last K kept.

Only complete checkpoints are ever restored (Orbax writes to a temporary folder and renames it
when the save has finished). Restoring takes an abstract target whose leaves may carry shardings
for the devices present now, so a run saved on one mesh resumes on another.

Faults (docs/training.md#faults): each process seals what it wrote once a save has finished
(`seal`, on a thread beside training: the size and sha256 of every file, in
N/checksums/process_K.json). Only a checkpoint sealed by every process is trusted; the newest one
is kept through the rotation until a newer one is sealed. A checkpoint that is not completely
sealed, whose files do not match their checksums, that cannot be read back, or whose arrays are
not finite is passed over for the previous one with a one-line warning on every process
(`first_readable`: the processes take each decision together) and is never deleted (a resumed
run moves it to WORKDIR/checkpoints_set_aside/). A read error that a storage service's transient
failure causes is retried, never taken for a bad checkpoint. A failed asynchronous save stops
the run at once, naming the last good checkpoint (`Saves`); steps in a manager's `keep_also` set
outlive the keep-K rotation (the checkpoint kept before trouble).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import re
import sys
import time
import warnings
from typing import Callable

from etils.epath import Path  # local paths, and gs:// or other remote workdirs
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from gattn import cli
from gattn.config import ConfigError
from gattn.train import hosts, save_barrier
from gattn.train.seal import CHECKSUMS, seal, sealed, unsealed, verify  # noqa: F401 (checkpoint.seal, ...)

SET_ASIDE = "checkpoints_set_aside"
READ_TRIES = 4  # a read that a transient storage error fails is tried this often, waiting 1, 2, 4 s between
RETRY_SECONDS = 1.0
BARRIER_PREFIX = "gattn"  # Orbax's barriers are named f"{BARRIER_PREFIX}_{name}" (`_restore` joins one)
# A storage service's transient failure, in the words its clients use. A status code counts only
# where it reads as one ("HTTP 503", "status code 500", "503 Service Unavailable", "429 GET ..."),
# never a bare number: a read error names the step folder (checkpoints/500/...), an offset or a
# shape, and step 500 is a preset's first save. Paths are removed before matching (`transient`).
_STATUS = r"(?:50[0234]|429)"
TRANSIENT = re.compile(
    rf"\b(?:HTTP|status|code|response|error|HttpError)\b[\s:=]*(?:code[\s:=]*)?{_STATUS}\b"
    rf"|(?<![\w.,(\[-]){_STATUS}\s+(?:GET|PUT|POST|HEAD|DELETE|PATCH|Service|Internal|Bad|Gateway|Too)\b"
    r"|\b(?:UNAVAILABLE|DEADLINE_EXCEEDED|ServiceUnavailable|TooManyRequests|InternalServerError|BadGateway|"
    r"GatewayTimeout|temporarily|timed out|Connection (?:reset|aborted|refused)|RemoteDisconnected)\b", re.IGNORECASE)
_PATH = re.compile(r"\S*[/\\]\S*")  # a path or URL, one token


class CheckpointFailure(cli.Failure):
    """No checkpoint can be read, or a save failed: one line, exit 1."""


@dataclasses.dataclass
class _KeepAlso:
    """An Orbax preservation policy: the steps in `steps` (a set the caller updates) are kept."""

    steps: set

    def should_preserve(self, checkpoints, *, context):
        return [c.step in self.steps for c in checkpoints]


@dataclasses.dataclass
class _NewestSealed:
    """An Orbax preservation policy: the newest checkpoint that every process has sealed is kept
    until a newer one is, so a rotation never leaves only checkpoints whose seal is unfinished."""

    directory: Path

    def should_preserve(self, checkpoints, *, context):
        def complete(step):
            try:
                return unsealed(self.directory / str(step)) is None
            except (OSError, ValueError):  # an unreadable seal: not sealed
                return False
        newest = next((c.step for c in sorted(checkpoints, key=lambda c: -c.step) if complete(c.step)), None)
        return [c.step == newest for c in checkpoints]


class _QuietOrbax(logging.Filter):
    """Orbax logs a failed read or save as several tracebacks from its threads; gattn reports it as
    one line instead, so they are dropped unless GATTN_DEBUG=1 (--debug)."""

    def filter(self, record):
        if cli.debugging():
            return True
        if record.name == "asyncio":  # a failed write's or read's other tasks ("exception was never retrieved")
            return "exception was never retrieved" not in record.getMessage()
        return "/orbax/" not in record.pathname.replace("\\", "/")


def _quiet_orbax() -> None:
    if not cli.debugging():  # a failed write's abandoned fragments, reported at interpreter exit
        warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    for name in ("absl", "orbax", "asyncio"):
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
    directory = Path(workdir).absolute() / "checkpoints"
    policy = policies.AnyPreservationPolicy([policies.LatestN(keep), _NewestSealed(directory),
                                             _KeepAlso(keep_also if keep_also is not None else set())])
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policy, save_interval_steps=every, enable_async_checkpointing=True, create=True,
        multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=BARRIER_PREFIX),
        # A save that fails on one process fails on all (a full disk never hangs a slice).
        async_options=ocp.options.AsyncOptions(barrier_sync_fn=save_barrier.for_this_run()))
    return ocp.CheckpointManager(directory, options=options, item_names=("state", "data", "meta"))


def reason(e: BaseException) -> str:
    """Why a read or save failed, as one short line: the innermost cause's first line, without
    TensorStore's driver chain and spec."""
    while e.__cause__ is not None and str(e.__cause__):
        e = e.__cause__
    text = cli.first_line(e)
    disk = re.search(r"No space left on device|Disk quota exceeded|Read-only file system|Permission denied", str(e))
    if disk and not text.startswith(disk.group(0)):  # what the user must fix first, before the long path
        text = f"{disk.group(0)}: {text}"
    text = re.sub(r"\s*\[tensorstore_spec.*", "", text)
    text = re.sub(r"\.?\s*See full TensorStore details.*", "", text)
    text = re.sub(r'(Error opening "\w+" driver: )+', "", text)
    return f"{type(e).__name__}: {text[:240]}" if text else type(e).__name__


def transient(e: BaseException) -> bool:
    """Whether an error of a read is a storage service's transient failure (an HTTP 503 or 429, a
    gRPC UNAVAILABLE, a timeout, a reset connection), not a fault of the checkpoint."""
    chain = [e]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
        if len(chain) > 8:
            break
    return any(isinstance(x, (TimeoutError, ConnectionError))
               or TRANSIENT.search(_PATH.sub(" ", f"{type(x).__name__} {x}")) for x in chain)


def _agreed(what: str, fn: Callable[[], tuple[str | None, object]]):
    """(why, out) of `fn` (which returns them) on every process at once: `why` is the first
    process's reason against the checkpoint (an error of `fn` but a transient one counts as one),
    None if every process succeeded. While any process's error is transient, every process tries
    again (READ_TRIES in all); then CheckpointFailure. A ConfigError (a checkpoint of another
    model, the same on every process) and running out of memory are raised as they are."""
    for attempt in range(READ_TRIES):
        kind, why, out = None, None, None
        try:
            why, out = fn()
            kind = "data" if why else None
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 (any read error, except a lack of memory, marks a bad checkpoint)
            if isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e):
                raise
            if cli.debugging():
                logging.getLogger("gattn").exception("reading %s", what)
            kind, why = ("transient" if transient(e) else "data"), reason(e)
        verdicts = hosts.gather_json([kind, why])  # one process's bad share is everyone's
        bad = next((w for k, w in verdicts if k == "data"), None)
        if bad is not None:
            return bad, None
        busy = next((w for k, w in verdicts if k == "transient"), None)
        if busy is None:
            return None, out
        if attempt + 1 < READ_TRIES:
            time.sleep(RETRY_SECONDS * 2 ** attempt)
    raise CheckpointFailure(f"reading {what} failed {READ_TRIES} times ({busy}): the storage did not answer, "
                            "which says nothing about the checkpoint, so nothing was set aside; rerun when it answers")


def first_readable(mngr: ocp.CheckpointManager, read: Callable[[int], object], step: int | None = None,
                   flag: str = "--step", then: str = ""):
    """(step, read(step)) for the newest checkpoint that is sealed, verifies and reads back (or
    exactly `step`), with a one-line warning for each newer one it passes over (ending with `then`,
    what the caller does with it); None if there is no checkpoint. A checkpoint is passed over when
    a process's seal of it is missing (its save did not finish), when its files do not match their
    checksums (`verify`), when `read` raises (TensorStore's bare Exception included), or when an
    array it read is not finite (NaN or inf). The processes take each of these decisions together
    (`_agreed`), so none reads a checkpoint that another passes over. A run none of whose
    checkpoints has a seal (saved by an older gattn) is read unchecked, with one note. A
    ConfigError from `read` (a checkpoint of another model) is raised as it is, and so is running
    out of memory while restoring, so a good checkpoint is never taken for a bad one; a storage
    error that persists is CheckpointFailure. If no checkpoint can be used, CheckpointFailure,
    listing each step and its reason. Nothing is moved or deleted here."""
    steps = sorted(mngr.all_steps(), reverse=True)
    if step is not None and step not in steps:
        raise ConfigError(flag, step, f"one of the saved steps {sorted(steps)}")
    folder = Path(mngr.directory)
    legacy = not any((folder / str(s) / CHECKSUMS).exists() for s in steps)
    failed = []
    for s in ([step] if step is not None else steps):
        what = f"checkpoint step {s} in {mngr.directory}"
        why, out = _agreed(what, lambda: (None if legacy else unsealed(folder / str(s)) or verify(folder / str(s)), None))
        if why is None:
            why, out = _agreed(what, lambda: (None, read(s)))
        if why is None:  # (a jit over every process's arrays: only once every read succeeded)
            why, _ = _agreed(what, lambda: (not_finite(out), None))
        if why:
            failed.append((s, why))
            continue
        for bad, bad_why in failed:
            print(f"warning: checkpoint step {bad} in {mngr.directory} cannot be used ({bad_why}); "
                  f"using step {s} instead{then}", file=sys.stderr, flush=True)
        if legacy:
            print(f"note: checkpoint step {s} in {mngr.directory} has no seal (saved by an older gattn, or before "
                  "its first seal finished): only its arrays were checked (finite)", file=sys.stderr, flush=True)
        return s, out
    if not failed:
        return None
    listed = "; ".join(f"step {s}: {why}" for s, why in failed)
    raise CheckpointFailure(f"no checkpoint in {mngr.directory} can be used ({listed}); they are left "
                            "as they are: use a new --workdir, or restore the files")


def not_finite(tree) -> str | None:
    """Which floating-point arrays of `tree` (anything with jax.Array leaves) hold a NaN or an
    inf, as one short line, or None."""
    leaves = [(jax.tree_util.keystr(k), x) for k, x in jax.tree_util.tree_leaves_with_path(tree)
              if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)]
    if not leaves:
        return None
    ok = np.asarray(jax.jit(lambda xs: jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))([x for _, x in leaves]))
    bad = [name for (name, _), fine in zip(leaves, ok) if not fine]
    if not bad:
        return None
    return f"{len(bad)} of its {len(leaves)} arrays are not finite (NaN or inf), first {bad[0]}"


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
    """The last checkpoint saved before trouble (a skipped non-finite step, a collapsed step or a
    loss spike), kept outside the keep-K rotation: a run that drifts to huge but finite weights
    before its first non-finite step would otherwise rotate every good checkpoint away.

    Checkpoint k holds the weights after step k, which step k + 1 is the first to use: a
    checkpoint is *confirmed* once the step after it read back fine (`fine`), and the newest
    confirmed one is kept too until a newer one is confirmed, so trouble that shows in the very
    next step never leaves only the checkpoint that caused it. On trouble, the confirmed one
    becomes the kept one, if `clean` trouble-free steps (train.spike_window) came before it, so
    one saved in the middle of the trouble never replaces it. Its step, the confirmed one and the
    last trouble are saved in `meta`."""

    def __init__(self, keep_also: set, meta: dict, clean: int):
        self.keep_also, self.clean = keep_also, clean
        self.step, self.last_trouble = meta.get("kept_step"), meta.get("last_trouble")
        self.confirmed = meta.get("confirmed_step")
        self._protect()

    def _protect(self) -> None:
        self.keep_also.clear()
        self.keep_also.update(s for s in (self.step, self.confirmed) if s is not None)

    def fine(self, step: int, latest_saved: int | None) -> None:
        """Step `step` read back fine; `latest_saved` is the newest checkpoint (saved before it)."""
        if latest_saved is not None and latest_saved != self.confirmed:
            self.confirmed = latest_saved
            self._protect()

    def __call__(self, step: int) -> None:
        """Step `step` was trouble."""
        c = self.confirmed
        if c is not None and c != self.step and (self.last_trouble is None or c - self.last_trouble >= self.clean):
            self.step = c
        self.last_trouble = step
        self._protect()

    def meta(self) -> dict:
        return {"kept_step": self.step, "last_trouble": self.last_trouble, "confirmed_step": self.confirmed}


class Saves:
    """The run's asynchronous saves, checked and sealed: a save that failed (a full disk, a lost
    mount) stops the run as soon as it is known, with CheckpointFailure naming the last good
    checkpoint. Once Orbax has written a save, this process seals its files on a thread of its own
    (`seal` reads them all back), so the training steps go on meanwhile; the next save, or the end
    of the run, waits for it."""

    def __init__(self, mngr: ocp.CheckpointManager, last_good: int | None):
        self.mngr, self.good, self.pending, self.failed = mngr, last_good, None, False
        self.sealer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gattn-seal")
        self.sealing: concurrent.futures.Future | None = None

    def save(self, step: int, state, data_state: dict, meta: dict) -> None:
        self.check(wait=True)  # Orbax waits for the previous save here anyway
        try:
            save(self.mngr, step, state, data_state, meta, force=True)
        except Exception as e:  # noqa: BLE001
            raise self._failure(step, e) from None
        self.pending = step

    def check(self, wait: bool = False) -> None:
        """Raises CheckpointFailure if the pending save (or its seal) failed; starts its seal once
        it is written; with `wait`, waits for both."""
        if self.pending is None:
            return
        try:
            if self.sealing is None:
                if not wait and self.mngr.is_saving_in_progress():
                    return
                self.mngr.wait_until_finished()  # (raises what the background write raised)
                self.sealing = self.sealer.submit(seal, Path(self.mngr.directory) / str(self.pending),
                                                  jax.process_index(), jax.process_count())
            if not wait and not self.sealing.done():
                return
            self.sealing.result()
        except Exception as e:  # noqa: BLE001
            raise self._failure(self.pending, e) from None
        self.good, self.pending, self.sealing = self.pending, None, None

    def last_good(self) -> str:
        """Where a stopped run goes on from, as its error line says it."""
        return (f"the last good checkpoint is step {self.good} in {self.mngr.directory}" if self.good is not None
                else "there is no good checkpoint yet")

    def _failure(self, step: int, e: BaseException) -> CheckpointFailure:
        self.failed = True
        return CheckpointFailure(f"saving checkpoint step {step} failed ({reason(e)}); stopping: {self.last_good()}")

    def close(self) -> None:
        """Waits for the last save and its seal (a failure raises, unless one was reported already)."""
        try:
            if not self.failed:
                self.check(wait=True)
        finally:
            self.sealer.shutdown(wait=True)
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


def _restore(mngr: ocp.CheckpointManager, step: int, args):
    """mngr.restore, which ends at a barrier of every process ("Checkpointer:restore"): a process
    whose read failed before it goes to that barrier too, so that the processes stay in step
    (each reads its own shards, so one may fail alone) and can agree on what to do next."""
    try:
        return mngr.restore(step, args=args)
    except Exception:
        if hosts.count() > 1:
            ocp.multihost.sync_global_processes(ocp.multihost.unique_barrier_key("Checkpointer:restore",
                                                                                 prefix=BARRIER_PREFIX))
        raise


def restore(mngr: ocp.CheckpointManager, abstract_state, step: int | None = None):
    """(state, data_state, meta) of `step` (default: the latest complete one), or None if the
    directory holds no checkpoint. `abstract_state`: jax.ShapeDtypeStruct leaves (with
    shardings to restore onto a particular mesh)."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        return None
    out = _restore(mngr, step, ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                  data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
    return out.state, out.data, out.meta


def restore_meta(mngr: ocp.CheckpointManager, step: int | None = None) -> dict | None:
    """The JSON metadata of `step` (default: the latest) without reading any array."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        return None
    return _restore(mngr, step, ocp.args.Composite(meta=ocp.args.JsonRestore())).meta


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
    out = _restore(mngr, step, ocp.args.Composite(state=ocp.args.PyTreeRestore(
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
