"""Attention kernels: pure functions on arrays that know nothing of the model.

`attention` is the one entry point the model calls; `impl` picks the implementation:

    xla     plain jnp (reference.py): the reference every other implementation is tested against
    pallas  flash attention in Pallas with the sigmoid output gate fused in (flash.py); compiled
            by Mosaic on TPU, run in interpret mode elsewhere

Both take an optional `gate` (logits, [B, S, Hq, K] or [B, S, Hq]) and return
attention(q, k, v) * sigmoid(gate). `shard_attention` wraps either for a device mesh; the
dispatcher does so for `pallas` under the mesh set by `jax.set_mesh` (as the trainer does).
"""

from __future__ import annotations

from gattn.kernels.flash import BlockSizes, gated_flash_attention
from gattn.kernels.reference import attention_masked, attention_xla
from gattn.kernels.sharded import on_context_mesh, shard_attention


def attention_pallas(q, k, v, gate=None, *, causal: bool = True, segment_ids=None,
                     sm_scale: float | None = None, block_q: int = 512, block_k: int = 512,
                     return_probs: bool = False, interpret: bool | None = None):
    """The fused kernel behind the dispatcher's keyword set."""
    if return_probs:
        raise ValueError("attention impl 'pallas' never forms the attention matrix; "
                         "use impl 'xla' to return probabilities")
    return gated_flash_attention(q, k, v, gate, causal=causal, segment_ids=segment_ids,
                                 sm_scale=sm_scale, block_sizes=BlockSizes(block_q, block_k),
                                 interpret=interpret)


IMPLS = {"xla": attention_xla, "pallas": attention_pallas}


def attention(q, k, v, gate=None, *, impl: str = "xla", **kwargs):
    """Runs the attention implementation named by `impl` (the model's `attention_impl`)."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} is not available; implemented: {sorted(IMPLS)}")
    fn = IMPLS[impl]
    if impl == "pallas":  # Mosaic kernels are not auto-partitioned: shard_map over the mesh
        fn = on_context_mesh(fn)
    return fn(q, k, v, gate, **kwargs)


__all__ = ["IMPLS", "BlockSizes", "attention", "attention_masked", "attention_pallas",
           "attention_xla", "gated_flash_attention", "on_context_mesh", "shard_attention"]
