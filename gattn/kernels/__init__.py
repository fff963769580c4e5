"""Attention kernels: pure functions on arrays that know nothing of the model.

`attention` is the one entry point the model calls; `impl` picks the implementation:

    xla     plain jnp (reference.py): the reference every other implementation is tested against
    pallas  flash attention in Pallas with the sigmoid output gate fused in (flash.py); compiled
            by Mosaic on TPU, run in interpret mode elsewhere
    pallas_gpu  the same kernel for GPUs, Pallas' Triton lowering (flash_gpu.py); interpret mode
            off a GPU
    cudnn   cuDNN flash attention via jax.nn.dot_product_attention, the gate applied after it
            (cudnn.py); JAX's XLA implementation of that call off a GPU
    auto    per backend (`resolve`): TPU -> pallas, GPU -> GPU_DEFAULT, anything else -> xla

Both take an optional `gate` (logits, [B, S, Hq, K] or [B, S, Hq]) and return
attention(q, k, v) * sigmoid(gate). `shard_attention` wraps either for a device mesh; the
dispatcher does so for `pallas` under the mesh set by `jax.set_mesh` (as the trainer does).
"""

from __future__ import annotations

import jax

from gattn.kernels.standin import enabled as standin_enabled
from gattn.kernels.cudnn import attention_cudnn
from gattn.kernels.flash import BlockSizes, gated_flash_attention
from gattn.kernels.flash_gpu import GpuBlockSizes, gated_flash_attention_gpu
from gattn.kernels.reference import attention_masked, attention_xla
from gattn.kernels.sharded import on_context_mesh, shard_attention


def attention_pallas(q, k, v, gate=None, *, causal: bool = True, segment_ids=None,
                     sm_scale: float | None = None, block_q: int = 512, block_k: int = 512,
                     return_probs: bool = False, interpret: bool | None = None,
                     kv_segment_ids=None, return_lse: bool = False):
    """The fused kernel behind the dispatcher's keyword set (`kv_segment_ids`, `return_lse`: see
    `gated_flash_attention`)."""
    if return_probs:
        raise ValueError("attention impl 'pallas' never forms the attention matrix; "
                         "use impl 'xla' to return probabilities")
    if interpret is not False and standin_enabled(jax.default_backend()):
        return attention_xla(q, k, v, gate, causal=causal, segment_ids=segment_ids, sm_scale=sm_scale,
                             kv_segment_ids=kv_segment_ids, return_lse=return_lse)
    return gated_flash_attention(q, k, v, gate, causal=causal, segment_ids=segment_ids,
                                 sm_scale=sm_scale, block_sizes=BlockSizes(block_q, block_k),
                                 interpret=interpret, kv_segment_ids=kv_segment_ids,
                                 return_lse=return_lse)


def attention_pallas_gpu(q, k, v, gate=None, *, causal: bool = True, segment_ids=None,
                         sm_scale: float | None = None, block_q: int | None = None,
                         block_k: int | None = None, return_probs: bool = False,
                         interpret: bool | None = None):
    """The fused GPU kernel behind the dispatcher's keyword set (blocks: GpuBlockSizes' defaults
    unless given)."""
    if return_probs:
        raise ValueError("attention impl 'pallas_gpu' never forms the attention matrix; "
                         "use impl 'xla' to return probabilities")
    blocks = GpuBlockSizes()
    if block_q or block_k:
        blocks = GpuBlockSizes(block_q=block_q or blocks.block_q, block_k=block_k or blocks.block_k)
    return gated_flash_attention_gpu(q, k, v, gate, causal=causal, segment_ids=segment_ids,
                                     sm_scale=sm_scale, block_sizes=blocks, interpret=interpret)


# What `auto` runs on a GPU. The fused kernel: it applies the gate without an HBM round trip of
# the ungated output and handles packed sequences without an [S, T] mask, which cuDNN needs as a
# bias. Measured on an H200 (docs/gpu.md#results, 2026-12-04): in gpu_125m's bf16 training step at
# S = 2048 it is 1.04x faster than cudnn + gate (gated) and even (baseline); the kernel alone is
# 1.26x (2k) to 1.49x (8k) slower than cuDNN, so long sequences may favour `cudnn`.
GPU_DEFAULT = "pallas_gpu"


def resolve(impl: str, platform: str | None = None) -> str:
    """The implementation `impl` names on `platform` (default: the context mesh's, else the
    default backend's): `auto` picks per backend, every other name is itself."""
    if impl != "auto":
        return impl
    if platform is None:
        mesh = jax.sharding.get_abstract_mesh()
        device = None if mesh.empty else getattr(mesh, "abstract_device", None)
        platform = device.platform if device is not None else jax.default_backend()
    if platform == "tpu":
        return "pallas"
    return GPU_DEFAULT if platform in ("gpu", "cuda", "rocm") else "xla"


def _auto(q, k, v, gate=None, **kwargs):
    return IMPLS[resolve("auto")](q, k, v, gate, **kwargs)


IMPLS = {"xla": attention_xla, "pallas": attention_pallas, "pallas_gpu": attention_pallas_gpu,
         "cudnn": attention_cudnn, "auto": _auto}


def attention(q, k, v, gate=None, *, impl: str = "xla", **kwargs):
    """Runs the attention implementation named by `impl` (the model's `attention_impl`; `auto` is
    resolved for the platform first)."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} is not available; implemented: {sorted(IMPLS)}")
    impl = resolve(impl)
    fn = IMPLS[impl]
    if impl in ("pallas", "pallas_gpu"):  # Pallas kernels are not auto-partitioned: shard_map over the mesh
        fn = on_context_mesh(fn)
    return fn(q, k, v, gate, **kwargs)


__all__ = ["GPU_DEFAULT", "IMPLS", "BlockSizes", "GpuBlockSizes", "attention", "attention_cudnn",
           "attention_masked", "attention_pallas", "attention_pallas_gpu", "attention_xla",
           "gated_flash_attention_gpu", "resolve", "gated_flash_attention", "on_context_mesh", "shard_attention"]
