"""Parameter counts, from the built model (never from a formula): total, and activated per
token for MoE models (the paper's "A" in 15A2B)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from flax import nnx

from gattn.config import ModelConfig


@functools.lru_cache(maxsize=None)
def _count_built(cfg: ModelConfig) -> int:
    from gattn.model.transformer import Transformer  # noqa: PLC0415 (keeps `--help` free of model imports)

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def count_params(cfg: ModelConfig) -> int:
    """Number of parameters of the model `cfg` describes; no weight is allocated. Blocks of one
    kind are identical, so the abstract model is built with one and two layers of each kind only
    (building all of a paper-size model's layers abstractly takes seconds): the embedding and
    head, (one - (two - one)), plus each layer's block, (two - one) of its kind."""
    if cfg.num_layers <= 2 and not cfg.hybrid:
        return _count_built(cfg)
    total, rest = 0, 0
    for kind in sorted({cfg.layer_type(i) for i in range(cfg.num_layers)}):
        def built(n):
            kinds = (kind,) * n if cfg.hybrid else None
            return _count_built(dataclasses.replace(cfg, num_layers=n, layer_types=kinds))
        one, two = built(1), built(2)
        rest = one - (two - one)
        total += (two - one) * sum(cfg.layer_type(i) == kind for i in range(cfg.num_layers))
    return rest + total


def activated_params(cfg: ModelConfig) -> int:
    """Parameters one token uses: all of them but the experts it is not routed to."""
    n = count_params(cfg)
    if cfg.moe is not None:
        total, activated = cfg.moe.num_params(cfg.d_model)
        n -= cfg.num_layers * (total - activated)
    return n
