"""A fine-grained mixture-of-experts FFN: route, permute, grouped matmul, unpermute.

    route      softmax router over E experts, keep the top-k per token (optionally renormalised)
    permute    sort the N * k (token, expert) assignments by expert: [N*k, D] and group sizes [E]
    grouped    each expert's SwiGLU on its contiguous rows (`jax.lax.ragged_dot`, dropless)
    unpermute  scatter the rows back and sum each token's k outputs, weighted by the router

With a capacity factor each expert keeps at most C rows (the first C in token order) and the
others are dropped: their expert output is zero and they are counted. That path computes on a
fixed [E, C, D] buffer with batched matmuls, so its cost is capacity_factor x the activated
compute for any E. The dropless path uses `jax.lax.ragged_dot`, a grouped matmul on TPU; XLA's
CPU lowering of it computes every expert for every row (cost grows with E: see
bench/moe_step_time.py), so on CPU use a capacity factor for speed.

The auxiliary losses are returned as named values, never folded into the LM loss here:
    lbl      E * sum_e f_e * p_e, f_e = share of the N*k assignments routed to e, p_e = mean router
             probability of e. With scope "global" f and p are counted over the whole (global)
             batch (Qiu et al. 2025, "Demons in the detail"); under jit on a mesh the sums over a
             data-sharded batch are global by construction. "micro" splits the tokens into
             `micro_batches` groups (a data-parallel shard each), computes the loss per group and
             averages, the usual per-micro-batch LBL.
    z_loss   mean over tokens of logsumexp(router logits)^2 (ST-MoE).
    load     tokens routed to each expert [E]; dropped: assignments over capacity.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from gattn.config import ModelConfig, MoESpec
from gattn.layers import DTYPES, FFN_ACTIVATIONS, dense, param


def route(logits_NxE: jax.Array, spec: MoESpec):
    """(weights [N, k], experts [N, k], probs [N, E]): softmax in float32, top-k."""
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    weights_NxK, experts_NxK = jax.lax.top_k(probs_NxE, spec.top_k)
    if spec.renormalize:
        weights_NxK = weights_NxK / jnp.sum(weights_NxK, axis=-1, keepdims=True)
    return weights_NxK, experts_NxK, probs_NxE


def load_balancing_loss(probs_NxE: jax.Array, experts_NxK: jax.Array, groups: int = 1) -> jax.Array:
    """E * sum_e f_e p_e per group of tokens (the batch split into `groups` equal parts, in token
    order), averaged over groups. groups=1 is the global-batch loss."""
    n, e = probs_NxE.shape
    if n % groups:
        raise ValueError(f"lbl over {groups} micro-batches needs tokens ({n}) divisible by it")
    probs = probs_NxE.reshape(groups, n // groups, e)
    picks = jax.nn.one_hot(experts_NxK.reshape(groups, -1), e, dtype=jnp.float32)  # [G, n*k/G, E]
    f_GxE = jnp.mean(picks, axis=1)
    p_GxE = jnp.mean(probs, axis=1)
    return jnp.mean(e * jnp.sum(f_GxE * p_GxE, axis=-1))


def router_z_loss(logits_NxE: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_NxE.astype(jnp.float32), axis=-1)))


def permute(x_NxD: jax.Array, experts_NxK: jax.Array, num_experts: int):
    """(rows [N*k, D] sorted by expert, order [N*k]: the assignment each row came from, group
    sizes [E])."""
    flat = experts_NxK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = jnp.take(x_NxD, order // experts_NxK.shape[1], axis=0)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return rows, order, sizes


def unpermute(rows_MxD: jax.Array, order_M: jax.Array, weights_NxK: jax.Array) -> jax.Array:
    """Inverse of `permute`, then each token's k outputs summed with its router weights."""
    n, k = weights_NxK.shape
    per_assignment = jnp.zeros_like(rows_MxD).at[order_M].set(rows_MxD).reshape(n, k, -1)
    out = jnp.einsum("nkd,nk->nd", per_assignment.astype(jnp.float32), weights_NxK)
    return out.astype(rows_MxD.dtype)


def capacity(spec: MoESpec, tokens: int) -> int:
    return max(1, math.ceil(spec.capacity_factor * tokens * spec.top_k / spec.num_experts))


def dispatch(rows_MxD, sizes_E, expert_of_row_M, cap: int, dtype):
    """Each expert's first `cap` rows (in token order) into an [E * cap, D] buffer. Returns the
    buffer, each row's slot in it (E * cap, out of range, for dropped rows) and the keep mask."""
    e, m = sizes_E.shape[0], rows_MxD.shape[0]
    rank = jnp.arange(m) - (jnp.cumsum(sizes_E) - sizes_E)[expert_of_row_M]
    keep = rank < cap
    slot = jnp.where(keep, expert_of_row_M * cap + rank, e * cap)
    buf = jnp.zeros((e * cap, rows_MxD.shape[1]), dtype).at[slot].set(rows_MxD.astype(dtype), mode="drop")
    return buf, slot, keep


def combine(out_rows, slot_M, keep_M):
    """Inverse of `dispatch`: each row's output from the [E * cap, D] buffer, 0 for dropped rows."""
    picked = jnp.take(out_rows, jnp.minimum(slot_M, out_rows.shape[0] - 1), axis=0)
    return jnp.where(keep_M[:, None], picked, 0)


def batched_swiglu(act, dtype, x_ExCxD, w1, w3, w2):
    """Each expert's SwiGLU on its own [C, D] block: one batched matmul per projection."""
    h = act(jnp.einsum("ecd,edf->ecf", x_ExCxD, w1)) * jnp.einsum("ecd,edf->ecf", x_ExCxD, w3)
    return jnp.einsum("ecf,efd->ecd", h.astype(dtype), w2)


class MoE(nnx.Module):
    """Router [D, E] and E SwiGLU experts w1, w3 [E, D, F], w2 [E, F, D]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        spec, d = cfg.moe, cfg.d_model
        pd, std = DTYPES[cfg.param_dtype], cfg.init_std
        e, f = spec.num_experts, spec.expert_width
        self.spec = spec
        self.router = param(rngs, (d, e), ("embed", None), std=std, dtype=pd)
        self.w1 = param(rngs, (e, d, f), ("expert", "embed", "mlp"), std=std, dtype=pd)
        self.w3 = param(rngs, (e, d, f), ("expert", "embed", "mlp"), std=std, dtype=pd)
        self.w2 = param(rngs, (e, f, d), ("expert", "mlp", "embed"), std=std, dtype=pd)
        self.act = FFN_ACTIVATIONS[cfg.ffn_activation]
        self.dtype = DTYPES[cfg.dtype]

    def _w(self, p):
        return p[...].astype(self.dtype)

    def experts(self, rows_MxD: jax.Array, sizes_E: jax.Array) -> jax.Array:
        """Each expert's SwiGLU on its contiguous block of rows (grouped matmul, dropless)."""
        x = rows_MxD.astype(self.dtype)
        h = (self.act(jax.lax.ragged_dot(x, self._w(self.w1), sizes_E))
             * jax.lax.ragged_dot(x, self._w(self.w3), sizes_E))
        return jax.lax.ragged_dot(h.astype(self.dtype), self._w(self.w2), sizes_E)

    def experts_with_capacity(self, rows_MxD, sizes_E, expert_of_row_M, cap: int):
        """Each expert's first `cap` rows in an [E, cap, D] buffer and one batched matmul per
        projection: cost E * cap rows = capacity_factor * N * k, whatever E is. Returns the rows'
        outputs (0 for dropped rows) and the keep mask."""
        e = sizes_E.shape[0]
        buf, slot, keep = dispatch(rows_MxD, sizes_E, expert_of_row_M, cap, self.dtype)
        out = batched_swiglu(self.act, self.dtype, buf.reshape(e, cap, -1), self._w(self.w1),
                             self._w(self.w3), self._w(self.w2))
        return combine(out.reshape(e * cap, -1), slot, keep), keep

    def __call__(self, x_NxD: jax.Array):
        """(out [N, D], aux {lbl, z_loss, load [E], dropped})."""
        spec = self.spec
        mesh = jax.sharding.get_abstract_mesh()
        from gattn import expert_parallel  # noqa: PLC0415 (it builds on this module's verbs)

        if expert_parallel.applies(mesh, spec):  # experts split over the mesh: explicit all-to-all
            return expert_parallel.moe_forward(self, x_NxD, mesh)
        logits_NxE = dense(x_NxD, self.router, self.dtype, out_dtype=jnp.float32)
        weights_NxK, experts_NxK, probs_NxE = route(logits_NxE, spec)
        rows, order, sizes = permute(x_NxD, experts_NxK, spec.num_experts)
        if spec.capacity_factor is None:
            out_rows, dropped = self.experts(rows, sizes), jnp.zeros((), jnp.int32)
        else:
            expert_of_row = jnp.take(experts_NxK.reshape(-1), order)
            out_rows, keep = self.experts_with_capacity(rows, sizes, expert_of_row,
                                                        capacity(spec, x_NxD.shape[0]))
            dropped = jnp.sum(~keep).astype(jnp.int32)
        out = unpermute(out_rows, order, weights_NxK)
        groups = spec.micro_batches if spec.lbl_scope == "micro" else 1
        aux = {"lbl": load_balancing_loss(probs_NxE, experts_NxK, groups),
               "z_loss": router_z_loss(logits_NxE), "load": sizes, "dropped": dropped}
        return out, aux
