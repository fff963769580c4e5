"""Continued training from another run (`train.init_from`): the paper's context extension raises
the RoPE base and the sequence length of a trained model and trains on (Sec. 4.4).

A new run starts from the source run's parameters with a fresh optimizer and its own schedule,
reading text with the source's tokenizer (copied to WORKDIR/tokenizer/init_from.model). The
architecture stays: `check` compares the model configs (only `MAY_DIFFER` may change) and every
parameter's name, shape and dtype, before anything is read or written. The sequence length, the
data and the whole train config may change.
"""

from __future__ import annotations

import dataclasses

from etils.epath import Path  # local paths, and gs:// or other remote workdirs
import jax
from flax import nnx

from gattn.config import POSITION_FIELDS, Config, ConfigError
from gattn.train import checkpoint, rundir
from gattn.data.tokenizer import HF_TOKENIZER_DIR, INIT_FROM_TOKENIZER, tokenizer_path
from gattn.model.transformer import Transformer

# Model fields a continued run may change: positions, initialisation, and MoE training policy.
# Everything else (shapes, gates, norms, activations, routing) is the architecture; execution
# settings (exec.*, mesh.*) are never part of it.
MAY_DIFFER = tuple(f"model.{f}" for f in (*POSITION_FIELDS, "init_std", "moe.capacity_factor", "moe.lbl_coef",
                                          "moe.lbl_scope", "moe.micro_batches", "moe.z_loss_coef"))


def source_config(cfg: Config) -> Config:
    """The config of run directory `train.init_from`."""
    try:
        return rundir.read_config(cfg.train.init_from)
    except ConfigError as e:
        raise ConfigError("train.init_from", cfg.train.init_from,
                          f"expected a run directory holding a valid config.json ({e})") from None


def copy_tokenizer(cfg: Config, workdir: Path) -> None:
    """Copies the source run's tokenizer to WORKDIR/tokenizer/init_from.model, which
    `tokenizer_path` then gives for this run (unless the user named one in data.tokenizer). Done
    at the first start only: a resumed run keeps its copy (the source may be gone)."""
    if cfg.data.tokenizer:
        return
    src = tokenizer_path(source_config(cfg), Path(cfg.train.init_from))
    if not src.is_file():
        raise ConfigError("train.init_from", cfg.train.init_from, f"its tokenizer {src} is missing")
    if src.suffix == ".json":  # a Hugging Face tokenizer (a converted model): its folder, as is
        dst = Path(workdir) / "tokenizer" / HF_TOKENIZER_DIR
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.parent.iterdir():
            (dst / f.name).write_bytes(f.read_bytes())
        return
    copy = Path(workdir) / "tokenizer" / INIT_FROM_TOKENIZER
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.with_suffix(".tmp").write_bytes(src.read_bytes())
    copy.with_suffix(".tmp").rename(copy)  # atomic


def check(cfg: Config) -> int:
    """The checkpoint step of run `train.init_from` that this run starts from (`train.init_step`,
    default its latest), after checking that both models have the same architecture: the same
    model config but for `MAY_DIFFER`, and every parameter with the same name, shape and dtype."""
    src_dir, src = cfg.train.init_from, source_config(cfg)
    rundir.check_same(cfg, src, ("model",), may_change=MAY_DIFFER, what=f"the source run {src_dir} has",
                      fix=f"a continued run keeps the architecture (the model may change only "
                          f"{', '.join(m.removeprefix('model.') for m in MAY_DIFFER)})")

    def layout(model_cfg):
        params = nnx.state(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)
        return {jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value"):
                (tuple(v.shape), str(v.dtype)) for p, v in jax.tree_util.tree_leaves_with_path(params)}

    mine, theirs = layout(cfg.model), layout(src.model)
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            raise ConfigError("train.init_from", src_dir,
                              f"its parameter {name} is {theirs.get(name) or 'absent'} but this model's is "
                              f"{mine.get(name) or 'absent'}: a continued run keeps the architecture")
    steps = checkpoint.saved_steps(Path(src_dir))
    step = cfg.train.init_step if cfg.train.init_step is not None else (steps[-1] if steps else None)
    if step not in steps:
        raise ConfigError("train.init_step" if cfg.train.init_step is not None else "train.init_from",
                          step if cfg.train.init_step is not None else src_dir,
                          f"one of the saved steps {steps} of {src_dir}" if steps else "a run with a checkpoint")
    return step


def params(cfg: Config, like, step: int):
    """The parameters of run `train.init_from` at `step` (see `check`), read by the run loader in
    this run's block layout, then placed in the shardings of `like` (this run's parameters).
    Without `train.init_step`, `step` is the source's newest: one that cannot be used (unsealed,
    its seal unfinished because the source was preempted or is still training; damaged) gives
    way to the newest that can, with a one-line warning, as a resume does."""
    src = dataclasses.replace(source_config(cfg), exec=cfg.exec, mesh=cfg.mesh)
    model = rundir.load(cfg.train.init_from, step if cfg.train.init_step is not None else None, cfg=src).model
    return checkpoint.place(nnx.state(model, nnx.Param), checkpoint.abstract(like))
