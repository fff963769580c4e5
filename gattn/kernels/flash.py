"""Flash attention in Pallas (Mosaic TPU) with the paper's sigmoid output gate fused in.

    y = softmax(q k^T * sm_scale + mask) v * sigmoid(gate)

Forward: one kernel, online softmax over key blocks; the gate is applied in the epilogue while
the output block is still in VMEM, so the ungated output never goes to HBM. It saves y (the
output itself) and the log-sum-exp per row, nothing else.

Backward (`custom_vjp`): the gate is folded in with y = o * s, s = sigmoid(g):
    dO = dy * s,   dg = dy * y * (1 - s),   rowsum(o * dO) = rowsum(y * dy),
so the backward needs y, never o. One XLA fusion computes dO, dg and the row term D; then a
dK/dV kernel (key blocks outer, query heads of the group and query blocks inner, so GQA sums
over its query heads in VMEM and K/V are never repeated in HBM) and a dQ kernel.

Layout. The public arrays are q, gate [B, S, Hq, K] and k, v [B, T, Hk, K]. When head_dim is a
multiple of 128 they are viewed, without copying, as [B, S, H*K] and a block is (rows, K) at
lane offset h*K; otherwise the wrapper transposes them to [B, H*S, K] (one HBM round trip each
way). Row vectors (log-sum-exp, D, headwise gates, query segment ids) are [B, H, S, 1].

Masking. Causal (query r sees keys <= r + T - S), padding of the sequence to the block size,
and segment ids: a query attends to keys with its own id; id 0 is padding and a padding query
attends to nothing and outputs exactly 0 (so do its gradients). Causal blocks that are fully
masked are skipped, and their index maps are clamped so their K/V (or Q) blocks are not fetched.
Masked scores are excluded with `where`, never by a large negative bias alone, so a fully masked
row is 0 rather than NaN or a uniform average.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_NEG = -1e30


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query and key block lengths (rows of q and of k/v per kernel step). TPU wants multiples of
    128; a block longer than the (128-rounded) sequence is shortened to it."""
    block_q: int = 512
    block_k: int = 512

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 8 or value % 8:
                raise ValueError(f"block_sizes.{name} = {value!r}: must be a positive multiple of 8")


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernels need to know at trace time."""
    causal: bool
    scale: float
    bq: int
    bk: int
    nq: int           # query blocks
    nk: int           # key blocks
    groups: int       # query heads per kv head
    offset: int       # T - S (causal diagonal offset)
    kv_len: int       # keys before padding; keys at >= kv_len are masked (when no segment ids)
    padded_kv: bool
    segments: bool
    lanes: bool       # heads-in-lanes layout (head_dim % 128 == 0)
    interpret: bool


def _round_up(n, m):
    return -(-n // m) * m


# ---------------------------------------------------------------- layout helpers

def _to3(x, lanes):
    b, s, h, d = x.shape
    return x.reshape(b, s, h * d) if lanes else x.transpose(0, 2, 1, 3).reshape(b, h * s, d)


def _from3(x3, shape, lanes):
    b, s, h, d = shape
    return x3.reshape(shape) if lanes else x3.reshape(b, h, s, d).transpose(0, 2, 1, 3)


def _tile_spec(st: _Static, block, n_blocks, d, index):
    """BlockSpec of a (block, d) tile of a 3-D array; `index` maps grid ids to (b, head, blk)."""
    if st.lanes:
        return pl.BlockSpec((None, block, d), lambda *g: (lambda b, h, i: (b, i, h))(*index(*g)))
    return pl.BlockSpec((None, block, d),
                        lambda *g: (lambda b, h, i: (b, h * n_blocks + i, 0))(*index(*g)))


def _row_spec(block, index):
    """BlockSpec of a (block, 1) column of a [B, H, S, 1] array."""
    return pl.BlockSpec((None, None, block, 1), lambda *g: (lambda b, h, i: (b, h, i, 0))(*index(*g)))


def _sds(shape, dtype, like):
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)


def _last_k_block(st: _Static, i):
    """Last key block a causal query block i can see."""
    return jnp.minimum((i * st.bq + st.bq - 1 + st.offset) // st.bk, st.nk - 1)


def _first_q_block(st: _Static, j):
    """First query block that can see key block j (causal)."""
    return jnp.clip((j * st.bk - st.offset) // st.bq, 0, st.nq - 1)


def _block_visible(st: _Static, i, j):
    if not st.causal:
        return True
    return j * st.bk <= i * st.bq + st.bq - 1 + st.offset


def _mask(st: _Static, i, j, qseg_ref, kseg_ref):
    """[bq, bk] bool: which scores of block (i, j) are kept (None when all are)."""
    mask = None

    def both(m):
        return m if mask is None else mask & m

    if st.causal or st.padded_kv:
        rows = i * st.bq + jax.lax.broadcasted_iota(jnp.int32, (st.bq, st.bk), 0)
        cols = j * st.bk + jax.lax.broadcasted_iota(jnp.int32, (st.bq, st.bk), 1)
        if st.causal:
            mask = both(cols <= rows + st.offset)
        if st.padded_kv and not st.segments:
            mask = both(cols < st.kv_len)
    if st.segments:
        qs, ks = qseg_ref[...], kseg_ref[...]  # [bq, 1], [1, bk]
        mask = both((qs == ks) & (qs != 0))
    return mask


def _nt(a, b):  # a @ b^T with float32 accumulation
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _nn(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _probs(st, q, k, i, j, qseg_ref, kseg_ref, lse):
    """Recomputed attention probabilities of block (i, j) from the saved log-sum-exp."""
    s = _nt(q, k) * st.scale
    p = jnp.exp(s - lse)
    mask = _mask(st, i, j, qseg_ref, kseg_ref)
    return p if mask is None else jnp.where(mask, p, 0.0)


# ---------------------------------------------------------------- forward

def _fwd_kernel(st: _Static, gate: str | None, *refs):
    q_ref, k_ref, v_ref, *refs = refs
    qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if st.segments else (None, None)
    g_ref = refs.pop(0) if gate else None
    o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(_block_visible(st, i, j))
    def _step():
        s = _nt(q_ref[...], k_ref[...]) * st.scale  # [bq, bk]
        mask = _mask(st, i, j, qseg_ref, kseg_ref)
        if mask is not None:
            s = jnp.where(mask, s, _NEG)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + _nn(p.astype(v_ref.dtype), v_ref[...])
        m_sc[...] = m_new

    @pl.when(j == st.nk - 1)
    def _finish():
        l = l_sc[...]
        l_safe = jnp.where(l == 0.0, 1.0, l)  # fully masked row: acc is 0, output 0
        o = acc_sc[...] / l_safe
        if gate:
            o = o * jax.nn.sigmoid(g_ref[...].astype(jnp.float32))
        o_ref[...] = o.astype(o_ref.dtype)
        lse_ref[...] = m_sc[...] + jnp.log(l_safe)


def _seg_specs(st: _Static, q_index, k_index):
    return [pl.BlockSpec((None, st.bq, 1), lambda *g: (lambda b, h, i: (b, i, 0))(*q_index(*g))),
            pl.BlockSpec((None, 1, st.bk), lambda *g: (lambda b, h, j: (b, 0, j))(*k_index(*g)))]


def _forward(st: _Static, q3, k3, v3, qseg, kseg, g, gate, shape):
    b, s, hq, d = shape
    q_index = lambda b_, h, i, j: (b_, h, i)
    if st.causal:
        k_index = lambda b_, h, i, j: (b_, h // st.groups, jnp.minimum(j, _last_k_block(st, i)))
    else:
        k_index = lambda b_, h, i, j: (b_, h // st.groups, j)
    in_specs = [_tile_spec(st, st.bq, st.nq, d, q_index),
                _tile_spec(st, st.bk, st.nk, d, k_index),
                _tile_spec(st, st.bk, st.nk, d, k_index)]
    args = [q3, k3, v3]
    if st.segments:
        in_specs += _seg_specs(st, q_index, k_index)
        args += [qseg, kseg]
    if gate == "elementwise":
        in_specs.append(_tile_spec(st, st.bq, st.nq, d, q_index))
        args.append(g)
    elif gate == "headwise":
        in_specs.append(_row_spec(st.bq, q_index))
        args.append(g)
    out_shape = [_sds(q3.shape, q3.dtype, q3), _sds((b, hq, s, 1), jnp.float32, q3)]
    out_specs = [_tile_spec(st, st.bq, st.nq, d, q_index), _row_spec(st.bq, q_index)]
    y3, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, st, gate),
        grid=(b, hq, st.nq, st.nk),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((st.bq, 1), jnp.float32), pltpu.VMEM((st.bq, 1), jnp.float32),
                        pltpu.VMEM((st.bq, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=st.interpret, name="gated_flash_fwd" if gate else "flash_fwd",
    )(*args)
    return y3, lse


# ---------------------------------------------------------------- backward

def _dkv_kernel(st: _Static, *refs):
    q_ref, k_ref, v_ref, *refs = refs
    qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if st.segments else (None, None)
    do_ref, lse_ref, dd_ref, dk_ref, dv_ref, dk_sc, dv_sc = refs
    j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(_block_visible(st, i, j))
    def _step():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        p = _probs(st, q, k, i, j, qseg_ref, kseg_ref, lse_ref[...])  # [bq, bk]
        dv_sc[...] += _nn(p.astype(do.dtype).T, do)
        dp = _nt(do, v)
        ds = p * (dp - dd_ref[...])
        dk_sc[...] += _nn(ds.astype(q.dtype).T, q) * st.scale

    @pl.when((g == st.groups - 1) & (i == st.nq - 1))
    def _finish():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(st: _Static, *refs):
    q_ref, k_ref, v_ref, *refs = refs
    qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if st.segments else (None, None)
    do_ref, lse_ref, dd_ref, dq_ref, dq_sc = refs
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(_block_visible(st, i, j))
    def _step():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        p = _probs(st, q, k, i, j, qseg_ref, kseg_ref, lse_ref[...])
        ds = p * (_nt(do, v) - dd_ref[...])
        dq_sc[...] += _nn(ds.astype(k.dtype), k) * st.scale

    @pl.when(j == st.nk - 1)
    def _finish():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _backward(st: _Static, q3, k3, v3, qseg, kseg, do3, lse, dd, shape, kv_shape):
    b, s, hq, d = shape
    hk = kv_shape[2]
    params = dict(interpret=st.interpret)

    # dK, dV: grid (b, kv head, key block, query head in group, query block).
    q_of = lambda b_, h, j, g, i: (
        b_, h * st.groups + g, jnp.maximum(i, _first_q_block(st, j)) if st.causal else i)
    k_of = lambda b_, h, j, g, i: (b_, h, j)
    in_specs = [_tile_spec(st, st.bq, st.nq, d, q_of), _tile_spec(st, st.bk, st.nk, d, k_of),
                _tile_spec(st, st.bk, st.nk, d, k_of)]
    args = [q3, k3, v3]
    if st.segments:
        in_specs += _seg_specs(st, q_of, k_of)
        args += [qseg, kseg]
    in_specs += [_tile_spec(st, st.bq, st.nq, d, q_of), _row_spec(st.bq, q_of), _row_spec(st.bq, q_of)]
    args += [do3, lse, dd]
    dk3, dv3 = pl.pallas_call(
        functools.partial(_dkv_kernel, st),
        grid=(b, hk, st.nk, st.groups, st.nq),
        in_specs=in_specs,
        out_specs=[_tile_spec(st, st.bk, st.nk, d, k_of), _tile_spec(st, st.bk, st.nk, d, k_of)],
        out_shape=[_sds(k3.shape, k3.dtype, k3), _sds(v3.shape, v3.dtype, v3)],
        scratch_shapes=[pltpu.VMEM((st.bk, d), jnp.float32), pltpu.VMEM((st.bk, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
        name="flash_bwd_dkv", **params,
    )(*args)

    # dQ: grid (b, query head, query block, key block), like the forward.
    q_of = lambda b_, h, i, j: (b_, h, i)
    if st.causal:
        k_of = lambda b_, h, i, j: (b_, h // st.groups, jnp.minimum(j, _last_k_block(st, i)))
    else:
        k_of = lambda b_, h, i, j: (b_, h // st.groups, j)
    in_specs = [_tile_spec(st, st.bq, st.nq, d, q_of), _tile_spec(st, st.bk, st.nk, d, k_of),
                _tile_spec(st, st.bk, st.nk, d, k_of)]
    args = [q3, k3, v3]
    if st.segments:
        in_specs += _seg_specs(st, q_of, k_of)
        args += [qseg, kseg]
    in_specs += [_tile_spec(st, st.bq, st.nq, d, q_of), _row_spec(st.bq, q_of), _row_spec(st.bq, q_of)]
    args += [do3, lse, dd]
    dq3 = pl.pallas_call(
        functools.partial(_dq_kernel, st),
        grid=(b, hq, st.nq, st.nk),
        in_specs=in_specs,
        out_specs=_tile_spec(st, st.bq, st.nq, d, q_of),
        out_shape=_sds(q3.shape, q3.dtype, q3),
        scratch_shapes=[pltpu.VMEM((st.bq, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        name="flash_bwd_dq", **params,
    )(*args)
    return dq3, dk3, dv3


# ---------------------------------------------------------------- custom_vjp core

def _rows(st: _Static, x3, shape):
    """Sum over head_dim of a 3-D tile array: [B, H, S, 1] float32."""
    b, s, h, d = shape
    x = x3.astype(jnp.float32)
    if st.lanes:
        return x.reshape(b, s, h, d).sum(-1).transpose(0, 2, 1)[..., None]
    return x.reshape(b, h, s, d).sum(-1)[..., None]


def _broadcast_rows(st: _Static, r, shape):
    """[B, H, S, 1] -> the 3-D tile layout, broadcast over head_dim."""
    b, s, h, d = shape
    if st.lanes:
        return jnp.broadcast_to(r[..., 0].transpose(0, 2, 1)[..., None], (b, s, h, d)).reshape(b, s, h * d)
    return jnp.broadcast_to(r, (b, h, s, d)).reshape(b, h * s, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _flash(st, gate, shape, kv_shape, q3, k3, v3, qseg, kseg, g):
    return _forward(st, q3, k3, v3, qseg, kseg, g, gate, shape)[0]


def _flash_fwd(st, gate, shape, kv_shape, q3, k3, v3, qseg, kseg, g):
    y3, lse = _forward(st, q3, k3, v3, qseg, kseg, g, gate, shape)
    return y3, (q3, k3, v3, qseg, kseg, g, y3, lse)


def _flash_bwd(st, gate, shape, kv_shape, res, dy3):
    q3, k3, v3, qseg, kseg, g, y3, lse = res
    dd = _rows(st, y3.astype(jnp.float32) * dy3.astype(jnp.float32), shape)  # rowsum(o * dO)
    dg = None
    if gate is None:
        do3 = dy3
    else:
        sg = jax.nn.sigmoid(g.astype(jnp.float32))
        if gate == "headwise":
            do3 = dy3.astype(jnp.float32) * _broadcast_rows(st, sg, shape)
            dg = (dd * (1.0 - sg)).astype(g.dtype)  # sum_k dy*y*(1-s) = D * (1-s)
        else:
            do3 = dy3.astype(jnp.float32) * sg
            dg = (dy3.astype(jnp.float32) * y3.astype(jnp.float32) * (1.0 - sg)).astype(g.dtype)
        do3 = do3.astype(q3.dtype)
    dq3, dk3, dv3 = _backward(st, q3, k3, v3, qseg, kseg, do3, lse, dd, shape, kv_shape)
    return dq3, dk3, dv3, None, None, dg


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------- public entry point

def _gate_kind(gate, q):
    if gate is None:
        return None
    if gate.shape == q.shape:
        return "elementwise"
    if gate.shape in (q.shape[:3], q.shape[:3] + (1,)):
        return "headwise"
    raise ValueError(f"gate {gate.shape}: must be elementwise {q.shape} or headwise "
                     f"{q.shape[:3]} / {q.shape[:3] + (1,)} (logits, before the sigmoid)")


def _check(q, k, v, segment_ids, causal):
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"expected q [B,S,Hq,K] and k, v [B,T,Hk,K]; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {q.shape} and k {k.shape}: batch and head_dim must match and "
                         "q_heads must be a multiple of kv_heads")
    if causal and q.shape[1] > k.shape[1]:
        raise ValueError(f"causal attention needs at least as many keys as queries; got "
                         f"q length {q.shape[1]} > k length {k.shape[1]}")
    if segment_ids is not None and (segment_ids.shape != q.shape[:2] or q.shape[1] != k.shape[1]):
        raise ValueError(f"segment_ids {segment_ids.shape} must be [B, S] = {q.shape[:2]} "
                         "for self-attention")


def gated_flash_attention(q, k, v, gate=None, *, causal: bool = True, segment_ids=None,
                          sm_scale: float | None = None, block_sizes: BlockSizes | None = None,
                          interpret: bool | None = None):
    """softmax(q k^T * sm_scale + mask) v * sigmoid(gate), gate fused into the kernel.

    q [B, S, Hq, K]; k, v [B, T, Hk, K] (GQA: query head h reads kv head h // (Hq // Hk));
    gate: None (plain attention), logits [B, S, Hq, K] (elementwise) or [B, S, Hq] /
    [B, S, Hq, 1] (headwise). segment_ids [B, S] int, self-attention only: 0 = padding (attends
    to nothing, outputs 0). Sequences are padded to the block size internally. sm_scale defaults
    to K ** -0.5. `interpret` defaults to True off TPU. Differentiable in q, k, v and gate.
    Returns [B, S, Hq, K] in q's dtype.
    """
    _check(q, k, v, segment_ids, causal)
    kind = _gate_kind(gate, q)
    b, s, hq, d = q.shape
    t, hk = k.shape[1], k.shape[2]
    bs = block_sizes or BlockSizes()
    bq, bk = min(bs.block_q, _round_up(s, 128)), min(bs.block_k, _round_up(t, 128))
    sp, tp = _round_up(s, bq), _round_up(t, bk)
    st = _Static(causal=causal, scale=float(d ** -0.5 if sm_scale is None else sm_scale),
                 bq=bq, bk=bk, nq=sp // bq, nk=tp // bk, groups=hq // hk, offset=t - s, kv_len=t,
                 padded_kv=tp != t, segments=segment_ids is not None, lanes=d % 128 == 0,
                 interpret=jax.default_backend() != "tpu" if interpret is None else bool(interpret))
    if not st.interpret and (bk % 128 or bq % 8):
        raise ValueError(f"block_sizes {bs}: compiled for TPU the key block must be a multiple of "
                         f"128 and the query block of 8 (got {bq} x {bk} for lengths {s} x {t})")
    pad = lambda x, n: x if n == x.shape[1] else jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    q_p, k_p, v_p = pad(q, sp), pad(k, tp), pad(v, tp)
    shape, kv_shape = (b, sp, hq, d), (b, tp, hk, d)
    qseg = kseg = g = None
    if segment_ids is not None:
        seg = pad(segment_ids.astype(jnp.int32), sp)
        qseg, kseg = seg[:, :, None], seg[:, None, :]
    if kind == "elementwise":
        g = _to3(pad(gate, sp), st.lanes)
    elif kind == "headwise":
        g = pad(gate.reshape(b, s, hq), sp).transpose(0, 2, 1)[..., None]
    y3 = _flash(st, kind, shape, kv_shape, _to3(q_p, st.lanes), _to3(k_p, st.lanes),
                _to3(v_p, st.lanes), qseg, kseg, g)
    return _from3(y3, shape, st.lanes)[:, :s]
