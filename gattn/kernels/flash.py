"""Flash attention in Pallas (Mosaic TPU) with the paper's sigmoid output gate fused in.

    y = softmax(q k^T * sm_scale + mask) v * sigmoid(gate)

Forward: one kernel, online softmax over key blocks; the gate is applied in the epilogue while
the output block is still in VMEM, so the ungated output never goes to HBM. It saves y (the
output itself) and the log-sum-exp per row, nothing else.

Backward (`custom_vjp`): the gate is folded in with y = o * s, s = sigmoid(g):
    dO = dy * s,   dg = dy * y * (1 - s),   rowsum(o * dO) = rowsum(y * dy),
so the backward needs y, never o. A small kernel computes dO, dg and the row term D per query
block (reading y, dy and g once); then a dK/dV kernel (key blocks outer, query heads of the group and query blocks inner, so GQA sums
over its query heads in VMEM and K/V are never repeated in HBM) and a dQ kernel.

Layout. The public arrays are q, gate [B, S, Hq, K] and k, v [B, T, Hk, K]. When head_dim is a
multiple of 128 they are viewed as [B, S, H*K] and a block is (rows, K) at lane offset h*K: the
layout the model's projections produce, so XLA folds the reshapes away; otherwise the wrapper transposes them to [B, H*S, K] (one HBM round trip each
way). Row vectors (log-sum-exp, the row term D, headwise gates) are lane-dense [B, H, 1, S] and
segment ids [B, 1, S] (one copy padded to the queries' length, one to the keys'); a kernel turns
a row piece into a column with a 2-D transpose where it needs one (segment ids pass through
float32 there, exact below 2**24: `MAX_SEGMENT_ID`).
Concrete segment ids are checked against that bound; traced ones (under jit) cannot be without a
device-to-host copy per call, so the bound is the caller's: ids from gattn's pipeline are at most
seq_len + 1 (one per document in a row), and `dense_segment_ids` renumbers any others in-graph.

Masking. Causal (query r sees keys <= r + T - S), padding of the sequence to the block size,
and segment ids: a query attends to keys with its own id; id 0 is padding and a padding query
attends to nothing and outputs exactly 0 (so do its gradients). Causal blocks that are fully
masked are skipped, and their index maps are clamped so their K/V (or Q) blocks are not fetched.
Masked scores are excluded with `where`, never by a large negative bias alone, so a fully masked
row is 0 rather than NaN or a uniform average.

Pieces of a sequence (context parallelism). `kv_segment_ids` gives the keys their own ids, so the
queries may be one piece of a sequence and the keys another; `return_lse` also returns the rows'
log-sum-exp, which merges such pieces (see `gated_flash_attention`). Its cotangent enters the
backward through the row term: lse's derivative in score ij is p_ij, so
ds = p * (dP - D) + p * dlse = p * (dP - (D - dlse)), and the dK/dV and dQ kernels get D - dlse.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import gattn.kernels.flash_blocks as fb
from gattn.kernels.flash_blocks import MAX_SEGMENT_ID, BlockSizes
from gattn.kernels.reference import check_inputs


# ---------------------------------------------------------------- forward

def _fwd_kernel(st: fb.Static, gate: str | None, d: int, *refs):
    q_ref, k_ref, v_ref, *refs = refs
    qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if st.segments else (None, None)
    g_ref = refs.pop(0) if gate else None
    o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, fb.NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(fb.block_visible(st, i, j))
    def _step():
        k, v = k_ref[...], v_ref[...]
        mask = fb.query_major_mask(st, i, j, qseg_ref, kseg_ref)
        for g in range(st.groups):
            s = fb.nt(fb.head(st, q_ref, g, d), k) * st.scale  # [bq, bk]
            if mask is not None:
                s = jnp.where(mask, s, fb.NEG)
            m_prev = m_sc[g]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.exp(s - m_new)
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_sc[g] = alpha * l_sc[g] + jnp.sum(p, axis=1, keepdims=True)
            acc_sc[g] = alpha * acc_sc[g] + fb.nn(p.astype(v.dtype), v)
            m_sc[g] = m_new

    @pl.when(j == st.nk - 1)
    def _finish():
        for g in range(st.groups):
            l = l_sc[g]
            l_safe = jnp.where(l == 0.0, 1.0, l)  # fully masked row: acc is 0, output 0
            o = acc_sc[g] / l_safe
            if gate == "elementwise":
                o = o * jax.nn.sigmoid(fb.head(st, g_ref, g, d).astype(jnp.float32))
            elif gate == "headwise":
                o = o * fb.column(jax.nn.sigmoid(g_ref[g].astype(jnp.float32)))
            fb.set_head(st, o_ref, g, d, o)
            lse_ref[g] = fb.row(m_sc[g] + jnp.log(l_safe))


def _k_index(st: fb.Static):
    """Key-block index map of query-major grids (b, kv head, i, j): causal blocks past the
    diagonal repeat the last visible block, so Pallas does not fetch them."""
    if st.causal:
        return lambda b, h, i, j: (b, h, jnp.minimum(j, fb.last_k_block(st, i)))
    return lambda b, h, i, j: (b, h, j)


def _forward(st: fb.Static, q, k, v, seg, g, gate, shape, kv_shape):
    b, s, hq, d = shape
    hk = kv_shape[2]
    q_index, k_index = (lambda b_, h, i, j: (b_, h, i)), _k_index(st)
    in_specs = [fb.q_spec(st, d, q_index), fb.kv_spec(st, d, k_index), fb.kv_spec(st, d, k_index)]
    args = [q, k, v]
    if st.segments:
        in_specs += [fb.seg_spec(st.bq, q_index), fb.seg_spec(st.bk, k_index)]
        args += list(seg)  # (query ids, key ids)
    if gate:
        in_specs.append(fb.q_spec(st, d, q_index) if gate == "elementwise" else fb.rows_spec(st, q_index))
        args.append(g)
    y, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, st, gate, d),
        grid=(b, hk, st.nq, st.nk),
        in_specs=in_specs,
        out_specs=[fb.q_spec(st, d, q_index), fb.rows_spec(st, q_index)],
        out_shape=[fb.sds(q.shape, q.dtype, q), fb.sds((b, hq, 1, s), jnp.float32, q)],
        scratch_shapes=[pltpu.VMEM((st.groups, st.bq, 1), jnp.float32),
                        pltpu.VMEM((st.groups, st.bq, 1), jnp.float32),
                        pltpu.VMEM((st.groups, st.bq, d), jnp.float32)],
        compiler_params=fb.params("parallel", "parallel", "parallel", "arbitrary"),
        cost_estimate=fb.cost(st, "fwd", b, hq, hk, d, q.dtype.itemsize, gate),
        interpret=st.interpret, name="gated_flash_fwd" if gate else "flash_fwd",
    )(*args)
    return y, lse


# ---------------------------------------------------------------- backward

def _prep_kernel(st: fb.Static, gate: str | None, d: int, *refs):
    """The gate's backward and the row term, per query block and head:
    D = rowsum(y * dy), dO = dy * s, dg = dy * y * (1 - s) (headwise: D * (1 - s))."""
    y_ref, dy_ref, *refs = refs
    g_ref = refs.pop(0) if gate else None
    dd_ref, *refs = refs
    do_ref, dg_ref = refs if gate else (None, None)
    for g in range(st.groups):
        y = fb.head(st, y_ref, g, d).astype(jnp.float32)
        dy = fb.head(st, dy_ref, g, d).astype(jnp.float32)
        d_col = jnp.sum(y * dy, axis=1, keepdims=True)
        dd_ref[g] = fb.row(d_col)
        if gate == "elementwise":
            sg = jax.nn.sigmoid(fb.head(st, g_ref, g, d).astype(jnp.float32))
            fb.set_head(st, do_ref, g, d, dy * sg)
            fb.set_head(st, dg_ref, g, d, dy * y * (1.0 - sg))
        elif gate == "headwise":
            sg = jax.nn.sigmoid(g_ref[g].astype(jnp.float32))  # (1, bq)
            fb.set_head(st, do_ref, g, d, dy * fb.column(sg))
            dg_ref[g] = (fb.row(d_col) * (1.0 - sg)).astype(dg_ref.dtype)


def _prep(st: fb.Static, y, dy, g, gate, shape, kv_shape):
    b, s, hq, d = shape
    index = lambda b_, h, i: (b_, h, i)
    tile, rows = fb.q_spec(st, d, index), fb.rows_spec(st, index)
    in_specs, args = [tile, tile], [y, dy]
    out_specs, out_shape = [rows], [fb.sds((b, hq, 1, s), jnp.float32, y)]
    if gate:
        g_spec = tile if gate == "elementwise" else rows
        in_specs.append(g_spec)
        args.append(g)
        out_specs += [tile, g_spec]
        out_shape += [fb.sds(y.shape, y.dtype, y), fb.sds(g.shape, g.dtype, g)]
    out = pl.pallas_call(
        functools.partial(_prep_kernel, st, gate, d), grid=(b, kv_shape[2], st.nq),
        in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=fb.params("parallel", "parallel", "parallel"),
        cost_estimate=fb.cost(st, "prep", b, hq, kv_shape[2], d, y.dtype.itemsize, gate),
        interpret=st.interpret, name="gated_flash_bwd_prep" if gate else "flash_bwd_prep",
    )(*args)
    return (out[0], dy, None) if gate is None else tuple(out)


def _dkv_kernel(st: fb.Static, d: int, *refs):
    """Key-major: scores are [bk, bq] (k q^T), so the saved rows (lse, D) and the query segment
    ids broadcast along keys as they are stored, and no matrix is transposed. The group's query
    heads all add into the one kv head's dK, dV in VMEM."""
    q_ref, k_ref, v_ref, *refs = refs
    qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if st.segments else (None, None)
    do_ref, lse_ref, dd_ref, dk_ref, dv_ref, dk_sc, dv_sc = refs
    j, i = pl.program_id(2), pl.program_id(3)

    @pl.when(i == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(fb.block_visible(st, i, j))
    def _step():
        k, v = k_ref[...], v_ref[...]
        q_pos, k_pos = fb.positions(st, i, j, key_major=True)
        seg = (qseg_ref[...], fb.column(kseg_ref[...])) if st.segments else (None, None)
        mask = fb.mask(st, q_pos, k_pos, *seg)
        for g in range(st.groups):
            q, do = fb.head(st, q_ref, g, d), fb.head(st, do_ref, g, d)
            p_t = jnp.exp(fb.nt(k, q) * st.scale - lse_ref[g])  # [bk, bq]
            if mask is not None:
                p_t = jnp.where(mask, p_t, 0.0)
            dv_sc[...] += fb.nn(p_t.astype(do.dtype), do)
            ds_t = p_t * (fb.nt(v, do) - dd_ref[g])
            dk_sc[...] += fb.nn(ds_t.astype(q.dtype), q) * st.scale

    @pl.when(i == st.nq - 1)
    def _finish():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(st: fb.Static, d: int, *refs):
    q_ref, k_ref, v_ref, *refs = refs
    qseg_ref, kseg_ref = (refs.pop(0), refs.pop(0)) if st.segments else (None, None)
    do_ref, lse_ref, dd_ref, dq_ref, dq_sc = refs
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(fb.block_visible(st, i, j))
    def _step():
        k, v = k_ref[...], v_ref[...]
        mask = fb.query_major_mask(st, i, j, qseg_ref, kseg_ref)
        for g in range(st.groups):
            q, do = fb.head(st, q_ref, g, d), fb.head(st, do_ref, g, d)
            p = jnp.exp(fb.nt(q, k) * st.scale - fb.column(lse_ref[g]))  # [bq, bk]
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            ds = p * (fb.nt(do, v) - fb.column(dd_ref[g]))
            dq_sc[g] += fb.nn(ds.astype(k.dtype), k) * st.scale

    @pl.when(j == st.nk - 1)
    def _finish():
        for g in range(st.groups):
            fb.set_head(st, dq_ref, g, d, dq_sc[g])


def _bwd_inputs(st: fb.Static, d, q_of, k_of, q, k, v, seg, do, lse, dd):
    in_specs = [fb.q_spec(st, d, q_of), fb.kv_spec(st, d, k_of), fb.kv_spec(st, d, k_of)]
    args = [q, k, v]
    if st.segments:
        in_specs += [fb.seg_spec(st.bq, q_of), fb.seg_spec(st.bk, k_of)]
        args += list(seg)  # (query ids, key ids)
    in_specs += [fb.q_spec(st, d, q_of), fb.rows_spec(st, q_of), fb.rows_spec(st, q_of)]
    return in_specs, args + [do, lse, dd]


def _dkv(st: fb.Static, q, k, v, seg, do, lse, dd, shape, kv_shape):
    """dK, dV: grid (b, kv head, key block, query block), with the dK/dV blocks; causal query
    blocks before the diagonal repeat the first visible one, so they are not fetched."""
    st = st.for_dkv()
    b, _, hq, d = shape
    hk = kv_shape[2]
    q_of = lambda b_, h, j, i: (b_, h, jnp.maximum(i, fb.first_q_block(st, j)) if st.causal else i)
    k_of = lambda b_, h, j, i: (b_, h, j)
    in_specs, args = _bwd_inputs(st, d, q_of, k_of, q, k, v, seg, do, lse, dd)
    return pl.pallas_call(
        functools.partial(_dkv_kernel, st, d),
        grid=(b, hk, st.nk, st.nq),
        in_specs=in_specs,
        out_specs=[fb.kv_spec(st, d, k_of), fb.kv_spec(st, d, k_of)],
        out_shape=[fb.sds(k.shape, k.dtype, k), fb.sds(v.shape, v.dtype, v)],
        scratch_shapes=[pltpu.VMEM((st.bk, d), jnp.float32), pltpu.VMEM((st.bk, d), jnp.float32)],
        compiler_params=fb.params("parallel", "parallel", "parallel", "arbitrary"),
        cost_estimate=fb.cost(st, "dkv", b, hq, hk, d, q.dtype.itemsize),
        interpret=st.interpret, name="flash_bwd_dkv",
    )(*args)


def _dq(st: fb.Static, q, k, v, seg, do, lse, dd, shape, kv_shape):
    """dQ: grid (b, kv head, query block, key block), like the forward."""
    b, _, hq, d = shape
    hk = kv_shape[2]
    q_of = lambda b_, h, i, j: (b_, h, i)
    in_specs, args = _bwd_inputs(st, d, q_of, _k_index(st), q, k, v, seg, do, lse, dd)
    return pl.pallas_call(
        functools.partial(_dq_kernel, st, d),
        grid=(b, hk, st.nq, st.nk),
        in_specs=in_specs,
        out_specs=fb.q_spec(st, d, q_of),
        out_shape=fb.sds(q.shape, q.dtype, q),
        scratch_shapes=[pltpu.VMEM((st.groups, st.bq, d), jnp.float32)],
        compiler_params=fb.params("parallel", "parallel", "parallel", "arbitrary"),
        cost_estimate=fb.cost(st, "dq", b, hq, hk, d, q.dtype.itemsize),
        interpret=st.interpret, name="flash_bwd_dq",
    )(*args)


# ---------------------------------------------------------------- custom_vjp core

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _flash(st, gate, shape, kv_shape, q, k, v, seg, g):
    return _forward(st, q, k, v, seg, g, gate, shape, kv_shape)[0]


def _flash_fwd(st, gate, shape, kv_shape, q, k, v, seg, g):
    y, lse = _forward(st, q, k, v, seg, g, gate, shape, kv_shape)
    return y, (q, k, v, seg, g, y, lse)


def _flash_bwd(st, gate, shape, kv_shape, res, dy, dlse=None):
    q, k, v, seg, g, y, lse = res
    dd, do, dg = _prep(st, y, dy, g, gate, shape, kv_shape)
    if dlse is not None:  # the row term the dK/dV and dQ kernels use; the gate's dg keeps D
        dd = dd - dlse
    dk, dv = _dkv(st, q, k, v, seg, do, lse, dd, shape, kv_shape)
    dq = _dq(st, q, k, v, seg, do, lse, dd, shape, kv_shape)
    return dq, dk, dv, None, dg


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _flash_lse(st, gate, shape, kv_shape, q, k, v, seg, g):
    """`_flash` that also returns the log-sum-exp residual [B, Hq, 1, S_padded] as an output; a
    function of its own, so the plain call's program has no extra output or cotangent."""
    return _forward(st, q, k, v, seg, g, gate, shape, kv_shape)


def _flash_lse_fwd(st, gate, shape, kv_shape, q, k, v, seg, g):
    y, lse = _forward(st, q, k, v, seg, g, gate, shape, kv_shape)
    return (y, lse), (q, k, v, seg, g, y, lse)


def _flash_lse_bwd(st, gate, shape, kv_shape, res, cotangents):
    dy, dlse = cotangents
    return _flash_bwd(st, gate, shape, kv_shape, res, dy, dlse)


_flash_lse.defvjp(_flash_lse_fwd, _flash_lse_bwd)


# ---------------------------------------------------------------- public entry point

def dense_segment_ids(segment_ids_BxS):
    """The same segmentation with ids 1, 2, ... (at most S) per row, 0 (padding) kept: ids of any
    size become safe for the kernel (`MAX_SEGMENT_ID`). Jittable; one sort per row."""
    order_BxS = jnp.argsort(segment_ids_BxS, axis=1)
    sorted_BxS = jnp.take_along_axis(segment_ids_BxS, order_BxS, axis=1)
    new_BxS = jnp.concatenate([jnp.ones_like(sorted_BxS[:, :1], bool),
                               sorted_BxS[:, 1:] != sorted_BxS[:, :-1]], axis=1)
    rank_BxS = jnp.cumsum(new_BxS, axis=1, dtype=jnp.int32)  # 1.. per distinct id, in sorted order
    rows = jnp.arange(segment_ids_BxS.shape[0])[:, None]
    dense_BxS = jnp.zeros(segment_ids_BxS.shape, jnp.int32).at[rows, order_BxS].set(rank_BxS)
    return jnp.where(segment_ids_BxS == 0, 0, dense_BxS)


def _check_segment_values(segment_ids, name: str = "segment_ids") -> None:
    if isinstance(segment_ids, jax.core.Tracer):
        return  # under jit the values are unknown here: see the module docstring
    ids = np.asarray(segment_ids)
    if ids.size and (ids.max() >= MAX_SEGMENT_ID or ids.min() <= -MAX_SEGMENT_ID):
        bad = ids.max() if ids.max() >= MAX_SEGMENT_ID else ids.min()
        raise ValueError(f"{name} hold {bad}: the pallas kernel is exact only for |id| < 2**24 = "
                         f"{MAX_SEGMENT_ID} (ids cross it as float32); renumber them per row "
                         "(gattn.kernels.flash.dense_segment_ids)")


def _check(q, k, v, segment_ids, gate, causal, kv_segment_ids=None) -> str | None:
    kind = check_inputs(q, k, v, segment_ids, gate, kv_segment_ids)
    for name, ids in (("segment_ids", segment_ids), ("kv_segment_ids", kv_segment_ids)):
        if ids is not None:
            _check_segment_values(ids, name)
    if causal and q.shape[1] > k.shape[1]:
        raise ValueError(f"causal attention needs at least as many keys as queries; got "
                         f"q length {q.shape[1]} > k length {k.shape[1]}")
    return kind


def gated_flash_attention(q, k, v, gate=None, *, causal: bool = True, segment_ids=None,
                          sm_scale: float | None = None, block_sizes: BlockSizes | None = None,
                          interpret: bool | None = None, kv_segment_ids=None,
                          return_lse: bool = False):
    """softmax(q k^T * sm_scale + mask) v * sigmoid(gate), gate fused into the kernel.

    q [B, S, Hq, K]; k, v [B, T, Hk, K] (GQA: query head h reads kv head h // (Hq // Hk));
    gate: None (plain attention), logits [B, S, Hq, K] (elementwise) or [B, S, Hq] /
    [B, S, Hq, 1] (headwise). segment_ids [B, S] int: 0 = padding (attends to nothing, outputs
    0); alone they need self-attention (T = S), with kv_segment_ids [B, T] (the keys' ids) they
    are the queries' ids and T is free. Queries are padded to a multiple of the query block and
    keys to one of the key block internally (`flash_blocks.layout`). sm_scale defaults to
    K ** -0.5. `interpret` defaults to True off TPU (the platform of the context mesh, if one is
    set). Differentiable in q, k, v and gate.
    Returns [B, S, Hq, K] in q's dtype; with `return_lse` (y, lse): lse [B, S, Hq] float32, the
    log-sum-exp of the scaled scores over the keys each query sees (-1e30 where it sees none),
    differentiable too. Attentions of the same queries over pieces of the keys merge by it:
    lse = logaddexp(lse_1, lse_2), y = exp(lse_1 - lse) y_1 + exp(lse_2 - lse) y_2 (the gate
    scales every piece's y alike, so gated pieces merge too).
    """
    kind = _check(q, k, v, segment_ids, gate, causal, kv_segment_ids)
    b, s, hq, d = q.shape
    t, hk = k.shape[1], k.shape[2]
    bs = block_sizes or BlockSizes()
    lay = fb.layout(s, t, bs)
    bq, bk, bq2, bk2, sp, tp = lay.bq, lay.bk, lay.bq_dkv, lay.bk_dkv, lay.sp, lay.tp
    st = fb.Static(causal=causal, scale=float(d ** -0.5 if sm_scale is None else sm_scale),
                 bq=bq, bk=bk, nq=sp // bq, nk=tp // bk, groups=hq // hk, offset=t - s, kv_len=t,
                 padded_kv=tp != t, segments=segment_ids is not None, lanes=d % 128 == 0,
                 interpret=not fb.on_tpu() if interpret is None else bool(interpret),
                 dkv_blocks=(bq2, bk2))
    if not st.interpret and any(x % 128 for x in (bq, bk, bq2, bk2)):
        raise ValueError(f"block_sizes {bs}: compiled for TPU the blocks must be multiples of 128 "
                         f"(got {bq} x {bk}, dkv {bq2} x {bk2} for lengths {s} x {t})")
    pad = lambda x, n: x if n == x.shape[1] else jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    q_p, k_p, v_p = pad(q, sp), pad(k, tp), pad(v, tp)
    shape, kv_shape = (b, sp, hq, d), (b, tp, hk, d)
    seg = g = None
    if segment_ids is not None:
        ids = segment_ids.astype(jnp.int32)  # padded per side: queries to sp, keys to tp
        kv_ids = ids if kv_segment_ids is None else kv_segment_ids.astype(jnp.int32)
        seg = (pad(ids, sp)[:, None, :], pad(kv_ids, tp)[:, None, :])
    if kind == "elementwise":
        g = fb.tiles(pad(gate, sp), st.lanes)
    elif kind == "headwise":
        g = pad(gate.reshape(b, s, hq), sp).transpose(0, 2, 1)[:, :, None]
    args = (fb.tiles(q_p, st.lanes), fb.tiles(k_p, st.lanes), fb.tiles(v_p, st.lanes), seg, g)
    if not return_lse:
        return fb.untiles(_flash(st, kind, shape, kv_shape, *args), shape, st.lanes)[:, :s]
    y, lse = _flash_lse(st, kind, shape, kv_shape, *args)
    return fb.untiles(y, shape, st.lanes)[:, :s], lse[:, :, 0, :s].transpose(0, 2, 1)
