"""Flash attention for GPUs in Pallas (Triton lowering) with the paper's sigmoid output gate fused in.

    y = softmax(q k^T * sm_scale + mask) v * sigmoid(gate)

The same contract as the TPU kernel (flash.py) and the reference (reference.py): q, gate
[B, S, Hq, K], k, v [B, T, Hk, K], GQA without repeating K/V, causal and packed-sequence masks
(segment id 0 is padding: it attends to nothing and outputs exactly 0), any length.

Forward: one kernel per (query block, batch, query head); online softmax in base 2 over key
blocks; the gate is applied in the epilogue, so the ungated output never reaches HBM. It saves y
and one log-sum-exp per row. Backward (`custom_vjp`), as in flash.py: with y = o * s,
s = sigmoid(g): dO = dy * s, dg = dy * y * (1 - s), rowsum(o * dO) = rowsum(y * dy), so the
backward never needs o. That elementwise step is left to XLA (one fused pass on a GPU); then a
dK/dV kernel (one per key block and kv head, summing its G query heads in registers, so K/V
gradients are never formed per query head) and a dQ kernel.

Layout: arrays stay [B, S, H, K] (the projections' layout; a block is (rows, K) of one head).
Triton wants power-of-two tiles, so head_dim is zero-padded to a power of two >= 16 (zero
columns change neither scores nor outputs) and sequences to the block size. Off a GPU the kernels
run in Pallas interpret mode (how the tests check them on CPU; ~100x slower than XLA).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from gattn.kernels.reference import check_inputs

try:  # Triton-specific compiler parameters (the name moved between JAX releases)
    from jax.experimental.pallas import triton as _pltriton
    _CompilerParams = getattr(_pltriton, "CompilerParams", None) or getattr(_pltriton, "TritonCompilerParams")
except ImportError:  # pragma: no cover - a JAX without the Triton lowering: interpret mode only
    _CompilerParams = None

_NEG = -1e30            # masked score (log2 domain): finite, so no inf - inf
_EMPTY_LSE = 1e30       # log-sum-exp of a row that sees no key: exp2(s - lse) == 0 for every s
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Rows per kernel step: (block_q, block_k) of the forward, (block_q_bwd, block_k_bwd) of
    both backward kernels. Powers of two >= 16 (Triton tiles); a block longer than the sequence
    (rounded up to a power of two) is shortened to it."""
    block_q: int = 64
    block_k: int = 64
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps: int | None = None   # None: 4 for head_dim <= 64, else 8
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 16 or value & (value - 1):
                raise ValueError(f"block_sizes.{name} = {value!r}: must be a power of two >= 16")


@dataclasses.dataclass(frozen=True)
class _Static:
    causal: bool
    scale: float      # sm_scale * log2(e): scores are kept in base 2
    bq: int
    bk: int
    bq2: int          # backward blocks
    bk2: int
    groups: int       # query heads per kv head
    offset: int       # T - S (causal diagonal offset)
    kv_len: int       # keys before padding
    padded_kv: bool
    segments: bool
    interpret: bool
    num_warps: int
    num_stages: int


def _on_gpu() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = device.platform if device is not None else jax.default_backend()
    return platform in ("gpu", "cuda", "rocm")


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _nt(a, b):  # a @ b^T, float32 accumulation
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _nn(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _tn(a, b):  # a^T @ b
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _mask(st: _Static, q_pos, k_pos, q_seg, k_seg):
    """[bq, bk] visibility, or None when nothing is masked."""
    mask = None
    if st.causal:
        mask = k_pos[None, :] <= q_pos[:, None] + st.offset
    if st.segments:  # same document, and a padding query (id 0) sees nothing
        same = (q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] != 0)
        mask = same if mask is None else mask & same
    elif st.padded_kv and not st.causal:
        inside = jnp.broadcast_to(k_pos[None, :] < st.kv_len, (q_pos.shape[0], k_pos.shape[0]))
        mask = inside if mask is None else mask & inside
    return mask


def _kv_blocks_for(st: _Static, i, bq, bk, nk):
    """Key blocks query block i can see: all, or (causal) up to its last row's diagonal."""
    if not st.causal:
        return nk
    return jnp.minimum(nk, lax.div((i + 1) * bq + st.offset + bk - 1, bk))


def _params(st: _Static):
    if st.interpret or _CompilerParams is None:
        return None
    return _CompilerParams(num_warps=st.num_warps, num_stages=st.num_stages)


# ---------------------------------------------------------------- forward

def _fwd_kernel(q_ref, k_ref, v_ref, seg_ref, g_ref, y_ref, lse_ref, *, st: _Static, gate, nk):
    i = pl.program_id(0)
    bq, bk = st.bq, st.bk
    q = q_ref[...]
    q_pos = i * bq + jnp.arange(bq)
    q_seg = seg_ref[pl.ds(i * bq, bq)] if st.segments else None

    def body(j, carry):
        acc, m, l = carry
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        s = _nt(q, k) * st.scale
        k_seg = seg_ref[pl.ds(j * bk, bk)] if st.segments else None
        mask = _mask(st, q_pos, j * bk + jnp.arange(bk), q_seg, k_seg)
        if mask is not None:
            s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])
        if mask is not None:  # a fully masked row keeps p == 0 (not a uniform average)
            p = jnp.where(mask, p, 0.0)
        corr = jnp.exp2(m - m_new)
        return acc * corr[:, None] + _nn(p.astype(v.dtype), v), m_new, l * corr + jnp.sum(p, axis=1)

    init = (jnp.zeros((bq, q.shape[1]), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(0, _kv_blocks_for(st, i, bq, bk, nk), body, init)
    seen = l > 0
    o = acc / jnp.where(seen, l, 1.0)[:, None]
    if gate == "elementwise":
        o = o * jax.nn.sigmoid(g_ref[...].astype(jnp.float32))
    elif gate == "headwise":
        o = o * jax.nn.sigmoid(g_ref[...].astype(jnp.float32))[:, None]
    y_ref[...] = o.astype(y_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), _EMPTY_LSE)


def _forward(st: _Static, q, k, v, seg, g, gate):
    b, sp, hq, dp = q.shape
    tp = k.shape[1]
    nq, nk = sp // st.bq, tp // st.bk
    gq = st.groups
    q_spec = pl.BlockSpec((None, st.bq, None, dp), lambda i, bi, h: (bi, i, h, 0))
    kv_spec = pl.BlockSpec((None, tp, None, dp), lambda i, bi, h: (bi, 0, h // gq, 0))
    seg_spec = None if seg is None else pl.BlockSpec((None, sp), lambda i, bi, h: (bi, 0))
    g_spec = {None: None, "elementwise": q_spec,
              "headwise": pl.BlockSpec((None, None, st.bq), lambda i, bi, h: (bi, h, i))}[gate]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, st=st, gate=gate, nk=nk),
        grid=(nq, b, hq),
        in_specs=[q_spec, kv_spec, kv_spec, seg_spec, g_spec],
        out_specs=[q_spec, pl.BlockSpec((None, None, st.bq), lambda i, bi, h: (bi, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, sp), jnp.float32)],
        compiler_params=_params(st), interpret=st.interpret, name="gated_flash_fwd_gpu",
    )(q, k, v, seg, g)


# ---------------------------------------------------------------- backward

def _dkv_kernel(q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref, dd_ref, dk_ref, dv_ref, *, st: _Static, nq):
    """One key block of one kv head: dK, dV summed over the group's query heads and query blocks."""
    j = pl.program_id(0)
    bq, bk = st.bq2, st.bk2
    k, v = k_ref[...], v_ref[...]
    k_pos = j * bk + jnp.arange(bk)
    k_seg = seg_ref[pl.ds(j * bk, bk)] if st.segments else None
    # causal: the first query block with a row that sees key j * bk
    first = jnp.maximum(0, lax.div(j * bk - st.offset, bq)) if st.causal else 0
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for g in range(st.groups):  # static: the group's query heads, summed in registers
        def body(i, carry, g=g):
            dk, dv = carry
            rows = pl.ds(i * bq, bq)
            q = q_ref[rows, g, :]
            do = do_ref[rows, g, :]
            s = _nt(q, k) * st.scale
            mask = _mask(st, i * bq + jnp.arange(bq), k_pos,
                         seg_ref[rows] if st.segments else None, k_seg)
            p = jnp.exp2(s - lse_ref[g, rows][:, None])
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            dv = dv + _tn(p.astype(do.dtype), do)
            ds = p * (_nt(do, v) - dd_ref[g, rows][:, None]) * (st.scale / _LOG2E)
            return dk + _tn(ds.astype(q.dtype), q), dv
        dk, dv = lax.fori_loop(first, nq, body, (dk, dv))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref, dd_ref, dq_ref, *, st: _Static, nk):
    i = pl.program_id(0)
    bq, bk = st.bq2, st.bk2
    q, do = q_ref[...], do_ref[...]
    lse, dd = lse_ref[...], dd_ref[...]
    q_pos = i * bq + jnp.arange(bq)
    q_seg = seg_ref[pl.ds(i * bq, bq)] if st.segments else None

    def body(j, dq):
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        s = _nt(q, k) * st.scale
        mask = _mask(st, q_pos, j * bk + jnp.arange(bk), q_seg,
                     seg_ref[pl.ds(j * bk, bk)] if st.segments else None)
        p = jnp.exp2(s - lse[:, None])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        ds = p * (_nt(do, v) - dd[:, None]) * (st.scale / _LOG2E)
        return dq + _nn(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, _kv_blocks_for(st, i, bq, bk, nk), body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _backward(st: _Static, q, k, v, seg, do, lse, dd):
    b, sp, hq, dp = q.shape
    tp, hk = k.shape[1], k.shape[2]
    gq, bq, bk = st.groups, st.bq2, st.bk2
    seg_spec = None if seg is None else pl.BlockSpec((None, sp), lambda *ids: (ids[1], 0))
    # dK/dV: grid (key block, batch, kv head); the group's query heads are read as a [S, G, K] block
    group_spec = pl.BlockSpec((None, sp, gq, dp), lambda j, bi, h: (bi, 0, h, 0))
    kblock_spec = pl.BlockSpec((None, bk, None, dp), lambda j, bi, h: (bi, j, h, 0))
    group_rows = pl.BlockSpec((None, gq, sp), lambda j, bi, h: (bi, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, st=st, nq=sp // bq),
        grid=(tp // bk, b, hk),
        in_specs=[group_spec, kblock_spec, kblock_spec, seg_spec, group_spec, group_rows, group_rows],
        out_specs=[kblock_spec, kblock_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(st), interpret=st.interpret, name="gated_flash_dkv_gpu",
    )(q, k, v, seg, do, lse, dd)
    # dQ: grid (query block, batch, query head)
    q_spec = pl.BlockSpec((None, bq, None, dp), lambda i, bi, h: (bi, i, h, 0))
    kv_spec = pl.BlockSpec((None, tp, None, dp), lambda i, bi, h: (bi, 0, h // gq, 0))
    rows_spec = pl.BlockSpec((None, None, bq), lambda i, bi, h: (bi, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=st, nk=tp // bk),
        grid=(sp // bq, b, hq),
        in_specs=[q_spec, kv_spec, kv_spec, seg_spec, q_spec, rows_spec, rows_spec],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(st), interpret=st.interpret, name="gated_flash_dq_gpu",
    )(q, k, v, seg, do, lse, dd)
    return dq, dk, dv


def _gate_scores(g, gate):
    """sigmoid(gate) broadcastable against [B, S, Hq, K] (headwise g is [B, Hq, S])."""
    s = jax.nn.sigmoid(g.astype(jnp.float32))
    return s if gate == "elementwise" else s.transpose(0, 2, 1)[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(st, gate, q, k, v, seg, g):
    return _forward(st, q, k, v, seg, g, gate)[0]


def _flash_fwd(st, gate, q, k, v, seg, g):
    y, lse = _forward(st, q, k, v, seg, g, gate)
    return y, (q, k, v, seg, g, y, lse)


def _flash_bwd(st, gate, res, dy):
    q, k, v, seg, g, y, lse = res
    dy32, y32 = dy.astype(jnp.float32), y.astype(jnp.float32)
    dd = jnp.sum(y32 * dy32, axis=-1).transpose(0, 2, 1)  # rowsum(o * dO) = rowsum(y * dy): [B, Hq, S]
    dg = None
    if gate is None:
        do = dy
    else:
        s = _gate_scores(g, gate)
        do = (dy32 * s).astype(q.dtype)
        dg32 = dy32 * y32 * (1.0 - s)
        dg = (dg32 if gate == "elementwise" else jnp.sum(dg32, axis=-1).transpose(0, 2, 1)).astype(g.dtype)
    dq, dk, dv = _backward(st, q, k, v, seg, do, lse, dd)
    return dq, dk, dv, None, dg


_flash.defvjp(_flash_fwd, _flash_bwd)


def gated_flash_attention_gpu(q, k, v, gate=None, *, causal: bool = True, segment_ids=None,
                              sm_scale: float | None = None, block_sizes: GpuBlockSizes | None = None,
                              interpret: bool | None = None):
    """softmax(q k^T * sm_scale + mask) v * sigmoid(gate), the gate fused into the GPU kernel.

    Same arguments as `gated_flash_attention` (flash.py): q [B, S, Hq, K]; k, v [B, T, Hk, K];
    gate None, [B, S, Hq, K] (elementwise) or [B, S, Hq] / [B, S, Hq, 1] (headwise) logits;
    segment_ids [B, S] (0 = padding). `interpret` defaults to True off a GPU. Differentiable in
    q, k, v and gate. Returns [B, S, Hq, K] in q's dtype."""
    kind = check_inputs(q, k, v, segment_ids, gate)
    if causal and q.shape[1] > k.shape[1]:
        raise ValueError(f"causal attention needs at least as many keys as queries; got "
                         f"q length {q.shape[1]} > k length {k.shape[1]}")
    b, s, hq, d = q.shape
    t, hk = k.shape[1], k.shape[2]
    bs = block_sizes or GpuBlockSizes()
    bq, bk = min(bs.block_q, _pow2(s)), min(bs.block_k, _pow2(t))
    bq2, bk2 = min(bs.block_q_bwd, _pow2(s)), min(bs.block_k_bwd, _pow2(t))
    sp = -(-s // max(bq, bq2)) * max(bq, bq2)
    tp = -(-t // max(bk, bk2)) * max(bk, bk2)
    if segment_ids is not None:  # one id array serves queries and keys: one padded length
        sp = tp = max(sp, tp)
    dp = _pow2(d)
    st = _Static(causal=causal, scale=float(d ** -0.5 if sm_scale is None else sm_scale) * _LOG2E,
                 bq=bq, bk=bk, bq2=bq2, bk2=bk2, groups=hq // hk, offset=t - s, kv_len=t,
                 padded_kv=tp != t, segments=segment_ids is not None,
                 interpret=not _on_gpu() if interpret is None else bool(interpret),
                 num_warps=bs.num_warps or (4 if dp <= 64 else 8), num_stages=bs.num_stages)

    def pad(x, n):  # [B, L, H, K] -> [B, n, H, dp]
        return jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, dp - x.shape[3])))

    seg = g = None
    if segment_ids is not None:
        seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, sp - s)))
    if kind == "elementwise":
        g = pad(gate, sp)
    elif kind == "headwise":
        g = jnp.pad(gate.reshape(b, s, hq), ((0, 0), (0, sp - s), (0, 0))).transpose(0, 2, 1)
    y = _flash(st, kind, pad(q, sp), pad(k, tp), pad(v, tp), seg, g)
    return y[:, :s, :, :d]
