"""The GPU attention paths against the reference: the fused Pallas kernel for GPUs (flash_gpu.py,
interpret mode here), its Triton lowering (the custom calls a GPU would compile, lowered on this
CPU host), cuDNN + gate (cudnn.py; JAX's XLA implementation off a GPU) and the `auto` dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gattn import kernels
from gattn.kernels.flash_gpu import GpuBlockSizes, gated_flash_attention_gpu
from gattn.kernels.reference import attention_xla

BLOCKS = GpuBlockSizes(16, 16, 16, 16)


def _inputs(b, s, hq, hk, d, gate, segments, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, s, hq, d))
    k = jax.random.normal(ks[1], (b, s, hk, d))
    v = jax.random.normal(ks[2], (b, s, hk, d))
    g = {None: None, "elementwise": jax.random.normal(ks[3], (b, s, hq, d)),
         "headwise": jax.random.normal(ks[3], (b, s, hq))}[gate]
    ids = None
    if segments:  # two documents, then padding (id 0)
        third = s // 3
        ids = jnp.concatenate([jnp.full((b, third), 1), jnp.full((b, third), 2),
                               jnp.zeros((b, s - 2 * third), int)], axis=1).astype(jnp.int32)
    return q, k, v, g, ids


def _compare(fn, b, s, hq, hk, d, gate, segments, causal, tol=1e-5):
    q, k, v, g, ids = _inputs(b, s, hq, hk, d, gate, segments)
    args = (q, k, v) if g is None else (q, k, v, g)

    def grads(f):  # output and gradients under a non-uniform cotangent (every term matters)
        def run(*args):
            y, vjp = jax.vjp(lambda *a: f(*a[:3], a[3] if len(a) > 3 else None, causal=causal,
                                          segment_ids=ids), *args)
            return y, vjp(jnp.cos(y))
        return jax.jit(run)(*args)  # one program: far faster than op-by-op here

    (y, got), (y_ref, want) = grads(fn), grads(attention_xla)
    np.testing.assert_allclose(y, y_ref, atol=tol * float(jnp.max(jnp.abs(y_ref))))
    for name, a, r in zip("qkvg", got, want):
        np.testing.assert_allclose(a, r, atol=tol * max(1.0, float(jnp.max(jnp.abs(r)))), err_msg=f"d{name}")
    if ids is not None:  # padding queries: exactly zero output
        assert float(jnp.max(jnp.abs(jnp.where((ids == 0)[:, :, None, None], y, 0)))) == 0.0


def kernel(q, k, v, g, **kw):
    return gated_flash_attention_gpu(q, k, v, g, block_sizes=BLOCKS, interpret=True, **kw)


@pytest.mark.parametrize("shape, gate, segments, causal", [
    ((1, 20, 4, 2, 16), "elementwise", True, True),   # GQA 2, packed + padding, length not a block multiple
    ((1, 20, 2, 1, 24), "headwise", False, True),     # GQA 2 (MQA), head_dim padded to 32
])
def test_gpu_kernel_matches_reference(shape, gate, segments, causal):
    _compare(kernel, *shape, gate, segments, causal)


@pytest.mark.slow
@pytest.mark.parametrize("shape, gate, segments, causal", [
    ((2, 20, 2, 2, 16), None, False, False),
    ((1, 45, 4, 2, 16), "headwise", True, False),
    ((1, 37, 4, 2, 16), "elementwise", True, True),
    ((1, 40, 4, 1, 32), "headwise", False, True),
    ((2, 64, 8, 2, 64), "elementwise", True, True),
    ((1, 29, 2, 2, 128), "elementwise", False, False),
])
def test_gpu_kernel_matches_reference_more(shape, gate, segments, causal):
    _compare(kernel, *shape, gate, segments, causal)


@pytest.mark.slow
def test_gpu_kernel_bfloat16_inputs():
    q, k, v, g, ids = _inputs(1, 32, 4, 2, 16, "elementwise", True)
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    y = kernel(bf(q), bf(k), bf(v), bf(g), causal=True, segment_ids=ids)
    ref = attention_xla(bf(q).astype(jnp.float32), bf(k).astype(jnp.float32), bf(v).astype(jnp.float32),
                        bf(g).astype(jnp.float32), causal=True, segment_ids=ids)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(y.astype(jnp.float32), ref, atol=2e-2 * float(jnp.max(jnp.abs(ref))))


@pytest.mark.parametrize("gate", [None, "elementwise", "headwise"])
def test_gpu_kernel_lowers_to_triton(gate):
    """Forward and backward lower for CUDA on this CPU host: three Triton custom calls (forward,
    dK/dV, dQ), bfloat16, GQA 3 (gpu_125m's heads) and 4, segment ids, head_dim 64 and 128, a
    length of no block multiple.
    (Triton's own compile to PTX happens on a GPU only: bench/gpu_check.sh.)"""
    for d, hq, hk in ((64, 12, 4), (128, 8, 2)):
        b, s = 2, 1000
        q = jax.ShapeDtypeStruct((b, s, hq, d), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((b, s, hk, d), jnp.bfloat16)
        ids = jax.ShapeDtypeStruct((b, s), jnp.int32)
        g = {None: None, "elementwise": q, "headwise": jax.ShapeDtypeStruct((b, s, hq), jnp.bfloat16)}[gate]

        def loss(q, k, v, g, ids):
            y = gated_flash_attention_gpu(q, k, v, g, segment_ids=ids, interpret=False,
                                          block_sizes=GpuBlockSizes(64, 64, 64, 64))
            return jnp.sum(y.astype(jnp.float32))

        grad = jax.jit(jax.grad(loss, (0, 1, 2) if g is None else (0, 1, 2, 3)))
        text = grad.trace(q, kv, kv, g, ids).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 3, text.count("xla.gpu.triton")
        for name in ("gated_flash_fwd_gpu", "gated_flash_dkv_gpu", "gated_flash_dq_gpu"):
            assert name in text


def test_gpu_block_sizes_are_checked():
    with pytest.raises(ValueError, match="block_sizes.block_k = 48: must be a power of two"):
        GpuBlockSizes(block_k=48)


def test_cudnn_path_matches_reference_off_gpu():
    """The cuDNN wrapper's masks, GQA and separate gate (JAX's XLA implementation here)."""
    _compare(kernels.attention_cudnn, 1, 24, 4, 2, 16, "headwise", True, True)


def test_auto_picks_per_backend():
    assert kernels.resolve("auto", "tpu") == "pallas"
    assert kernels.resolve("auto", "gpu") == kernels.GPU_DEFAULT == "pallas_gpu"
    assert kernels.resolve("auto", "cpu") == "xla"
    assert kernels.resolve("cudnn", "tpu") == "cudnn"  # an explicit choice is kept
    assert kernels.resolve("auto") == "xla"  # this CPU host


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas_gpu", "cudnn"])
@pytest.mark.parametrize("variant", ["sdpa_elementwise", "sdpa_headwise"])
def test_gpu_attention_in_the_model_matches_xla(impl, variant):
    """A model with exec.attention_impl=pallas_gpu (interpret mode) or cudnn (XLA's implementation
    here) has the xla model's loss and gradients, packed rows and padding included."""
    from flax import nnx

    from conftest import tiny_model
    from gattn import variants
    from gattn.config import ExecConfig
    from gattn.model.transformer import Transformer
    from gattn.train.loss import lm_loss

    cfg = variants.apply(variant, tiny_model())
    xla = Transformer(cfg, ExecConfig(), rngs=nnx.Rngs(0))
    other = Transformer(cfg, ExecConfig(attention_impl=impl), rngs=nnx.Rngs(1))
    nnx.update(other, nnx.state(xla, nnx.Param))
    x = jax.random.randint(jax.random.key(0), (2, 20), 0, cfg.vocab_size)
    seg = jnp.asarray([[1] * 12 + [2] * 6 + [0] * 2, [1] * 20])
    pos = jnp.asarray([list(range(12)) + list(range(6)) + [0, 0], list(range(20))])
    grads = lambda m: nnx.value_and_grad(lambda m: lm_loss(m, x, seg, pos))(m)  # noqa: E731
    (l_x, g_x), (l_o, g_o) = grads(xla), grads(other)
    np.testing.assert_allclose(l_o, l_x, rtol=1e-5)
    flat_x, flat_o = dict(nnx.to_flat_state(g_x)), dict(nnx.to_flat_state(g_o))
    for path in flat_x:
        a, b = np.asarray(flat_o[path][...]), np.asarray(flat_x[path][...])
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, np.abs(b).max()), err_msg=str(path))
