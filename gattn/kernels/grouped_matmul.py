"""Grouped matmul over contiguous groups of rows: out[r] = x[r] @ w[g] for the rows r of group g,
groups laid out one after another from row 0 (sizes [L]); rows past sum(sizes) are padding and
come out zero. Two implementations, picked by name (exec.grouped_matmul):

    ragged_dot  jax.lax.ragged_dot (XLA; libtpu lowers it to Mosaic kernels of its own)
    megablox    the Pallas TPU kernel jax ships (jax.experimental.pallas.ops.tpu.megablox): gmm
                forward, gmm + tgmm backward under its custom_vjp; run in interpret mode off TPU

megablox assumes the groups fill all rows, and rows a multiple of its row tile. So the padding
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

TILE = 128  # megablox's default tile, the TPU's lane width


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def row_tile(rows: int) -> int:
    """megablox's row tile for `rows` rows: 128, or the rows rounded up to 16 (bf16's sublane
    tile) when fewer."""
    return min(TILE, _round_up(rows, 16))


def padded_rows(rows: int) -> int:
    """`rows` rounded up to a multiple of its row tile (megablox needs whole tiles)."""
    return _round_up(rows, row_tile(rows))


def megablox_dot(x_BxK: jax.Array, w_LxKxN: jax.Array, sizes_L: jax.Array, *, interpret: bool = False):
    """The grouped matmul by megablox; B must be `padded_rows(B)`. Output in x's dtype, like
    ragged_dot's. K and N are tiled by 128 when both are at least that, else by the smaller one
    (the backward pass swaps their roles, so one tile serves both)."""
    b, k = x_BxK.shape
    n = w_LxKxN.shape[2]
    if b != padded_rows(b):
        raise ValueError(f"megablox needs the rows ({b}) a multiple of its row tile: use padded_rows({b}) = "
                         f"{padded_rows(b)}")
    tile = TILE if min(k, n) >= TILE else min(k, n)
    sizes = sizes_L.astype(jnp.int32)
    with_padding = jnp.concatenate([sizes, (b - jnp.sum(sizes))[None]])  # the last group: no weights
    return megablox.gmm(x_BxK, w_LxKxN, with_padding, x_BxK.dtype, (row_tile(b), tile, tile),
                        None, None, False, interpret)


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
            return jax.lax.ragged_dot
        return lambda x, w, sizes: megablox_dot(x, w, sizes, interpret=platform != "tpu")
    raise ValueError(f"grouped matmul {kind!r}: expected one of {', '.join(map(repr, GROUPED_MATMULS))}")
