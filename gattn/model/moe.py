"""A fine-grained mixture-of-experts FFN: route, permute, grouped matmul, unpermute.

    route      softmax router over E experts (float32 logits from float32 inputs and weights, under
               any compute dtype), keep the top-k per token (optionally renormalised)
    permute    sort the N * k (token, expert) assignments by expert: [N*P, D] and group sizes [E]
    grouped    each expert's SwiGLU on its contiguous rows (`jax.lax.ragged_dot`, dropless)
    unpermute  scatter the rows back and sum each token's k outputs, weighted by the router

With a capacity factor each expert keeps at most C rows (the first C in token order) and the
others are dropped: their expert output is zero and they are counted. Capacity is a
training-throughput device counted over each forward pass's tokens (validation loss keeps it,
as the run trained); cached decoding (`decoding=True`) is always dropless, so that a row's
generation never depends on the other rows of its batch or their padding. That path computes on a
fixed [E, C, D] buffer with batched matmuls, so its cost is capacity_factor x the activated
compute for any E. The dropless path uses `jax.lax.ragged_dot`, a grouped matmul on TPU; XLA's
CPU lowering of it computes every expert for every row (cost grows with E: see
bench/moe_step_time.py), so on CPU use a capacity factor for speed. On a mesh with an expert
axis, exec.moe_impl picks the explicit exchange: "all_to_all" (capacity, gattn/model/expert_parallel.py)
or "ragged" (dropless, only the routed rows moved: gattn/model/dropless_ep.py).

The auxiliary losses are returned as named values, never folded into the LM loss here:
    lbl      E * sum_e f_e * p_e, f_e = share of the N*k assignments routed to e, p_e = mean router
             probability of e. With scope "global" f and p are counted over the whole (global)
             batch (Qiu et al. 2025, "Demons in the detail"); under jit on a mesh the sums over a
             data-sharded batch are global by construction. "micro" splits the batch's rows into
             `micro_batches` groups of whole rows (a data-parallel shard each when micro_batches
             is the number of shards), computes the loss per group and averages, the usual
             per-micro-batch LBL (config checks train.batch_size % micro_batches == 0).
    z_loss   mean over tokens of logsumexp(router logits)^2 (ST-MoE).
    load     tokens routed to each expert [E]; dropped: assignments over capacity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from gattn.config import ExecConfig, ModelConfig
from gattn.model import dropless_ep, expert_parallel, sharding
from gattn.model.layers import DTYPES, FFN_ACTIVATIONS, SwiGLU, dense, param
from gattn.model.moe_ops import (batched_swiglu, capacity, combine, dispatch, load_balancing_loss, permute,
                                 route, router_logits, router_z_loss, unpermute)


class MoE(nnx.Module):
    """Router [D, E] and E SwiGLU experts w1, w3 [E, D, F], w2 [E, F, D]; with
    moe.shared_expert_width, a shared SwiGLU expert that every token runs, scaled by
    sigmoid(x shared_gate) (shared_gate [D, 1]) and added (Qwen3-Next's)."""

    def __init__(self, cfg: ModelConfig, ex: ExecConfig = ExecConfig(), *, rngs: nnx.Rngs):
        spec, d = cfg.moe, cfg.d_model
        pd, std = DTYPES[cfg.param_dtype], cfg.init_std
        e, f = spec.num_experts, spec.expert_width
        self.spec = spec
        self.router = param("weight", rngs, (d, e), ("embed", None), std=std, dtype=pd)
        self.w1 = param("weight", rngs, (e, d, f), ("expert", "embed", "mlp"), std=std, dtype=pd)
        self.w3 = param("weight", rngs, (e, d, f), ("expert", "embed", "mlp"), std=std, dtype=pd)
        self.w2 = param("weight", rngs, (e, f, d), ("expert", "mlp", "embed"), std=std, dtype=pd)
        self.act = FFN_ACTIVATIONS[cfg.ffn_activation]
        self.dtype = DTYPES[ex.dtype]
        self.impl = ex.moe_impl
        self.moe_buffer = ex.moe_buffer
        self.grouped_matmul = ex.grouped_matmul
        if spec.shared_expert_width:
            self.shared_expert = SwiGLU(cfg, spec.shared_expert_width, ex, rngs=rngs)
            self.shared_gate = param("weight", rngs, (d, 1), ("embed", None), std=std, dtype=pd)

    def _w(self, p):
        return p[...].astype(self.dtype)

    def weights(self) -> dict:
        """router [D, E] and w1, w3 [E, D, F], w2 [E, F, D] (the experts in the compute dtype)."""
        return {"router": self.router[...], "w1": self._w(self.w1), "w3": self._w(self.w3), "w2": self._w(self.w2)}

    def experts(self, rows_MxD: jax.Array, sizes_E: jax.Array) -> jax.Array:
        """Each expert's SwiGLU on its contiguous block of rows (grouped matmul, dropless); named
        as the dense FFN's (mlpwi_0, mlpwi_1, mlpwo) for exec.remat's policies."""
        x = rows_MxD.astype(self.dtype)
        h = (self.act(checkpoint_name(jax.lax.ragged_dot(x, self._w(self.w1), sizes_E), "mlpwi_0"))
             * checkpoint_name(jax.lax.ragged_dot(x, self._w(self.w3), sizes_E), "mlpwi_1"))
        return checkpoint_name(jax.lax.ragged_dot(h.astype(self.dtype), self._w(self.w2), sizes_E), "mlpwo")

    def experts_with_capacity(self, rows_MxD, sizes_E, expert_of_row_M, cap: int):
        """Each expert's first `cap` rows in an [E, cap, D] buffer and one batched matmul per
        projection: cost E * cap rows = capacity_factor * N * k, whatever E is. Returns the rows'
        outputs (0 for dropped rows) and the keep mask."""
        e = sizes_E.shape[0]
        buf, slot, keep = dispatch(rows_MxD, sizes_E, expert_of_row_M, cap, self.dtype)
        out = batched_swiglu(self.act, self.dtype, buf.reshape(e, cap, -1), self._w(self.w1),
                             self._w(self.w3), self._w(self.w2))
        return combine(checkpoint_name(out.reshape(e * cap, -1), "mlpwo"), slot, keep), keep

    def __call__(self, x_NxD: jax.Array, num_rows: int | None = None, *, decoding: bool = False):
        """(out [N, D], aux {lbl, z_loss, load [E], dropped}) of the N = num_rows * S tokens of
        num_rows sequences (None: each token its own row). `decoding` (cached decoding, where a
        batch holds unrelated prompts and their left padding): every token computes what it would
        alone, so dropless whatever the capacity factor (capacity pools the batch's tokens, and rows
        would compete for expert slots), and aux is {} (the auxiliary losses are training terms)."""
        out, aux = self._routed(x_NxD, num_rows, decoding)
        if self.spec.shared_expert_width:
            gate_Nx1 = jax.nn.sigmoid(dense(x_NxD, self.shared_gate, jnp.float32))
            out = out + (gate_Nx1 * self.shared_expert(x_NxD).astype(jnp.float32)).astype(out.dtype)
        return out, aux

    def _routed(self, x_NxD, num_rows, decoding):
        """The routed experts' output and aux (`__call__` without the shared expert)."""
        spec = self.spec
        if self.impl == "all_to_all" and not decoding:  # exec.moe_impl: the explicit exchange over the expert axis
            mesh = expert_parallel.context_mesh(spec)
            return expert_parallel.moe_forward(self.weights(), spec, self.act, self.dtype, x_NxD, mesh)
        if self.impl == "ragged" and not decoding:  # dropless expert parallelism: ragged exchange, grouped matmuls
            mesh = dropless_ep.context_mesh(spec)
            return dropless_ep.moe_forward(self.weights(), spec, self.act, self.dtype, x_NxD, mesh,
                                           self.moe_buffer, self.grouped_matmul)
        logits_NxE = router_logits(x_NxD, self.router[...])
        weights_NxP, experts_NxP, probs_NxE = route(logits_NxE, spec)
        rows, order, sizes = permute(x_NxD, experts_NxP, spec.num_experts)
        if spec.capacity_factor is None or decoding:
            out_rows, dropped = self.experts(rows, sizes), jnp.zeros((), jnp.int32)
        else:
            expert_of_row = jnp.take(experts_NxP.reshape(-1), order)
            out_rows, keep = self.experts_with_capacity(rows, sizes, expert_of_row,
                                                        capacity(spec, x_NxD.shape[0]))
            dropped = jnp.sum(~keep).astype(jnp.int32)
        out = unpermute(out_rows, order, weights_NxP)
        if decoding:
            return out, {}
        aux = {"lbl": self._lbl(probs_NxE, experts_NxP, x_NxD.shape[0] if num_rows is None else num_rows),
               "z_loss": router_z_loss(logits_NxE), "load": sizes, "dropped": dropped}
        return out, aux

    def _lbl(self, probs_NxE, experts_NxP, num_rows: int):
        """The global-batch LBL, or with scope "micro" the mean over micro_batches groups of whole
        rows (tokens are row-major, so equal token-order groups are whole rows when micro_batches
        divides num_rows). A batch that does not split so has no per-micro-batch LBL: NaN, loud if
        a loss is built on it. The trainer's batch is checked (train.batch_size); other forwards
        (validation, analysis: any batch size) throw aux["lbl"] away."""
        if self.spec.lbl_scope != "micro":
            return load_balancing_loss(probs_NxE, experts_NxP)
        if num_rows % self.spec.micro_batches:
            return jnp.full((), jnp.nan, jnp.float32)
        n, s = probs_NxE.shape[0], probs_NxE.shape[0] // num_rows  # (rows from the stream's token order)
        probs_NxE, experts_NxP = (sharding.unstream(a, num_rows, s).reshape(n, -1) for a in (probs_NxE, experts_NxP))
        return load_balancing_loss(probs_NxE, experts_NxP, self.spec.micro_batches)
