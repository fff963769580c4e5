"""What one step of the TPU flash kernels (`flash.py`) sees: block sizes, the static facts a
trace needs (`Static`), how the public [B, S, H, K] arrays are tiled into blocks (`tiles`, the
BlockSpecs), which scores a block keeps (causal, padding, segment ids), and the cost estimate
XLA schedules the kernels by. Pure helpers: the kernels and their `custom_vjp` are in flash.py.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG = -1e30
MAX_SEGMENT_ID = 2**24  # segment ids cross the kernel as float32: exact for |id| < 2**24
# Scoped VMEM a kernel may use: a step holds a whole GQA group's query blocks (and their float32
# accumulators); 48 MiB fits the VMEM of v5e, v5p and v6e chips.
VMEM_LIMIT = 48 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query and key block lengths (rows per kernel step) of the forward and dQ kernels, and of
    the dK/dV kernel, which streams the whole GQA group's q and dO past each key block and so
    wants longer key blocks. TPU wants multiples of 128; a block longer than the (128-rounded)
    sequence is shortened to it, and a dK/dV block to one that tiles the padded length (`layout`)."""
    block_q: int = 512
    block_k: int = 512
    block_q_dkv: int = 512
    block_k_dkv: int = 2048

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_dkv", "block_k_dkv"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 8 or value % 8:
                raise ValueError(f"block_sizes.{name} = {value!r}: must be a positive multiple of 8")


@dataclasses.dataclass(frozen=True)
class Static:
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
    dkv_blocks: tuple[int, int]  # (bq, bk) of the dK/dV kernel

    def for_dkv(self) -> "Static":
        bq, bk = self.dkv_blocks
        return dataclasses.replace(self, bq=bq, bk=bk, nq=self.nq * self.bq // bq,
                                   nk=self.nk * self.bk // bk)


def on_tpu() -> bool:
    """Whether this trace is for TPU: the platform of the mesh set with `jax.set_mesh` (so an
    ahead-of-time compile for a TPU topology from a CPU host gets the real kernel), else the
    default backend's."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return (device.platform if device is not None else jax.default_backend()) == "tpu"


def round_up(n, m):
    return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class Layout:
    """The blocks one call runs with and the lengths it pads to: queries to a multiple of bq,
    keys to a multiple of bk, so at most one block of padding each (never to a common multiple
    of all the blocks). The dK/dV blocks are the longest that tile those lengths."""
    bq: int
    bk: int
    bq_dkv: int
    bk_dkv: int
    sp: int   # padded query length
    tp: int   # padded key length


def _tiling(block: int, base: int, n: int) -> int:
    """The longest block <= `block` that tiles n (a multiple of `base`): a multiple of
    gcd(block, base, 128), so blocks that were TPU-sized (x 128) stay so; `base` itself qualifies."""
    unit = math.gcd(block, base, 128)
    return max(m for m in range(unit, min(block, n) + 1, unit) if n % m == 0)


def layout(s: int, t: int, bs: BlockSizes) -> Layout:
    """Blocks and padded lengths for s queries and t keys; a block longer than its (128-rounded)
    sequence is shortened to it."""
    fit = lambda block, n: min(block, round_up(n, 128))
    bq, bk = fit(bs.block_q, s), fit(bs.block_k, t)
    sp, tp = round_up(s, bq), round_up(t, bk)
    return Layout(bq, bk, _tiling(fit(bs.block_q_dkv, s), bq, sp), _tiling(fit(bs.block_k_dkv, t), bk, tp),
                  sp, tp)


# ---------------------------------------------------------------- layout helpers
#
# A kernel step handles one kv head and the G query heads that read it (GQA group), so K/V
# blocks are fetched once per group rather than once per query head. Query-side arrays are
# blocked as all G heads of the group, key-side arrays as the one kv head.

def tiles(x, lanes):
    """[B, S, H, K] -> the kernel layout: [B, S, H*K] (lanes) or [B, H, S, K]."""
    b, s, h, d = x.shape
    return x.reshape(b, s, h * d) if lanes else x.transpose(0, 2, 1, 3)


def untiles(x, shape, lanes):
    return x.reshape(shape) if lanes else x.transpose(0, 2, 1, 3)


def q_spec(st: Static, d, index):
    """The group's G query heads x a query block; `index` maps grid ids to (b, kv head, blk)."""
    g = st.groups
    if st.lanes:
        return pl.BlockSpec((None, st.bq, g * d), lambda *ids: (lambda b, h, i: (b, i, h))(*index(*ids)))
    return pl.BlockSpec((None, g, st.bq, d), lambda *ids: (lambda b, h, i: (b, h, i, 0))(*index(*ids)))


def kv_spec(st: Static, d, index):
    """One kv head x a key block."""
    if st.lanes:
        return pl.BlockSpec((None, st.bk, d), lambda *ids: (lambda b, h, j: (b, j, h))(*index(*ids)))
    return pl.BlockSpec((None, None, st.bk, d), lambda *ids: (lambda b, h, j: (b, h, j, 0))(*index(*ids)))


def rows_spec(st: Static, index):
    """The group's G heads x (1, block) of a lane-dense [B, Hq, 1, S] row array."""
    return pl.BlockSpec((None, st.groups, 1, st.bq),
                        lambda *ids: (lambda b, h, i: (b, h, 0, i))(*index(*ids)))


def seg_spec(block, index):
    """A (1, block) piece of the [B, 1, S] segment ids."""
    return pl.BlockSpec((None, 1, block), lambda *ids: (lambda b, h, i: (b, 0, i))(*index(*ids)))


def head(st: Static, ref, g, d):
    """Head g of a query-side block: [bq, d]."""
    return ref[:, g * d:(g + 1) * d] if st.lanes else ref[g]


def set_head(st: Static, ref, g, d, value):
    if st.lanes:
        ref[:, g * d:(g + 1) * d] = value.astype(ref.dtype)
    else:
        ref[g] = value.astype(ref.dtype)


def sds(shape, dtype, like):
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)


def column(row_1xN):
    """(1, n) -> (n, 1). Row vectors live lane-dense in HBM (a [.., S, 1] array would be padded
    to 128 lanes per element on TPU); a 2-D transpose of a broadcast tile turns one into a column."""
    dtype = row_1xN.dtype
    tile = jnp.broadcast_to(row_1xN.astype(jnp.float32), (128, row_1xN.shape[1]))
    return tile.T[:, :1].astype(dtype)


def row(column_Nx1):
    """(n, 1) -> (1, n), the inverse of `column`."""
    tile = jnp.broadcast_to(column_Nx1.astype(jnp.float32), (column_Nx1.shape[0], 128))
    return tile.T[:1].astype(column_Nx1.dtype)


def last_k_block(st: Static, i):
    """Last key block a causal query block i can see."""
    return jnp.minimum((i * st.bq + st.bq - 1 + st.offset) // st.bk, st.nk - 1)


def first_q_block(st: Static, j):
    """First query block that can see key block j (causal)."""
    return jnp.clip((j * st.bk - st.offset) // st.bq, 0, st.nq - 1)


def block_visible(st: Static, i, j):
    if not st.causal:
        return True
    return j * st.bk <= i * st.bq + st.bq - 1 + st.offset


def mask(st: Static, q_pos, k_pos, q_seg, k_seg):
    """Which scores are kept, from broadcastable positions and segment ids: [bq, 1] with [1, bk]
    for query-major blocks, [1, bq] with [bk, 1] for key-major ones. None when all are."""
    keep = None

    def both(m):
        return m if keep is None else keep & m

    if st.causal:
        keep = both(k_pos <= q_pos + st.offset)
    if st.padded_kv and not st.segments:  # with segment ids, padded keys have id 0
        keep = both(k_pos < st.kv_len)
    if st.segments:
        keep = both((q_seg == k_seg) & (q_seg != 0))
    return keep


def positions(st: Static, i, j, key_major: bool):
    iota = lambda n, axis: jax.lax.broadcasted_iota(jnp.int32, (n, 1) if axis == 0 else (1, n), axis)
    if key_major:
        return i * st.bq + iota(st.bq, 1), j * st.bk + iota(st.bk, 0)
    return i * st.bq + iota(st.bq, 0), j * st.bk + iota(st.bk, 1)


def nt(a, b):  # a @ b^T with float32 accumulation
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def nn(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def query_major_mask(st, i, j, qseg_ref, kseg_ref):
    """[bq, bk] mask of block (i, j), as the forward and dQ kernels see it."""
    q_pos, k_pos = positions(st, i, j, key_major=False)
    q_seg = k_seg = None
    if st.segments:
        q_seg, k_seg = column(qseg_ref[...]), kseg_ref[...]
    return mask(st, q_pos, k_pos, q_seg, k_seg)


def cost(st: Static, kernel: str, b: int, hq: int, hk: int, d: int, itemsize: int,
          gate: str | None = None) -> pl.CostEstimate:
    """HBM bytes, flops and exps of one kernel, counted block by block as its grid fetches them
    (fully masked causal blocks are neither fetched nor computed; K/V once per GQA group). XLA's
    cost analysis, and its scheduler, see a Mosaic kernel only through this estimate."""
    last = lambda i: min((i * st.bq + st.bq - 1 + st.offset) // st.bk, st.nk - 1)
    pairs = sum(last(i) + 1 for i in range(st.nq)) if st.causal else st.nq * st.nk
    g = st.groups
    tq, tk, row = st.bq * d * itemsize, st.bk * d * itemsize, st.bq * 4
    sq, sk = (st.bq * 4, st.bk * 4) if st.segments else (0, 0)
    gq = {None: 0, "elementwise": tq, "headwise": row}[gate]
    exps = b * hq * pairs * st.bq * st.bk
    if kernel == "fwd":  # per query block: q, gate, out, lse; per visible key block: k, v
        nbytes = b * hk * (st.nq * (g * (2 * tq + gq + row) + sq) + pairs * (2 * tk + sk))
        return pl.CostEstimate(flops=4 * exps * d, transcendentals=exps, bytes_accessed=nbytes)
    if kernel == "dq":  # per query block: q, dO, lse, D, dq; per visible key block: k, v
        nbytes = b * hk * (st.nq * (g * (3 * tq + 2 * row) + sq) + pairs * (2 * tk + sk))
        return pl.CostEstimate(flops=6 * exps * d, transcendentals=exps, bytes_accessed=nbytes)
    if kernel == "dkv":  # per key block: k, v, dk, dv; per visible query block: q, dO, lse, D
        nbytes = b * hk * (st.nk * (4 * tk + sk) + pairs * (g * (2 * tq + 2 * row) + sq))
        return pl.CostEstimate(flops=8 * exps * d, transcendentals=exps, bytes_accessed=nbytes)
    # prep: y, dy in; D out; with a gate also g in, dO and dg out
    nbytes = b * hq * st.nq * (2 * tq + row + (2 * gq + tq if gate else 0))
    return pl.CostEstimate(flops=b * hq * st.nq * st.bq * d * 4, transcendentals=0 if gate is None
                           else b * hq * st.nq * st.bq * (d if gate == "elementwise" else 1),
                           bytes_accessed=nbytes)


def params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=VMEM_LIMIT)
