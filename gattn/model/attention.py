"""GQA attention with RoPE, optional QK-norm, and the paper's gate at any of G1..G5.

    Q = X W_Q, K = X W_K, V = X W_V      [N, heads, head_dim]; gate here for G4 / G3 / G2
    Y = SDPA(RoPE(Q), RoPE(K), V)         causal, GQA; G1 non-linearity and gate act on Y
    O = concat_heads(Y) W_O               G5 gate acts on O

Order inside a projection: projection -> QK-norm -> gate -> RoPE, so a gate on Q or K is not
undone by the norm. Switch Heads (Table 6) replace W_V (and W_K) by experts mixed per kv head by
a sigmoid top-k router; with one expert and top-1 this is exactly the G2 headwise gate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from gattn import kernels
from gattn.config import ConfigError, ExecConfig, ModelConfig
from gattn.model import context, sharding
from gattn.model.capture import NOTHING, Capture
from gattn.model.gates import Gate, sdpa_nonlinearity
from gattn.model.layers import DTYPES, apply_rope, dense, norm_scale, param, rms_norm


class SwitchProjection(nnx.Module):
    """E expert projections per kv head; a sigmoid router keeps the top-k and weights them:
    out[n, h] = sum_{e in topk(s[n, h])} s[n, h, e] * (x W_e)[n, h],  s = sigmoid(x W_r)."""

    def __init__(self, cfg: ModelConfig, ex: ExecConfig, *, rngs: nnx.Rngs):
        e, hk, hd = cfg.switch_heads.num_experts, cfg.kv_heads, cfg.head_dim
        self.w = param("weight", rngs, (e, cfg.d_model, hk * hd), ("expert", "embed", "kv_heads"),
                       std=cfg.init_std, dtype=DTYPES[cfg.param_dtype])
        self.shape, self.dtype = (e, hk, hd), DTYPES[ex.dtype]

    def __call__(self, x_NxD, weights_NxHxE):
        e, hk, hd = self.shape
        w = self.w[...].astype(self.dtype)
        out_NxExHK = jnp.einsum("nd,edo->neo", x_NxD.astype(self.dtype), w)
        out_NxExHxK = out_NxExHK.reshape(-1, e, hk, hd)
        return jnp.einsum("nhe,nehk->nhk", weights_NxHxE.astype(self.dtype), out_NxExHxK)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, ex: ExecConfig = ExecConfig(), *, rngs: nnx.Rngs):
        self.cfg, self.ex = cfg, ex
        d, hq, hk, hd = cfg.d_model, cfg.q_heads, cfg.kv_heads, cfg.head_dim
        pd, std = DTYPES[cfg.param_dtype], cfg.init_std
        self.dtype = DTYPES[ex.dtype]
        self.wq = param("weight", rngs, (d, hq * hd), ("embed", "heads"), std=std, dtype=pd)
        sw = cfg.switch_heads
        if sw is None or sw.targets == "v":
            self.wk = param("weight", rngs, (d, hk * hd), ("embed", "kv_heads"), std=std, dtype=pd)
        if sw is None:
            self.wv = param("weight", rngs, (d, hk * hd), ("embed", "kv_heads"), std=std, dtype=pd)
        else:
            self.router = param("weight", rngs, (d, hk * sw.num_experts), ("embed", "kv_heads"), std=std, dtype=pd)
            self.v_experts = SwitchProjection(cfg, ex, rngs=rngs)
            if sw.targets == "kv":
                self.k_experts = SwitchProjection(cfg, ex, rngs=rngs)
        self.wo = param("weight", rngs, (hq * hd, d), ("heads", "embed"), std=std, dtype=pd)
        if cfg.attention_bias or cfg.qkv_bias:
            self.bq = param("bias", None, (hq * hd,), ("heads",), dtype=pd)
            self.bk = param("bias", None, (hk * hd,), ("kv_heads",), dtype=pd)
            self.bv = param("bias", None, (hk * hd,), ("kv_heads",), dtype=pd)
        if cfg.attention_bias:
            self.bo = param("bias", None, (d,), ("embed",), dtype=pd)
        if cfg.qk_norm:
            self.q_norm = norm_scale((hd,), ("head_dim",), cfg)
            self.k_norm = norm_scale((hd,), ("head_dim",), cfg)
        if cfg.sdpa_nonlinearity == "rmsnorm":
            self.sdpa_norm = param("scale", None, (hq, hd), ("heads", "head_dim"), value=1.0, dtype=pd)
        self.gate = Gate(cfg.gate, cfg, ex, rngs=rngs) if cfg.gate is not None else None

    def _gate_at(self, position: str, y_NxHxW, x_NxD, capture: Capture = NOTHING):
        if self.gate is not None and self.gate.spec.position == position:
            return self.gate(y_NxHxW, x_NxD, capture)
        return y_NxHxW

    def _switch_weights(self, x_NxD):
        sw, hk = self.cfg.switch_heads, self.cfg.kv_heads
        s_NxHxE = jax.nn.sigmoid(dense(x_NxD, self.router, jnp.float32).reshape(-1, hk, sw.num_experts))
        _, top = jax.lax.top_k(s_NxHxE, sw.top_k)
        keep = jax.nn.one_hot(top, sw.num_experts, dtype=s_NxHxE.dtype).sum(axis=-2)
        return s_NxHxE * keep

    def _project(self, x_NxI, name: str):
        """x W (+ b with attention_bias; W_Q, W_K, W_V's with qkv_bias) for W_Q, W_K, W_V, W_O
        (name 'q', 'k', 'v', 'o')."""
        out = dense(x_NxI, getattr(self, f"w{name}"), self.dtype)
        if hasattr(self, f"b{name}"):
            out = out + getattr(self, f"b{name}")[...].astype(self.dtype)
        return out

    def _qkv(self, x_NxD, positions_N, capture: Capture = NOTHING):
        """q [N, Hq, K], k and v [N, Hk, K] as SDPA takes them: projected, QK-normed, gated,
        rotated."""
        cfg, n = self.cfg, x_NxD.shape[0]
        hq, hk, hd = cfg.q_heads, cfg.kv_heads, cfg.head_dim
        q = self._project(x_NxD, "q").reshape(n, hq, hd)
        if cfg.switch_heads is None:
            k = self._project(x_NxD, "k").reshape(n, hk, hd)
            v = self._project(x_NxD, "v").reshape(n, hk, hd)
        else:
            weights = self._switch_weights(x_NxD)
            v = self.v_experts(x_NxD, weights)
            k = (self.k_experts(x_NxD, weights) if cfg.switch_heads.targets == "kv"
                  else dense(x_NxD, self.wk, self.dtype).reshape(n, hk, hd))
        # (names for exec.remat's policies: gattn/model/transformer.py, SAVED_NAMES)
        q, k, v = (checkpoint_name(t, name) for t, name in ((q, "query_proj"), (k, "key_proj"), (v, "value_proj")))
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm[...], cfg.norm_eps, cfg.zero_centered_norm)
            k = rms_norm(k, self.k_norm[...], cfg.norm_eps, cfg.zero_centered_norm)
        q = self._gate_at("query", q, x_NxD, capture)
        k = self._gate_at("key", k, x_NxD, capture)
        v = self._gate_at("value", v, x_NxD, capture)
        q = apply_rope(q, positions_N, cfg.rope_base, cfg.yarn, cfg.rope_dim)
        k = apply_rope(k, positions_N, cfg.rope_base, cfg.yarn, cfg.rope_dim)
        if capture.qk:
            self.sow(nnx.Intermediate, "q", q)
            self.sow(nnx.Intermediate, "k", k)
        return q, k, v

    def _output(self, y_NxHxK, x_NxD, *, sdpa_gate: bool = True, capture: Capture = NOTHING):
        """G1 non-linearity and gate (unless the kernel applied it), W_O, then the G5 gate."""
        cfg, n = self.cfg, x_NxD.shape[0]
        y = sdpa_nonlinearity(cfg.sdpa_nonlinearity, y_NxHxK,
                              self.sdpa_norm[...] if cfg.sdpa_nonlinearity == "rmsnorm" else None,
                              cfg.norm_eps)
        if sdpa_gate:
            y = self._gate_at("sdpa", y, x_NxD, capture)
        o_NxD = checkpoint_name(self._project(checkpoint_name(y.reshape(n, -1), "attn_out"), "o"), "out_proj")
        return self._gate_at("dense", o_NxD[:, None, :], x_NxD, capture)[:, 0, :]

    def __call__(self, x_NxD, positions_N, segment_ids_BxS, batch: tuple[int, int],
                 capture: Capture = NOTHING, prefix_ids_BxSxK=None):
        cfg, ex, n = self.cfg, self.ex, x_NxD.shape[0]
        b, s = batch
        hq, hk, hd = cfg.q_heads, cfg.kv_heads, cfg.head_dim
        q, k, v = self._qkv(x_NxD, positions_N, capture)
        # `auto`: this platform's choice; a shared prefix (prefix ids) only the xla attention knows
        impl = "xla" if prefix_ids_BxSxK is not None else kernels.resolve(ex.attention_impl)
        if capture.attn_probs and impl != "xla":
            raise ValueError(f"capturing the attention matrix needs exec.attention_impl='xla' (this model "
                             f"runs {ex.attention_impl!r}, which never forms it); build the model with "
                             "the xla attention for analysis")

        # A sigmoid gate right on the SDPA output goes into the attention function as logits, so
        # the pallas kernel applies it in its epilogue (the xla path multiplies after SDPA). A
        # capture of the ungated SDPA output or of the gate keeps the gate outside.
        fused = (self.gate is not None and self.gate.spec.fusable and cfg.sdpa_nonlinearity == "none"
                 and not (capture.sdpa_out or capture.gate))
        # (tokens in the residual stream's order, sharding.stream; rows [B, S] for the attention)
        gate_logits = sharding.unstream(self.gate.logits(x_NxD), b, s).reshape(b, s, hq, -1) if fused else None
        # The flash blocks are the TPU kernel's; the GPU kernel and cuDNN keep their own defaults.
        options = {"xla": dict(block_q=ex.attention_block_q, query_chunk=ex.attention_query_chunk,
                               prefix_ids=prefix_ids_BxSxK),
                   "pallas": dict(block_q=ex.flash_block_q, block_k=ex.flash_block_k)}.get(impl, {})
        q_BxSxHxK, k_BxSxHxK, v_BxSxHxK = (sharding.unstream(t, b, s) for t in (q, k, v))
        if context.size() > 1:  # the sequence split over the mesh's context axis (rows arranged)
            if prefix_ids_BxSxK is not None or capture.attn_probs:
                raise ValueError("context parallelism (mesh.context > 1) runs causal attention over arranged "
                                 "rows only: no shared prefix ids, no captured attention matrix")
            if impl not in ("xla", "pallas"):  # (`auto` on a GPU; the config refuses the names themselves)
                raise ConfigError("exec.attention_impl", ex.attention_impl, f"xla or pallas with mesh.context > 1 "
                                  f"(it runs {impl!r} here): the chunk pairs need the keys' own segment ids and "
                                  "the log-sum-exp, which only those take and return")
            options.pop("prefix_ids", None)
            out = context.attention(kernels.IMPLS[impl], q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, gate_logits,
                                    segment_ids_BxS=segment_ids_BxS, **options)
        else:
            out = kernels.attention(q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, gate_logits, impl=impl, causal=True,
                                    segment_ids=segment_ids_BxS, return_probs=capture.attn_probs, **options)
        if capture.attn_probs:
            out, probs_BxHxSxS = out
            self.sow(nnx.Intermediate, "attn_probs", probs_BxHxSxS)
        y = sharding.stream(out).reshape(n, hq, hd)
        if capture.sdpa_out:
            self.sow(nnx.Intermediate, "sdpa_out", y)
        return self._output(y, x_NxD, sdpa_gate=not fused, capture=capture)

    def decode(self, x_NxD, positions_N, k_BxHxTxK, v_BxHxTxK, mask_BxSxT, index):
        """Cached attention for S new tokens per row (N = B * S): writes their k and v into the
        cache slots index..index+S-1, attends every new query over the cache slots `mask_BxSxT`
        shows it. Returns (out [N, D], k cache, v cache)."""
        cfg, n = self.cfg, x_NxD.shape[0]
        b = k_BxHxTxK.shape[0]
        s = n // b
        q, k, v = self._qkv(x_NxD, positions_N)
        at = (0, 0, index, 0)

        def write(cache, new_NxHxK):
            new = new_NxHxK.reshape(b, s, cfg.kv_heads, -1).transpose(0, 2, 1, 3)
            return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), at)

        k_BxHxTxK, v_BxHxTxK = write(k_BxHxTxK, k), write(v_BxHxTxK, v)
        out = kernels.attention_masked(q.reshape(b, s, cfg.q_heads, -1), k_BxHxTxK, v_BxHxTxK, mask_BxSxT)
        return self._output(out.reshape(n, cfg.q_heads, -1), x_NxD), k_BxHxTxK, v_BxHxTxK
