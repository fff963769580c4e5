"""Expert parallelism with an explicit token exchange: the MoE layer inside `shard_map`.

Each device holds the tokens of its (data, fsdp, expert, context) shard (gattn/model/sharding.py
`token_axes`: on a context axis, its piece of the residual stream) and the E / n experts of
its expert shard (each expert's width split over `model`). Per device:

    route        its own tokens (the router is replicated)
    dispatch     each expert's first C rows into a [n, E/n, C, D] buffer, C = ceil(c N_local k / E)
    all_to_all   over `expert`: every device receives, for its own experts, the rows that every
                 other device of its expert group routed to them
    experts      one batched matmul per projection on [E/n, n C, D]; psum over `model`
    all_to_all   back, then each token's k outputs summed with its router weights

The buffers have a fixed size, so this path needs a capacity factor; rows past an expert's
capacity are dropped and counted. Capacity is per source shard here (c N_local k / E rows of each
expert from each shard), where the single-device path counts it over the whole batch, so with
drops the two choose different tokens; without drops they agree exactly (tested). The
global-batch LBL is explicit here (`shard_aux`, shared with gattn/model/dropless_ep.py): expert
counts and router probabilities are `psum`med over the batch axes before they are combined.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gattn.config import ConfigError
from gattn.model.moe_ops import (balance, batched_swiglu, capacity, combine, dispatch, load_balancing_loss,
                                 permute, route, router_logits, router_z_loss, unpermute)
from gattn.model.sharding import token_axes



def context_mesh(spec):
    """The mesh set with `jax.set_mesh` (the trainer sets the run's around its step), checked
    for this path (exec.moe_impl = "all_to_all"): an expert axis > 1 dividing the experts."""
    mesh = jax.sharding.get_abstract_mesh()
    n = 0 if mesh.empty or "expert" not in mesh.axis_names else mesh.shape["expert"]
    if n < 2 or spec.num_experts % n or spec.capacity_factor is None:
        raise ValueError(f"exec.moe_impl='all_to_all' runs under a mesh (jax.set_mesh) whose expert axis "
                         f"(here {n or 'none'}) is > 1 and divides the {spec.num_experts} experts, with a "
                         "capacity factor; use exec.moe_impl='partitioned' otherwise")
    return mesh


def micro_groups_per_shard(spec, mesh) -> int:
    """LBL groups (micro-batches) per token shard (`token_axes`): 1 for the global scope. A shard
    holds whole micro-batches (whole rows) when their count is a multiple of the shards'; on a
    context axis it holds pieces of rows, so the per-micro-batch LBL is refused there."""
    if spec.lbl_scope != "micro":
        return 1
    if mesh.shape.get("context", 1) > 1:
        raise ConfigError("moe.lbl_scope", spec.lbl_scope, "'global' with mesh.context > 1 and exec.moe_impl "
                          "'all_to_all' or 'ragged': a device holds pieces of rows there, not whole micro-batches "
                          "(exec.moe_impl='partitioned' computes the per-micro-batch LBL under context)")
    n_shards = math.prod(mesh.shape[a] for a in token_axes(mesh))
    if spec.micro_batches % n_shards:
        raise ConfigError("moe.micro_batches", spec.micro_batches,
                          f"with experts split over the mesh, a multiple of the {n_shards} "
                          "data x fsdp x expert shards (each shard holds whole micro-batches)")
    return spec.micro_batches // n_shards


def shard_aux(spec, logits_NxE, probs_NxE, experts_NxP, counts_E, dropped, batch, groups_per_shard: int):
    """The aux values of one shard's tokens inside `shard_map` over the `batch` axes (`token_axes`), as one device
    computes them for the whole batch (every expert-parallel path uses this): the global-batch LBL
    from expert counts and router probabilities psummed over the batch axes, or the per-micro-batch
    one averaged; z-loss; load [E]; dropped rows."""
    n_local, k = experts_NxP.shape
    if spec.lbl_scope == "global":
        n_shards = jax.lax.psum(1, batch)
        lbl = balance(jax.lax.psum(counts_E, batch), jax.lax.psum(jnp.sum(probs_NxE, axis=0), batch),
                      n_local * n_shards, k)
    else:
        lbl = jax.lax.pmean(load_balancing_loss(probs_NxE, experts_NxP, groups_per_shard), batch)
    return {"lbl": lbl, "z_loss": jax.lax.pmean(router_z_loss(logits_NxE), batch),
            "load": jax.lax.psum(counts_E, batch).astype(jnp.int32),
            "dropped": jax.lax.psum(dropped, batch).astype(jnp.int32)}


def moe_forward(weights: dict, spec, act, dtype, x_NxD: jax.Array, mesh):
    """(out [N, D], aux) of the MoE layer with `weights` (gattn.model.moe.MoE.weights()) and
    experts split over the mesh's `expert` axis; same contract as `MoE.__call__`."""
    n_exp = mesh.shape["expert"]
    model = "model" if mesh.shape.get("model", 1) > 1 else None
    batch = token_axes(mesh)  # includes "expert" and "context"
    groups_per_shard = micro_groups_per_shard(spec, mesh)
    mlp_ok = model is not None and spec.expert_width % mesh.shape["model"] == 0
    w13_spec = P("expert", None, "model" if mlp_ok else None)
    w2_spec = P("expert", "model" if mlp_ok else None, None)

    def body(x, router, w1, w3, w2):
        n_local, e = x.shape[0], spec.num_experts
        logits = router_logits(x, router)
        weights, experts, probs = route(logits, spec)
        rows, order, counts = permute(x, experts, e)
        cap = capacity(spec, n_local)
        buf, slot, keep = dispatch(rows, counts, jnp.take(experts.reshape(-1), order), cap, dtype)
        buf = buf.reshape(n_exp, e // n_exp, cap, -1)                   # [dest shard, E/n, C, D]
        recv = jax.lax.all_to_all(buf, "expert", 0, 0)                  # [src shard, E/n, C, D]
        xin = recv.transpose(1, 0, 2, 3).reshape(e // n_exp, n_exp * cap, -1)
        y = batched_swiglu(act, dtype, xin, w1, w3, w2)
        if mlp_ok:
            y = jax.lax.psum(y, "model")
        y = y.reshape(e // n_exp, n_exp, cap, -1).transpose(1, 0, 2, 3)
        back = jax.lax.all_to_all(y, "expert", 0, 0).reshape(e * cap, -1)
        out = unpermute(combine(back, slot, keep), order, weights)
        return out, shard_aux(spec, logits, probs, experts, counts, jnp.sum(~keep), batch, groups_per_shard)

    aux_specs = {"lbl": P(), "z_loss": P(), "load": P(), "dropped": P()}
    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(P(batch, None), P(None, None), w13_spec, w13_spec, w2_spec),
                       out_specs=(P(batch, None), aux_specs))
    return fn(x_NxD, weights["router"], weights["w1"], weights["w3"], weights["w2"])
