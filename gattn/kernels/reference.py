"""Scaled dot-product attention in plain jnp: the `xla` implementation and the reference.

Inputs follow the kernel convention q [B, S, Hq, K], k/v [B, T, Hk, K] (GQA: query head h uses
kv head h // (Hq // Hk)). Internally the computation runs in [B, Hk, G, S, K] with an additive
mask; for causal self-attention the queries are split into blocks and block i only multiplies
the keys it can see, which skips the fully masked upper triangle (on CPU this is what keeps the
attention core near the matmul floor; see docs/performance.md).

Segment ids [B, S] (int): a query attends only to keys with the same id. Id 0 marks padding:
the output (and attention row) of a padding query is set to exactly zero, and no real token
attends to padding. With `kv_segment_ids` [B, T] the segment ids are the queries' and those the
keys', and T may differ from S (a piece of a sequence against another piece, as context
parallelism runs it); a query that then sees no key outputs 0, as a padding query does. Prefix
ids [B, S, K] (or [B, S]: K = 1; int, with segment ids; xla only) also let a query see the
earlier keys of up to K other segments, prefixes that several segments share: a multiple-choice
question's context laid out once before its choices, each choice a segment whose prefix ids name
the context's segment (and the few-shot examples' before it, when several questions share those).
0: no shared prefix. See gattn/interop/harness.py.

`attention_masked` takes an explicit [B, S, T] visibility mask instead (cached decoding: S new
queries over T cache slots), with k/v in the kv cache's [B, Hk, T, K] layout, so a decode step
reads the cache as it is (a transposed copy of a long cache per layer and token would cost more
than the attention), and runs the same block computation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite, so a fully masked row never produces inf - inf = NaN


def check_inputs(q, k, v, segment_ids=None, gate=None, kv_segment_ids=None) -> str | None:
    """Checks the shapes and dtypes every implementation takes (static: nothing is read from the
    arrays, so it holds under jit); returns the gate's kind (None, "elementwise" or "headwise").
    q, k, v and the gate share one floating dtype: a silent promotion would run the attention in
    another precision than the caller chose. Segment ids are integers, compared for equality;
    `kv_segment_ids` (the keys' ids, [B, T]) come with the queries' `segment_ids`."""
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"expected q [B,S,Hq,K], k/v [B,T,Hk,K]; got q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"incompatible q {q.shape} and k {k.shape}: batch and head_dim must match "
                         "and q_heads must be a multiple of kv_heads")
    named = {"q": q, "k": k, "v": v} | ({} if gate is None else {"gate": gate})
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q has dtype {q.dtype}: expected a floating dtype (float32, bfloat16, ...)")
    for name, x in named.items():
        if x.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {x.dtype} but q has {q.dtype}: q, k, v and the gate must "
                             f"share one dtype (got {', '.join(f'{n} {y.dtype}' for n, y in named.items())}); "
                             "cast them first")
    if kv_segment_ids is not None and segment_ids is None:
        raise ValueError("kv_segment_ids (the keys' ids) were given without segment_ids (the queries' "
                         "ids): pass both, or neither")
    for name, ids in (("segment_ids", segment_ids), ("kv_segment_ids", kv_segment_ids)):
        if ids is not None and not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} has dtype {ids.dtype}: expected an integer dtype "
                             "(int32; ids are compared for equality, 0 = padding)")
    if segment_ids is not None:
        if kv_segment_ids is None and q.shape[1] != k.shape[1]:
            raise ValueError(f"segment_ids need self-attention (as many keys as queries): k/v length "
                             f"{k.shape[1]} != q length {q.shape[1]}; pass segment_ids=None for "
                             "cross or cached attention (attention_masked takes an explicit mask), or "
                             "the keys' ids as kv_segment_ids [B, T]")
        if segment_ids.shape != q.shape[:2]:
            raise ValueError(f"segment_ids {segment_ids.shape} must be [B, S] = {q.shape[:2]}")
    if kv_segment_ids is not None and kv_segment_ids.shape != k.shape[:2]:
        raise ValueError(f"kv_segment_ids {kv_segment_ids.shape} must be [B, T] = {k.shape[:2]} "
                         "(the keys' segment ids)")
    if gate is None:
        return None
    if gate.shape == q.shape:
        return "elementwise"
    if gate.shape in (q.shape[:3], q.shape[:3] + (1,)):
        return "headwise"
    raise ValueError(f"gate {gate.shape}: must be elementwise {q.shape} or headwise "
                     f"{q.shape[:3]} / {q.shape[:3] + (1,)} (logits, before the sigmoid)")


def _block(q_BHGQK, k_BHTK, v_BHTK, bias, scale, lse: bool = False):
    """o, p and (if `lse`) the rows' log-sum-exp of the masked, scaled scores [B, Hk, G, bq]."""
    if q_BHGQK.shape[2] == 1:  # MHA: plain 4-D dots; the singleton G axis costs ~4 ms/layer on CPU
        s = jnp.einsum("bhqd,bhtd->bhqt", q_BHGQK[:, :, 0], k_BHTK, preferred_element_type=jnp.float32)
        z = s * scale + bias[:, :, 0]
        p = jax.nn.softmax(z, axis=-1)
        o = jnp.einsum("bhqt,bhtd->bhqd", p.astype(v_BHTK.dtype), v_BHTK)
        return o[:, :, None], p[:, :, None], jax.nn.logsumexp(z, axis=-1)[:, :, None] if lse else None
    s = jnp.einsum("bhgqd,bhtd->bhgqt", q_BHGQK, k_BHTK, preferred_element_type=jnp.float32)
    z = s * scale + bias
    p = jax.nn.softmax(z, axis=-1)
    o = jnp.einsum("bhgqt,bhtd->bhgqd", p.astype(v_BHTK.dtype), v_BHTK)
    return o, p, jax.nn.logsumexp(z, axis=-1) if lse else None


def attention_xla(q, k, v, gate=None, *, causal: bool = True, segment_ids=None,
                  sm_scale: float | None = None, block_q: int = 128, query_chunk: int = 0,
                  return_probs: bool = False, prefix_ids=None, kv_segment_ids=None,
                  return_lse: bool = False):
    """softmax(q k^T * sm_scale + mask) v [* sigmoid(gate)]. Returns o [B, S, Hq, K] (and probs
    [B, Hq, S, T] in float32 if `return_probs`, then lse [B, S, Hq] in float32 if `return_lse`).
    `gate`: logits [B, S, Hq, K] (elementwise) or [B, S, Hq] / [B, S, Hq, 1] (headwise), applied
    in float32 after the attention.

    lse = log sum_j exp(q_i k_j * sm_scale) over the keys query i sees (-1e30 for a query that sees
    none, a padding query included), so attentions over pieces of the keys merge into the whole
    one: lse = logaddexp(lse_1, lse_2), o = exp(lse_1 - lse) o_1 + exp(lse_2 - lse) o_2 (the
    gate scales every piece alike). Differentiable in both outputs (jax autodiff); every path
    (blocks, chunks) has it.

    `block_q`: causal query blocks, each multiplying only the keys it can see (all blocks are one
    program, so XLA may keep every block's scores live at once: ~S^2/2 per layer). `query_chunk`
    > 0 instead runs the queries `query_chunk` at a time in a sequential loop over all keys (the
    last chunk padded): memory O(query_chunk * T) per layer at any length, for long contexts on
    CPU, at the price of the masked upper triangle's FLOPs."""
    check_inputs(q, k, v, segment_ids, gate, kv_segment_ids)
    if prefix_ids is not None:
        if segment_ids is None or prefix_ids.shape[:2] != segment_ids.shape or prefix_ids.ndim not in (2, 3):
            raise ValueError(f"prefix_ids {prefix_ids.shape} must be [B, S] or [B, S, K] with segment_ids "
                             f"[B, S] (got {None if segment_ids is None else segment_ids.shape})")
        prefix_ids = prefix_ids.reshape(*segment_ids.shape, -1)
    b, s, hq, d = q.shape
    t, hk = k.shape[1], k.shape[2]
    g = hq // hk
    scale = d ** -0.5 if sm_scale is None else sm_scale
    q5 = q.reshape(b, s, hk, g, d).transpose(0, 2, 3, 1, 4)  # [B, Hk, G, S, K]
    k4, v4 = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hk, T, K]

    kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
    want_lse = return_lse or kv_segment_ids is not None  # a row that sees no key has lse ~ _NEG

    def bias_for(q0, bq, kv_end, q_ids_BxS=segment_ids, q_prefix_BxSxK=prefix_ids):
        bias = jnp.zeros((bq, kv_end), jnp.float32)
        if causal:  # query at absolute position q0 + r sees keys at <= q0 + r (+ t - s offset)
            rows = jnp.arange(bq)[:, None] + q0 + (t - s)
            bias = jnp.where(jnp.arange(kv_end)[None, :] <= rows, bias, _NEG)
        bias = bias[None, None, None]
        if segment_ids is not None:
            q_ids = jax.lax.dynamic_slice_in_dim(q_ids_BxS, q0, bq, axis=1)
            k_ids = kv_ids[:, None, :kv_end]
            same = q_ids[:, :, None] == k_ids
            if q_prefix_BxSxK is not None:  # and the keys of the segments the query's prefix ids name
                prefix = jax.lax.dynamic_slice_in_dim(q_prefix_BxSxK, q0, bq, axis=1)
                shared = jnp.any(prefix[:, :, None, :] == k_ids[..., None], axis=-1)
                same |= shared & (k_ids != 0)
            bias = jnp.where(same[:, None, None], bias, _NEG)
        return bias

    if query_chunk and s > query_chunk:
        n = -(-s // query_chunk)  # the last chunk is padded with queries that are sliced off
        pad = n * query_chunk - s
        q5p = jnp.pad(q5, ((0, 0),) * 3 + ((0, pad), (0, 0)))
        q_ids = None if segment_ids is None else jnp.pad(segment_ids, ((0, 0), (0, pad)))
        q_prefix = None if prefix_ids is None else jnp.pad(prefix_ids, ((0, 0), (0, pad), (0, 0)))

        def chunk(i):
            q0 = i * query_chunk
            q_c = jax.lax.dynamic_slice_in_dim(q5p, q0, query_chunk, axis=3)
            o, p, lse = _block(q_c, k4, v4, bias_for(q0, query_chunk, t, q_ids, q_prefix), scale, want_lse)
            return o, p if return_probs else None, lse

        o_n, p_n, lse_n = jax.lax.map(chunk, jnp.arange(n))  # [n, B, Hk, G, chunk, ...]
        o = jnp.moveaxis(o_n, 0, 3).reshape(b, hk, g, n * query_chunk, d)[:, :, :, :s]
        p = None if p_n is None else jnp.moveaxis(p_n, 0, 3).reshape(b, hk, g, n * query_chunk, t)[:, :, :, :s]
        lse = None if lse_n is None else jnp.moveaxis(lse_n, 0, 3).reshape(b, hk, g, n * query_chunk)[..., :s]
    else:
        blocked = causal and block_q and s == t and s > block_q and s % block_q == 0
        bq = block_q if blocked else s
        outs, probs, lses = [], [], []
        for i in range(s // bq):
            q0, kv_end = i * bq, ((i + 1) * bq if blocked else t)
            o, p, lse = _block(q5[:, :, :, q0:q0 + bq], k4[:, :, :kv_end], v4[:, :, :kv_end],
                               bias_for(q0, bq, kv_end), scale, want_lse)
            outs.append(o)
            lses.append(lse)
            if return_probs:
                probs.append(jnp.pad(p, ((0, 0),) * 4 + ((0, t - kv_end),)))
        o = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]
        p = (jnp.concatenate(probs, axis=3) if len(probs) > 1 else probs[0]) if return_probs else None
        lse = (jnp.concatenate(lses, axis=3) if len(lses) > 1 else lses[0]) if want_lse else None
    o = o.transpose(0, 3, 1, 2, 4).reshape(b, s, hq, d)
    if p is not None:
        p = p.reshape(b, hq, s, t)
    if lse is not None:
        lse = lse.transpose(0, 3, 1, 2).reshape(b, s, hq).astype(jnp.float32)
    if segment_ids is not None:  # padding queries (and ones that see no key): zero output and row
        valid = (segment_ids != 0)[:, :, None, None]  # [B, S, 1, 1], or [B, S, Hq, 1] with the row test
        if kv_segment_ids is not None:
            valid = valid & (lse > _NEG / 2)[..., None]
        o = jnp.where(valid, o, 0).astype(o.dtype)
        if p is not None:
            p = jnp.where(valid.transpose(0, 2, 1, 3), p, 0.0)
        if lse is not None:
            lse = jnp.where(valid[..., 0], lse, _NEG)
    if gate is not None:
        g = gate.reshape(q.shape[:3] + (-1,)).astype(jnp.float32)
        o = (o.astype(jnp.float32) * jax.nn.sigmoid(g)).astype(o.dtype)
    out = (o,) + ((p,) if return_probs else ()) + ((lse,) if return_lse else ())
    return out if len(out) > 1 else o


def attention_masked(q, k_BxHxTxK, v_BxHxTxK, mask_BxSxT, *, sm_scale: float | None = None):
    """softmax(q k^T * sm_scale, over the keys where mask_BxSxT is True) v: o [B, S, Hq, K].
    q [B, S, Hq, K]; k/v [B, Hk, T, K] (the kv cache's layout, any T). A query that sees no key
    gets a finite output."""
    b, s, hq, d = q.shape
    hk, t = k_BxHxTxK.shape[1], k_BxHxTxK.shape[2]
    if (k_BxHxTxK.shape != v_BxHxTxK.shape or k_BxHxTxK.shape != (b, hk, t, d) or hq % hk
            or mask_BxSxT.shape != (b, s, t)):
        raise ValueError(f"expected q [B,S,Hq,K], k/v [B,Hk,T,K] with Hq a multiple of Hk, mask [B,S,T]; got "
                         f"q {q.shape}, k {k_BxHxTxK.shape}, v {v_BxHxTxK.shape}, mask {mask_BxSxT.shape}")
    scale = d ** -0.5 if sm_scale is None else sm_scale
    q5 = q.reshape(b, s, hk, hq // hk, d).transpose(0, 2, 3, 1, 4)  # [B, Hk, G, S, K]
    bias = jnp.where(mask_BxSxT, 0.0, _NEG).astype(jnp.float32)[:, None, None]
    o, _, _ = _block(q5, k_BxHxTxK, v_BxHxTxK, bias, scale)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, s, hq, d)
