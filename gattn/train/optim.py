"""AdamW with the paper's schedule: linear warmup to the max LR, cosine decay to a floor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gattn.config import TrainConfig
from gattn.model.layers import ROLES


def schedule(cfg: TrainConfig) -> optax.Schedule:
    """The LR of each update, by optax's count of the updates applied before it: update k = count
    + 1 gets peak * k / warmup during warmup (the first update moves the weights, update `warmup`
    has the peak), then a cosine reaches the floor at update `steps`."""
    peak, floor, warmup = cfg.schedule
    curve = optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=warmup,
                                               decay_steps=cfg.steps, end_value=floor)
    return lambda count: curve(count + 1)


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


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (default betas and epsilon, as the paper keeps them)."""
    adamw = optax.adamw(schedule(cfg), weight_decay=cfg.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else adamw


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
