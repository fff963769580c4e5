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


# Parameters left out of weight decay, by name: norm scales (also when stacked by scan_layers or
# per head), biases, and the input-independent gate tensor, whose decay would pull the gate to 0.5.
NO_DECAY = ("scale", "q_norm", "k_norm", "sdpa_norm", "theta", "bias")


def decay_mask(params: nnx.State) -> nnx.State:
    """True for the weight matrices that AdamW decays, False for the parameters in NO_DECAY."""
    def keep(path, x):
        names = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
        return names[-1] not in NO_DECAY
    return jax.tree_util.tree_map_with_path(keep, params)


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (default betas and epsilon, as the paper keeps them)."""
    adamw = optax.adamw(schedule(cfg), weight_decay=cfg.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else adamw


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
