"""Continued training from another run (`train.init_from`): the paper's context extension raises
the RoPE base and the sequence length of a trained model and trains on (Sec. 4.4).

A new run starts from the source run's parameters with a fresh optimizer and its own schedule,
reading text with the source's tokenizer. Only what no parameter depends on may differ (rope_base,
yarn, seq_len, data, schedule): `check` compares every parameter's name, shape and dtype before
anything is read or written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from flax import nnx

from gattn import checkpoint
from gattn import config as config_lib
from gattn.config import Config, ConfigError
from gattn.data.tokenizer import tokenizer_path
from gattn.model import Transformer


def source_config(cfg: Config) -> Config:
    """The config of run directory `train.init_from` (a clear error if it is not a run)."""
    try:
        return config_lib.load_run(cfg.train.init_from)
    except ConfigError:
        raise ConfigError("train.init_from", cfg.train.init_from,
                          "expected a run directory holding config.json and checkpoints/") from None


def with_source_tokenizer(cfg: Config, workdir: Path) -> Config:
    """A continued run (train.init_from) reads text with its source run's tokenizer: the file is
    copied into WORKDIR/tokenizer and named by data.tokenizer (unless the user set one)."""
    if not cfg.train.init_from or cfg.data.tokenizer:
        return cfg
    copy = next(iter(sorted((workdir / "tokenizer").glob("init-from-*.model"))), None)
    if copy is None:  # the first start (a resumed run uses its copy: the source may be gone)
        path = tokenizer_path(source_config(cfg), Path(cfg.train.init_from))
        if not path.is_file():
            raise ConfigError("train.init_from", cfg.train.init_from, f"its tokenizer {path} is missing")
        copy = workdir / "tokenizer" / f"init-from-{path.name}"
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.with_suffix(".tmp").write_bytes(path.read_bytes())
        copy.with_suffix(".tmp").rename(copy)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(copy.absolute())))


def check(cfg: Config) -> int:
    """The checkpoint step of run `train.init_from` that this run starts from (`train.init_step`,
    default its latest), after checking, before any array is read, that every parameter has the
    same name, shape and dtype in both models: continued training may change what no parameter
    depends on (rope_base, yarn, seq_len, the data, the schedule), not the architecture."""
    src_dir, src = cfg.train.init_from, source_config(cfg)

    def layout(model_cfg):
        params = nnx.state(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))), nnx.Param)
        return {jax.tree_util.keystr(p, simple=True, separator=".").removesuffix(".value"):
                (tuple(v.shape), str(v.dtype)) for p, v in jax.tree_util.tree_leaves_with_path(params)}

    mine, theirs = layout(cfg.model), layout(src.model)
    for name in sorted(set(mine) | set(theirs)):
        if mine.get(name) != theirs.get(name):
            raise ConfigError("train.init_from", src_dir,
                              f"its parameter {name} is {theirs.get(name) or 'absent'} but this model's is "
                              f"{mine.get(name) or 'absent'}: a continued run keeps the architecture "
                              "(rope_base, yarn, seq_len, data and schedule may change)")
    steps = checkpoint.saved_steps(Path(src_dir))
    step = cfg.train.init_step if cfg.train.init_step is not None else (steps[-1] if steps else None)
    if step not in steps:
        raise ConfigError("train.init_step" if cfg.train.init_step is not None else "train.init_from",
                          step if cfg.train.init_step is not None else src_dir,
                          f"one of the saved steps {steps} of {src_dir}" if steps else "a run with a checkpoint")
    return step


def params(cfg: Config, like, step: int):
    """The parameters of run `train.init_from` at `step` (see `check`), restored into the
    layout and shardings of `like` (this run's parameters)."""
    mngr = checkpoint.manager(Path(cfg.train.init_from), 1, 1)
    try:
        return checkpoint.restore_params(mngr, checkpoint.abstract(like), step)
    finally:
        mngr.close()
