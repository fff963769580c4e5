"""The Pallas gated flash-attention kernel against the xla reference, in interpret mode on CPU.

Tolerances: float32 inputs agree to 1e-5 (values and gradients; both sides accumulate in float32
but sum in different orders). bfloat16 inputs are compared with the float32 reference on the same
(bf16-rounded) inputs, to 2e-2 relative to the largest magnitude: the kernel rounds p to bf16
before p @ v and its output to bf16, as the xla path does.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gattn.kernels import BlockSizes, attention_xla, gated_flash_attention

import multidevice

BLOCKS = BlockSizes(block_q=8, block_k=16, block_q_dkv=16, block_k_dkv=8)


def _inputs(seed, b, s, hq, hk, d, gate, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    q, k, v = arr(b, s, hq, d), arr(b, s, hk, d), arr(b, s, hk, d)
    g = {None: None, "elementwise": lambda: arr(b, s, hq, d), "headwise": lambda: arr(b, s, hq)}[gate]
    return q, k, v, (g() if callable(g) else g)


def _segments(b, s):
    """Row 0: two documents then 5 padding tokens; other rows: one document."""
    seg = np.ones((b, s), np.int32)
    seg[0, s // 2:] = 2
    seg[0, -5:] = 0
    return jnp.asarray(seg)


def _compare(q, k, v, g, *, causal, seg, atol, blocks=BLOCKS):
    kernel = lambda q, k, v, g: gated_flash_attention(q, k, v, g, causal=causal, segment_ids=seg,
                                                      block_sizes=blocks, interpret=True)
    ref = lambda q, k, v, g: attention_xla(q.astype(jnp.float32), k.astype(jnp.float32),
                                           v.astype(jnp.float32), None if g is None else g.astype(jnp.float32),
                                           causal=causal, segment_ids=seg)
    y, y_ref = kernel(q, k, v, g), ref(q, k, v, g)
    assert y.shape == q.shape and y.dtype == q.dtype
    scale = float(jnp.abs(y_ref).max())
    np.testing.assert_allclose(np.asarray(y, np.float32), y_ref, atol=atol * scale, rtol=0)

    w = jnp.asarray(np.random.default_rng(1).normal(size=y.shape), jnp.float32)
    argnums = (0, 1, 2) if g is None else (0, 1, 2, 3)
    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w)
    grads = jax.grad(loss(kernel), argnums)(q, k, v, g)
    grads_ref = jax.grad(loss(ref), argnums)(q, k, v, g)
    for name, a, b in zip("qkvg", grads, grads_ref):
        assert a.dtype == q.dtype, name
        scale = float(jnp.abs(b).max())
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   atol=atol * scale, rtol=0, err_msg=f"d{name}")


# (seq, q_heads, kv_heads, head_dim, causal, gate, segments): every axis of the matrix
# appears at least once; sequences 20/37/45 are not multiples of the 8/16 blocks. The dK/dV kernel
# runs on its own 16 x 8 blocks, so block boundaries differ between the passes.
CASES = [
    (32, 2, 2, 16, True, "elementwise", False),   # GQA 1, blocks divide the sequence
    (20, 4, 2, 16, True, "headwise", False),      # GQA 2, ragged sequence
    (37, 4, 1, 32, False, "elementwise", False),  # GQA 4, not causal, ragged
    (45, 4, 2, 16, True, "elementwise", True),    # segment ids with padding
    # Kept out of the default run (time): their axes appear in the cases above too.
    pytest.param(24, 4, 4, 16, False, "headwise", True, marks=pytest.mark.slow),  # non-causal, segments
    pytest.param(20, 2, 1, 16, True, None, False, marks=pytest.mark.slow),        # plain flash attention
    (24, 2, 1, 128, True, "elementwise", True),   # head_dim 128: heads-in-lanes layout
]


@pytest.mark.parametrize("s, hq, hk, d, causal, gate, segments", CASES)
def test_float32_values_and_gradients_match_reference(s, hq, hk, d, causal, gate, segments):
    b = 2
    q, k, v, g = _inputs(s, b, s, hq, hk, d, gate)
    _compare(q, k, v, g, causal=causal, seg=_segments(b, s) if segments else None, atol=1e-5)


@pytest.mark.parametrize("gate, segments, d", [
    ("elementwise", True, 16), pytest.param("headwise", False, 128, marks=pytest.mark.slow)])
def test_bfloat16_values_and_gradients_match_reference(gate, segments, d):
    b, s = 2, 29
    q, k, v, g = _inputs(3, b, s, 4, 2, d, gate, jnp.bfloat16)
    _compare(q, k, v, g, causal=True, seg=_segments(b, s) if segments else None, atol=2e-2)


def test_default_blocks_and_headwise_gate_with_trailing_axis():
    """Default (TPU) block sizes shrink to a short sequence; [B,S,Hq,1] equals [B,S,Hq]."""
    q, k, v, g = _inputs(4, 1, 40, 2, 1, 16, "headwise")
    y3 = gated_flash_attention(q, k, v, g, interpret=True)
    y4 = gated_flash_attention(q, k, v, g[..., None], interpret=True)
    np.testing.assert_array_equal(y3, y4)
    np.testing.assert_allclose(y3, attention_xla(q, k, v, g), atol=1e-5)


def test_padding_queries_output_zero_and_get_zero_gradients():
    b, s = 2, 21
    q, k, v, g = _inputs(5, b, s, 2, 1, 16, "elementwise")
    seg = _segments(b, s)
    f = lambda q, k, v, g: gated_flash_attention(q, k, v, g, segment_ids=seg, block_sizes=BLOCKS,
                                                 interpret=True)
    y = f(q, k, v, g)
    assert bool(jnp.isfinite(y).all())
    pad = np.asarray(seg == 0)
    assert pad.sum() == 5 and np.all(np.asarray(y)[pad] == 0)
    dq, dk, dv, dg = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), (0, 1, 2, 3))(q, k, v, g)
    for name, grad in zip("qkvg", (dq, dk, dv, dg)):
        assert bool(jnp.isfinite(grad).all()), name
        assert np.all(np.asarray(grad)[pad] == 0), name  # padding neither attends nor is attended
    assert np.abs(np.asarray(dk)[~pad]).max() > 0


def test_fused_gate_equals_gating_the_ungated_kernel():
    q, k, v, g = _inputs(6, 1, 24, 2, 2, 16, "elementwise")
    fused = gated_flash_attention(q, k, v, g, block_sizes=BLOCKS, interpret=True)
    plain = gated_flash_attention(q, k, v, block_sizes=BLOCKS, interpret=True)
    np.testing.assert_allclose(fused, plain * jax.nn.sigmoid(g), atol=1e-6)


def test_sm_scale_is_used():
    q, k, v, _ = _inputs(7, 1, 16, 2, 1, 16, None)
    y = gated_flash_attention(q, k, v, sm_scale=0.3, block_sizes=BLOCKS, interpret=True)
    np.testing.assert_allclose(y, attention_xla(q, k, v, sm_scale=0.3), atol=1e-5)
    assert np.abs(np.asarray(y - attention_xla(q, k, v))).max() > 1e-3


@pytest.mark.parametrize("make, match", [
    (lambda q, k, v: (q, k, v, q[..., :3]), r"gate \(1, 16, 4, 3\)"),
    (lambda q, k, v: (q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), None), "multiple of kv_heads"),
    (lambda q, k, v: (q, k[:, :8], v, None), "expected q"),
    (lambda q, k, v: (q, k[:, :8], v[:, :8], None), "causal attention needs at least"),
])
def test_bad_shapes_raise_clear_errors(make, match):
    q, k, v, _ = _inputs(8, 1, 16, 4, 2, 16, None)
    q, k, v, g = make(q, k, v)
    with pytest.raises(ValueError, match=match):
        gated_flash_attention(q, k, v, g, interpret=True)


def test_bad_block_sizes_raise():
    with pytest.raises(ValueError, match="block_sizes.block_k = 100"):
        BlockSizes(block_q=128, block_k=100)
    with pytest.raises(ValueError, match="block_sizes.block_k_dkv = 0"):
        BlockSizes(block_k_dkv=0)
    q, k, v, _ = _inputs(9, 1, 256, 2, 1, 16, None)
    with pytest.raises(ValueError, match="multiples of 128"):
        gated_flash_attention(q, k, v, block_sizes=BlockSizes(8, 64), interpret=False)
    with pytest.raises(ValueError, match="dkv 128 x 64"):
        gated_flash_attention(q, k, v, block_sizes=BlockSizes(128, 128, 128, 64), interpret=False)


def test_shard_attention_over_batch_and_heads_matches_reference():
    """8 simulated devices, mesh (data 2, model 4): each device runs the kernel on its rows and
    heads; values and gradients equal the unsharded reference (tests/multidevice/sharded_flash.py)."""
    assert "ok 8" in multidevice.run("sharded_flash", "--mesh", "2,4")


def test_mixed_dtypes_float_or_cross_attention_segment_ids_are_refused():
    """Static checks, shared by every implementation (reference.check_inputs): named arrays, dtypes
    and the real cause."""
    q, k, v, g = _inputs(10, 1, 16, 4, 2, 16, "elementwise")
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    seg = jnp.ones((1, 16), jnp.int32)
    for args, match in [((q, bf(k), v, g), "k has dtype bfloat16 but q has float32"),
                        ((q, k, v, bf(g)), "gate has dtype bfloat16 but q has float32"),
                        ((bf(q), bf(k), bf(v), g), "gate has dtype float32 but q has bfloat16")]:
        for fn in (gated_flash_attention, attention_xla):
            with pytest.raises(ValueError, match=match):
                fn(*args)
    with pytest.raises(ValueError, match="segment_ids has dtype float32: expected an integer dtype"):
        gated_flash_attention(q, k, v, g, segment_ids=seg.astype(jnp.float32), interpret=True)
    with pytest.raises(ValueError, match=r"segment_ids need self-attention .*: k/v length 8 != q length 16"):
        gated_flash_attention(q, k[:, :8], v[:, :8], g, causal=False, segment_ids=seg, interpret=True)
    with pytest.raises(ValueError, match=r"segment_ids \(1, 15\) must be \[B, S\] = \(1, 16\)"):
        attention_xla(q, k, v, g, segment_ids=seg[:, :15])


def test_segment_ids_beyond_float32_exactness():
    """Ids >= 2**24 would merge in the kernel's float32 pass: concrete ones are refused;
    dense_segment_ids renumbers them (in-graph) with the same segmentation."""
    from gattn.kernels.flash import MAX_SEGMENT_ID, dense_segment_ids

    q, k, v, _ = _inputs(11, 1, 16, 2, 1, 16, None)
    big = np.full((1, 16), MAX_SEGMENT_ID, np.int64)
    big[0, 8:] = MAX_SEGMENT_ID + 1  # two documents whose ids are the same float32
    big[0, -2:] = 0
    big = jnp.asarray(big, jnp.int32)
    with pytest.raises(ValueError, match="segment_ids hold 16777217: .*exact only for \\|id\\| < 2\\*\\*24"):
        gated_flash_attention(q, k, v, segment_ids=big, interpret=True)
    dense = jax.jit(dense_segment_ids)(big)
    assert dense.tolist() == [[2] * 8 + [3] * 6 + [0] * 2]
    ids = jnp.asarray([[5, 5, -3, 0, 7, -3], [0, 0, 1, 1, 9, 9]], jnp.int32)
    same = lambda x: np.asarray(x[:, :, None] == x[:, None, :])  # noqa: E731
    d = dense_segment_ids(ids)
    assert (same(d) == same(ids)).all() and ((d == 0) == (ids == 0)).all() and int(d.max()) <= 6


@pytest.mark.slow  # the kernel in interpret mode: ~5 s
def test_dense_segment_ids_give_the_kernel_the_reference_answer():
    from gattn.kernels.flash import MAX_SEGMENT_ID, dense_segment_ids

    q, k, v, _ = _inputs(11, 1, 16, 2, 1, 16, None)
    big = jnp.asarray([[MAX_SEGMENT_ID] * 8 + [MAX_SEGMENT_ID + 1] * 6 + [0] * 2], jnp.int32)
    y = gated_flash_attention(q, k, v, segment_ids=dense_segment_ids(big), block_sizes=BLOCKS, interpret=True)
    np.testing.assert_allclose(y, attention_xla(q, k, v, segment_ids=big), atol=1e-5)


def _grids(f, *args):
    """name -> grid of every pallas_call in the trace of `f` (sub-jaxprs included)."""
    found = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found[eqn.params["name"]] = tuple(eqn.params["grid_mapping"].grid)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else [value]:
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return found


@pytest.mark.parametrize("s, nq, nk, dkv", [(640, 2, 2, (2, 2)), (2560, 5, 5, (5, 2))])
def test_queries_and_keys_pad_to_their_own_block_at_most_one_block(s, nq, nk, dkv):
    """The default 512 / 512 blocks (dK/dV 512 x 2048): S = 640 pads to 1024 (a 2 x 2 grid), not
    to the blocks' least common multiple (2560: 5 x 5); S = 2560 is not padded at all. The dK/dV
    key block shrinks to a length that tiles the padded keys (1280 at 2560). Traced only."""
    q = jax.ShapeDtypeStruct((1, s, 2, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, s, 1, 128), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(gated_flash_attention(q, k, v, interpret=True).astype(jnp.float32))
    grids = _grids(jax.grad(loss, (0, 1, 2)), q, k, k)
    assert grids["flash_fwd"] == (1, 1, nq, nk) and grids["flash_bwd_dq"] == (1, 1, nq, nk)
    assert grids["flash_bwd_dkv"] == (1, 1, dkv[1], dkv[0])  # (key blocks, query blocks)


def test_unequal_query_and_key_padding_matches_reference():
    """Blocks 16 (queries) / 8 (keys) at S = 20 with segment ids: queries pad to 32, keys to 24,
    each side's segment ids to its own length; values and gradients equal the reference."""
    blocks = BlockSizes(block_q=16, block_k=8, block_q_dkv=8, block_k_dkv=16)
    b, s = 2, 20
    q, k, v, g = _inputs(12, b, s, 2, 1, 16, "elementwise")
    seg = _segments(b, s)
    grids = _grids(lambda *a: gated_flash_attention(*a, segment_ids=seg, block_sizes=blocks, interpret=True),
                   q, k, v, g)
    assert grids["gated_flash_fwd"] == (b, 1, 2, 3)
    _compare(q, k, v, g, causal=True, seg=seg, atol=1e-5, blocks=blocks)
