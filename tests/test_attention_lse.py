"""Attention over a piece of a sequence: the keys' own segment ids (`kv_segment_ids`) and the rows'
log-sum-exp (`return_lse`), by which pieces merge into the whole attention (context parallelism).

The flash kernel runs in interpret mode on CPU. Tolerances as tests/test_flash.py: float32 values
and gradients agree to 1e-5 of the largest magnitude, lse to 1e-5 absolute; a row that sees no
key has o = 0 and lse = -1e30 in both implementations, asserted exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gattn.kernels import BlockSizes, attention_pallas, attention_xla, gated_flash_attention

BLOCKS = BlockSizes(block_q=16, block_k=32, block_q_dkv=32, block_k_dkv=16)
NEG = -1e30


def _arrays(seed, b, s, t, hq, hk, d, gate):
    rng = np.random.default_rng(seed)
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    q, k, v = arr(b, s, hq, d), arr(b, t, hk, d), arr(b, t, hk, d)
    g = {None: None, "elementwise": lambda: arr(b, s, hq, d), "headwise": lambda: arr(b, s, hq)}[gate]
    return q, k, v, (g() if callable(g) else g)


def _piece_ids(b, s, t):
    """The last s of t positions as queries (causal offset t - s). Row 0: keys of documents 1, 2,
    then padding; the queries start in document 2, then a document 3 with no key here (a
    non-padding query that sees nothing, as in a piece of a longer sequence), then padding.
    Other rows: one document, a few padding keys at the start and queries at the end."""
    kv = np.ones((b, t), np.int32)
    kv[0, 30:60], kv[0, 60:] = 2, 0
    kv[1:, :5] = 0
    qi = np.ones((b, s), np.int32)
    qi[0, :10], qi[0, 10:30], qi[0, 30:] = 2, 3, 0
    qi[1:, -3:] = 0
    return jnp.asarray(qi), jnp.asarray(kv)


def _numpy_attention(q, k, v, causal, q_ids, kv_ids, scale):
    """o and lse in float64 from the definition: rows that see no key get o = 0, lse = -1e30."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s, t, groups = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    z = np.einsum("bshd,bthd->bhst", q, k) * scale
    seen = np.ones((q.shape[0], 1, s, t), bool)
    if causal:
        seen &= np.arange(t)[None, :] <= np.arange(s)[:, None] + t - s
    if q_ids is not None:
        q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
        seen &= ((q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] != 0))[:, None]
    z = np.where(seen, z, -np.inf)
    any_BxHxS = seen.any(-1) & np.ones(z.shape[:3], bool)
    m = np.where(any_BxHxS, z.max(-1), 0.0)
    e = np.exp(z - m[..., None])
    lse = np.where(any_BxHxS, m + np.log(np.maximum(e.sum(-1), 1e-300)), NEG)
    p = np.where(any_BxHxS[..., None], e / np.maximum(e.sum(-1, keepdims=True), 1e-300), 0.0)
    return np.einsum("bhst,bthd->bshd", p, v), lse.transpose(0, 2, 1)


def _flash(**kw):
    return lambda q, k, v, g=None: gated_flash_attention(q, k, v, g, block_sizes=BLOCKS, interpret=True,
                                                         return_lse=True, **kw)


def _reference(**kw):
    return lambda q, k, v, g=None: attention_xla(q, k, v, g, return_lse=True, **kw)


def _close(a, b, atol=1e-5, err_msg=""):
    scale = float(np.abs(np.asarray(b)).max())
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol * scale, rtol=0, err_msg=err_msg)


@pytest.mark.parametrize("s, t, hq, hk, causal, pieces, options", [
    (40, 72, 4, 2, True, True, {}),                   # a piece: kv ids, T > S, GQA
    (40, 72, 4, 2, True, True, {"query_chunk": 16}),  # the same, queries chunked
    (40, 72, 2, 2, False, False, {}),                 # cross attention, no ids, MHA
    (256, 256, 2, 1, True, False, {}),                # causal self-attention in query blocks
])
def test_reference_lse_equals_float64_definition(s, t, hq, hk, causal, pieces, options):
    q, k, v, _ = _arrays(0, 2, s, t, hq, hk, 64, None)
    q_ids, kv_ids = _piece_ids(2, s, t) if pieces else (None, None)
    o, lse = jax.jit(lambda q, k, v, q_ids, kv_ids: attention_xla(  # (one program, not one per op)
        q, k, v, causal=causal, segment_ids=q_ids, kv_segment_ids=kv_ids, sm_scale=0.2, return_lse=True,
        **options))(q, k, v, q_ids, kv_ids)
    o64, lse64 = _numpy_attention(q, k, v, causal, q_ids, kv_ids, 0.2)
    assert lse.shape == (2, s, hq) and lse.dtype == jnp.float32
    np.testing.assert_allclose(lse, lse64, atol=1e-5, rtol=1e-6)
    _close(o, o64)
    if pieces:  # row 0's document-3 queries see no key: 0 and -1e30, not a uniform average
        assert np.all(np.asarray(lse)[0, 10:30] == NEG) and np.all(np.asarray(o)[0, 10:30] == 0)
        assert np.all(np.asarray(lse)[0, :10] > 0)


GATES = [(None, 64), ("elementwise", 128),
         pytest.param("headwise", 64, marks=pytest.mark.slow)]  # kept out of the default run (time)


@pytest.mark.parametrize("gate, d", GATES)
def test_flash_o_and_lse_on_a_piece_match_reference(gate, d):
    """Causal, 40 queries over 72 keys (offset 32), key ids of their own with padding, GQA 4 / 2."""
    q, k, v, g = _arrays(1, 2, 40, 72, 4, 2, d, gate)
    q_ids, kv_ids = _piece_ids(2, 40, 72)
    ids = dict(segment_ids=q_ids, kv_segment_ids=kv_ids)
    plain = lambda q, k, v, g: gated_flash_attention(  # noqa: E731
        q, k, v, g, block_sizes=BLOCKS, interpret=True, **ids)
    (y, lse), (y_ref, lse_ref), y_plain = jax.jit(lambda *a: (_flash(**ids)(*a), _reference(**ids)(*a), plain(*a)))(
        q, k, v, g)  # (one program, not one per op)
    assert y.shape == q.shape and lse.shape == (2, 40, 4) and lse.dtype == jnp.float32
    _close(y, y_ref)
    np.testing.assert_allclose(lse, lse_ref, atol=1e-5, rtol=1e-6)
    assert np.all(np.asarray(lse)[0, 10:] == NEG) and np.all(np.asarray(y)[0, 10:] == 0)
    np.testing.assert_array_equal(y_plain, y)  # return_lse adds an output, changes none


def _o_and_lse_loss(f, shape, lse_weight=1.0):
    """sum(o * w1) + sum(lse * w2): a loss that both outputs feed."""
    rng = np.random.default_rng(2)
    w1 = jnp.asarray(rng.normal(size=shape), jnp.float32)
    w2 = jnp.asarray(rng.normal(size=shape[:3]), jnp.float32) * lse_weight

    def loss(*args):
        o, lse = f(*args)
        return jnp.sum(o * w1) + jnp.sum(lse * w2)
    return loss


@pytest.mark.parametrize("gate, d", GATES)
def test_flash_gradients_through_o_and_lse_match_reference(gate, d):
    q, k, v, g = _arrays(3, 2, 40, 72, 4, 2, d, gate)
    q_ids, kv_ids = _piece_ids(2, 40, 72)
    argnums = (0, 1, 2) if g is None else (0, 1, 2, 3)
    ids = dict(segment_ids=q_ids, kv_segment_ids=kv_ids)
    flash, ref = _flash(**ids), _reference(**ids)
    grads = jax.jit(jax.grad(_o_and_lse_loss(flash, q.shape), argnums))(q, k, v, g)
    grads_ref = jax.jit(jax.grad(_o_and_lse_loss(ref, q.shape), argnums))(q, k, v, g)
    grads, grads_ref = [np.asarray(x) for x in grads], [np.asarray(x) for x in grads_ref]
    for name, a, b in zip("qkvg", grads, grads_ref):
        assert np.isfinite(a).all(), name
        _close(a, b, err_msg=f"d{name}")
    # lse's cotangent carries weight: without it dq and dk would be off by far more than 1e-5
    dq_o, dk_o = jax.jit(jax.grad(_o_and_lse_loss(ref, q.shape, lse_weight=0.0), (0, 1)))(q, k, v, g)
    for a, b in ((dq_o, grads_ref[0]), (dk_o, grads_ref[1])):
        assert np.abs(np.asarray(a) - b).max() > 0.1 * np.abs(b).max()


FLASH_MERGE = BlockSizes(64, 64, 64, 64)


def _impl(name):
    if name == "pallas":
        return lambda q, k, v, g, **kw: gated_flash_attention(q, k, v, g, block_sizes=FLASH_MERGE,
                                                              interpret=True, return_lse=True, **kw)
    return lambda q, k, v, g, **kw: attention_xla(q, k, v, g, return_lse=True, **kw)


def _merged(f, q, k, v, g, ids):
    """Causal self-attention from pieces, as context parallelism runs it: queries and keys in
    halves; the first half's queries over the first half's keys (causal), the second half's over
    the first half's keys (all visible but for segments) and over its own (causal), those two
    merged by their lse. The gate scales both pieces of a row alike, so gated pieces merge."""
    h = q.shape[1] // 2
    first, second = (lambda x: x[:, :h]), (lambda x: x[:, h:])  # noqa: E731
    o11, lse11 = f(first(q), first(k), first(v), first(g), causal=True, segment_ids=first(ids),
                   kv_segment_ids=first(ids))
    o21, lse21 = f(second(q), first(k), first(v), second(g), causal=False, segment_ids=second(ids),
                   kv_segment_ids=first(ids))
    o22, lse22 = f(second(q), second(k), second(v), second(g), causal=True, segment_ids=second(ids),
                   kv_segment_ids=second(ids))
    lse2 = jnp.logaddexp(lse21, lse22)
    o2 = jnp.exp(lse21 - lse2)[..., None] * o21 + jnp.exp(lse22 - lse2)[..., None] * o22
    return jnp.concatenate([o11, o2], axis=1), jnp.concatenate([lse11, lse2], axis=1)


# (pallas in interpret mode: ~1 min of CPU, in the slow set; its cousins in the default set are the
# kernel's o, lse and gradient tests above and this merge through the xla implementation)
@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_pieces_merged_by_lse_equal_the_whole_attention(impl):
    """256 positions, row 0: documents of 150 and 90 tokens and 16 padding, so the second half's
    document-2 queries see no key of the first half (lse -1e30, weight 0 in the merge); values
    and gradients of a loss on o and lse equal the whole causal attention's."""
    q, k, v, g = _arrays(4, 2, 256, 256, 2, 1, 128, "elementwise")
    ids = np.ones((2, 256), np.int32)
    ids[0, 150:], ids[0, 240:] = 2, 0
    ids = jnp.asarray(ids)
    whole = lambda q, k, v, g: attention_xla(q, k, v, g, causal=True, segment_ids=ids, return_lse=True)  # noqa: E731
    pieces = lambda q, k, v, g: _merged(_impl(impl), q, k, v, g, ids)  # noqa: E731

    @jax.jit  # (one program for both sides' values and gradients, not one per op)
    def values_and_grads(q, k, v, g):
        return ((pieces(q, k, v, g), whole(q, k, v, g)),
                (jax.grad(_o_and_lse_loss(pieces, q.shape), (0, 1, 2, 3))(q, k, v, g),
                 jax.grad(_o_and_lse_loss(whole, q.shape), (0, 1, 2, 3))(q, k, v, g)))

    ((o, lse), (o_ref, lse_ref)), (grads, grads_ref) = values_and_grads(q, k, v, g)
    _close(o, o_ref)
    np.testing.assert_allclose(lse, lse_ref, atol=1e-5, rtol=1e-6)
    for name, a, b in zip("qkvg", grads, grads_ref):
        _close(a, b, err_msg=f"d{name}")


def _call(fn, q, k, v, **kw):
    if fn is attention_xla:
        return fn(q, k, v, return_lse=True, **kw)
    return fn(q, k, v, return_lse=True, interpret=True, **kw)


@pytest.mark.parametrize("fn", [gated_flash_attention, attention_pallas, attention_xla])
def test_bad_piece_ids_are_refused_naming_the_field(fn):
    """Static checks: nothing runs. Segment ids alone still need T = S."""
    q, k, v, _ = _arrays(5, 2, 40, 72, 4, 2, 64, None)
    q_ids, kv_ids = _piece_ids(2, 40, 72)
    for kw, match in [
        (dict(segment_ids=q_ids, kv_segment_ids=kv_ids[:, :71]),
         r"kv_segment_ids \(2, 71\) must be \[B, T\] = \(2, 72\)"),
        (dict(segment_ids=q_ids, kv_segment_ids=kv_ids[:1]), r"kv_segment_ids \(1, 72\) must be \[B, T\]"),
        (dict(segment_ids=q_ids), r"segment_ids need self-attention .*72 != q length 40.* kv_segment_ids \[B, T\]"),
        (dict(kv_segment_ids=kv_ids), r"kv_segment_ids \(the keys' ids\) were given without segment_ids"),
        (dict(segment_ids=q_ids, kv_segment_ids=kv_ids.astype(jnp.float32)), "kv_segment_ids has dtype float32"),
    ]:
        with pytest.raises(ValueError, match=match):
            _call(fn, q, k, v, **kw)
    if fn is not attention_xla:  # the kernel's float32 pass: key ids >= 2**24 are refused too
        with pytest.raises(ValueError, match="kv_segment_ids hold 16777216"):
            _call(fn, q, k, v, segment_ids=q_ids, kv_segment_ids=kv_ids.at[1, 9].set(2**24))


@pytest.mark.parametrize("head_dim", [128, 64])
def test_return_lse_gradient_compiles_for_tpu(head_dim):
    """The lse variant's backward (pieces with their own key ids, T > S, gated) through Mosaic for
    a v5e topology, heads over 4 chips in a shard_map, as tests/test_flash_tpu.py compiles the
    plain one (libtpu on this CPU machine; nothing runs). 256 queries over 512 keys in key blocks
    of 256, so the keys span two blocks (Mosaic's compile time grows with the block: at the
    default 512 it takes 4x as long)."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices
    mesh = Mesh(np.asarray(devices).reshape(4), ("model",))
    tile, rows = P(None, None, "model", None), P(None, None, "model")

    def body(q, k, v, g, q_ids, kv_ids):
        return attention_pallas(q, k, v, g, segment_ids=q_ids, kv_segment_ids=kv_ids, return_lse=True,
                                interpret=False, block_k=256)

    attn = jax.shard_map(body, mesh=mesh, in_specs=(tile,) * 4 + (P(), P()), out_specs=(tile, rows),
                         check_vma=False)

    def loss(q, k, v, g, q_ids, kv_ids):
        o, lse = attn(q, k, v, g, q_ids, kv_ids)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(lse)

    abstract = lambda shape, spec, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dtype, sharding=NamedSharding(mesh, spec))
    q = abstract((2, 256, 8, head_dim), tile)
    kv = abstract((2, 512, 4, head_dim), tile)
    args = (q, kv, kv, q, abstract((2, 256), P(), jnp.int32), abstract((2, 512), P(), jnp.int32))
    text = jax.jit(jax.grad(loss, (0, 1, 2, 3))).lower(*args).compile().as_text()
    for kernel in ("gated_flash_fwd", "gated_flash_bwd_prep", "flash_bwd_dkv", "flash_bwd_dq"):
        assert kernel in text, kernel
