"""The gate of the paper (Eq. 5) at any position, and the non-gate non-linearities at G1.

A gate is data (`GateSpec`); this module turns it into parameters and an operation on the tensor
at its position. All positions view their tensor as [N, heads, width]:

    position      tensor                 heads   width (elementwise / headwise)
    sdpa  (G1)    SDPA output Y          q       head_dim / 1
    value (G2)    X W_V                  k       head_dim / 1
    key   (G3)    X W_K                  k       head_dim / 1
    query (G4)    X W_Q                  q       head_dim / 1
    dense (G5)    O = Y W_O              1       d_model

The gate reads X, the block's input after its pre-attention RMSNorm, of the *current* token.
Head-shared gates compute the head-specific score and average it over the head axis (Sec. 3.2.1),
so they keep the head-specific parameter count (Table 1 rows 12-13). Input-independent gates
(Table 4 row 6) replace X W_theta with a learnable [heads, width] tensor, zero-initialised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from gattn.config import ExecConfig, GateSpec, ModelConfig
from gattn.model.capture import NOTHING, Capture
from gattn.model.layers import DTYPES, dense, param, rms_norm

# Logical axis of the gate's head axis at each position (the dense position has none).
HEAD_AXIS = {"sdpa": "heads", "query": "heads", "value": "kv_heads", "key": "kv_heads", "dense": None}


def ns_sigmoid(x):
    """Non-sparse sigmoid (Sec. 4.2): 0.5 + 0.5 * sigmoid(x), in [0.5, 1]."""
    return 0.5 + 0.5 * jax.nn.sigmoid(x)


ACTIVATIONS = {"sigmoid": jax.nn.sigmoid, "silu": jax.nn.silu, "ns_sigmoid": ns_sigmoid,
               "identity": lambda x: x}


class Gate(nnx.Module):
    """Y' = Y * act(X W_theta) (multiplicative) or Y + act(X W_theta) (additive)."""

    def __init__(self, spec: GateSpec, cfg: ModelConfig, ex: ExecConfig = ExecConfig(), *, rngs: nnx.Rngs):
        self.spec = spec
        self.heads, self.width = spec.shape(cfg)  # see the table in the module docstring
        axis = HEAD_AXIS[spec.position]
        pd = DTYPES[cfg.param_dtype]
        if spec.input_dependent:
            self.w = param("weight", rngs, (cfg.d_model, self.heads * self.width), ("embed", axis or "mlp"),
                           std=cfg.init_std, dtype=pd)
            if cfg.attention_bias:  # the gate's slice of a widened q_proj's bias (gattn/interop/decoder.py)
                self.b = param("bias", None, (self.heads * self.width,), (axis or "mlp",), dtype=pd)
        else:
            self.theta = param("gate_theta", None, (self.heads, self.width), (axis, None), value=0.0, dtype=pd)
        self.act = ACTIVATIONS[spec.activation]
        self.dtype = DTYPES[ex.dtype]

    def logits(self, x_NxD: jax.Array) -> jax.Array:
        """X W_theta as [N, heads, width] (or [1, heads, width] when input-independent)."""
        if self.spec.input_dependent:
            z = dense(x_NxD, self.w, self.dtype)
            if hasattr(self, "b"):
                z = z + self.b[...].astype(self.dtype)
            return checkpoint_name(z, "gate_proj").reshape(-1, self.heads, self.width)
        return self.theta[...][None]

    def scores(self, x_NxD: jax.Array) -> jax.Array:
        """act(X W_theta) as [N, heads, width] (or [1, heads, width] when input-independent),
        with the head axis averaged to 1 when head-shared. Computed in float32."""
        s = self.act(self.logits(x_NxD).astype(jnp.float32))
        if self.spec.sharing == "head_shared":
            s = jnp.mean(s, axis=1, keepdims=True)
        return s

    def __call__(self, y_NxHxW: jax.Array, x_NxD: jax.Array, capture: Capture = NOTHING) -> jax.Array:
        s = self.scores(x_NxD)
        if capture.gate:
            self.sow(nnx.Intermediate, "gate_scores", jnp.broadcast_to(s, (y_NxHxW.shape[0],) + s.shape[1:]))
        y = y_NxHxW.astype(jnp.float32)
        out = y * s if self.spec.form == "multiplicative" else y + s
        if capture.gate:  # what the gate acts on and what it returns (Fig. 5)
            self.sow(nnx.Intermediate, "gate_input", y_NxHxW)
            self.sow(nnx.Intermediate, "gated", out.astype(y_NxHxW.dtype))
        return out.astype(y_NxHxW.dtype)


def sdpa_nonlinearity(kind: str, y_NxHxK: jax.Array, scale_K: jax.Array | None, eps: float):
    """Table 3: RMSNorm applied to each head independently, with its own [head_dim] scale per head
    ('SDPA GroupNorm', row 5; scale_K is [heads, head_dim]), or parameter-free SiLU (row 6) on Y."""
    if kind == "rmsnorm":
        return rms_norm(y_NxHxK, scale_K, eps)
    if kind == "silu":
        return jax.nn.silu(y_NxHxK)
    return y_NxHxK
