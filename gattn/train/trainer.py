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
import json
import math
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
from gattn.config import Config, ConfigError, from_dict
from gattn.data import record as data_record, synthetic
from gattn.data.tokenizer import load_tokenizer, tokenizer_path
from gattn.model import sharding
from gattn.model.transformer import Transformer, relayout
from gattn.train import checkpoint, hosts, init_from, metrics, optim, rundir
from gattn.train.loss import aux_loss, aux_metrics, lm_loss_and_aux, lm_nll_sum


class TrainingStopped(cli.Failure):
    """Too many consecutive non-finite steps: the run stops, naming the checkpoint kept from before
    the trouble (checkpoint.BeforeTrouble)."""


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
    _, build, shardings = _state_builder(cfg, mesh)
    return checkpoint.abstract(jax.eval_shape(build), shardings)


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
            raise ConfigError("--workdir", str(workdir),
                              f"it holds a model converted from {saved_meta['converted_from']} (parameters "
                              "only): train from it in a new run directory with --init-from")
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


def make_train_step(cfg: Config, graphdef, shardings=None, mesh=None):
    """A jitted step. A non-finite loss or gradient leaves params and optimizer state unchanged
    (the step is skipped and reported), so it never reaches a checkpoint. With `shardings` (of
    the state, see `state_shardings`) and `mesh`, the step is compiled with explicit input and
    output shardings: the state keeps its layout, batches split over data x expert."""
    tx, lr = optim.optimizer(cfg.train), optim.schedule(cfg.train)

    def step(state, batch):
        def loss_fn(params):
            model = nnx.merge(graphdef, params)
            ce, aux = lm_loss_and_aux(model, batch["tokens"], batch["segment_ids"], batch["positions"])
            return ce + aux_loss(cfg.model.moe, aux), (ce, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
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
        return new_state, report

    if shardings is None:
        return jax.jit(step, donate_argnums=0)
    if mesh is None:
        raise ValueError("make_train_step: `shardings` need the `mesh` they were made for")
    batch = sharding.batch_sharding(mesh)
    return jax.jit(step, donate_argnums=0, in_shardings=(shardings, batch),
                   out_shardings=(shardings, sharding.replicated(mesh)))


def make_eval_step(graphdef):
    @jax.jit
    def eval_step(params, batch):
        model = nnx.merge(graphdef, params)
        return lm_nll_sum(model, batch["tokens"], batch["segment_ids"], batch["positions"])
    return eval_step


def validate(eval_step, params, batches: dict[str, list], mesh=None) -> dict[str, float]:
    """Held-out loss and perplexity per domain (under `mesh`, as the train step runs, so the
    Pallas attention and the expert-parallel MoE take the same path). Every process holds all
    the held-out batches; they enter the step replicated."""
    out = {}
    for domain, domain_batches in batches.items():
        total = count = 0.0
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            for b in domain_batches:
                if mesh is not None:
                    b = {k: global_array(v, sharding.replicated(mesh)) for k, v in b.items()}
                s, c = eval_step(params, b)
                total, count = total + float(s), count + float(c)
        out[f"val_loss/{domain}"] = total / count
        out[f"val_ppl/{domain}"] = math.exp(min(total / count, 50.0))
    return out


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
    """Whether to save and stop now: SIGTERM to this process (one process), or to any host, in
    which case every host agrees on the same step (JAX's preemption sync point)."""

    def __init__(self):
        self.signal = None
        self.many = hosts.count() > 1
        if not self.many:
            self.previous = signal.signal(signal.SIGTERM, lambda signum, frame: setattr(self, "signal", signum))

    def __call__(self, step: int) -> bool:
        if self.many:
            from jax.experimental import multihost_utils  # noqa: PLC0415

            return multihost_utils.reached_preemption_sync_point(step)
        return self.signal is not None

    def close(self):
        if not self.many:
            signal.signal(signal.SIGTERM, self.previous)


def data_source(cfg: Config):
    """The batches' module: gattn.data.synthetic for data.source="synthetic" (random tokens for
    timing: no tokenizer, Grain or TFDS), else gattn.data.pipeline, imported only here so that a
    synthetic run needs neither Grain nor TFDS installed."""
    if cfg.data.source == synthetic.SOURCE:
        return synthetic
    from gattn.data import pipeline  # noqa: PLC0415

    return pipeline


def prepare(cfg: Config, workdir: Path, source_step: int | None, allow_corpus_change: bool = False):
    """The one-time preparation of a run (its tokenizer, the TFDS build, a continued run's
    tokenizer copy, WORKDIR/data.json), done by process 0 while the others wait; then every host
    has its copy, whether the workdir is a shared filesystem or each host's own disk. A resume
    keeps the run's recorded tokenizer and refuses changed data unless `allow_corpus_change`
    (gattn/data/record.py). Returns (the tokenizer, its file, the earlier fingerprints): what
    `data_record.write` keeps once the resume is accepted."""
    tokenizer, pipeline = None, data_source(cfg)
    if pipeline is synthetic:
        workdir.mkdir(parents=True, exist_ok=True)
        return None, None, []
    fresh, earlier, path = not checkpoint.saved_steps(workdir), [], None  # a fresh run chooses its tokenizer
    if hosts.primary():
        workdir.mkdir(parents=True, exist_ok=True)
        if not fresh and _same_data_config(cfg, workdir):  # (else `resume` names the changed data.* field)
            earlier = data_record.check_resume(cfg, workdir, tokenizer_path(cfg, workdir), allow_corpus_change)
        if source_step is not None:
            init_from.copy_tokenizer(cfg, workdir)
        tokenizer = load_tokenizer(cfg, workdir, fresh=fresh)  # (trained here on first use)
        path = tokenizer_path(cfg, workdir, fresh=fresh)
        pipeline.prepare(cfg, workdir)
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


def _same_data_config(cfg: Config, workdir: Path) -> bool:
    try:
        return rundir.read_config(workdir).data == cfg.data
    except ConfigError:  # no readable config.json: the fingerprint decides
        return True


def train(cfg: Config, workdir: str | Path, *, progress: bool = True, resume_step: int | None = None,
          allow_corpus_change: bool = False) -> dict:
    """Trains `cfg` in `workdir` (resuming if it holds a checkpoint; else starting from the
    parameters of `train.init_from` when set); returns the summary. With several processes (a pod
    slice), each reads its own rows of every batch and process 0 alone writes metrics and files.
    `resume_step`: resume from that saved step instead of the latest (later ones are set aside).
    `allow_corpus_change`: resume even if the data changed since the run was trained."""
    rundir.check_workdir(workdir)
    workdir = Path(workdir)
    # A continued run's source is checked before anything is written (and only until it has a
    # checkpoint of its own: resuming never reads the source again).
    source_step = init_from.check(cfg) if cfg.train.init_from and not checkpoint.saved_steps(workdir) else None
    t = cfg.train
    mesh = sharding.make_mesh(cfg.mesh)
    shards = mesh.shape["data"] * mesh.shape["expert"]
    if t.batch_size % shards:
        raise ConfigError("train.batch_size", t.batch_size,
                          f"a multiple of the {shards} data x expert shards of the mesh {dict(mesh.shape)}")
    tokenizer, tokenizer_file, earlier = prepare(cfg, workdir, source_step, allow_corpus_change)
    pipeline = data_source(cfg)
    batch_sharding = sharding.batch_sharding(mesh)
    data = pipeline.train_iterator(cfg, tokenizer, workdir, local_rows(batch_sharding, t.batch_size))
    val_batches = pipeline.validation_batches(cfg, tokenizer, workdir)

    def feed(batch: dict) -> dict:  # this process's rows -> the global batch
        return {k: jax.make_array_from_process_local_data(batch_sharding, v, (t.batch_size, v.shape[1]))
                for k, v in batch.items()}

    graphdef, state = init_state(cfg, mesh)
    keep_also = set()  # the checkpoint kept before trouble (checkpoint.BeforeTrouble)
    mngr = checkpoint.manager(workdir, t.keep_checkpoints, t.checkpoint_every, keep_also)
    restored = resume(cfg, workdir, mngr, state, mesh, resume_step)
    meta = rundir.meta(cfg)
    if restored is not None:
        state, data_state, meta = restored
        pipeline.set_state(data, data_state)
    elif source_step is not None:
        state = {**state, "params": init_from.params(cfg, state["params"], source_step)}
    start = int(state["step"])
    if hosts.primary() and tokenizer_file is not None:  # the resume is accepted: what it trains on
        data_record.write(cfg, workdir, tokenizer_file, earlier)
    if hosts.primary():  # (an earlier, different config.json goes to config_history.jsonl)
        rundir.record_config(workdir, cfg, start)
    log = metrics.MetricsLog(workdir, start)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    train_step, eval_step = make_train_step(cfg, graphdef, shardings, mesh), make_eval_step(graphdef)
    spikes = metrics.SpikeCounter(t.spike_window, t.spike_margin)
    spikes.count = meta["loss_spikes"]
    spikes.recent.extend(meta["recent_losses"])  # the spike window continues across a resume

    before_trouble = checkpoint.BeforeTrouble(keep_also, meta, clean=t.spike_window)
    saves = checkpoint.Saves(mngr, start if restored is not None else None)
    stop = Stopper()
    bar = metrics.Progress(progress and hosts.primary(), start, t.steps)
    bad_in_a_row, skipped, val, loss = 0, meta["skipped_steps"], {}, meta["final_loss"]
    tokens_per_step, clock, timed_steps, eval_seconds = t.batch_size * t.seq_len, time.perf_counter(), 0, 0.0

    def tokens_per_sec():  # training throughput: compilation and validation time left out
        return tokens_per_step * timed_steps / max(time.perf_counter() - clock - eval_seconds, 1e-9)

    try:
        for step in range(start + 1, t.steps + 1):
            with jax.set_mesh(mesh):
                state, m = train_step(state, feed(next(data)))
            loss, finite = float(m["loss"]), bool(m["finite"])
            bad_in_a_row = 0 if finite else bad_in_a_row + 1
            skipped += not finite
            if not finite or spikes(loss):  # trouble: keep the last checkpoint from before it
                before_trouble(step, mngr.latest_step())
            if bad_in_a_row >= t.max_bad_steps:
                kept = before_trouble.step
                raise TrainingStopped(
                    f"{bad_in_a_row} consecutive steps had a non-finite loss or gradient (last: step "
                    f"{step}, loss {loss}); stopping. " + (
                        f"The last checkpoint saved before the trouble began, step {kept}, is kept: lower "
                        f"train.learning_rate or check the data, then rerun with --resume-step {kept}."
                        if kept is not None else "No checkpoint was saved before the trouble began: lower "
                        "train.learning_rate or check the data, then start again in a new --workdir."))
            saves.check()  # a failed asynchronous save stops the run here
            timed_steps += step > start + 1  # the first step includes compilation
            if step == start + 1:
                clock = time.perf_counter()
            if step % t.eval_every == 0 or step == t.steps:
                t0 = time.perf_counter()
                val = validate(eval_step, state["params"], val_batches, mesh)
                eval_seconds += time.perf_counter() - t0
            if step % t.log_every == 0 or step % t.eval_every == 0 or step == t.steps:
                record = {"loss": loss, "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]),
                          "tokens_per_sec": tokens_per_sec() if timed_steps else 0.0,
                          "skipped_steps": skipped, "loss_spikes": spikes.count,
                          **{k: float(v) for k, v in m.items() if k.startswith("moe/")}}
                if step % t.eval_every == 0 or step == t.steps:
                    record.update(val)
                log.write(step, record)
            bar.update(step, loss, tokens_per_sec())
            stopping = stop(step)
            if step == t.steps or stopping or mngr.should_save(step):  # build the args only then
                meta = rundir.meta(cfg, skipped_steps=skipped, loss_spikes=spikes.count,
                                   recent_losses=list(spikes.recent), final_loss=loss if finite else None,
                                   **before_trouble.meta())
                data_state = {k: v for part in hosts.gather_json(data.get_state()) for k, v in part.items()}
                saves.save(step, state, data_state, meta)
            if stopping:
                saves.check(wait=True)
                if hosts.primary():
                    print(f"\nSIGTERM: saved step {step} in {workdir}/checkpoints; rerun to resume.", flush=True)
                break
    finally:
        log.close()
        bar.close()
        stop.close()
        saves.close()  # waits for the last save; a failure raises CheckpointFailure
    if not val:  # nothing left to train (a finished run rerun): validate what is there
        val = validate(eval_step, state["params"], val_batches, mesh)
    summary = {"step": int(state["step"]), "completed": int(state["step"]) >= t.steps,
               "final_loss": loss, "skipped_steps": skipped, "loss_spikes": spikes.count, **val}
    if hosts.primary():
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
