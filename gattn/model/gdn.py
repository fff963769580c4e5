"""Gated DeltaNet (Yang et al. 2024), the linear-attention layer of Qwen3-Next's 3:1 hybrid.

Per value head, a state S [K, V] (keys -> values) is decayed, corrected towards the new pair
(k_t, v_t) by one step of the delta rule with learning rate beta_t, and read by the query:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T
    o_t = S_t^T q_t / sqrt(K)

with q, k L2-normalised, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) <= 0. The layer
around it follows transformers' Qwen3NextGatedDeltaNet (Qwen3.5's is the same layer, its
projections packed differently: the tensor section below): projections of x to q, k, v, z, b, a; a
depthwise causal conv (width W) with SiLU over the channels of q, k, v; the rule; an RMSNorm per
head (scale w, not 1 + w) gated by SiLU(z); the output projection.

Packed rows: a token whose segment id differs from the previous token's starts a document. There
the recurrent state is zeroed before the token's update, and the conv window never reaches across
a segment boundary, so a packed row computes what its documents compute alone. Padding (id 0)
outputs zero.

Legend (this file): B batch, S sequence, D d_model, H value heads (heads of the state), G key
heads (each serves H/G consecutive value heads), K key head dim, V value head dim, M conv channels
(2 G K + H V), W conv width, N chunks, C chunk length.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from gattn.config import ConfigError
from gattn.kernels import gdn as gdn_kernel
from gattn.kernels.flash_blocks import on_tpu
from gattn.kernels.standin import enabled as standin_enabled
from gattn.model import context
from gattn.model.layers import dense, param, rms_norm

# The rule's contractions run in full float32 on every backend (TPU and GPU default to bf16 /
# TF32 passes for float32 matmuls; the chunked and recurrent forms must agree to ~1e-5).
PRECISION = jax.lax.Precision.HIGHEST
L2_EPS = 1e-6  # q, k normalised as x / sqrt(sum x^2 + eps), as FLA and transformers do


@dataclasses.dataclass(frozen=True)
class GDNSpec:
    """The architecture of one Gated DeltaNet layer (Qwen3-Next: 16 key heads and 32 value heads
    of 128, conv width 4)."""

    d_model: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("d_model", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, value, "expected an integer >= 1")
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError("num_v_heads", self.num_v_heads,
                              f"expected a multiple of num_k_heads = {self.num_k_heads} (each key head "
                              "serves num_v_heads / num_k_heads value heads)")
        if not isinstance(self.norm_eps, (int, float)) or isinstance(self.norm_eps, bool) or not self.norm_eps > 0:
            raise ConfigError("norm_eps", self.norm_eps, "expected a number > 0")

    @classmethod
    def of(cls, cfg) -> GDNSpec:
        """The GDN layers' spec in gattn model `cfg` (a ModelConfig with `linear_attention`)."""
        la = cfg.linear_attention
        return cls(cfg.d_model, la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim, la.conv_kernel,
                   cfg.norm_eps)

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def init_state(self, batch: int) -> GDNState:
        """A fresh decoding state for `batch` rows: zeros, from the spec's shapes alone."""
        return GDNState(jnp.zeros((batch, self.conv_kernel - 1, self.conv_dim), jnp.float32),
                        jnp.zeros((batch, self.num_v_heads, self.head_k_dim, self.head_v_dim), jnp.float32))

    @classmethod
    def from_hf_config(cls, hf: dict) -> GDNSpec:
        """The spec of a transformers Qwen3NextConfig (as a dict of its fields)."""
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError("hidden_act", hf["hidden_act"], "expected 'silu' (the conv's activation here)")
        return cls(hf["hidden_size"], hf["linear_num_key_heads"], hf["linear_num_value_heads"],
                   hf["linear_key_head_dim"], hf["linear_value_head_dim"], hf["linear_conv_kernel_dim"],
                   hf["rms_norm_eps"])

    def hf_config(self) -> dict:
        """The Qwen3NextConfig fields this spec sets (rms_norm_eps is shared with the other norms)."""
        return {"hidden_size": self.d_model, "linear_num_key_heads": self.num_k_heads,
                "linear_num_value_heads": self.num_v_heads, "linear_key_head_dim": self.head_k_dim,
                "linear_value_head_dim": self.head_v_dim, "linear_conv_kernel_dim": self.conv_kernel,
                "rms_norm_eps": self.norm_eps, "hidden_act": "silu"}


# --------------------------------------------------------------------------- the rule


def l2_normalize(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _prepare(q_BxSxGxK, k_BxSxGxK, v_BxSxHxV, g_BxSxH, beta_BxSxH, resets_BxS, state_BxHxKxV):
    """float32 inputs with q, k repeated to the value heads (key head j serves value heads
    j*H/G .. (j+1)*H/G - 1), q scaled by 1/sqrt(K); resets default to none, the state to zeros."""
    b, s, g, dk = q_BxSxGxK.shape
    h, dv = v_BxSxHxV.shape[2:]
    q, k = (jnp.repeat(x.astype(jnp.float32), h // g, axis=2) for x in (q_BxSxGxK, k_BxSxGxK))
    v, gl, beta = (x.astype(jnp.float32) for x in (v_BxSxHxV, g_BxSxH, beta_BxSxH))
    resets = jnp.zeros((b, s), bool) if resets_BxS is None else resets_BxS.astype(bool)
    state = (jnp.zeros((b, h, dk, dv), jnp.float32) if state_BxHxKxV is None
             else state_BxHxKxV.astype(jnp.float32))
    return q * dk ** -0.5, k, v, gl, beta, resets, state


def recurrent_gated_delta_rule(q_BxSxGxK, k_BxSxGxK, v_BxSxHxV, g_BxSxH, beta_BxSxH, resets_BxS=None,
                               state_BxHxKxV=None) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule one token at a time (decoding; the reference for the chunked form).
    q and k as given (the layer L2-normalises them); `resets_BxS` True zeroes the state before
    that token. Returns (o [B, S, H, V], final state [B, H, K, V]), float32."""
    q, k, v, g, beta, resets, state = _prepare(q_BxSxGxK, k_BxSxGxK, v_BxSxHxV, g_BxSxH, beta_BxSxH,
                                               resets_BxS, state_BxHxKxV)

    def token(s_BxHxKxV, xs):
        q_BxHxK, k_BxHxK, v_BxHxV, g_BxH, beta_BxH, reset_B = xs
        decay_BxH = jnp.where(reset_B[:, None], 0.0, jnp.exp(g_BxH))
        s_BxHxKxV = s_BxHxKxV * decay_BxH[..., None, None]
        predicted_BxHxV = jnp.einsum("bhkv,bhk->bhv", s_BxHxKxV, k_BxHxK, precision=PRECISION)
        delta_BxHxV = (v_BxHxV - predicted_BxHxV) * beta_BxH[..., None]
        s_BxHxKxV = s_BxHxKxV + k_BxHxK[..., :, None] * delta_BxHxV[..., None, :]
        return s_BxHxKxV, jnp.einsum("bhkv,bhk->bhv", s_BxHxKxV, q_BxHxK, precision=PRECISION)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, resets)]
    state, o_SxBxHxV = jax.lax.scan(token, state, time_major)
    return jnp.moveaxis(o_SxBxHxV, 0, 1), state


def unit_lower_inverse(a_XxCxC: jax.Array) -> jax.Array:
    """(I + A)^-1 for strictly lower-triangular A (batched over leading axes), by forward
    substitution one row at a time, as FLA and transformers compute the chunk's T: row i of
    (I + A)^-1 - I is -a_i - a_i (rows < i of it), and a_i is zero from column i on, so the
    not yet computed rows (still -A, strictly lower) never enter. Pure matmuls in a fori_loop:
    no LAPACK call (XLA:CPU's triangular solve inside the training step's jit hung the second
    call of the step on jax 0.10.2, docs/hybrid.md)."""
    c = a_XxCxC.shape[-1]
    neg = -a_XxCxC

    def row(i, t):
        r = jax.lax.dynamic_index_in_dim(t, i, axis=-2, keepdims=False)  # [..., C]: -a_i
        r = r + jnp.einsum("...j,...jk->...k", r, t, precision=PRECISION)
        return jax.lax.dynamic_update_index_in_dim(t, r, i, axis=-2)

    return jax.lax.fori_loop(1, c, row, neg) + jnp.eye(c, dtype=a_XxCxC.dtype)


def chunk_gated_delta_rule(q_BxSxGxK, k_BxSxGxK, v_BxSxHxV, g_BxSxH, beta_BxSxH, resets_BxS=None,
                           state_BxHxKxV=None, chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """The same function as `recurrent_gated_delta_rule`, C tokens at a time (training, prefill).

    Inside a chunk the C delta-rule steps fold into matmuls (the WY / UT transform): with
    Gamma_ij = exp(cum_i - cum_j) (cum = within-chunk cumsum of g) for j <= i in the same
    document and 0 otherwise, T = (I + strictly_lower(diag(beta) K K^T * Gamma))^-1 gives the new
    values U = T (beta V) and the keys that read the carried state Wk = T (beta K exp(cum)). Then

        V'  = U - Wk S                                    (what the carried state does not predict)
        O   = (Q exp(cum)) S + (Q K^T * Gamma) V'
        S  <- exp(cum_C) S + (K exp(cum_C - cum))^T V'

    A reset cuts Gamma between documents and zeroes every term through the carried state for the
    tokens after it (the masks `from_start` and `to_end` below), as g = -inf would without NaNs.
    S is padded to a multiple of C with tokens that change nothing (k = v = beta = g = 0)."""
    q, k, v, g, beta, resets, state = _prepare(q_BxSxGxK, k_BxSxGxK, v_BxSxHxV, g_BxSxH, beta_BxSxH,
                                               resets_BxS, state_BxHxKxV)
    b, s, h, _ = q.shape
    c = chunk_size
    pad = -s % c
    n = (s + pad) // c

    def chunked(x):  # [B, S, H, ...] -> [B, H, N, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, c, *x.shape[2:]), 3, 1) if x.ndim > 2 else x.reshape(b, 1, n, c)

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    resets_Bx1xNxC = chunked(resets)
    run_BxNxC = jnp.cumsum(resets_Bx1xNxC[:, 0], axis=-1)  # documents started so far in the chunk
    # g at a reset would decay a state that is zeroed anyway: dropped, so cum stays within a document
    cum_BxHxNxC = jnp.cumsum(jnp.where(resets_Bx1xNxC, 0.0, g), axis=-1)

    causal_CxC = jnp.tril(jnp.ones((c, c), bool))
    same_doc_BxNxCxC = (run_BxNxC[..., :, None] == run_BxNxC[..., None, :]) & causal_CxC
    same_doc = same_doc_BxNxCxC[:, None]
    diff = cum_BxHxNxC[..., :, None] - cum_BxHxNxC[..., None, :]
    gamma_BxHxNxCxC = jnp.where(same_doc, jnp.exp(jnp.where(same_doc, diff, 0.0)), 0.0)
    from_start = (run_BxNxC == 0)[:, None, ..., None]  # tokens that still see the carried state
    to_end = (run_BxNxC == run_BxNxC[..., -1:])[:, None, ..., None]  # tokens the chunk's state keeps

    def mm(spec, x, y):
        return jnp.einsum(spec, x, y, precision=PRECISION)

    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    strictly_lower_CxC = ~jnp.eye(c, dtype=bool)
    system_BxHxNxCxC = jnp.where(strictly_lower_CxC, mm("bhnck,bhnjk->bhncj", k_beta, k) * gamma_BxHxNxCxC, 0.0)

    t_BxHxNxCxC = unit_lower_inverse(system_BxHxNxCxC)

    def solve(rhs):  # T rhs = (I + system)^-1 rhs
        return mm("bhnij,bhnjd->bhnid", t_BxHxNxCxC, rhs)

    u_BxHxNxCxV = solve(v_beta)
    wk_BxHxNxCxK = solve(jnp.where(from_start, k_beta * jnp.exp(cum_BxHxNxC)[..., None], 0.0))
    attn_BxHxNxCxC = mm("bhnck,bhnjk->bhncj", q, k) * gamma_BxHxNxCxC
    q_in_BxHxNxCxK = jnp.where(from_start, q * jnp.exp(cum_BxHxNxC)[..., None], 0.0)
    k_out_BxHxNxCxK = jnp.where(to_end, k * jnp.exp(cum_BxHxNxC[..., -1:] - cum_BxHxNxC)[..., None], 0.0)
    carry_BxHxN = jnp.where(run_BxNxC[:, None, :, -1] == 0, jnp.exp(cum_BxHxNxC[..., -1]), 0.0)

    def chunk(s_BxHxKxV, xs):
        u, wk, attn, qi, ko, carry_BxH = xs
        v_new_BxHxCxV = u - mm("bhck,bhkv->bhcv", wk, s_BxHxKxV)
        o_BxHxCxV = mm("bhck,bhkv->bhcv", qi, s_BxHxKxV) + mm("bhcj,bhjv->bhcv", attn, v_new_BxHxCxV)
        s_BxHxKxV = s_BxHxKxV * carry_BxH[..., None, None] + mm("bhck,bhcv->bhkv", ko, v_new_BxHxCxV)
        return s_BxHxKxV, o_BxHxCxV

    chunk_major = [jnp.moveaxis(x, 2, 0) for x in (u_BxHxNxCxV, wk_BxHxNxCxK, attn_BxHxNxCxC, q_in_BxHxNxCxK,
                                                   k_out_BxHxNxCxK, carry_BxHxN)]
    state, o_NxBxHxCxV = jax.lax.scan(chunk, state, chunk_major)
    o_BxSxHxV = jnp.moveaxis(o_NxBxHxCxV, 0, 2).reshape(b, h, n * c, -1).transpose(0, 2, 1, 3)
    return o_BxSxHxV[:, :s], state


# --------------------------------------------------------------------------- the conv


def causal_conv1d(x_BxSxM, w_WxM, segment_ids_BxS=None, state_BxW1xM=None,
                  state_segment_ids_BxW1=None) -> tuple[jax.Array, jax.Array]:
    """SiLU of a depthwise causal conv: y_t = silu(sum_j w_j x_{t-W+1+j}), w_{W-1} on the current
    token (transformers' conv1d weight [M, 1, W] transposed). The W-1 inputs before the first token
    come from `state` (default zeros); with segment ids a tap reads only inputs of the token's own
    segment (the state counts as the first token's, unless `state_segment_ids` give its inputs'
    own: a chunk of a longer row, gattn/model/context.py). Returns (y [B, S, M] float32, the state
    after the last token [B, W-1, M]: the last W-1 inputs of the last token's segment, zeros
    before it)."""
    b, s, m = x_BxSxM.shape
    width = w_WxM.shape[0]
    past = jnp.zeros((b, width - 1, m), jnp.float32) if state_BxW1xM is None else state_BxW1xM
    xs_BxTxM = jnp.concatenate([past.astype(jnp.float32), x_BxSxM.astype(jnp.float32)], axis=1)
    w = w_WxM.astype(jnp.float32)
    if segment_ids_BxS is not None:
        past_ids = (jnp.repeat(segment_ids_BxS[:, :1], width - 1, axis=1) if state_segment_ids_BxW1 is None
                    else state_segment_ids_BxW1.astype(segment_ids_BxS.dtype))
        ids_BxT = jnp.concatenate([past_ids, segment_ids_BxS], axis=1)
    y_BxSxM = jnp.zeros((b, s, m), jnp.float32)
    for j in range(width):
        tap_BxSxM = xs_BxTxM[:, j:j + s] * w[j]
        if segment_ids_BxS is not None:
            tap_BxSxM = jnp.where((ids_BxT[:, j:j + s] == segment_ids_BxS)[..., None], tap_BxSxM, 0.0)
        y_BxSxM = y_BxSxM + tap_BxSxM
    state = xs_BxTxM[:, xs_BxTxM.shape[1] - (width - 1):]
    if segment_ids_BxS is not None:
        last_doc = ids_BxT[:, ids_BxT.shape[1] - (width - 1):] == segment_ids_BxS[:, -1:]
        state = jnp.where(last_doc[..., None], state, 0.0)
    return jax.nn.silu(y_BxSxM), state


def document_starts(segment_ids_BxS: jax.Array) -> jax.Array:
    """True where a token's segment id differs from the previous token's (never at t = 0: a call
    that starts from a state continues it)."""
    return jnp.pad(segment_ids_BxS[:, 1:] != segment_ids_BxS[:, :-1], [(0, 0), (1, 0)])


# --------------------------------------------------------------------------- the layer


class GDNState(NamedTuple):
    """What decoding carries per layer (float32): the conv's last W-1 inputs, time-major (the
    transpose of the last W-1 of transformers' conv state [B, M, W]), and the rule's state."""

    conv_BxW1xM: jax.Array
    recurrent_BxHxKxV: jax.Array


class GatedDeltaNet(nnx.Module):
    """The Gated DeltaNet layer: x [B, S, D] -> y [B, S, D] (module docstring).

    Parameters per head so that heads shard over the mesh's model axis: q and k projections and
    convs on `kv_heads` (the G key heads, like GQA's), v, z, b, a, A_log, dt_bias and the output
    projection on `heads` (the H value heads). A_log and dt_bias are role "bias": not decayed, as
    Mamba's and FLA's trainers leave them. Initialised as transformers does: weights (convs
    included) normal(init_std), dt_bias 1, A ~ U(0.01, 16), norm scale 1. `chunk_size` and `impl`
    (exec.gdn_impl: xla, the chunked rule here; pallas, gattn/kernels/gdn.py; auto, the kernel on
    TPU) are how the rule is computed (execution), not what it computes."""

    def __init__(self, spec: GDNSpec, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=jnp.float32,
                 init_std: float = 0.02, chunk_size: int = 64, impl: str = "xla"):
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ConfigError("chunk_size", chunk_size, "expected an integer >= 1")
        if impl not in gdn_kernel.IMPLS:
            raise ConfigError("impl", impl, f"expected one of {', '.join(map(repr, gdn_kernel.IMPLS))}")
        if impl != "xla" and chunk_size % 8:
            raise ConfigError("chunk_size", chunk_size, f"a multiple of 8 for impl {impl!r} (the kernel's chunk)")
        self.spec, self.dtype, self.chunk_size, self.impl = spec, dtype, chunk_size, impl
        d, g, h = spec.d_model, spec.num_k_heads, spec.num_v_heads
        gk, hv, w = g * spec.head_k_dim, h * spec.head_v_dim, spec.conv_kernel

        def weight(shape, axes):
            return param("weight", rngs, shape, axes, std=init_std, dtype=param_dtype)

        self.wq, self.wk = weight((d, gk), ("embed", "kv_heads")), weight((d, gk), ("embed", "kv_heads"))
        self.wv, self.wz = weight((d, hv), ("embed", "heads")), weight((d, hv), ("embed", "heads"))
        self.wb, self.wa = weight((d, h), ("embed", "heads")), weight((d, h), ("embed", "heads"))
        self.conv_q, self.conv_k = weight((w, gk), (None, "kv_heads")), weight((w, gk), (None, "kv_heads"))
        self.conv_v = weight((w, hv), (None, "heads"))
        self.dt_bias = param("bias", None, (h,), ("heads",), value=1.0, dtype=param_dtype)
        self.a_log = param("bias", None, (h,), ("heads",), dtype=param_dtype)
        a_H = jax.random.uniform(rngs.params(), (h,), minval=0.01, maxval=16.0)  # (away from 0: log A finite)
        self.a_log[...] = jnp.log(a_H).astype(param_dtype)
        self.norm = param("scale", None, (spec.head_v_dim,), ("head_dim",), value=1.0, dtype=param_dtype)
        self.wo = weight((hv, d), ("heads", "embed"))

    def init_state(self, batch: int) -> GDNState:
        return self.spec.init_state(batch)

    def __call__(self, x_BxSxD: jax.Array, segment_ids_BxS: jax.Array | None = None) -> jax.Array:
        """The training forward pass (chunked rule); segment ids as gattn's pipeline packs rows.
        With a context axis on the mesh the rows are arranged (gattn/model/context.py) and split
        over it."""
        if context.size() > 1:
            return self._mix(x_BxSxD, segment_ids_BxS, None, self._chunked, over_context=True)[0]
        return self.prefill(x_BxSxD, segment_ids_BxS)[0]

    def prefill(self, x_BxSxD, segment_ids_BxS=None, state: GDNState | None = None) -> tuple[jax.Array, GDNState]:
        """(y, the state after the last token): S tokens with the chunked rule, from `state`
        (default: a fresh one). The state is the last token's document's, so rows of a batch of
        prompts are left-padded (padding is a segment of its own)."""
        return self._mix(x_BxSxD, segment_ids_BxS, state, self._chunked)

    def step(self, x_Bx1xD: jax.Array, state: GDNState) -> tuple[jax.Array, GDNState]:
        """One decoding step per row (the recurrent rule): (y [B, 1, D], state)."""
        return self._mix(x_Bx1xD, None, state, recurrent_gated_delta_rule)

    def _chunked(self, *args):
        # (GATTN_PALLAS_STANDIN: off TPU the kernel's reference stands in for it, kernels/standin.py)
        if gdn_kernel.resolve(self.impl) == "pallas" and (on_tpu() or not standin_enabled(jax.default_backend())):
            return gdn_kernel.gated_delta_rule_on_mesh(*args, chunk_size=self.chunk_size)
        return chunk_gated_delta_rule(*args, chunk_size=self.chunk_size)

    def _split(self, qkv_BxSxM):
        """The conv's output -> q, k [B, S, G, K] (L2-normalised) and v [B, S, H, V]."""
        spec, (b, s) = self.spec, qkv_BxSxM.shape[:2]
        g, dk = spec.num_k_heads, spec.head_k_dim
        q, k, v = jnp.split(qkv_BxSxM, [g * dk, 2 * g * dk], axis=-1)
        return (l2_normalize(q.reshape(b, s, g, dk)), l2_normalize(k.reshape(b, s, g, dk)),
                v.reshape(b, s, spec.num_v_heads, spec.head_v_dim))

    def _mix(self, x_BxSxD, segment_ids_BxS, state, rule, over_context: bool = False):
        """Project, conv, the rule (`rule`: chunked or recurrent), gated norm, output projection.
        `over_context`: the sequence part split over the mesh's context axis (no state in or
        out: the returned state is None)."""
        spec, (b, s) = self.spec, x_BxSxD.shape[:2]
        h, dv = spec.num_v_heads, spec.head_v_dim
        x_NxD = x_BxSxD.reshape(b * s, -1)
        state = self.init_state(b) if state is None and not over_context else state

        def project(w, out_dtype=None, name=None):  # (names: exec.remat's, gattn/model/transformer.py)
            y = dense(x_NxD, w, self.dtype, out_dtype).reshape(b, s, -1)
            return y if name is None else checkpoint_name(y, name)

        qkv_BxSxM = jnp.concatenate([project(self.wq, name="query_proj"), project(self.wk, name="key_proj"),
                                     project(self.wv, name="value_proj")], axis=-1)
        w_WxM = jnp.concatenate([self.conv_q[...], self.conv_k[...], self.conv_v[...]], axis=-1)
        beta_BxSxH = jax.nn.sigmoid(project(self.wb, jnp.float32))
        a_BxSxH = project(self.wa, jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g_BxSxH = -jnp.exp(self.a_log[...].astype(jnp.float32)) * jax.nn.softplus(a_BxSxH)
        if over_context:
            o_BxSxHxV = context.gdn(causal_conv1d, self._split, rule, qkv_BxSxM, w_WxM, g_BxSxH, beta_BxSxH,
                                    segment_ids_BxS)
            conv_state = recurrent = None
        else:
            qkv_BxSxM, conv_state = causal_conv1d(qkv_BxSxM, w_WxM, segment_ids_BxS, state.conv_BxW1xM)
            q_BxSxGxK, k_BxSxGxK, v_BxSxHxV = self._split(qkv_BxSxM)
            resets_BxS = None if segment_ids_BxS is None else document_starts(segment_ids_BxS)
            o_BxSxHxV, recurrent = rule(q_BxSxGxK, k_BxSxGxK, v_BxSxHxV, g_BxSxH, beta_BxSxH,
                                        resets_BxS, state.recurrent_BxHxKxV)
        if segment_ids_BxS is not None:  # padding outputs zero (the gated norm and W_O keep it so)
            o_BxSxHxV = jnp.where((segment_ids_BxS != 0)[..., None, None], o_BxSxHxV, 0.0)
        z_BxSxHxV = project(self.wz, jnp.float32, "gate_proj").reshape(b, s, h, dv)
        y_BxSxHxV = rms_norm(o_BxSxHxV, self.norm[...], spec.norm_eps) * jax.nn.silu(z_BxSxHxV)
        y_NxD = checkpoint_name(dense(checkpoint_name(y_BxSxHxV.reshape(b * s, h * dv), "attn_out"), self.wo,
                                      self.dtype), "out_proj")
        return y_NxD.reshape(b, s, -1), None if over_context else GDNState(conv_state, recurrent)


# --------------------------------------------------------------------------- transformers' tensors
#
# Qwen3-Next packs the projections per key head: in_proj_qkvz's rows are, for each key head j,
# [q_j (K) | k_j (K) | v (H/G value heads of V) | z (same)], in_proj_ba's are [b (H/G) | a (H/G)].
# Qwen3.5 has one projection per role: in_proj_qkv's rows are [all q | all k | all v] (the conv's
# channel order), then in_proj_z, in_proj_b, in_proj_a. Both compute the same layer; the conv's
# channels are [all q | all k | all v] in both. Here each is a parameter of its own.

HF_NAMES = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
            "out_proj.weight")
QWEN3_5_NAMES = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                 "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")
PACKINGS = ("qwen3_next", "qwen3_5")


def hf_names(packing: str = "qwen3_next") -> tuple[str, ...]:
    """The tensor names of one layer in `packing` (a Hugging Face layout: qwen3_next or qwen3_5)."""
    if packing not in PACKINGS:
        raise ConfigError("packing", packing, f"one of {', '.join(PACKINGS)}")
    return HF_NAMES if packing == "qwen3_next" else QWEN3_5_NAMES


def hf_shapes(spec: GDNSpec, packing: str = "qwen3_next") -> dict[str, tuple[int, ...]]:
    """The tensors of one layer in `packing` and their shapes."""
    g, h, dk, dv, d = spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim, spec.d_model
    proj = ({"in_proj_qkv.weight": (2 * g * dk + h * dv, d), "in_proj_z.weight": (h * dv, d),
             "in_proj_b.weight": (h, d), "in_proj_a.weight": (h, d)} if hf_names(packing) == QWEN3_5_NAMES
            else {"in_proj_qkvz.weight": (2 * g * dk + 2 * h * dv, d), "in_proj_ba.weight": (2 * h, d)})
    return {**proj, "conv1d.weight": (spec.conv_dim, 1, spec.conv_kernel), "dt_bias": (h,), "A_log": (h,),
            "norm.weight": (dv,), "out_proj.weight": (d, h * dv)}


def from_hf(tensors: dict[str, np.ndarray], prefix: str, spec: GDNSpec,
            packing: str = "qwen3_next") -> dict[tuple[str, ...], np.ndarray]:
    """transformers' `{prefix}in_proj_qkvz.weight`, ... (prefix e.g. "model.layers.0.linear_attn.";
    `packing` qwen3_next or qwen3_5, above) -> this layer's parameters {path: array}."""
    t = {name: np.asarray(tensors[prefix + name]) for name in hf_names(packing)}
    g, h, dk, dv = spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
    if packing == "qwen3_5":
        q, k, v = np.split(t["in_proj_qkv.weight"], [g * dk, 2 * g * dk])
        z, b, a = t["in_proj_z.weight"], t["in_proj_b.weight"], t["in_proj_a.weight"]
    else:
        r = h // g
        qkvz = t["in_proj_qkvz.weight"].reshape(g, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
        b, a = np.split(t["in_proj_ba.weight"].reshape(g, 2 * r, -1), [r], axis=1)
    conv_q, conv_k, conv_v = np.split(t["conv1d.weight"][:, 0, :].T, [g * dk, 2 * g * dk], axis=1)
    out = {"wq": q.reshape(g * dk, -1).T, "wk": k.reshape(g * dk, -1).T, "wv": v.reshape(h * dv, -1).T,
           "wz": z.reshape(h * dv, -1).T, "wb": b.reshape(h, -1).T, "wa": a.reshape(h, -1).T,
           "conv_q": conv_q, "conv_k": conv_k, "conv_v": conv_v, "dt_bias": t["dt_bias"],
           "a_log": t["A_log"], "norm": t["norm.weight"], "wo": t["out_proj.weight"].T}
    return {(name,): np.ascontiguousarray(value) for name, value in out.items()}


def to_hf(params: dict[tuple[str, ...], np.ndarray], prefix: str, spec: GDNSpec,
          packing: str = "qwen3_next") -> dict[str, np.ndarray]:
    """This layer's parameters {path: array} -> transformers' tensors (the inverse of from_hf)."""
    hf_names(packing)  # (refuses an unknown packing)
    p = {path[-1]: np.asarray(value) for path, value in params.items()}
    g, h, dk, dv = spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
    r = h // g

    def per_key_head(name, rows):  # [D, G * rows] -> [G, rows, D]
        return p[name].T.reshape(g, rows, -1)

    if packing == "qwen3_5":
        out = {"in_proj_qkv.weight": np.concatenate([p["wq"], p["wk"], p["wv"]], axis=1).T,
               "in_proj_z.weight": p["wz"].T, "in_proj_b.weight": p["wb"].T, "in_proj_a.weight": p["wa"].T}
    else:
        qkvz = np.concatenate([per_key_head("wq", dk), per_key_head("wk", dk), per_key_head("wv", r * dv),
                               per_key_head("wz", r * dv)], axis=1)
        ba = np.concatenate([per_key_head("wb", r), per_key_head("wa", r)], axis=1)
        out = {"in_proj_qkvz.weight": qkvz.reshape(-1, spec.d_model), "in_proj_ba.weight": ba.reshape(-1, spec.d_model)}
    conv = np.concatenate([p["conv_q"], p["conv_k"], p["conv_v"]], axis=1).T[:, None, :]
    out.update({"conv1d.weight": conv, "dt_bias": p["dt_bias"], "A_log": p["a_log"], "norm.weight": p["norm"],
                "out_proj.weight": p["wo"].T})
    return {prefix + name: np.ascontiguousarray(value) for name, value in out.items()}
