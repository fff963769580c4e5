"""The device mesh and the one table that maps logical axis names onto it.

Parameters carry logical names only (`gattn.layers.param`); `RULES` says which mesh axis each
name is split over, as MaxText's logical axis rules do:

    batch     -> (data, fsdp, expert)  tokens: data parallel; fsdp and expert carry data too
    embed     -> (fsdp, context)       FSDP: every weight's model dimension, so parameters, their
                                       gradients and the AdamW moments are split over fsdp (and
                                       over context, whose devices hold pieces of the same rows)
    heads     -> model                 query heads (attention, the SDPA gate)
    kv_heads  -> model                 key/value heads
    mlp       -> model                 FFN width (dense FFN and each expert's width)
    expert    -> expert                MoE experts
    vocab     -> model                 embedding rows and LM-head columns
    head_dim, layers -> replicated

With fsdp > 1 XLA's partitioner gathers each weight where a layer uses it (inside the layer scan:
one layer's weights at a time) and reduce-scatters its gradient, from these annotations alone, as
in MaxText; nothing in the model gathers by hand. A dimension that its mesh axes do not divide
stays replicated, so any config runs on any mesh, and a mesh axis splits at most one dimension of
an array. Divisibility is checked on the array dimension: a [D, kv_heads * head_dim] projection
with 4 kv heads of 128 on a model axis of 8 is split inside heads (correct, as XLA partitions the
math, but the attention then needs a regrouping; keep the model axis a divisor of kv_heads for
speed).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from gattn.config import BATCH_AXES, MESH_AXES, ConfigError, MeshConfig

AXES = MESH_AXES  # ("data", "fsdp", "context", "expert", "model")
RULES: dict[str, tuple[str, ...] | str | None] = {
    "batch": BATCH_AXES,
    "embed": ("fsdp", "context"),
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "expert": "expert",
    "vocab": "model",
    "head_dim": None,
    "layers": None,
}


def mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, ...]:
    """The axis sizes in AXES order, (data, fsdp, context, expert, model), for `n_devices`; data
    or fsdp = -1 takes the devices the others leave."""
    sizes = {"data": cfg.data, "fsdp": cfg.fsdp, "context": cfg.context, "expert": cfg.expert, "model": cfg.model}
    rest = [a for a, n in sizes.items() if n == -1]
    fixed = math.prod(n for n in sizes.values() if n != -1)
    if rest:
        sizes[rest[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise ConfigError("mesh", f"data={cfg.data}, fsdp={cfg.fsdp}, context={cfg.context}, expert={cfg.expert}, "
                          f"model={cfg.model}",
                          f"the axes must multiply to the {n_devices} devices present "
                          "(data=-1 or fsdp=-1 takes what the others leave)")
    return tuple(sizes[a] for a in AXES)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """The mesh of `cfg` over `devices` (default: every device). On several TPU slices the data
    axis spans them: its collectives (the gradient reduction once per step) cross the data-center
    network (DCN), every other axis stays inside a slice, on its ICI (jax's hybrid device mesh)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices == 1:
        grid = np.asarray(devices).reshape(shape)
    else:
        if shape[0] % slices:
            raise ConfigError("mesh.data", shape[0], f"a multiple of the {slices} slices (the data axis spans "
                              "them): set mesh.data to the slice count and fsdp to -1, say")
        from jax.experimental import mesh_utils  # noqa: PLC0415

        dcn = (slices,) + (1,) * (len(shape) - 1)
        grid = mesh_utils.create_hybrid_device_mesh((shape[0] // slices, *shape[1:]), dcn, devices=devices)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def batch_shards(mesh) -> int:
    """How many parts a batch's rows are split into on `mesh` (data x fsdp x expert)."""
    return math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)


def spec(logical: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec of an array with these logical axes and shape on `mesh`."""
    out, used = [], set()
    for name, size in zip(logical, shape):
        axes = RULES.get(name) if name else None
        axes = (axes,) if isinstance(axes, str) else (axes or ())
        axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
        while axes and size % math.prod(mesh.shape[a] for a in axes):
            axes = axes[:-1]  # not divisible: the longest leading run of the axes that divides (or none)
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*out)


def gathered(x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
    """`x` (a weight with these logical axes) laid out as a layer computes with it on the context
    mesh (`jax.set_mesh`): split as the rules say but not over fsdp (or context). For a weight used in every
    step of a loop (the LM head in the chunked loss): gathered once before it, not per step. No
    mesh, or no fsdp axis: `x` as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("fsdp", 1) * mesh.shape.get("context", 1) == 1:
        return x
    axes = [tuple(a for a in ((p,) if isinstance(p, str) else (p or ())) if a not in ("fsdp", "context")) or None
            for p in spec(logical, x.shape, mesh)]
    return jax.lax.with_sharding_constraint(x, P(*(a[0] if a and len(a) == 1 else a for a in axes)))


def token_axes(mesh) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that split the residual stream's tokens [N, D] (`rows`): the
    batch axes, then context. The expert-parallel MoE splits its tokens over the same axes, so
    each device routes and exchanges its own tokens only (without context there, every context
    device would gather its batch shard's tokens and repeat their whole MoE)."""
    return tuple(a for a in BATCH_AXES + ("context",) if mesh.shape.get(a, 1) > 1)


def rows(x: jax.Array) -> jax.Array:
    """`x` (activations whose leading axis is the batch's rows, or tokens flattened row by row)
    split over the batch axes on the context mesh (`jax.set_mesh`), the rest of it whole: the
    residual stream's layout, pinned at the embedding and after every block as MaxText pins its
    activations. Left to propagation alone, XLA may lay the stream out as the embedding table is
    split (d_model over fsdp) and then all-reduce every layer's full-batch activations: the
    hybrid qwen3_5_2b on v5p-32 sent 9,018 GiB per chip per step that way. With a context axis
    the tokens of each row are split over it too (tokens in `stream` order: the batch axes split
    the rows, context each row's sequence). No mesh, or inside a shard_map over every batch axis:
    `x` as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    manual = set(mesh.manual_axes)
    axes = tuple(a for a in token_axes(mesh) if a not in manual)
    if not axes or x.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return x
    return jax.lax.with_sharding_constraint(x, P(axes[0] if len(axes) == 1 else axes, *([None] * (x.ndim - 1))))


def _stream_split(b: int, s: int) -> tuple[int, int] | None:
    """(batch shards, context devices) when the residual stream's token order differs from
    row-major for [B, S] = [b, s] tokens on the context mesh: a context axis and more than one row
    per batch shard. None otherwise (and with no mesh, inside a shard_map over the axes, or when
    they do not divide the rows and the sequence)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    manual = set(mesh.manual_axes)
    ctx = 1 if "context" in manual else mesh.shape.get("context", 1)
    shards = math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES if a not in manual)
    if ctx == 1 or b % shards or s % ctx or b // shards == 1:
        return None
    return shards, ctx


def stream(x_BxSx: jax.Array) -> jax.Array:
    """[B, S, ...] -> [B * S, ...] in the residual stream's token order: row-major, except with a
    context axis and R > 1 rows per batch shard, where it is shard-major (batch shard, context
    device, row in the shard, position in the device's piece), so that splitting the tokens into
    contiguous blocks (`rows`) gives each device exactly its rows' pieces of the sequence: the
    layout of the context shard_maps (batch axes split the rows, context each row), reached from the
    stream by local transposes. A row-major stream would put R / context whole rows on a device
    and every attention and Gated DeltaNet layer would reshard (all-to-all) in and out."""
    b, s = x_BxSx.shape[:2]
    rest = x_BxSx.shape[2:]
    split = _stream_split(b, s)
    if split is None:
        return x_BxSx.reshape(b * s, *rest)
    shards, ctx = split
    x = x_BxSx.reshape(shards, b // shards, ctx, s // ctx, *rest)
    return jnp.swapaxes(x, 1, 2).reshape(b * s, *rest)


def unstream(x_Nx: jax.Array, b: int, s: int) -> jax.Array:
    """The inverse of `stream`: stream-ordered tokens [b * s, ...] as rows [b, s, ...]."""
    rest = x_Nx.shape[1:]
    split = _stream_split(b, s)
    if split is None:
        return x_Nx.reshape(b, s, *rest)
    shards, ctx = split
    x = x_Nx.reshape(shards, ctx, b // shards, s // ctx, *rest)
    return jnp.swapaxes(x, 1, 2).reshape(b, s, *rest)


def row_major(x_Nx: jax.Array, b: int, s: int) -> jax.Array:
    """Stream-ordered tokens [b * s, ...] in row-major order (what a caller of the model reads),
    split as `rows` splits them: a no-op unless `stream` reorders."""
    if _stream_split(b, s) is None:
        return x_Nx
    return rows(unstream(x_Nx, b, s).reshape(x_Nx.shape))


def check_batch(batch_size: int, microbatches: int, mesh) -> None:
    """Refuses a global batch that the mesh's batch shards (`batch_shards`) times the microbatches
    do not divide, by name (the trainer, and the rehearsal's config stage on an abstract mesh
    before any process starts)."""
    shards = batch_shards(mesh)
    if batch_size % (shards * microbatches):
        raise ConfigError("train.batch_size", batch_size,
                          f"a multiple of the {shards} data x fsdp x expert shards of the mesh {dict(mesh.shape)}"
                          + (f" times train.microbatches ({microbatches}): every shard holds rows of each "
                             "microbatch" if microbatches > 1 else ""))


def param_shardings(params: nnx.State, mesh: Mesh):
    """NamedShardings for a state of parameters (arrays or abstract), from their logical axes."""
    logical = nnx.get_partition_spec(params)
    return jax.tree.map(lambda p, s: NamedSharding(mesh, spec(tuple(s), p.shape, mesh)),
                        params, logical)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Tokens [B, S]: rows split over the data, fsdp and expert axes."""
    return NamedSharding(mesh, spec(("batch", None), (batch_shards(mesh), 1), mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
