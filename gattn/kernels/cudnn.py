"""cuDNN flash attention (through `jax.nn.dot_product_attention`) with the gate applied after it.

The GPU alternative to the fused Pallas kernel (flash_gpu.py): cuDNN computes the attention,
then XLA multiplies by sigmoid(gate), one extra HBM round trip of the ungated output. Packed
sequences become an explicit [B, 1, S, T] mask (same document, and no query of id 0 sees
anything), which cuDNN takes as a bias; padding queries are then set to exactly 0, as in the
reference. Off a GPU there is no cuDNN: the same call runs JAX's XLA implementation, so tests on
CPU check this wrapper (masks, GQA, gate), not cuDNN itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gattn.kernels.reference import check_inputs


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def attention_cudnn(q, k, v, gate=None, *, causal: bool = True, segment_ids=None,
                    sm_scale: float | None = None, return_probs: bool = False,
                    implementation: str | None = None):
    """jax.nn.dot_product_attention(q, k, v) [* sigmoid(gate)], the reference's contract.
    `implementation`: "cudnn" (default on a GPU) or "xla" (default elsewhere)."""
    if return_probs:
        raise ValueError("attention impl 'cudnn' never forms the attention matrix; "
                         "use impl 'xla' to return probabilities")
    kind = check_inputs(q, k, v, segment_ids, gate)
    if implementation is None:
        implementation = "cudnn" if _on_gpu() else "xla"
    mask = None
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = (same & (segment_ids != 0)[:, :, None])[:, None]  # [B, 1, S, T]
    if implementation == "cudnn" and q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"attention impl 'cudnn' needs bfloat16 or float16 inputs (got {q.dtype}); "
                         "set exec.dtype=bfloat16")
    o = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask,
                                     scale=sm_scale, is_causal=causal, implementation=implementation)
    if segment_ids is not None:
        o = jnp.where((segment_ids != 0)[:, :, None, None], o, 0).astype(o.dtype)
    if kind is not None:
        g = gate.reshape(q.shape[:3] + (-1,)).astype(jnp.float32)
        o = (o.astype(jnp.float32) * jax.nn.sigmoid(g)).astype(o.dtype)
    return o
