"""AdamW with the paper's schedule: linear warmup to the max LR, cosine decay to a floor; and
what a resume that changes the number of steps does to it (`continued`)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gattn.config import TrainConfig
from gattn.model.layers import ROLES


NO_CONTINUATION = 2**31 - 1  # continue_step of a schedule without a continuation (no update reaches it)


def schedule_values(cfg: TrainConfig) -> dict[str, np.float32]:
    """The numbers that define the LR schedule of `cfg` (`lr_at`). The train step takes them as
    arguments, not constants, so a run with other steps or another LR compiles the same program
    and a resume with more steps loads it from the compilation cache."""
    peak, floor, warmup = cfg.schedule
    tail_floor = cfg.continue_lr if cfg.extend == "constant" else floor
    values = {"peak": peak, "floor": floor, "warmup": warmup, "steps": cfg.steps,
              "continue_step": cfg.continue_step or NO_CONTINUATION, "continue_lr": cfg.continue_lr,
              "tail_floor": tail_floor}
    return {k: np.float32(v) for k, v in values.items()}


def lr_at(count, v: dict) -> jax.Array:
    """The LR of update count + 1 under schedule values `v`: peak * k / warmup during warmup (the
    first update moves the weights, update `warmup` has the peak), then a cosine that reaches the
    floor at update `steps` (optax's warmup_cosine_decay_schedule). From update count
    `continue_step` on (a continuation, `continued`), `continue_lr` taken by a cosine to
    `tail_floor` at the last update (held when tail_floor == continue_lr)."""
    k = jnp.asarray(count, jnp.float32) + 1
    warm = v["peak"] * k / jnp.maximum(v["warmup"], 1)
    t = jnp.clip((k - v["warmup"]) / (v["steps"] - v["warmup"]), 0.0, 1.0)
    base = jnp.where(k < v["warmup"], warm, v["floor"] + (v["peak"] - v["floor"]) * 0.5 * (1 + jnp.cos(math.pi * t)))
    c = jnp.asarray(count, jnp.float32) - v["continue_step"]
    t = jnp.clip(c / jnp.maximum(v["steps"] - 1 - v["continue_step"], 1), 0.0, 1.0)
    tail = v["tail_floor"] + (v["continue_lr"] - v["tail_floor"]) * 0.5 * (1 + jnp.cos(math.pi * t))
    return jnp.where(c < 0, base, tail)


def schedule(cfg: TrainConfig, values: dict | None = None) -> optax.Schedule:
    """The LR of each update, by optax's count of the updates applied before it (`lr_at`);
    `values`: the schedule's numbers as traced arguments (the train step's)."""
    values = schedule_values(cfg) if values is None else values
    return lambda count: lr_at(count, values)


def continued(cfg: TrainConfig, saved: TrainConfig | None, count: int) -> tuple[TrainConfig, str]:
    """The schedule a run resumed at optimizer update count `count` trains with, and a note for
    the user ('' when there is nothing to say). `saved`: the train config of the checkpoint.

    Same `steps` as the checkpoint: its continuation (if any) goes on. Other `steps`: with
    extend="recompute" the cosine is refitted to the new total and the note gives the LR of the
    next update before and after; with "constant" or "decay" the LR the checkpoint's schedule had
    reached is kept or decayed from (continue_step / continue_lr record where, in config.json).
    A continuation set by hand (continue_step > 0) is taken as given."""
    if saved is None or cfg.continue_step:
        return cfg, ""
    if saved.steps == cfg.steps:
        if saved.continue_step and saved.continue_step <= count:
            return dataclasses.replace(cfg, extend=saved.extend, continue_step=saved.continue_step,
                                       continue_lr=saved.continue_lr), ""
        return cfg, ""
    before = float(schedule(saved)(count))
    change = f"train.steps {saved.steps} -> {cfg.steps} at update {count + 1}"
    if cfg.extend == "recompute":
        after = float(schedule(cfg)(count))
        return cfg, (f"note: {change}: the warmup + cosine is recomputed for {cfg.steps} steps, so the LR goes "
                     f"from {before:.3g} (the checkpoint's schedule) to {after:.3g}; --config.train.extend=constant "
                     f"keeps {before:.3g}, --config.train.extend=decay decays it to {cfg.schedule[1]:.3g} by step "
                     f"{cfg.steps}")
    new = dataclasses.replace(cfg, continue_step=count, continue_lr=before)
    how = "held" if cfg.extend == "constant" else f"then decays by a cosine to {cfg.schedule[1]:.3g} at step {cfg.steps}"
    return new, f"note: {change}: the LR continues from {before:.3g} (extend={cfg.extend!r}: {how})"


def schedule_count(opt_state) -> jax.Array:
    """The LR schedule's own step count in `opt_state`: the updates applied so far. A skipped step
    (non-finite) keeps the optimizer state, so this lags the trainer's step after one, and the
    schedule resumes where it paused: log `schedule(cfg)(schedule_count(...))`, the LR applied."""
    is_count = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    return next(s.count for s in jax.tree.leaves(opt_state, is_leaf=is_count) if is_count(s))


def decay_mask(params: nnx.State) -> nnx.State:
    """True for the parameters AdamW decays: those whose role (gattn.model.layers.ROLES, set
    where each parameter is created) is decayed; norm scales, biases and the input-independent
    gate tensor are not."""
    return jax.tree.map(lambda v: v.replace(ROLES[v.get_metadata()["role"]]), params,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def optimizer(cfg: TrainConfig, values: dict | None = None) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (default betas and epsilon, as the paper keeps them);
    `values`: the schedule's numbers, when the step takes them as arguments."""
    adamw = optax.adamw(schedule(cfg, values), weight_decay=cfg.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else adamw


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
