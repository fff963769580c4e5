"""Small building blocks: parameters with logical axis names, dense, RMSNorm, RoPE (and YaRN), SwiGLU.

Shapes are carried in names, one legend for the whole package: B = batch rows, S = sequence,
N = tokens (B * S: the residual stream is 2-D), D = d_model, H = heads, K = head_dim, F = FFN
width, V = vocabulary, T = cache slots; in the MoE, E = experts, P = experts picked per token
(top-k), M = routed rows (N * P), C = capacity.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from gattn.config import ExecConfig, ModelConfig, YarnSpec

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# What a parameter is for. Its role, not its name, decides whether AdamW decays it (ROLES[role]):
#   weight      projection and embedding matrices, routers, experts: decayed
#   bias        additive biases (attention, the gate's W_theta): not decayed
#   scale       RMSNorm scales (also per head, stacked by scan_layers): not decayed
#   gate_theta  the input-independent gate's logits (Table 4 row 6): decay would pull the gate to 0.5
ROLES = {"weight": True, "bias": False, "scale": False, "gate_theta": False}


def param(role: str, rngs: nnx.Rngs | None, shape, axes: tuple[str, ...], *, std: float = 0.0,
          value: float = 0.0, dtype=jnp.float32) -> nnx.Param:
    """A parameter of `role` (see ROLES) annotated with logical axis names only (the sharding
    table maps them to mesh axes). Normal(0, std) when `std` > 0, otherwise filled with `value`."""
    if role not in ROLES:
        raise ValueError(f"parameter role {role!r} is not one of {sorted(ROLES)}")
    if len(axes) != len(shape):
        raise ValueError(f"axes {axes} do not match shape {shape}")
    if std > 0:
        init = _truncated_normal(rngs.params(), tuple(shape), std)
    else:
        init = jnp.full(shape, value, jnp.float32)
    return nnx.Param(jnp.asarray(init).astype(dtype), out_sharding=axes, eager_sharding=False, role=role)


EAGER_DRAW_MAX = 1 << 22


def _truncated_normal(key: jax.Array, shape: tuple[int, ...], std: float):
    """std * jax.random.truncated_normal(key, -2, 2, shape), the same float32 values. Built eagerly
    (a model made outside jit: tests, notebooks, conversions), every new shape compiled its own
    sampler, ~0.5 s each on 2 cores; threefry's partitionable bits depend on an element's flat
    index only, so a draw of the next power of two elements, cut, gives the same numbers from one
    program per size class. Inside a trace (trainer.init_state's jit, eval_shape, the scanned
    layers' vmap), with another PRNG, or past 4M elements (a draw's own time outweighs a compile):
    the direct draw."""
    if (isinstance(key, jax.core.Tracer) or math.prod(shape) > EAGER_DRAW_MAX
            or not jax.config.jax_threefry_partitionable or str(jax.random.key_impl(key)) != "threefry2x32"):
        return std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
    n = math.prod(shape)
    flat = jax.random.truncated_normal(key, -2.0, 2.0, (1 << max(n - 1, 0).bit_length(),), jnp.float32)
    return np.float32(std) * np.asarray(flat)[:n].reshape(shape)


def dense(x_NxI: jax.Array, w_IxO: nnx.Param | jax.Array, dtype, out_dtype=None) -> jax.Array:
    """x @ w with inputs in the compute dtype; the result in `out_dtype` (default: the compute
    dtype; the LM head asks for float32 so bf16 logits are not rounded). The one matmul every
    projection goes through."""
    return jnp.dot(x_NxI.astype(dtype), jnp.asarray(w_IxO[...]).astype(dtype),
                   preferred_element_type=out_dtype or dtype)


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float, zero_centered: bool = False) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 and returned in x's dtype; the factor is
    `scale`, or 1 + scale when `zero_centered` (model.zero_centered_norm, Qwen3-Next's norms)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if scale is not None:
        y = y * (1.0 + scale.astype(jnp.float32) if zero_centered else scale.astype(jnp.float32))
    return y.astype(x.dtype)


def norm_scale(shape, axes: tuple, cfg: ModelConfig) -> nnx.Param:
    """An RMSNorm's scale parameter: 1, or 0 for a zero-centred norm (which multiplies by 1 + it)."""
    return param("scale", None, shape, axes, value=0.0 if cfg.zero_centered_norm else 1.0,
                 dtype=DTYPES[cfg.param_dtype])


class RMSNorm(nnx.Module):
    """The residual-stream norm of model `cfg`: d_model wide, its eps, dtype and centring."""

    def __init__(self, cfg: ModelConfig):
        self.scale = norm_scale((cfg.d_model,), ("embed",), cfg)
        self.eps, self.zero_centered = cfg.norm_eps, cfg.zero_centered_norm

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps, self.zero_centered)


def rope_frequencies(head_dim: int, base: float, yarn: YarnSpec | None = None) -> tuple[np.ndarray, float]:
    """(theta [head_dim/2], scale): the rotation frequency of each dimension pair and the factor
    on q and k after rotating. Plain RoPE: theta_i = base^(-2i/head_dim), scale 1.

    YaRN (Peng et al. 2023, "NTK-by-parts" and temperature): pair i turns L theta_i / (2 pi) times
    within the original context L. Pairs that turn more than beta_fast times keep theta_i, pairs
    that turn fewer than beta_slow times get theta_i / s, and between the two dimensions (floored
    and ceiled, as the reference code does) the ramp blends linearly; scale = sqrt(1/t) =
    0.1 ln s + 1 unless attention_factor is given. Host constants: the config is static.
    """
    theta = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if yarn is None:
        return theta.astype(np.float32), 1.0

    def dim_turning(turns):  # the (fractional) dimension whose pair turns `turns` times in L
        return head_dim * math.log(yarn.original_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_turning(yarn.beta_fast)), 0)
    high = min(math.ceil(dim_turning(yarn.beta_slow)), head_dim - 1)
    high = high + 0.001 if high == low else high
    ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0.0, 1.0)  # 0: keep, 1: interpolate
    theta = theta * (1 - ramp) + theta / yarn.factor * ramp
    return theta.astype(np.float32), yarn.temperature_factor


def apply_rope(x_NxHxK: jax.Array, positions_N: jax.Array, base: float,
               yarn: YarnSpec | None = None, rope_dim: int | None = None) -> jax.Array:
    """Rotary embedding in the rotate-half layout (pairs dimension i with i + K/2), the layout of
    Qwen/Llama checkpoints, so converted weights need no permutation. Computed as
    x * cos + rotate_half(x) * sin with full-width [N, 1, K] tables: on CPU this form is ~10 ms
    per layer (fwd+bwd, peer shapes) faster than combining the halves with [N, 1, K/2] tables.
    With `yarn`, the frequencies and the scale of `rope_frequencies`. With `rope_dim` < K
    (partial rotary, as Qwen3-Next), only the first rope_dim dims rotate, as a head of that size
    (pairs i and i + rope_dim/2, frequencies over rope_dim); the rest pass through unchanged.

    The angles, cos and sin are float32; the rotation itself runs in x's dtype, as Qwen's and
    Llama's reference code does (transformers casts cos and sin to the activations' dtype). In a
    bf16 model a float32 rotation kept [N, H, K] float32 copies of q and k alive in every layer's
    recomputed backward: dense_1p7b's step on v5p-64 peaked at 28.36 GiB per chip against 27.55
    with the rotation in bf16 (docs/presets.md)."""
    if rope_dim is not None and rope_dim < x_NxHxK.shape[-1]:
        rotated = apply_rope(x_NxHxK[..., :rope_dim], positions_N, base, yarn)
        return jnp.concatenate([rotated, x_NxHxK[..., rope_dim:]], axis=-1)
    k = x_NxHxK.shape[-1]
    theta, scale = rope_frequencies(k, base, yarn)
    angles_NxK2 = positions_N.astype(jnp.float32)[:, None] * jnp.asarray(theta)[None, :]
    cos, sin = jnp.cos(angles_NxK2), jnp.sin(angles_NxK2)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos_Nx1xK = jnp.concatenate([cos, cos], axis=-1)[:, None, :]
    sin_Nx1xK = jnp.concatenate([-sin, sin], axis=-1)[:, None, :]
    x = x_NxHxK
    rotated = jnp.concatenate([x[..., k // 2:], x[..., : k // 2]], axis=-1)
    return x * cos_Nx1xK.astype(x.dtype) + rotated * sin_Nx1xK.astype(x.dtype)


FFN_ACTIVATIONS = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu}


class SwiGLU(nnx.Module):
    """out = (act(x W1) * (x W3)) W2 (Shazeer 2020), the FFN of Qwen-style models. x W1, x W3 and
    the output are named mlpwi_0, mlpwi_1 and mlpwo for exec.remat's policies."""

    def __init__(self, cfg: ModelConfig, d_ff: int, ex: ExecConfig = ExecConfig(), *, rngs: nnx.Rngs):
        pd, std = DTYPES[cfg.param_dtype], cfg.init_std
        self.w1 = param("weight", rngs, (cfg.d_model, d_ff), ("embed", "mlp"), std=std, dtype=pd)
        self.w3 = param("weight", rngs, (cfg.d_model, d_ff), ("embed", "mlp"), std=std, dtype=pd)
        self.w2 = param("weight", rngs, (d_ff, cfg.d_model), ("mlp", "embed"), std=std, dtype=pd)
        self.act = FFN_ACTIVATIONS[cfg.ffn_activation]
        self.dtype = DTYPES[ex.dtype]

    def __call__(self, x_NxD):
        h_NxF = (self.act(checkpoint_name(dense(x_NxD, self.w1, self.dtype), "mlpwi_0"))
                 * checkpoint_name(dense(x_NxD, self.w3, self.dtype), "mlpwi_1"))
        return checkpoint_name(dense(h_NxF, self.w2, self.dtype), "mlpwo")
