"""AdamW with the paper's schedule: linear warmup to the max LR, cosine decay to a floor."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gattn.config import TrainConfig


def schedule(cfg: TrainConfig) -> optax.Schedule:
    peak, floor, warmup = cfg.schedule
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=warmup,
                                              decay_steps=cfg.steps, end_value=floor)


def decay_mask(params: nnx.State) -> nnx.State:
    """Weight decay on weight matrices only: not on norm scales (1-D), biases (1-D) or the
    input-independent gate tensor `theta`, whose decay would pull the gate toward 0.5."""
    def keep(path, x):
        names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
        return x.ndim >= 2 and names[-1] != "theta"
    return jax.tree_util.tree_map_with_path(keep, params)


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (default betas and epsilon, as the paper keeps them)."""
    adamw = optax.adamw(schedule(cfg), weight_decay=cfg.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else adamw


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
