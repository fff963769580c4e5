"""A run directory: what is written into it, and the one loader every reader of a run uses.

    WORKDIR/config.json      the run's Config (gattn.config.to_dict), written atomically
    WORKDIR/config_history.jsonl   each earlier config.json a resumed run replaced (`record_config`)
    WORKDIR/checkpoints/     Orbax: {step, params, opt_state}, the data iterator, `meta`
                             (counters, and the config the checkpoint was trained with)
    WORKDIR/metrics.jsonl    one row per logged step; rows past a resumed step are moved to
                             metrics.set_aside.jsonl (gattn.train.metrics.MetricsLog)
    WORKDIR/lock.json        held while train.py runs: one writer per run (gattn.train.lease)
    WORKDIR/logs/            each process's native log in a run of several (gattn.cluster)
    WORKDIR/tokenizer/, tfds/, tensorboard/, summary.json, eval/

Readers (eval.py, the main job, studies, `--init-from`, the converter, notebooks) call `load`:
the run's config plus the caller's overrides, on the devices present now, with execution
settings free to change and the architecture fixed:

    load_config(workdir, overrides)      the run's Config; an architecture change is refused
    load(workdir, step, overrides)       (cfg, model, step)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import NamedTuple

from etils.epath import Path  # local paths, and gs:// or other remote workdirs

from gattn import cli
from gattn.config import POSITION_FIELDS, Config, ConfigError, differences, from_dict, to_dict

CONFIG = "config.json"
HISTORY = "config_history.jsonl"
# What a resumed run shares with its checkpoint: the architecture, data and batch layout.
# Everything else (more steps, a new LR, another kernel, remat, scan or mesh) may change.
RESUME_FIXED = ("model", "data", "train.seed", "train.batch_size", "train.seq_len")
# What an evaluation may change in the model: how positions are encoded (YaRN on a checkpoint).
EVAL_MAY_CHANGE = tuple(f"model.{f}" for f in POSITION_FIELDS)


def write_config(workdir: str | Path, cfg: Config) -> None:
    """WORKDIR/config.json, replaced atomically (a reader never sees half a file)."""
    path = Path(workdir) / CONFIG
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(to_dict(cfg), indent=2))
    tmp.replace(path)


def record_config(workdir: str | Path, cfg: Config, step: int) -> None:
    """Writes WORKDIR/config.json for a run that starts (or resumes) at `step`, keeping history: an
    existing config.json that differs (a resumed run with more steps, a new LR, another kernel) is
    appended to WORKDIR/config_history.jsonl first, as {"replaced_at_step", "changed": {field:
    {"was", "now"}}, "config": the old one}, and one line names the changed fields. An unchanged
    config writes nothing."""
    workdir = Path(workdir)
    path = workdir / CONFIG
    if path.is_file():
        text = path.read_text()
        try:
            then = json.loads(text)
            changed = {name: {"was": was, "now": now} for name, now, was in differences(cfg, then, ("",))}
        except (ValueError, TypeError, AttributeError):  # not JSON, or not a config we can read now:
            then, changed = text, None                    # kept as it is, all of it "changed"
        if changed == {}:
            return
        with (workdir / HISTORY).open("a") as f:
            f.write(json.dumps({"replaced_at_step": step, "changed": changed, "config": then}) + "\n")
        print(f"note: {CONFIG} changed at step {step} ({_listed(changed)}); the earlier one is kept in "
              f"{workdir / HISTORY}", file=sys.stderr, flush=True)
    write_config(workdir, cfg)


def _listed(changed: dict | None, most: int = 6) -> str:
    """'train.steps 6 -> 8, ...' for the first `most` fields (one line however many changed)."""
    if changed is None:
        return "the earlier one could not be read as a config"

    def short(value):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."

    parts = [f"{name} {short(v['was'])} -> {short(v['now'])}" for name, v in list(changed.items())[:most]]
    return ", ".join(parts) + (f" and {len(changed) - most} more" if len(changed) > most else "")


def meta(cfg: Config, **extra) -> dict:
    """The JSON saved with every checkpoint: training counters and the config it was trained
    with (what `check_same` compares a resumed or continued run against)."""
    return {"skipped_steps": 0, "loss_spikes": 0, "recent_losses": [], "final_loss": None,
            **extra, "config": to_dict(cfg)}


def check_workdir(workdir: str | Path) -> None:
    """A run directory is a folder (created if absent), never a regular file, nor a Hugging Face
    model folder (whose config.json a run would otherwise overwrite or fail to read)."""
    if Path(workdir).exists() and not Path(workdir).is_dir():
        raise ConfigError("--workdir", str(workdir), "a run directory (a folder, created if absent); "
                          "this is a file")
    path = Path(workdir) / CONFIG
    if not path.is_file():
        return
    try:
        found = json.loads(path.read_text())
    except ValueError:  # not JSON: read_config says so
        return
    if isinstance(found, dict) and "model" not in found and ("architectures" in found or "model_type" in found):
        raise ConfigError("--workdir", str(workdir), f"{workdir} is a Hugging Face model folder, not a gattn "
                          "run: convert it first with "
                          f"`python -m gattn.convert from-hf {workdir} --workdir OUT`")


def check_writable(workdir: str | Path) -> None:
    """A run directory to train in must take files: a read-only one (a read-only mount, a folder
    of another user) is a ConfigError naming --workdir before any work, not an OSError mid-start."""
    if "://" in str(workdir):  # a bucket answers for itself on the first write
        return
    probe = Path(workdir) / f".gattn-write-check-{os.getpid()}"
    try:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError("--workdir", str(workdir), f"a folder this process can write ({e.strerror}: "
                          f"{e.filename or workdir}); evaluate a run there with eval.py, or train in another "
                          "--workdir") from None


def read_config(workdir: str | Path) -> Config:
    """The Config of run `workdir` as it was written (no overrides)."""
    path = Path(workdir) / CONFIG
    check_workdir(workdir)
    if not path.is_file():
        raise ConfigError("--workdir", str(workdir), f"expected a run directory holding {CONFIG} "
                          "(written by train.py or python -m gattn.convert)")
    try:
        return from_dict(Config, json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ConfigError("--workdir", str(workdir), f"its {CONFIG} is not valid JSON ({e})") from None


def check_same(now: Config, then: Config | dict, fixed: tuple[str, ...], *, may_change: tuple[str, ...] = (),
               what: str = "the checkpoint in this workdir was trained with", fix: str = "") -> None:
    """Refuses `now` if a field under `fixed` (but not under `may_change`) differs from `then`,
    naming the field and both values."""
    for name, mine, theirs in differences(now, then, fixed, may_differ=may_change):
        raise ConfigError(name, mine, f"{what} {theirs!r}" + (f"; {fix}" if fix else ""))


def load_config(workdir: str | Path, overrides: list[str] = ()) -> Config:
    """The run's config with `overrides` applied. Execution settings (exec.*, mesh.*), data and
    training fields may change; the architecture may not, except how positions are encoded
    (model.rope_base, model.yarn: YaRN on a trained checkpoint, whose original length defaults to
    the run's train.seq_len)."""
    run = read_config(workdir)
    overrides = list(overrides)
    names = [cli.override_path(o) for o in overrides]
    if (any(n.startswith("model.yarn.") for n in names) and "model.yarn.original_len" not in names
            and run.model.yarn is None):
        overrides.append(f"model.yarn.original_len={run.train.seq_len}")
    cfg = cli.apply_overrides(run, overrides)
    check_same(cfg, run, ("model",), may_change=EVAL_MAY_CHANGE,
               what=f"the run {workdir} is a model with",
               fix="a checkpoint is read with its own architecture (only exec.*, mesh.*, data.*, "
                   "model.rope_base and model.yarn.* may change)")
    return cfg


class Loaded(NamedTuple):
    cfg: Config
    model: object  # gattn.model.transformer.Transformer
    step: int


def portable(cfg: Config) -> Config:
    """`cfg` runnable on the devices present: the run's mesh if they can hold it (else every
    device on the data axis), and the pallas kernel only on TPU, pallas_gpu and cudnn only on a
    GPU (elsewhere they run in interpret mode, ~100x slower, or not at all, and the xla attention
    computes the same). Without the run's expert axis, an expert-parallel MoE (exec.moe_impl
    ragged or all_to_all) runs as the partitioned one (`transformer.off_mesh`), and the note says
    what that changes."""
    import jax  # noqa: PLC0415

    from gattn.config import MeshConfig  # noqa: PLC0415
    from gattn.model import sharding  # noqa: PLC0415
    from gattn.model.transformer import off_mesh  # noqa: PLC0415

    try:
        sharding.make_mesh(cfg.mesh)
    except ConfigError as e:
        ex = off_mesh(cfg.exec)
        moe = {"ragged": "; exec.moe_impl 'ragged' -> 'partitioned' (the same dropless MoE on one program)",
               "all_to_all": "; exec.moe_impl 'all_to_all' -> 'partitioned' (capacity then counted over each "
                             "forward pass's tokens, not per data x expert shard: where tokens are dropped, "
                             "outputs differ from the run's)"}.get(cfg.exec.moe_impl, "")
        print(f"note: {e}; using all {jax.device_count()} device(s) on the data axis instead{moe} "
              "(set --config.mesh.* to choose)", file=sys.stderr)
        cfg = dataclasses.replace(cfg, mesh=MeshConfig(), exec=ex)
    home = {"pallas": ("tpu",), "pallas_gpu": ("gpu", "cuda", "rocm"), "cudnn": ("gpu", "cuda")}
    if cfg.exec.attention_impl in home and jax.default_backend() not in home[cfg.exec.attention_impl]:
        cfg = dataclasses.replace(cfg, exec=dataclasses.replace(cfg.exec, attention_impl="xla"))
    return cfg


def load(workdir: str | Path, step: int | None = None, overrides: list[str] = (), *,
         cfg: Config | None = None, params=None) -> Loaded:
    """(cfg, model, step): the parameters of `workdir`'s checkpoint `step` (default: the latest),
    built with the run's config plus `overrides` (or `cfg`, from `load_config`), sharded over the
    devices present now (see `portable`; an explicit `exec.attention_impl` override is kept).
    Only parameters are read, so any optimizer and any execution settings will do: a checkpoint
    saved with scanned layers loads unscanned, and the reverse. An unreadable latest checkpoint
    gives way to the previous one with a one-line warning; if none can be read (or the chosen
    `step` cannot), checkpoint.CheckpointFailure.

    `params`: the parameters in memory instead (laid out as Transformer(cfg.model) builds them;
    step 0), for a folder converted on load (gattn.interop.runs)."""
    from flax import nnx  # noqa: PLC0415

    from gattn.model import sharding  # noqa: PLC0415
    from gattn.model.transformer import Transformer, relayout  # noqa: PLC0415
    from gattn.train import checkpoint  # noqa: PLC0415

    workdir = Path(workdir)
    cfg = cfg if cfg is not None else load_config(workdir, overrides)
    if not any("attention_impl" in o for o in overrides):
        cfg = portable(cfg)
    if params is None and not checkpoint.saved_steps(workdir):
        raise ConfigError("--workdir", str(workdir), "a run with a checkpoint; this one has none yet "
                          f"({workdir / 'checkpoints'} is empty: train it, or wait for its first save)")
    mesh = sharding.make_mesh(cfg.mesh)

    def abstract(ex):
        graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, ex, rngs=nnx.Rngs(0))), nnx.Param)
        return graphdef, checkpoint.abstract(params, sharding.param_shardings(params, mesh))

    graphdef, target = abstract(cfg.exec)
    def read(s):  # the checkpoint's block layout is the one it was trained with (older ones: config.json's)
        saved = (checkpoint.restore_meta(mngr, s) or {}).get("config")
        saved = from_dict(Config, saved) if saved else read_config(workdir)
        stored = target if saved.exec.scan_layers == cfg.exec.scan_layers else abstract(saved.exec)[1]
        return stored, checkpoint.restore_params(mngr, stored, s)

    if params is not None:
        step, stored = 0, None
    else:
        mngr = checkpoint.manager(workdir, 1, 1)
        try:  # an unreadable latest checkpoint: the previous one, with a warning (nothing is moved)
            step, (stored, params) = checkpoint.first_readable(mngr, read, step)
        finally:
            mngr.close()
    if stored is not target:
        params = checkpoint.place(relayout(params, target), target)
    return Loaded(cfg, nnx.merge(graphdef, params), step)
