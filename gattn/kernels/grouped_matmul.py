"""Grouped matmul over contiguous groups of rows: out[r] = x[r] @ w[g] for the rows r of group g,
groups laid out one after another from row 0 (sizes [L]); rows past sum(sizes) are padding and
come out zero. Two implementations, picked by name (exec.grouped_matmul):

    ragged_dot  jax.lax.ragged_dot (XLA; libtpu lowers it to Mosaic kernels of its own)
    megablox    the Pallas TPU kernel jax ships (jax.experimental.pallas.ops.tpu.megablox): gmm
                forward, gmm + tgmm backward under its custom_vjp; run in interpret mode off TPU

Its tiles are MaxText's megablox defaults (tile_batch_seq 512, tile_activation_dim and
tile_weight_dim 1024; `tiles`), not the kernel's own 128 x 128 x 128: a row tile streams its
group's whole K x N weight from HBM, and every N tile streams the rows again, so on moe_15a2b's
step (1M routed rows a chip a layer, K x N = 2048 x 704) 128-tiles read the rows 6x and the
weights 8,192 times a layer (docs/presets.md, issue 58). megablox assumes the groups fill all rows,
and rows a multiple of its row tile. So the padding
is handed to it as one more group that has no weights: megablox skips it and zeroes its rows
(the path it has for experts sharded over devices), and callers size their buffers with
`padded_rows`. Its pallas_call gives its output no varying-mesh-axes type, so inside
`jax.shard_map` it needs `check_vma=False` (gattn/model/dropless_ep.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

from gattn.config.checks import GROUPED_MATMULS
from gattn.kernels.standin import enabled as standin_enabled

TILE = 128  # the TPU's lane width: a K or N tile below the whole dimension is a multiple of it
TILE_M, TILE_KN = 512, 1024  # MaxText's megablox tiles: rows; K and N (the whole dim when smaller)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def row_tile(rows: int) -> int:
    """megablox's row tile for `rows` rows: TILE_M, or the rows rounded up to 16 (bf16's sublane
    tile) when fewer."""
    return min(TILE_M, _round_up(rows, 16))


def _dim_tile(size: int) -> int:
    """A K or N tile: the whole dimension up to TILE_KN, else the largest multiple of TILE that
    divides it and is at most TILE_KN (TILE when none does: megablox masks the last tile)."""
    if size <= TILE_KN:
        return size
    return next((t for t in range(TILE_KN, TILE - 1, -TILE) if size % t == 0), TILE)


def tiles(m: int, k: int, n: int) -> tuple[int, int, int]:
    """megablox's (tm, tk, tn) for one call of m rows, K and N (gmm's and tgmm's alike: the
    backward calls it with K and N swapped, so each call gets tiles of its own)."""
    return row_tile(m), _dim_tile(k), _dim_tile(n)


def padded_rows(rows: int) -> int:
    """`rows` rounded up to a multiple of its row tile (megablox needs whole tiles)."""
    return _round_up(rows, row_tile(rows))


def megablox_dot(x_BxK: jax.Array, w_LxKxN: jax.Array, sizes_L: jax.Array, *, interpret: bool = False):
    """The grouped matmul by megablox; B must be `padded_rows(B)`. Output in x's dtype, like
    ragged_dot's. Each of its calls (gmm forward, gmm and tgmm backward) takes `tiles` of its own
    shape."""
    b = x_BxK.shape[0]
    if b != padded_rows(b):
        raise ValueError(f"megablox needs the rows ({b}) a multiple of its row tile: use padded_rows({b}) = "
                         f"{padded_rows(b)}")
    sizes = sizes_L.astype(jnp.int32)
    with_padding = jnp.concatenate([sizes, (b - jnp.sum(sizes))[None]])  # the last group: no weights
    return megablox.gmm(x_BxK, w_LxKxN, with_padding, x_BxK.dtype, tiles, None, None, False, interpret)


def scanned_dot(x_BxK: jax.Array, w_LxKxN: jax.Array, sizes_L: jax.Array) -> jax.Array:
    """ragged_dot's result by a scan over the groups: each step multiplies every row by one group's
    weights and keeps that group's rows. The rehearsal's stand-in for megablox on CPU (GATTN_PALLAS_STANDIN):
    XLA's CPU ragged_dot materialises all L groups' products at once, [L, B, K] and [L, B, N]
    (the dropless MoE of moe_15a2b's rehearsal, 8 experts: 236 MiB of temporaries a device, 117 MiB
    this way, and 4.9 -> 3.2 GiB for a process of 8 devices); the FLOPs are the same L x B x K x N."""
    ends = jnp.cumsum(sizes_L.astype(jnp.int32))
    row_B = jnp.arange(x_BxK.shape[0])

    def group(acc_BxN, g):
        mine_B = (row_B >= ends[g] - sizes_L[g]) & (row_B < ends[g])
        out_BxN = jnp.dot(x_BxK, w_LxKxN[g], preferred_element_type=jnp.float32)
        return acc_BxN + jnp.where(mine_B[:, None], out_BxN, 0.0), None

    acc_BxN = jnp.zeros((x_BxK.shape[0], w_LxKxN.shape[2]), jnp.float32)
    acc_BxN, _ = jax.lax.scan(group, acc_BxN, jnp.arange(w_LxKxN.shape[0]))
    return acc_BxN.astype(x_BxK.dtype)


def grouped_dot(kind: str, platform: str):
    """(x [B, K], w [L, K, N], sizes [L]) -> [B, N] by `kind` (one of GROUPED_MATMULS) for a
    program compiled for `platform` (megablox: the kernel on TPU, interpret mode elsewhere)."""
    if kind == "ragged_dot":
        return jax.lax.ragged_dot
    if kind == "megablox":
        if platform not in ("tpu", "cpu"):  # interpret mode is for tests; on a GPU it would be ~100x slow
            raise ValueError(f"exec.grouped_matmul = 'megablox' is a TPU kernel (this program is for {platform}): "
                             "use 'ragged_dot'")
        if standin_enabled(platform):
            return scanned_dot
        return lambda x, w, sizes: megablox_dot(x, w, sizes, interpret=platform != "tpu")
    raise ValueError(f"grouped matmul {kind!r}: expected one of {', '.join(map(repr, GROUPED_MATMULS))}")
