"""Context parallelism: each row's sequence split over the mesh's `context` axis (mesh.context).

Layout. With n devices on the axis, a row of S tokens is cut into 2n chunks of C = S / 2n, and
device r holds chunks r and 2n-1-r: an early and a late one, so that every device has the same
causal attention work (r + 1 and 2n - r chunk pairs: 2n + 1 in all). `arrange` puts a batch's
per-token arrays (tokens, targets, positions, segment ids, loss weights) in that order once, in
the loss (gattn/train/loss.py), before the model; the residual stream is then split over context
(sharding.rows, its tokens in `sharding.stream` order: each device holds its rows' pieces), and
every per-token layer (projections, norms, FFN, the LM head and the loss, a sum over tokens) runs
on its tokens with no change; an expert-parallel MoE takes context as one of its token axes
(gattn/model/sharding.py `token_axes`), so each device routes its own tokens. RoPE reads
the positions it is given (arranged with the tokens), and targets are shifted before arranging,
so the loss and the MTP layer's t+2 targets cross chunk boundaries correctly.

Only the layers that mix tokens across the sequence communicate over the axis, each in a
shard_map whose body sees its device's two chunks:

- attention (`attention`): K, V and the segment ids are all-gathered over the axis; each chunk's
  queries attend to the chunk's own keys (causal: the diagonal pair) and to every earlier chunk
  (non-causal pairs, batched: 2n - 1 per device), each pair through the attention implementation
  with its log-sum-exp, merged by log-sum-exp. The paper's SDPA gate multiplies the merged
  output (outside the kernel: the pieces are ungated).
- Gated DeltaNet (`gdn`): the causal conv takes its W-1 inputs of left context from the end of
  the previous chunk (all-gathered tails); the rule runs on each chunk from an identity-augmented
  zero state, which yields the chunk's affine transition S_out = A S_in + B in one pass (the rule
  is linear in the state and acts on each value column alone: state [I | 0] and values [0 | v]
  give [A | B]); the transitions are all-gathered and composed in chunk order (a reset inside a
  chunk zeroes its A: the carry is cut at a packed document's start), and the rule runs again on
  each chunk from its true initial state. About three chunked passes of the rule (the first
  with K + V value columns); the rest of the layer is per token.

Everything else in a step (the gradient reduction over the context axis, parameters split over
it as over fsdp) is XLA's partitioning of the annotated arrays (gattn/model/sharding.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gattn.config import BATCH_AXES

AXIS = "context"
_FAR = -1e30  # the log-sum-exp of "no keys": finite, so merging never makes inf - inf


def size() -> int:
    """The context axis's size on the mesh set with `jax.set_mesh` (1 without one), outside any
    shard_map over it."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS in set(mesh.manual_axes):
        return 1
    return mesh.shape.get(AXIS, 1)


def order(length: int, n: int) -> np.ndarray:
    """The load-balanced layout of positions 0..length-1 over n devices: device r's slice holds
    chunks r and 2n-1-r (of length / 2n each), devices in order."""
    if length % (2 * n):
        raise ValueError(f"sequence length {length}: context parallelism over {n} devices needs a multiple of "
                         f"{2 * n} (2 x mesh.context chunks); set train.seq_len so that seq_len is one")
    c = length // (2 * n)
    chunks = np.arange(length).reshape(2 * n, c)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * n - 1 - r]]) for r in range(n)])


def arrange(*arrays_BxS, n: int | None = None):
    """Each [B, S, ...] array (None passes through) with its positions put in the layout `order`
    for n = `size()` devices; as they are for n = 1."""
    n = size() if n is None else n
    if n == 1:
        return arrays_BxS
    length = next(x.shape[1] for x in arrays_BxS if x is not None)
    index = jnp.asarray(order(length, n))
    return tuple(None if x is None else jnp.take(x, index, axis=1) for x in arrays_BxS)


def restore(x_BxS, n: int | None = None):
    """The inverse of `arrange` for one array: natural order again."""
    n = size() if n is None else n
    if n == 1:
        return x_BxS
    return jnp.take(x_BxS, jnp.asarray(np.argsort(order(x_BxS.shape[1], n))), axis=1)


# --------------------------------------------------------------------------- inside the shard_map


def _natural_chunks(x_BxSx, n: int):
    """The device's [B, 2C, ...] slice all-gathered over the axis, as [B, 2n, C, ...] in chunk
    order (chunk c is device c's first half for c < n, device 2n-1-c's second half after)."""
    b, s2 = x_BxSx.shape[:2]
    gathered = jax.lax.all_gather(x_BxSx, AXIS, axis=1, tiled=True)  # [B, n * 2C, ...], devices in order
    g = gathered.reshape(b, n, 2, s2 // 2, *x_BxSx.shape[2:])
    return jnp.concatenate([g[:, :, 0], g[:, ::-1, 1]], axis=1)


def _mine(n: int):
    """The global chunk indices of this device's two chunks, [2] int32 (traced: axis_index)."""
    r = jax.lax.axis_index(AXIS)
    return jnp.stack([r, 2 * n - 1 - r])


def _pieces(x_BxSx):
    """[B, 2C, ...] -> [2B, C, ...]: the device's two chunks as rows (row 2i + p: chunk p of row i)."""
    b, s2 = x_BxSx.shape[:2]
    return x_BxSx.reshape(b * 2, s2 // 2, *x_BxSx.shape[2:])


def _unpieces(x_2BxCx):
    b2, c = x_2BxCx.shape[:2]
    return x_2BxCx.reshape(b2 // 2, 2 * c, *x_2BxCx.shape[2:])


def _attention_body(fn, n, options, q, k, v, gate, seg):
    """One device's queries (two chunks) against the all-gathered keys: the diagonal pairs
    (causal) and the 2n - 1 earlier-chunk pairs (full), merged by log-sum-exp, then gated."""
    b, s2, hq, d = q.shape
    c = s2 // 2
    k_nat, v_nat, seg_nat = (_natural_chunks(x, n) for x in (k, v, seg))  # [B, 2n, C, ...]
    q_p, seg_p = _pieces(q), _pieces(seg)
    o_diag, lse_diag = fn(q_p, _pieces(k), _pieces(v), None, causal=True, segment_ids=seg_p,
                          kv_segment_ids=seg_p, return_lse=True, **options)
    o_diag, lse_diag = o_diag.reshape(b, 2, c, hq, d), lse_diag.reshape(b, 2, c, hq)

    # Pair j: the early chunk r against chunk j for j < r, the late chunk against chunk j - r after.
    r = jax.lax.axis_index(AXIS)
    j = jnp.arange(2 * n - 1)
    piece_J = (j >= r).astype(jnp.int32)
    key_chunk_J = jnp.where(j < r, j, j - r)
    q4, seg4 = q.reshape(b, 2, c, hq, d), seg.reshape(b, 2, c)
    pair_q = jnp.take(q4, piece_J, axis=1).reshape(b * (2 * n - 1), c, hq, d)
    pair_qseg = jnp.take(seg4, piece_J, axis=1).reshape(b * (2 * n - 1), c)
    take = lambda x: jnp.take(x, key_chunk_J, axis=1).reshape(b * (2 * n - 1), c, *x.shape[3:])  # noqa: E731
    o_pair, lse_pair = fn(pair_q, take(k_nat), take(v_nat), None, causal=False, segment_ids=pair_qseg,
                          kv_segment_ids=take(seg_nat), return_lse=True, **options)
    o_pair, lse_pair = o_pair.reshape(b, 2 * n - 1, c, hq, d), lse_pair.reshape(b, 2 * n - 1, c, hq)

    # Each piece's log-sum-exp over its diagonal pair and its earlier pairs; then one contraction
    # over the pairs (no float32 copy of the 2n - 1 pair outputs per piece).
    onehot_JxP = jax.nn.one_hot(piece_J, 2, dtype=jnp.float32)
    lse_J = lse_pair.astype(jnp.float32)
    masked_BxPxJ = jnp.where(onehot_JxP.T[None, :, :, None, None] > 0, lse_J[:, None], _FAR)
    total_BxP = jnp.logaddexp(lse_diag.astype(jnp.float32), jax.nn.logsumexp(masked_BxPxJ, axis=2))
    w_diag = jnp.exp(lse_diag - total_BxP)[..., None]
    w_J = jnp.exp(lse_J - jnp.take(total_BxP, piece_J, axis=1))  # [B, J, C, Hq]
    pairs = jnp.einsum("bjchd,bjch,jp->bpchd", o_pair, w_J.astype(o_pair.dtype), onehot_JxP.astype(o_pair.dtype),
                       preferred_element_type=jnp.float32)
    o = (w_diag * o_diag.astype(jnp.float32) + pairs).reshape(b, s2, hq, d)
    if gate is not None:
        o = o * jax.nn.sigmoid(gate.reshape(b, s2, hq, -1).astype(jnp.float32))
    return o.astype(q.dtype)


def attention(fn, q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, gate=None, *, segment_ids_BxS=None, **options):
    """Causal attention of arranged rows with the sequence split over the context axis: `fn` (an
    attention implementation taking kv_segment_ids and return_lse, gattn.kernels) on each pair of
    chunks. Batch rows split over the batch axes, heads over `model` where it divides the kv heads,
    as gattn.kernels.sharded does. Returns [B, S, Hq, K]."""
    mesh = jax.sharding.get_abstract_mesh()
    n = mesh.shape[AXIS]
    manual = set(mesh.manual_axes)
    batch = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1 and a not in manual) or None
    heads = "model" if mesh.shape.get("model", 1) > 1 and k_BxSxHxK.shape[2] % mesh.shape["model"] == 0 else None
    if segment_ids_BxS is None:
        segment_ids_BxS = jnp.ones(q_BxSxHxK.shape[:2], jnp.int32)
    tile = P(batch, AXIS, heads, None)
    gate_spec = None if gate is None else (tile if gate.ndim == 4 else P(batch, AXIS, heads))
    body = functools.partial(_attention_body, fn, n, options)
    return jax.shard_map(body, mesh=mesh, in_specs=(tile, tile, tile, gate_spec, P(batch, AXIS)),
                         out_specs=tile, check_vma=False)(q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, gate, segment_ids_BxS)


def _gdn_body(n, conv, split, rule, qkv, w, g, beta, seg):
    """One device's two chunks of a Gated DeltaNet layer's sequence part (gattn.model.gdn:
    the conv over the channels, `split` into L2-normalised q, k and v, the rule), with the left
    context and the state that flow in from the earlier chunks (module docstring)."""
    b, s2, m = qkv.shape
    c, width = s2 // 2, w.shape[0]
    if c < width - 1:
        raise ValueError(f"context parallelism: chunks of {c} tokens (the sequence / (2 x mesh.context)) are shorter "
                         f"than the conv's {width - 1} inputs of left context; use fewer context devices")
    mine = _mine(n)
    prev = jnp.maximum(mine - 1, 0)
    first = (mine == 0)[None, :]  # [1, 2]: the sequence's first chunk has nothing before it

    # The conv's left context: the last W-1 inputs (and their segment ids) of the previous chunk.
    tails = _natural_chunks(qkv.reshape(b, 2, c, m)[:, :, c - (width - 1):].reshape(b, 2 * (width - 1), m), n)
    tail_ids = _natural_chunks(seg.reshape(b, 2, c)[:, :, c - (width - 1):].reshape(b, 2 * (width - 1)), n)
    left = jnp.where(first[..., None, None], 0.0, jnp.take(tails, prev, axis=1))  # [B, 2, W-1, M]
    left_ids = jnp.where(first[..., None], 0, jnp.take(tail_ids, prev, axis=1))  # [B, 2, W-1]
    seg_p = _pieces(seg)
    x_p, _ = conv(_pieces(qkv), w, seg_p, left.reshape(b * 2, width - 1, m), left_ids.reshape(b * 2, width - 1))

    # A document that starts at a chunk's first token (its previous token: the previous chunk's last;
    # a conv of width 1 has no tail to read it from).
    last_ids = tail_ids[:, :, -1] if width > 1 else _natural_chunks(seg.reshape(b, 2, c)[:, :, -1], n)[:, :, 0]
    before_first = jnp.where(first, seg.reshape(b, 2, c)[:, :, 0], jnp.take(last_ids, prev, axis=1))
    resets = jnp.concatenate([(seg_p[:, 0] != before_first.reshape(-1))[:, None], seg_p[:, 1:] != seg_p[:, :-1]],
                             axis=1)
    q, k, v = split(x_p)
    g_p, beta_p = _pieces(g), _pieces(beta)
    dk, (h, dv) = k.shape[-1], v.shape[2:]

    # Pass 1: each chunk's transition [A | B] from the state [I | 0] with values [0 | v].
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b * 2, h, dk, dk))
    s0 = jnp.concatenate([eye, jnp.zeros((b * 2, h, dk, dv), jnp.float32)], axis=-1)
    v_aug = jnp.concatenate([jnp.zeros(v.shape[:3] + (dk,), v.dtype), v], axis=-1)
    _, ab = rule(q, k, v_aug, g_p, beta_p, resets, s0)  # [2B, H, K, K+V]
    ab_nat = _natural_chunks(ab.reshape(b, 2, h, dk, dk + dv), n)[:, :, 0]  # [B, 2n, H, K, K+V]

    def compose(s_BxHxKxV, ab_BxHxKxKV):  # the state entering a chunk -> the state entering the next
        a, bias = ab_BxHxKxKV[..., :dk], ab_BxHxKxKV[..., dk:]
        return jnp.einsum("bhij,bhjv->bhiv", a, s_BxHxKxV, precision=jax.lax.Precision.HIGHEST) + bias, s_BxHxKxV

    _, s_in = jax.lax.scan(compose, jnp.zeros((b, h, dk, dv), jnp.float32), jnp.moveaxis(ab_nat, 1, 0))
    s_in = jnp.take(jnp.moveaxis(s_in, 0, 1), mine, axis=1).reshape(b * 2, h, dk, dv)

    # Pass 2: the chunks' outputs from their true initial states.
    o, _ = rule(q, k, v, g_p, beta_p, resets, s_in)
    return _unpieces(o)


def gdn(conv, split, rule, qkv_BxSxM, w_WxM, g_BxSxH, beta_BxSxH, segment_ids_BxS=None):
    """The sequence part of a Gated DeltaNet layer for arranged rows split over the context axis:
    `conv` (gattn.model.gdn.causal_conv1d) on the conv channels, `split` of its output into q, k
    [., ., G, K] and v [., ., H, V], then `rule` (chunked) from zero states; o [B, S, H, V]
    float32. Rows split over the batch axes; heads whole."""
    mesh = jax.sharding.get_abstract_mesh()
    n = mesh.shape[AXIS]
    manual = set(mesh.manual_axes)
    batch = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1 and a not in manual) or None
    if segment_ids_BxS is None:
        segment_ids_BxS = jnp.ones(qkv_BxSxM.shape[:2], jnp.int32)
    rows, tokens = P(batch, AXIS, None), P(batch, AXIS)
    body = functools.partial(_gdn_body, n, conv, split, rule)
    return jax.shard_map(body, mesh=mesh, in_specs=(rows, P(), rows, rows, tokens),
                         out_specs=P(batch, AXIS, None, None), check_vma=False)(
        qkv_BxSxM, w_WxM, g_BxSxH, beta_BxSxH, segment_ids_BxS)
