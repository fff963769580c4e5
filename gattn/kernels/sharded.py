"""Running an attention implementation on a device mesh.

Mosaic kernels are not partitioned automatically: under `jit` with sharded inputs a Pallas call
must sit inside `shard_map`, where each device sees its own batch rows and heads. Attention is
independent across batch and heads, so splitting them needs no communication; GQA stays intact as
long as the head axis divides the kv heads (query head h reads kv head h // G, and a contiguous
split of Hk kv heads carries exactly their G * Hk / n query heads).
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from gattn.config import BATCH_AXES


def shard_attention(fn, mesh, *, batch_axes=BATCH_AXES, head_axis: str | None = "model"):
    """Wraps `fn(q, k, v, gate=None, *, segment_ids=None, **options)` for `mesh`: batch split over
    `batch_axes`, heads over `head_axis` when it divides the kv heads (else, and for None,
    heads are not split). Sequence stays whole."""
    manual = set(getattr(mesh, "manual_axes", ()))  # inside a shard_map over some axes (the trainer's data)
    batch = tuple(a for a in batch_axes if a in mesh.axis_names and a not in manual) or None
    heads = head_axis if head_axis in mesh.axis_names else None

    def wrapped(q, k, v, gate=None, *, segment_ids=None, **options):
        # Heads split only when the axis divides the kv heads (GQA groups stay whole); otherwise
        # every device of the head axis runs all heads of its batch rows.
        split = heads if heads and k.shape[2] % mesh.shape[heads] == 0 else None
        tile = P(batch, None, split, None)
        gate_spec = None if gate is None else (tile if gate.ndim == 4 else P(batch, None, split))
        seg_spec = None if segment_ids is None else P(batch, None)
        body = functools.partial(_call, fn, options)
        # The body has no collectives, so the varying-axes type check has nothing to protect;
        # interpret-mode Pallas mixes arrays that vary over different axes (segment ids vary over
        # the batch axes only), which the check rejects.
        return jax.shard_map(body, mesh=mesh, in_specs=(tile, tile, tile, gate_spec, seg_spec),
                             out_specs=tile, check_vma=False)(q, k, v, gate, segment_ids)

    return wrapped


def _call(fn, options, q, k, v, gate, segment_ids):
    return fn(q, k, v, gate, segment_ids=segment_ids, **options)


def on_context_mesh(fn, batch_axes=BATCH_AXES, head_axis: str = "model"):
    """`fn` wrapped by `shard_attention` for the mesh set with `jax.set_mesh` when it has more than
    one device (the trainer sets it around its step); `fn` itself otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn
    return shard_attention(fn, mesh, batch_axes=batch_axes, head_axis=head_axis)
