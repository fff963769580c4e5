"""The device mesh and the one table that maps logical axis names onto it.

Parameters carry logical names only (`gattn.layers.param`); `RULES` says which mesh axis each
name is split over, as MaxText's logical axis rules do:

    batch     -> (data, expert)   tokens: data parallel; the expert axis carries data too
    heads     -> model            query heads (attention, the SDPA gate)
    kv_heads  -> model            key/value heads
    mlp       -> model            FFN width (dense FFN and each expert's width)
    expert    -> expert           MoE experts
    vocab     -> model            embedding rows and LM-head columns
    embed, head_dim, layers -> replicated

A dimension that the mesh axis does not divide stays replicated, so any config runs on any mesh.
Divisibility is checked on the array dimension: a [D, kv_heads * head_dim] projection with 4 kv
heads of 128 on a model axis of 8 is split inside heads (correct, as XLA partitions the math, but
the attention then needs a regrouping; keep the model axis a divisor of kv_heads for speed).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from gattn.config import ConfigError, MeshConfig

AXES = ("data", "expert", "model")
RULES: dict[str, tuple[str, ...] | str | None] = {
    "batch": ("data", "expert"),
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "expert": "expert",
    "vocab": "model",
    "embed": None,
    "head_dim": None,
    "layers": None,
}


def mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int, int]:
    """(data, expert, model) for `n_devices`; data = -1 takes the devices the others leave."""
    data = cfg.data if cfg.data > 0 else n_devices // (cfg.expert * cfg.model)
    if data * cfg.expert * cfg.model != n_devices:
        raise ConfigError("mesh", f"data={cfg.data}, expert={cfg.expert}, model={cfg.model}",
                          f"the axes must multiply to the {n_devices} devices present "
                          "(data=-1 takes what expert x model leaves)")
    return data, cfg.expert, cfg.model


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def spec(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec of an array with these logical axes and shape on `mesh`."""
    out = []
    for name, size in zip(logical, shape):
        axes = RULES.get(name) if name else None
        axes = (axes,) if isinstance(axes, str) else (axes or ())
        axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)
        if axes and size % math.prod(mesh.shape[a] for a in axes):
            axes = ()  # not divisible: replicate this dimension
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*out)


def param_shardings(params: nnx.State, mesh: Mesh):
    """NamedShardings for a state of parameters (arrays or abstract), from their logical axes."""
    logical = nnx.get_partition_spec(params)
    return jax.tree.map(lambda p, s: NamedSharding(mesh, spec(tuple(s), p.shape, mesh)),
                        params, logical)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Tokens [B, S]: rows split over the data and expert axes."""
    return NamedSharding(mesh, spec(("batch", None), (mesh.shape["data"] * mesh.shape["expert"], 1), mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
