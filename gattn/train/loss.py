"""Next-token cross-entropy on 2-D logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_nll(logits_BxSxV: jax.Array, targets_BxS: jax.Array) -> jax.Array:
    """Cross-entropy of each token (float32) [B, S], computed on the 2-D [N, V] logits."""
    v = logits_BxSxV.shape[-1]
    logits_NxV = logits_BxSxV.reshape(-1, v).astype(jnp.float32)
    targets_N = targets_BxS.reshape(-1)
    logz_N = jax.nn.logsumexp(logits_NxV, axis=-1)
    picked_N = jnp.take_along_axis(logits_NxV, targets_N[:, None], axis=-1)[:, 0]
    return (logz_N - picked_N).reshape(targets_BxS.shape)


def cross_entropy(logits_BxSxV: jax.Array, targets_BxS: jax.Array,
                  weights_BxS: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy (float32); `weights` (e.g. 0 for padding) weight each token."""
    nll_N = token_nll(logits_BxSxV, targets_BxS).reshape(-1)
    if weights_BxS is None:
        return jnp.mean(nll_N)
    w_N = weights_BxS.reshape(-1).astype(jnp.float32)
    return jnp.sum(nll_N * w_N) / jnp.maximum(jnp.sum(w_N), 1.0)


def _next_token(model, tokens_BxS, segment_ids_BxS, positions_BxS):
    """(logits, targets, weights) for predicting tokens[:, 1:] from tokens[:, :-1]. With packed
    documents (segment ids, 0 = padding; positions restarting at each document) a target counts
    only if it is in the same document as its input token, so no document is predicted from the
    one before it and padding is ignored. Weights are None without segment ids."""
    inputs, targets = tokens_BxS[:, :-1], tokens_BxS[:, 1:]
    pos = None if positions_BxS is None else positions_BxS[:, :-1]
    if segment_ids_BxS is None:
        logits, aux = model.forward(inputs, positions_BxS=pos)
        return logits, targets, None, aux
    seg_in, seg_out = segment_ids_BxS[:, :-1], segment_ids_BxS[:, 1:]
    logits, aux = model.forward(inputs, positions_BxS=pos, segment_ids_BxS=seg_in)
    return logits, targets, (seg_out != 0) & (seg_out == seg_in), aux


def lm_loss(model, tokens_BxS: jax.Array, segment_ids_BxS: jax.Array | None = None,
            positions_BxS: jax.Array | None = None) -> jax.Array:
    """Mean next-token loss over the targets that count (see `_next_token`)."""
    return lm_loss_and_aux(model, tokens_BxS, segment_ids_BxS, positions_BxS)[0]


def lm_loss_and_aux(model, tokens_BxS: jax.Array, segment_ids_BxS: jax.Array | None = None,
                    positions_BxS: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """(mean next-token loss, the model's auxiliary values per layer); see `aux_loss`."""
    logits, targets, weights, aux = _next_token(model, tokens_BxS, segment_ids_BxS, positions_BxS)
    return cross_entropy(logits, targets, weights), aux


def aux_loss(moe, aux: dict) -> jax.Array:
    """The weighted auxiliary losses of a MoE model (0 for a dense one): lbl_coef * LBL +
    z_loss_coef * router z-loss, each averaged over layers."""
    if moe is None or not aux:
        return jnp.zeros((), jnp.float32)
    return moe.lbl_coef * jnp.mean(aux["lbl"]) + moe.z_loss_coef * jnp.mean(aux["z_loss"])


def aux_metrics(aux: dict) -> dict:
    """Scalars for the logs: mean LBL and z-loss over layers, dropped assignments, and the
    busiest expert's load over the mean load (1 = perfectly balanced), worst layer."""
    if not aux:
        return {}
    load = aux["load"].astype(jnp.float32)  # [L, E]
    return {"moe/lbl": jnp.mean(aux["lbl"]), "moe/z_loss": jnp.mean(aux["z_loss"]),
            "moe/dropped": jnp.sum(aux["dropped"]),
            "moe/max_over_mean_load": jnp.max(jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9))}


def lm_nll_sum(model, tokens_BxS: jax.Array, segment_ids_BxS: jax.Array,
               positions_BxS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(summed next-token loss, number of targets) of packed rows, for exact averages over many
    batches (validation)."""
    logits, targets, weights, _ = _next_token(model, tokens_BxS, segment_ids_BxS, positions_BxS)
    count = jnp.sum(weights)
    return cross_entropy(logits, targets, weights) * count, count
