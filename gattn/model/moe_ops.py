"""The MoE verbs as pure functions on arrays: router logits (float32), route, permute, grouped
(or capacity-bounded) expert compute, unpermute, and the auxiliary losses. The layer
(gattn/model/moe.py) and the expert-parallel paths (gattn/model/expert_parallel.py,
dropless_ep.py) are all built from these.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gattn.config import MoESpec


def router_logits(x_NxD: jax.Array, router_DxE: jax.Array) -> jax.Array:
    """[N, E] router logits from float32 inputs and weights at full float32 precision, whatever the
    compute dtype (as MaxText and Megatron route): bf16 would round the weights by ~2**-9 and flip
    the top-k choice of near ties. The matmul is D x E per token: small beside the experts'."""
    return jnp.dot(x_NxD.astype(jnp.float32), router_DxE.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def route(logits_NxE: jax.Array, spec: MoESpec):
    """(weights [N, P], experts [N, P], probs [N, E]): softmax in float32, top-k."""
    probs_NxE = jax.nn.softmax(logits_NxE.astype(jnp.float32), axis=-1)
    weights_NxP, experts_NxP = jax.lax.top_k(probs_NxE, spec.top_k)
    if spec.renormalize:
        weights_NxP = weights_NxP / jnp.sum(weights_NxP, axis=-1, keepdims=True)
    return weights_NxP, experts_NxP, probs_NxE


def balance(counts_E: jax.Array, prob_sums_E: jax.Array, tokens, top_k: int) -> jax.Array:
    """The load-balancing loss E * sum_e f_e p_e of a group of `tokens` tokens: f_e = share of
    the tokens * top_k assignments routed to e (`counts_E`), p_e = mean router probability of e
    (`prob_sums_E` / tokens). The one formula every path uses (the expert-parallel path passes
    counts and sums psummed over the global batch)."""
    e = counts_E.shape[-1]
    f = counts_E.astype(jnp.float32) / (tokens * top_k)
    p = prob_sums_E / tokens
    return e * jnp.sum(f * p, axis=-1)


def load_balancing_loss(probs_NxE: jax.Array, experts_NxP: jax.Array, groups: int = 1) -> jax.Array:
    """`balance` per group of tokens (the batch split into `groups` equal parts, in token order),
    averaged over groups. groups=1 is the global-batch loss."""
    n, e = probs_NxE.shape
    if n % groups:
        raise ValueError(f"lbl over {groups} micro-batches needs tokens ({n}) divisible by it")
    counts_GxE = jax.vmap(lambda x: jnp.bincount(x, length=e))(experts_NxP.reshape(groups, -1))
    prob_sums_GxE = jnp.sum(probs_NxE.reshape(groups, n // groups, e), axis=1)
    return jnp.mean(balance(counts_GxE, prob_sums_GxE, n // groups, experts_NxP.shape[1]))


def router_z_loss(logits_NxE: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_NxE.astype(jnp.float32), axis=-1)))


def permute(x_NxD: jax.Array, experts_NxP: jax.Array, num_experts: int):
    """(rows [N*P, D] sorted by expert, order [N*P]: the assignment each row came from, group
    sizes [E])."""
    flat = experts_NxP.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = jnp.take(x_NxD, order // experts_NxP.shape[1], axis=0)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return rows, order, sizes


def unpermute(rows_MxD: jax.Array, order_M: jax.Array, weights_NxP: jax.Array) -> jax.Array:
    """Inverse of `permute`, then each token's k outputs summed with its router weights.

    The inverse is a gather by the inverse permutation (an [M] integer scatter), not a scatter of
    the rows: JAX differentiates a scatter-set (indices it cannot know are unique) by scattering
    the update ids over the whole [M, D] operand and gathering them back, four u32 [M, D]
    arrays a layer (moe_15a2b: 8 GiB each, ~1.9 of its 17.2 TB of HBM traffic a step)."""
    n, p = weights_NxP.shape
    m = order_M.shape[0]
    inverse_M = jnp.zeros_like(order_M).at[order_M].set(jnp.arange(m, dtype=order_M.dtype), unique_indices=True)
    per_assignment = jnp.take(rows_MxD, inverse_M, axis=0, unique_indices=True).reshape(n, p, -1)
    out = jnp.einsum("npd,np->nd", per_assignment.astype(jnp.float32), weights_NxP)
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


