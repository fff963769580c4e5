"""The training loop: data, AdamW, NaN guard, loss-spike counter, validation, metrics, checkpoints.

A run lives in its work directory: `checkpoints/` (Orbax), `metrics.jsonl` (one JSON object per
logged step), `tensorboard/`, `tokenizer/`, `tfds/` and, at the end, `summary.json`. Starting a
run in a directory that holds a checkpoint resumes from the latest complete one that reads back
(or a chosen step): same data order, same numbers as an uninterrupted run. SIGTERM saves a
checkpoint and exits cleanly; a failed save stops the run (docs/training.md#faults).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import logging
import math
import os
import signal
import sys
import time

from etils.epath import Path  # local paths, and gs:// or other remote workdirs
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gattn import cli
from gattn.config import Config, ConfigError, from_dict, to_dict
from gattn.data import corpus, record as data_record, synthetic
from gattn.data.tokenizer import load_tokenizer, tokenizer_path
from gattn.model import sharding
from gattn.model.transformer import Transformer, relayout
from gattn.train import checkpoint, hosts, init_from, lease, optim, prefetch, rundir
from gattn.train.reports import Reports, Startup, TrainingStopped  # noqa: F401 (TrainingStopped: trainer's API)
from gattn.train.loss import (aux_loss, aux_metrics, lm_and_mtp_loss, lm_loss_and_aux, lm_nll_sum,
                              mtp_target_weights, target_weights)


def state_shardings(tx, abstract_params, mesh):
    """Shardings of {step, params, opt_state}: parameters by their logical axes (gattn/model/sharding.py),
    the optimizer's moments like their parameters, scalars replicated."""
    params = sharding.param_shardings(abstract_params, mesh)
    opt_state = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, abstract_params), params,
                                      transform_non_params=lambda _: sharding.replicated(mesh))
    return {"step": sharding.replicated(mesh), "params": params, "opt_state": opt_state}


def _state_builder(cfg: Config, mesh):
    """(graphdef, build, shardings): `build()` makes {step, params, opt_state} from the seed."""
    tx = optim.optimizer(cfg.train)
    new_model = lambda: Transformer(cfg.model, cfg.exec, rngs=nnx.Rngs(cfg.train.seed))  # noqa: E731
    graphdef, abstract_params = nnx.split(nnx.eval_shape(new_model), nnx.Param)

    def build():
        params = nnx.state(new_model(), nnx.Param)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    return graphdef, build, state_shardings(tx, abstract_params, mesh)


def init_state(cfg: Config, mesh=None):
    """(graphdef, state): state = {step, params, opt_state} as a pytree of arrays, created directly
    in its shardings on `mesh` (default: `cfg.mesh` over the present devices), so no device ever
    holds the whole model."""
    mesh = mesh if mesh is not None else sharding.make_mesh(cfg.mesh)
    graphdef, build, shardings = _state_builder(cfg, mesh)
    return graphdef, jax.jit(build, out_shardings=shardings)()


def abstract_state(cfg: Config, mesh):
    """The ShapeDtypeStructs (with shardings on `mesh`) of `init_state(cfg, mesh)`'s state."""
    return abstract_train_state(cfg, mesh)[1]


def abstract_train_state(cfg: Config, mesh):
    """(graphdef, abstract state): `init_state` without allocating anything, for compiling the
    step ahead of time (bench/fit_presets.py, bench/aot_train_step.py)."""
    graphdef, build, shardings = _state_builder(cfg, mesh)
    return graphdef, checkpoint.abstract(jax.eval_shape(build), shardings)


def restore(mngr, cfg: Config, saved: Config, state, mesh, step: int | None = None):
    """(state, data_state, meta) of checkpoint `step` (default: the latest), or None. A checkpoint
    saved with the other block layout (exec.scan_layers) is restored in its own layout, then restacked."""
    target = checkpoint.abstract(state)
    if saved.exec.scan_layers == cfg.exec.scan_layers:
        return checkpoint.restore(mngr, target, step)
    restored = checkpoint.restore(mngr, abstract_state(dataclasses.replace(cfg, exec=saved.exec), mesh), step)
    if restored is None:
        return None
    state, data_state, meta = restored
    return checkpoint.place(relayout(state, target["params"]), target), data_state, meta


def resume(cfg: Config, workdir: Path, mngr, state, mesh, step: int | None):
    """(state, data_state, meta) of the newest readable checkpoint (or exactly `step`), or None.
    A checkpoint of another model or data is refused before any array is read, and nothing is
    written then. An unreadable checkpoint is passed over with a warning; it and any checkpoint
    after the one resumed are moved to WORKDIR/checkpoints_set_aside/, never deleted (the
    resumed run would not save those steps again, and the rotation would delete them)."""

    def read(s):
        saved_meta = checkpoint.restore_meta(mngr, s) or {}
        if "converted_from" in saved_meta:
            raise _converted(workdir, saved_meta["converted_from"])
        if saved_meta.get("config"):
            rundir.check_same(cfg, saved_meta["config"], rundir.RESUME_FIXED,
                              fix="resume with the same value or use a new --workdir")
        saved_cfg = from_dict(Config, saved_meta["config"]) if saved_meta.get("config") else cfg
        return restore(mngr, cfg, saved_cfg, state, mesh, s)

    try:
        found = checkpoint.first_readable(mngr, read, step, flag="--resume-step",
                                          then=f", and setting it aside in {workdir / checkpoint.SET_ASIDE}")
    except (ConfigError, cli.Failure):
        mngr.close()
        raise
    if found is None:
        return None
    later = sorted(s for s in mngr.all_steps() if s > found[0])
    if later and hosts.primary():
        folder = checkpoint.set_aside(mngr, later)
        if step is not None:
            print(f"note: resuming from step {step}; the later checkpoints {later} are moved to {folder}, "
                  "not deleted", file=sys.stderr, flush=True)
    hosts.barrier("set aside")
    mngr.reload()
    return found[1]


_SUMMED_AUX = ("load", "dropped", "mtp_loss")  # counts (and the MTP loss's microbatch shares) add up over
#                                                 microbatches; the MoE losses average


def split_microbatches(batch: dict, m: int, mesh=None) -> dict:
    """[B, S] -> [m, B/m, S]: microbatch i holds rows i, i + m, i + 2m, ..., so that with rows split
    over the data x fsdp x expert shards in contiguous blocks each shard holds B / (m x shards) rows of
    every microbatch: the microbatches run one after the other on all devices, with no
    communication (the trainer checks that B / shards is a multiple of m)."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)  # (inside `_on_each_data_shard`)

    def split(x):
        x = jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)
        if mesh is not None:
            rows = sharding.batch_sharding(mesh).spec[0]
            rows = tuple(a for a in ((rows,) if isinstance(rows, str) else rows or ()) if a not in manual) or None
            spec = jax.sharding.PartitionSpec(None, rows)
            x = jax.lax.with_sharding_constraint(x, spec if manual else jax.sharding.NamedSharding(mesh, spec))
        return x
    return {k: split(v) for k, v in batch.items()}


def loss_and_grads(cfg: Config, graphdef, params, batch: dict, mesh=None):
    """((loss, aux), grads) of one global batch. With train.microbatches = m > 1 the batch runs as
    m sequential microbatches in one scan (gradient accumulation, float32 sums): each microbatch's
    summed token losses over the whole batch's target count, so the cross-entropy and its gradient
    are the big step's (to float rounding). A MoE is not: its router sees one microbatch at a
    time, so the global-batch LBL counts expert loads per microbatch (the mean of the microbatches'
    LBLs) and an expert capacity is per microbatch (other tokens are dropped than in the big
    step); loads and drop counts are summed. With train.mtp_loss_weight > 0 the MTP layer's
    cross-entropy (token t+2 at position t) is added with that weight, split over microbatches
    the same way, and returned in aux as "mtp_loss"."""
    m, mtp_weight = cfg.train.microbatches, cfg.train.mtp_loss_weight

    def objective(params, b, scale):
        model = nnx.merge(graphdef, params)
        if mtp_weight:
            ce, mtp, aux = lm_and_mtp_loss(model, b["tokens"], b["segment_ids"], b["positions"])
        else:
            (ce, aux), mtp = lm_loss_and_aux(model, b["tokens"], b["segment_ids"], b["positions"]), None
        if scale is not None:  # (this microbatch's share of the whole batch's means)
            ce = ce * jnp.sum(target_weights(b["segment_ids"])) / scale[0]
            if mtp_weight:
                mtp = mtp * jnp.sum(mtp_target_weights(b["segment_ids"])) / scale[1]
        loss = ce + aux_loss(cfg.model.moe, aux) / (1 if scale is None else m)
        if mtp_weight:
            loss, aux = loss + mtp_weight * mtp, {**aux, "mtp_loss": mtp}
        return loss, (ce, aux)

    if m == 1:
        (_, (loss, aux)), grads = jax.value_and_grad(objective, has_aux=True)(params, batch, None)
        return (loss, aux), grads

    def accumulate(params, batch, axes=(), reduce=None):
        """The scan over the microbatches; with `axes` (manual mesh axes of a shard_map) each shard
        sums its own rows' gradients and they are reduced once, after the scan (`reduce`: a
        gradient's reduction over `axes`, by default an all-reduce)."""
        totals = []
        for weights in (target_weights, mtp_target_weights):
            total = jnp.sum(weights(batch["segment_ids"])).astype(jnp.float32)
            totals.append(jnp.maximum(jax.lax.psum(total, axes) if axes else total, 1))

        def one(carry, b):
            grads_acc, loss_acc = carry
            (_, (part, aux)), grads = jax.value_and_grad(objective, has_aux=True)(params, b, totals)
            grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
            return (grads_acc, loss_acc + part), aux

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        (grads, loss), aux_M = jax.lax.scan(one, (zeros, jnp.zeros((), jnp.float32)),
                                            split_microbatches(batch, m, mesh))
        if axes:
            grads = (reduce or (lambda g: jax.lax.psum(g, axes)))(grads)
            loss = jax.lax.psum(loss, axes)
            if "mtp_loss" in aux_M:
                aux_M = {**aux_M, "mtp_loss": jax.lax.psum(aux_M["mtp_loss"], axes)}
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        aux = {k: v.sum(0) if k in _SUMMED_AUX else v.mean(0) for k, v in aux_M.items()}
        return (loss, aux), grads

    shape = dict(mesh.shape) if mesh is not None else {}
    if cfg.exec.accumulate == "gathered" and shape.get("fsdp", 1) > 1:
        return _gathered_on_each_shard(accumulate, params, batch, mesh)
    others = [a for a in shape if a != "data" and shape[a] > 1]
    if shape.get("data", 1) == 1 or cfg.model.moe is not None or len(others) > 1:
        return accumulate(params, batch)
    return _on_each_data_shard(accumulate, params, batch, mesh)


def _on_each_data_shard(accumulate, params, batch: dict, mesh):
    """`accumulate` in a shard_map over the data axis alone (the others stay automatic): every data
    shard accumulates float32 sums of its own rows' gradients over the microbatches, and one
    all-reduce over data per step replaces one per microbatch (the bytes do not grow with
    train.microbatches; tests/test_traffic.py). The parameters are not split over data, so nothing
    is gathered at its boundary. Taken with at most one other axis > 1 (data alone, data x fsdp
    across slices, data x model): with two, XLA 0.10's partitioner aborts on the partly manual
    program (a check failure, on CPU), and the plain scan runs, reducing per microbatch. A MoE
    keeps the plain scan too: its global-batch LBL counts every data shard's tokens."""
    rows = jax.sharding.PartitionSpec("data")
    fn = jax.shard_map(functools.partial(accumulate, axes=("data",)), mesh=mesh, axis_names={"data"},
                       in_specs=(jax.sharding.PartitionSpec(), jax.tree.map(lambda _: rows, batch)),
                       out_specs=jax.sharding.PartitionSpec(), check_vma=False)
    return fn(params, batch)


def _gathered_on_each_shard(accumulate, params, batch: dict, mesh):
    """exec.accumulate = "gathered" (ZeRO-2): `accumulate` in a shard_map over fsdp (and data, if
    > 1). The parameters cross its boundary whole over fsdp, so they are gathered once per step;
    every shard sums float32 gradients of its own rows over the microbatches, whole, and after the
    scan each gradient is all-reduced over data and reduce-scattered over fsdp to its parameter's
    layout (all-reduced, if the rules leave it whole): one reduction per step,
    the bytes independent of train.microbatches (tests/test_train_step.py). The other axes stay
    automatic; XLA 0.10's partitioner aborts on a partly manual program with two of them > 1, so
    such a mesh is refused."""
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    shape = dict(mesh.shape)
    auto = [a for a in shape if a not in ("data", "fsdp") and shape[a] > 1]
    if len(auto) > 1:
        raise ConfigError("exec.accumulate", "gathered",
                          f"a mesh with at most one of expert and model > 1 (here {shape}): XLA's partitioner "
                          "aborts on the partly manual step otherwise; use 'sharded'")
    manual = tuple(a for a in ("data", "fsdp") if shape[a] > 1)
    summed = tuple(a for a in manual if a != "fsdp")

    def unreduced(grads):  # each fsdp shard's own sums, stacked on a new leading axis split over fsdp
        return jax.tree.map(lambda g: (jax.lax.psum(g, summed) if summed else g)[None], grads)

    fn = jax.shard_map(functools.partial(accumulate, axes=manual, reduce=unreduced), mesh=mesh,
                       axis_names=set(manual),
                       in_specs=(P(), jax.tree.map(lambda _: P(manual), batch)),
                       out_specs=(P(), P("fsdp")), check_vma=False)
    (loss, aux), stacked = fn(params, batch)
    # The sum over that axis, laid out as the parameters are. (libtpu 0.10 compiles most of these
    # sums, as it did a psum_scatter inside the shard_map, as an all-reduce and a slice, not a
    # reduce-scatter: twice the bytes; docs/training.md says what that costs.)
    grads = jax.tree.map(lambda g, s: jax.lax.with_sharding_constraint(g.sum(0), s), stacked,
                         sharding.param_shardings(params, mesh))
    return (loss, aux), grads


def make_train_step(cfg: Config, graphdef, shardings=None, mesh=None):
    """A jitted step. A non-finite loss or gradient leaves params and optimizer state unchanged
    (the step is skipped and reported), so it never reaches a checkpoint. With `shardings` (of
    the state, see `state_shardings`) and `mesh`, the step is compiled with explicit input and
    output shardings: the state keeps its layout, batches split over data x expert."""
    def step(state, batch, schedule):
        tx, lr = optim.optimizer(cfg.train, schedule), optim.schedule(cfg.train, schedule)
        (loss, aux), grads = loss_and_grads(cfg, graphdef, state["params"], batch, mesh)
        grad_norm = optax.global_norm(grads)  # the clip computes it too (shared)
        keep = lambda: (state["params"], state["opt_state"], jnp.asarray(False))  # noqa: E731

        def update():
            updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            # Finite gradients are not enough: a huge step can overflow the new weights. (A finite
            # grad norm bounds every g^2, so the Adam moments stay finite.)
            return jax.lax.cond(optim.all_finite(params), lambda: (params, opt_state, jnp.asarray(True)), keep)

        # Branches instead of elementwise selects over params and optimizer state: ~35 ms/step
        # less on CPU at the peer shapes, and the update can run in place.
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state, ok = jax.lax.cond(ok, update, keep)
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        report = {"loss": loss, "grad_norm": grad_norm, "finite": ok,
                  # what optax applied (its count, not state["step"]: skipped steps do not advance it)
                  "lr": lr(optim.schedule_count(state["opt_state"])), **aux_metrics(aux)}
        if "mtp_loss" in aux:
            report["mtp/loss"] = aux["mtp_loss"]
        return new_state, report

    values = optim.schedule_values(cfg.train)
    if shardings is None:
        return TrainStep(jax.jit(step, donate_argnums=0), values)
    if mesh is None:
        raise ValueError("make_train_step: `shardings` need the `mesh` they were made for")
    batch, replicated = sharding.batch_sharding(mesh), sharding.replicated(mesh)
    return TrainStep(jax.jit(step, donate_argnums=0, in_shardings=(shardings, batch, replicated),
                             out_shardings=(shardings, replicated)), values)


class TrainStep:
    """`step(state, batch) -> (state, scalars)`: the jitted step with the LR schedule's numbers
    (optim.schedule_values) passed as arguments, so that runs which differ only in steps or LR
    share one compiled program (and the persistent compilation cache). `lower(state, batch)`
    for ahead-of-time compiles."""

    def __init__(self, jitted, schedule: dict):
        self.jitted, self.schedule = jitted, schedule

    def __call__(self, state, batch):
        return self.jitted(state, batch, self.schedule)

    def lower(self, state, batch):
        return self.jitted.lower(state, batch, self.schedule)


def make_eval_step(graphdef):
    @jax.jit
    def eval_step(params, batch):
        model = nnx.merge(graphdef, params)
        return lm_nll_sum(model, batch["tokens"], batch["segment_ids"], batch["positions"])
    return eval_step


def validate(eval_step, params, batches: dict[str, list], mesh=None) -> dict[str, float]:
    """Held-out loss and perplexity per domain (under `mesh`, as the train step runs, so the
    Pallas attention and the expert-parallel MoE take the same path). Every process holds all
    the held-out batches; each enters the step split over the data x expert shards like a
    training batch, padded with empty rows (segment id 0: they count for nothing) to a multiple
    of the shards, so any data.eval_batch_size runs on any mesh."""
    out = {}
    for domain, domain_batches in batches.items():
        total = count = 0.0
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            for b in domain_batches:
                if mesh is not None:
                    b = {k: global_array(v, sharding.batch_sharding(mesh))
                         for k, v in pad_rows(b, sharding.batch_shards(mesh)).items()}
                s, c = eval_step(params, b)
                total, count = total + float(s), count + float(c)
        out[f"val_loss/{domain}"] = total / count
        out[f"val_ppl/{domain}"] = math.exp(min(total / count, 50.0))
    return out


def pad_rows(batch: dict, multiple: int) -> dict:
    """`batch` with empty rows (all zeros: segment id 0 is padding) up to a multiple of `multiple` rows."""
    missing = -batch["tokens"].shape[0] % multiple
    return {k: np.pad(v, ((0, missing), (0, 0))) for k, v in batch.items()} if missing else batch


def global_array(x: np.ndarray, where):
    """A jax.Array of `x` (which every process holds whole) placed on the sharding `where`."""
    return jax.make_array_from_callback(x.shape, where, lambda index: x[index])


def local_rows(batch_sharding, batch_size: int) -> range:
    """The rows of the global batch that this process's devices hold (contiguous, as the mesh puts
    each process's devices side by side on the batch axes)."""
    rows = set()
    for index in batch_sharding.addressable_devices_indices_map((batch_size, 1)).values():
        rows.update(range(batch_size)[index[0]])
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise ValueError(f"this process holds rows {sorted(rows)} of the batch, which are not contiguous")
    return range(lo, hi)


class Stopper:
    """Whether to save and stop now: SIGTERM or SIGINT (Ctrl-C: its twin) to this process (one
    process), or to any host, in which case every host agrees on the same step (JAX's
    preemption sync point, which listens for SIGTERM: a SIGINT is passed on to it as one)."""

    def __init__(self):
        self.signal = None
        self.many = hosts.count() > 1
        handlers = {signal.SIGINT: self._interrupt} if self.many else {signal.SIGTERM: self._record,
                                                                         signal.SIGINT: self._interrupt}
        self.previous = {s: signal.signal(s, h) for s, h in handlers.items()}

    def _record(self, signum, frame):
        self.signal = signum

    def _interrupt(self, signum, frame):
        """Ctrl-C: save and stop at the end of the step; a second one stops at once."""
        if self.signal is not None:
            raise KeyboardInterrupt
        if self.many:
            os.kill(os.getpid(), signal.SIGTERM)
        self.signal = signum

    def __call__(self, step: int) -> bool:
        if self.many:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            return multihost_utils.reached_preemption_sync_point(step)
        return self.signal is not None

    def name(self) -> str:
        """The signal that stopped the run, as the user sent it (several processes: JAX's
        preemption notice is a SIGTERM, to this host or another; a Ctrl-C here is recorded)."""
        return "Ctrl-C (SIGINT)" if self.signal == signal.SIGINT else "SIGTERM"

    def close(self):
        """The loop is over: a signal from now on has nothing left to stop (the last step is saved,
        or being saved), so it is noted in one line instead of breaking the run's end with a
        KeyboardInterrupt (a second Ctrl-C still stops at once). `restore` puts the previous
        handlers back when `train` returns."""
        for s in self.previous:
            signal.signal(s, self._late)

    def _late(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum
        if hosts.primary():
            print(f"\nnote: {signal.Signals(signum).name} as the run ends: it finishes its last save and exits",
                  file=sys.stderr, flush=True)

    def restore(self):
        for s, h in self.previous.items():
            signal.signal(s, h)


class RunFilesFailure(cli.Failure):
    """The run's own files (metrics, TensorBoard, the lease) could not be written: one line."""


WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM)


def _close_all(closers) -> None:
    """Calls each closer in turn; the first error is raised after all ran, unless an error is
    already on its way out (then theirs are dropped: GATTN_DEBUG=1 logs them)."""
    ending, first = sys.exc_info()[1], None
    for close in closers:
        if close is None:
            continue
        try:
            close()
        except Exception as e:  # noqa: BLE001
            if ending is not None and cli.debugging():
                logging.getLogger("gattn").exception("while stopping after %s", ending)
            first = first or e
    if first is not None and ending is None:
        raise first


def data_source(cfg: Config):
    """The batches' module: gattn.data.synthetic for data.source="synthetic" (random tokens for
    timing: no tokenizer, Grain or TFDS), else gattn.data.pipeline, imported only here so that a
    synthetic run needs neither Grain nor TFDS installed."""
    if cfg.data.source == synthetic.SOURCE:
        return synthetic
    from gattn.data import pipeline  # noqa: PLC0415

    return pipeline


def prepare(cfg: Config, workdir: Path, source_step: int | None, allow_corpus_change: bool = False,
            startup: Startup | None = None):
    """The one-time preparation of a run (its tokenizer, the TFDS build, a continued run's
    tokenizer copy, WORKDIR/data.json), done by process 0 while the others wait; then every host
    has its copy, whether the workdir is a shared filesystem or each host's own disk. A resume
    keeps the run's recorded tokenizer and refuses changed data unless `allow_corpus_change`
    (gattn/data/record.py). Returns (the tokenizer, its file, the earlier fingerprints): what
    `data_record.write` keeps once the resume is accepted. `startup` times the tokenizer and the
    dataset stages."""
    startup = startup or Startup(False)
    tokenizer, pipeline = None, data_source(cfg)
    if pipeline is synthetic:
        workdir.mkdir(parents=True, exist_ok=True)
        return None, None, []
    fresh, earlier, path = not checkpoint.saved_steps(workdir), [], None  # a fresh run chooses its tokenizer
    if hosts.primary():
        workdir.mkdir(parents=True, exist_ok=True)
        if not fresh:  # the run's fields first (a changed data.* named), before anything is rewritten for it
            _check_resume_fields(cfg, workdir)
            earlier = data_record.check_resume(cfg, workdir, tokenizer_path(cfg, workdir), allow_corpus_change)
        if source_step is not None:
            init_from.copy_tokenizer(cfg, workdir)
        with startup.stage("tokenizer", "tokenizer (trained on the corpus on first use)"):
            tokenizer = load_tokenizer(cfg, workdir, fresh=fresh)
            path = tokenizer_path(cfg, workdir, fresh=fresh)
        with startup.stage("dataset", "dataset (built once per corpus and tokenizer)", own_lines=True):
            pipeline.prepare(cfg, workdir, tokenizer)
    hosts.barrier("prepared")
    workdir.mkdir(parents=True, exist_ok=True)
    path = Path(hosts.gather_json(str(path))[0])  # process 0's choice (it alone reads data.json)
    share_tokenizer(path)
    return tokenizer if tokenizer is not None else load_tokenizer(cfg, workdir, fresh=True, path=path), path, earlier


def share_tokenizer(path: Path) -> None:
    """Process 0's tokenizer file on every host; for a Hugging Face tokenizer.json also the
    tokenizer_config.json beside it, where `HFTokenizer` reads its EOS and BOS (without it another
    host would end its documents with another id)."""
    hosts.share_file(path)
    if path.suffix == ".json":
        hosts.share_file(path.with_name("tokenizer_config.json"), optional=True)


def _converted(workdir: Path, source: str) -> ConfigError:
    return ConfigError("--workdir", str(workdir), f"it holds a model converted from {source} (parameters only): "
                       "train from it in a new run directory with --init-from")


def _check_resume_fields(cfg: Config, workdir: Path) -> None:
    """A resume's fixed fields (rundir.RESUME_FIXED) against the run's config.json, before
    anything is written (before: a refused vocab_size was already in WORKDIR/corpus_report.json);
    `resume` checks them again against the checkpoint's own copy."""
    try:
        converted = json.loads((workdir / "converted.json").read_text())
    except (OSError, ValueError):
        converted = None
    if isinstance(converted, dict):  # (gattn.convert's run: a model to train from, not a run to resume)
        raise _converted(workdir, converted.get("from", "?"))
    try:
        then = rundir.read_config(workdir)
    except ConfigError:  # no readable config.json: the checkpoint's copy decides
        return
    rundir.check_same(cfg, then, rundir.RESUME_FIXED, fix="resume with the same value or use a new --workdir")


def train(cfg: Config, workdir: str | Path, *, progress: bool = True, resume_step: int | None = None,
          allow_corpus_change: bool = False, resume_anyway: bool = False) -> dict:
    """Trains `cfg` in `workdir` (resuming if it holds a checkpoint; else starting from the
    parameters of `train.init_from` when set); returns the summary. With several processes (a pod
    slice), each reads its own rows of every batch and process 0 alone writes metrics and files.
    `resume_step`: resume from that saved step instead of the latest (later ones are set aside).
    `allow_corpus_change`: resume even if the data changed since the run was trained.
    `resume_anyway`: resume from the newest checkpoint of a run that stopped for divergence (a
    plain rerun is refused: its newest checkpoint was saved in the trouble)."""
    hosts.check_same_run({**to_dict(cfg), "workdir": str(workdir), "resume_step": resume_step})  # or none trains
    corpus.check_embedded_suffices(cfg)  # a paper preset given no corpus of its own: refused, nothing written
    rundir.check_workdir(workdir)
    saved = checkpoint.saved_steps(workdir)
    if (resume_step is not None or resume_anyway) and not saved:
        # (before: a mistyped --workdir with --resume-step trained a new run from step 0)
        flag, value = ("--resume-step", resume_step) if resume_step is not None else ("--resume-anyway", True)
        raise ConfigError(flag, value, f"a run to resume; {workdir} has no checkpoint (a new run starts without it)")
    # A continued run's source is checked before anything is written, the lease included (and
    # only until it has a checkpoint of its own: resuming never reads the source again).
    source_step = init_from.check(cfg) if cfg.train.init_from and not saved else None
    if hosts.primary():
        rundir.check_writable(workdir)
    with lease.hold(workdir, primary=hosts.primary()):  # one train.py per run directory (WORKDIR/lock.json)
        if resume_step is None and not resume_anyway:
            check_not_diverged(Path(workdir))
        return _train(cfg, Path(workdir), progress, resume_step, allow_corpus_change, source_step)


def abstract_batch(cfg: Config, batch_sharding) -> dict:
    """The shapes of a global training batch (every pipeline's rows: tokens, segment ids and
    positions, int32, of seq_len + 1 tokens), to compile the step before the first batch is made."""
    shape = (cfg.train.batch_size, cfg.train.seq_len + 1)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding)
            for k in ("tokens", "segment_ids", "positions")}


def check_not_diverged(workdir: Path) -> None:
    """Refuses a plain rerun of a run that stopped for divergence (summary.json says so): it would
    resume from a checkpoint saved in the trouble, and may finish "completed" on ruined weights."""
    try:
        summary = json.loads((workdir / "summary.json").read_text())
    except (OSError, ValueError):
        return
    if not isinstance(summary, dict) or summary.get("stopped") != "diverged":
        return
    kept, newest = summary.get("kept_step"), max(checkpoint.saved_steps(workdir), default=None)
    raise TrainingStopped(
        f"this run stopped at step {summary.get('step')} for divergence ({summary.get('reason', '')}); a plain "
        f"rerun would resume from its newest checkpoint, step {newest}, saved in the trouble: " + (
            f"rerun with --resume-step {kept} (the checkpoint kept from before the trouble)" if kept is not None
            else "start again in a new --workdir") + f", or with --resume-anyway to go on from step {newest}")


def _train(cfg: Config, workdir: Path, progress: bool, resume_step: int | None, allow_corpus_change: bool,
           source_step: int | None) -> dict:
    t = cfg.train
    mesh = sharding.make_mesh(cfg.mesh)
    sharding.check_batch(t.batch_size, t.microbatches, mesh)
    startup = Startup(progress and hosts.primary())
    tokenizer, tokenizer_file, earlier = prepare(cfg, workdir, source_step, allow_corpus_change, startup)
    pipeline = data_source(cfg)
    batch_sharding = sharding.batch_sharding(mesh)
    with startup.stage("dataset", "reading the data"):
        data = pipeline.train_iterator(cfg, tokenizer, workdir, local_rows(batch_sharding, t.batch_size))
        val_batches = pipeline.validation_batches(cfg, tokenizer, workdir)

    def feed(batch: dict) -> dict:  # this process's rows -> the global batch
        return {k: jax.make_array_from_process_local_data(batch_sharding, v, (t.batch_size, v.shape[1]))
                for k, v in batch.items()}

    keep_also = set()  # the checkpoint kept before trouble (checkpoint.BeforeTrouble)
    mngr = checkpoint.manager(workdir, t.keep_checkpoints, t.checkpoint_every, keep_also)
    restored = None
    if checkpoint.saved_steps(workdir):  # a resume restores onto the state's shapes: nothing to initialise
        with startup.stage("restore", "restoring the checkpoint"):
            graphdef, state = abstract_train_state(cfg, mesh)
            restored = resume(cfg, workdir, mngr, state, mesh, resume_step)
    if restored is None:
        with startup.stage("model", "initialising the model and optimizer state"):
            graphdef, state = init_state(cfg, mesh)
    meta = rundir.meta(cfg)
    if restored is not None:
        state, data_state, meta = restored
        if hosts.primary():
            print(f"resumed from step {int(state['step'])} ({workdir / 'checkpoints'})", file=sys.stderr, flush=True)
        pipeline.set_state(data, data_state)
        saved = from_dict(Config, meta["config"]).train if meta.get("config") else None
        train_cfg, note = optim.continued(t, saved, int(optim.schedule_count(state["opt_state"])))
        cfg, t = dataclasses.replace(cfg, train=train_cfg), train_cfg  # (config.json records a continuation)
        if note and hosts.primary():
            print(note, file=sys.stderr, flush=True)
    elif source_step is not None:
        state = {**state, "params": init_from.params(cfg, state["params"], source_step)}
    start = int(state["step"])
    if start > t.steps:  # nothing to train, and config.json would record the smaller count
        mngr.close()
        raise ConfigError("train.steps (--steps)", t.steps,
                          f"at least {start}, the step this run's checkpoint has reached (a run is never cut "
                          "back; evaluate it with eval.py, or train a new run in a new --workdir)")
    if hosts.primary() and tokenizer_file is not None:  # the resume is accepted: what it trains on
        data_record.write(cfg, workdir, tokenizer_file, earlier, tokenizer)
    if hosts.primary():  # (an earlier, different config.json goes to config_history.jsonl)
        rundir.record_config(workdir, cfg, start)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    train_step, eval_step = make_train_step(cfg, graphdef, shardings, mesh), make_eval_step(graphdef)
    reports = Reports(cfg, workdir, meta, start, mngr, keep_also, progress)
    saves = checkpoint.Saves(mngr, start if restored is not None else None)
    stop = Stopper()
    batches = (prefetch.Prefetcher(data, feed, prefetch.depth(cfg), limit=t.steps - start)
               if start < t.steps else None)
    if batches is not None:  # compiled ahead of the loop (its call then reuses it), to time it apart
        with startup.stage("compile", "compiling the train step"), jax.set_mesh(mesh):
            train_step.lower(state, abstract_batch(cfg, batch_sharding)).compile()
    startup.write(workdir)
    try:  # the signal handlers are this run's until it returns (`Stopper.restore`)
        try:
            for step in range(start + 1, t.steps + 1):
                lease.check()  # a lost lease (another run took it, or no renewal): stop before writing again
                with jax.set_mesh(mesh):
                    state, m = train_step(state, next(batches))
                # The step runs while the previous step's scalars are read (one step late, so reading
                # them never keeps the next step from being dispatched) and the next batch is prepared.
                reports.read_previous()
                reports.pending(step, m)
                saves.check()  # a failed asynchronous save stops the run here
                if reports.validates(step):  # (logged with the step's scalars)
                    t0 = time.perf_counter()
                    reports.val = validate(eval_step, state["params"], val_batches, mesh)
                    reports.eval_seconds += time.perf_counter() - t0
                stopping = stop(step)
                if step == t.steps or stopping or mngr.should_save(step):
                    reports.read_previous()  # the checkpoint's bookkeeping needs this step's scalars
                    lease.check()
                    data_state = {k: v for part in hosts.gather_json(batches.get_state())
                                  for k, v in part.items()}
                    saves.save(step, state, data_state, reports.meta())
                if stopping:
                    saves.check(wait=True)
                    if hosts.primary():
                        print(f"\n{stop.name()}: saved step {step} in {workdir}/checkpoints; rerun to resume.",
                              flush=True)
                    break
            reports.read_previous()
        except TrainingStopped as e:  # a divergence: summary.json says so, and a plain rerun is refused
            if hosts.primary():
                (workdir / "summary.json").write_text(json.dumps({
                    "step": e.step, "completed": False, "stopped": "diverged", "kept_step": e.kept,
                    "reason": e.reason, "skipped_steps": reports.skipped,
                    "collapsed_steps": reports.collapsed_steps}, indent=2))
            raise
        except OSError as e:  # a full disk or a lost mount under the run's files: one line, no progress lost
            if e.errno not in WRITE_ERRORS:
                raise
            raise RunFilesFailure(f"writing the run's files failed at step {step} ({e.strerror}: "
                                  f"{e.filename or workdir}); stopping: {saves.last_good()}") from None
        finally:
            # Closing must not hide the error that stopped the loop (a full disk fails the
            # TensorBoard flush too): each closer runs, and its own error is raised only if the loop
            # ended without one.
            _close_all([batches.close if batches is not None else None, reports.close, stop.close,
                        saves.close])  # saves.close waits for the last save; a failure raises CheckpointFailure
        val = reports.val or validate(eval_step, state["params"], val_batches, mesh)  # (a finished run rerun)
        summary = {"step": int(state["step"]), "completed": int(state["step"]) >= t.steps,
                   "final_loss": reports.loss, "skipped_steps": reports.skipped,
                   "loss_spikes": reports.spikes.count, "collapsed_steps": reports.collapsed_steps, **val}
        if hosts.primary():
            (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
    finally:
        stop.restore()
