"""Next-token cross-entropy on 2-D logits, all at once or a chunk of the sequence at a time
(exec.loss_chunk), the MoE auxiliary losses, and the multi-token-prediction loss (model.mtp_layers:
token t+2 predicted at position t)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gattn.model import context, sharding
from gattn.model.transformer import head_logits


def token_nll(logits_BxSxV: jax.Array, targets_BxS: jax.Array) -> jax.Array:
    """Cross-entropy of each token (float32) [B, S], computed on the 2-D [N, V] logits."""
    v = logits_BxSxV.shape[-1]
    logits_NxV = logits_BxSxV.reshape(-1, v).astype(jnp.float32)
    targets_N = targets_BxS.reshape(-1)
    logz_N = jax.nn.logsumexp(logits_NxV, axis=-1)
    picked_N = jnp.take_along_axis(logits_NxV, targets_N[:, None], axis=-1)[:, 0]
    return (logz_N - picked_N).reshape(targets_BxS.shape)


def chunked_token_nll(x_BxSxD: jax.Array, head_DxV: jax.Array, targets_BxS: jax.Array, dtype,
                      chunk: int) -> jax.Array:
    """`token_nll` of the logits `head_logits(x, head, dtype)` without ever forming all of them:
    the sequence is cut into M chunks of C = `chunk` positions (the last one padded) and a loop
    computes one chunk's logits [B, C, V] at a time, recomputing them in the backward pass
    (jax.checkpoint) instead of keeping them. Chunks cut the sequence, not the batch: every
    chunk holds some positions of every row, so with rows sharded over the data axes each chunk
    is split over all devices as the whole batch is (chunks of the token axis would each sit on
    one device). The head's gradient is summed over the loop; XLA for TPU all-reduces it once,
    after the loop (docs/performance.md)."""
    b, s, d = x_BxSxD.shape
    c = min(chunk, s)
    m = -(-s // c)
    pad = ((0, 0), (0, m * c - s))
    x_MxBxCxD = jnp.pad(x_BxSxD, pad + ((0, 0),)).reshape(b, m, c, d).swapaxes(0, 1)
    targets_MxBxC = jnp.pad(targets_BxS, pad).reshape(b, m, c).swapaxes(0, 1)

    head_DxV = sharding.gathered(head_DxV.astype(dtype), ("embed", "vocab"))  # once, not in each chunk

    def one_chunk(head, x_BxCxD, targets_BxC):
        logits_NxV = head_logits(x_BxCxD.reshape(b * c, d), head, dtype)
        return token_nll(logits_NxV.reshape(b, c, -1), targets_BxC)

    one_chunk = jax.checkpoint(one_chunk, prevent_cse=False)  # (in a loop, CSE cannot undo the remat)
    nll_MxBxC = jax.lax.map(lambda xt: one_chunk(head_DxV, *xt), (x_MxBxCxD, targets_MxBxC))
    return nll_MxBxC.swapaxes(0, 1).reshape(b, m * c)[:, :s]  # padded positions dropped


def _weighted_mean(nll_BxS: jax.Array, weights_BxS: jax.Array | None) -> jax.Array:
    nll_N = nll_BxS.reshape(-1)
    if weights_BxS is None:
        return jnp.mean(nll_N)
    w_N = weights_BxS.reshape(-1).astype(jnp.float32)
    return jnp.sum(nll_N * w_N) / jnp.maximum(jnp.sum(w_N), 1.0)


def cross_entropy(logits_BxSxV: jax.Array, targets_BxS: jax.Array,
                  weights_BxS: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy (float32); `weights` (e.g. 0 for padding) weight each token."""
    return _weighted_mean(token_nll(logits_BxSxV, targets_BxS), weights_BxS)


def target_weights(segment_ids_BxS: jax.Array) -> jax.Array:
    """[B, S-1] bool: which next-token targets of packed rows count (the target is in the same
    document as its input token; padding, segment id 0, never counts)."""
    seg_in, seg_out = segment_ids_BxS[:, :-1], segment_ids_BxS[:, 1:]
    return (seg_out != 0) & (seg_out == seg_in)


def mtp_target_weights(segment_ids_BxS: jax.Array) -> jax.Array:
    """[B, S-1] bool: which MTP targets count, the target of input position t being token t+2:
    tokens t, t+1 and t+2 all in one document (not padding); the last position has none."""
    seg_in, seg_mid, seg_out = segment_ids_BxS[:, :-2], segment_ids_BxS[:, 1:-1], segment_ids_BxS[:, 2:]
    w = (seg_out != 0) & (seg_out == seg_in) & (seg_mid == seg_in)
    return jnp.pad(w, ((0, 0), (0, 1)))


def _head_nll(model, x_NxD, targets_BxS):
    """Cross-entropy [B, S] of the LM head on final hidden states x_NxD: the logits all at once, or
    exec.loss_chunk positions per row at a time (`chunked_token_nll`)."""
    b, s = targets_BxS.shape
    if model.ex.loss_chunk:
        # On a context axis of n, each row's n pieces are rows of their own, so that every chunk
        # holds positions of every device's piece (a chunk of the arranged sequence would sit on one).
        n = context.size() if s % context.size() == 0 else 1
        nll = chunked_token_nll(x_NxD.reshape(b * n, s // n, -1), model.head_weight(),
                                targets_BxS.reshape(b * n, s // n), model.dtype, max(1, model.ex.loss_chunk // n))
        return nll.reshape(b, s)
    return token_nll(head_logits(x_NxD, model.head_weight(), model.dtype).reshape(b, s, -1), targets_BxS)


def _next_token_nll(model, tokens_BxS, segment_ids_BxS, positions_BxS, hidden_too: bool = False):
    """(nll [B, S-1], weights, aux) for predicting tokens[:, 1:] from tokens[:, :-1]. With packed
    documents (segment ids, 0 = padding; positions restarting at each document) a target counts
    only if it is in the same document as its input token, so no document is predicted from the
    one before it and padding is ignored. Weights are None without segment ids. `hidden_too`
    appends the final hidden states x_NxD (the MTP layer's input)."""
    inputs, targets = tokens_BxS[:, :-1], tokens_BxS[:, 1:]
    pos = None if positions_BxS is None else positions_BxS[:, :-1]
    seg_in = weights = None
    if segment_ids_BxS is not None:
        seg_in, weights = segment_ids_BxS[:, :-1], target_weights(segment_ids_BxS)
    if context.size() > 1:  # every per-token array in the context axis's layout (a sum over tokens follows)
        if pos is None:
            pos = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
        inputs, targets, pos, seg_in, weights = context.arrange(inputs, targets, pos, seg_in, weights)
    x_NxD, aux = model.hidden(inputs, positions_BxS=pos, segment_ids_BxS=seg_in)
    nll = _head_nll(model, x_NxD, targets)
    return (nll, weights, aux, x_NxD) if hidden_too else (nll, weights, aux)


def lm_loss(model, tokens_BxS: jax.Array, segment_ids_BxS: jax.Array | None = None,
            positions_BxS: jax.Array | None = None) -> jax.Array:
    """Mean next-token loss over the targets that count (see `_next_token_nll`)."""
    return lm_loss_and_aux(model, tokens_BxS, segment_ids_BxS, positions_BxS)[0]


def lm_loss_and_aux(model, tokens_BxS: jax.Array, segment_ids_BxS: jax.Array | None = None,
                    positions_BxS: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """(mean next-token loss, the model's auxiliary values per layer); see `aux_loss`."""
    nll, weights, aux = _next_token_nll(model, tokens_BxS, segment_ids_BxS, positions_BxS)
    return _weighted_mean(nll, weights), aux


def lm_and_mtp_loss(model, tokens_BxS: jax.Array, segment_ids_BxS: jax.Array | None = None,
                    positions_BxS: jax.Array | None = None) -> tuple[jax.Array, jax.Array, dict]:
    """(mean next-token loss, mean MTP loss, aux) of a model with an MTP layer, from one forward
    pass. The MTP layer at input position t reads the main model's final hidden state there and
    token t+1 (the next-token target) and predicts token t+2, counted where `mtp_target_weights`
    says (without segment ids: every position but the last). aux stacks the MTP block's MoE
    values after the main layers' ([L + 1, ...]), so its router is balanced like theirs."""
    nll, weights, aux, x_NxD = _next_token_nll(model, tokens_BxS, segment_ids_BxS, positions_BxS, hidden_too=True)
    next_BxS = tokens_BxS[:, 1:]  # x_{t+1}, the MTP input beside h_t
    pos = None if positions_BxS is None else positions_BxS[:, :-1]
    seg_in = None if segment_ids_BxS is None else segment_ids_BxS[:, :-1]
    mtp_targets = jnp.pad(tokens_BxS[:, 2:], ((0, 0), (0, 1)))  # (the last position's target is cut below)
    if segment_ids_BxS is not None:
        mtp_weights = mtp_target_weights(segment_ids_BxS)
    else:
        mtp_weights = jnp.pad(jnp.ones_like(tokens_BxS[:, 2:], bool), ((0, 0), (0, 1)))
    if context.size() > 1:  # as the main model's (`_next_token_nll`): shifted first, then arranged
        if pos is None:
            pos = jnp.broadcast_to(jnp.arange(next_BxS.shape[1]), next_BxS.shape)
        next_BxS, pos, seg_in, mtp_targets, mtp_weights = context.arrange(next_BxS, pos, seg_in, mtp_targets,
                                                                          mtp_weights)
    y_NxD, mtp_aux = model.mtp_hidden(x_NxD, next_BxS, pos, seg_in)
    mtp = _weighted_mean(_head_nll(model, y_NxD, mtp_targets), mtp_weights)
    if aux:
        aux = jax.tree.map(lambda main, extra: jnp.concatenate([main, extra[None]]), aux, mtp_aux)
    return _weighted_mean(nll, weights), mtp, aux


def aux_loss(moe, aux: dict) -> jax.Array:
    """The weighted auxiliary losses of a MoE model (0 for a dense one): lbl_coef * LBL +
    z_loss_coef * router z-loss, each averaged over layers."""
    if moe is None or not aux:
        return jnp.zeros((), jnp.float32)
    return moe.lbl_coef * jnp.mean(aux["lbl"]) + moe.z_loss_coef * jnp.mean(aux["z_loss"])


def aux_metrics(aux: dict) -> dict:
    """Scalars for the logs: mean LBL and z-loss over layers, dropped assignments, and the
    busiest expert's load over the mean load (1 = perfectly balanced), worst layer."""
    if "lbl" not in aux:  # a dense model (its aux holds at most the MTP loss)
        return {}
    load = aux["load"].astype(jnp.float32)  # [L, E]
    return {"moe/lbl": jnp.mean(aux["lbl"]), "moe/z_loss": jnp.mean(aux["z_loss"]),
            "moe/dropped": jnp.sum(aux["dropped"]),
            "moe/max_over_mean_load": jnp.max(jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9))}


def lm_nll_sum(model, tokens_BxS: jax.Array, segment_ids_BxS: jax.Array,
               positions_BxS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(summed next-token loss, number of targets) of packed rows, for exact averages over many
    batches (validation)."""
    nll, weights, _ = _next_token_nll(model, tokens_BxS, segment_ids_BxS, positions_BxS)
    count = jnp.sum(weights)
    return _weighted_mean(nll, weights) * count, count
