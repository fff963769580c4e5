"""Qwen3-Next's and Qwen3.5's multi-token-prediction (MTP) layer: at position t it reads the main
model's final hidden state h_t and the next token x_{t+1}, and predicts x_{t+2}.

    e_t = norm_emb(embed(x_{t+1})),  g_t = norm_hidden(h_t)
    y_t = norm(block([e_t | g_t] W_fc))            logits_t = y_t @ head  ->  x_{t+2}

`h_t` is the main model's hidden state after its final norm (what its LM head reads; vLLM's and
SGLang's Qwen3-Next / Qwen3.5 drafters are fed exactly that). The embedding comes first in the
concatenation. `block` is one full-attention decoder block of the model's own kind (gated
attention, MoE or dense FFN), causal over the sequence of MTP inputs, at the positions of t; the
embedding and the LM head are the main model's. The four norms are the model's RMSNorms
(zero-centred, 1 + w, in Qwen3-Next and Qwen3.5). The released checkpoints name the tensors
mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.fc ([D, 2D]), mtp.layers.0.* and mtp.norm
(gattn/interop/mtp.py maps them).

The Transformer builds it (model.mtp_layers = 1) and runs it: `Transformer.mtp_hidden` for the
training loss (gattn/train/loss.py), `Transformer.mtp_decode` with its own kv cache for
self-speculative decoding (gattn/eval/speculative.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gattn.config import ModelConfig
from gattn.model.layers import DTYPES, RMSNorm, dense, param


class MTP(nnx.Module):
    """One MTP layer around `block` (a full-attention Block of the model, built by the caller)."""

    def __init__(self, cfg: ModelConfig, block: nnx.Module, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d = cfg.d_model
        self.pre_fc_norm_embedding = RMSNorm(cfg)
        self.pre_fc_norm_hidden = RMSNorm(cfg)
        self.fc = param("weight", rngs, (2 * d, d), ("embed", None), std=cfg.init_std, dtype=DTYPES[cfg.param_dtype])
        self.block = block
        self.norm = RMSNorm(cfg)
        self.dtype = dtype

    def combine(self, hidden_NxD: jax.Array, next_embed_NxD: jax.Array) -> jax.Array:
        """[norm_emb(e) | norm_hidden(h)] W_fc: the block's input [N, D]."""
        x_Nx2D = jnp.concatenate([self.pre_fc_norm_embedding(next_embed_NxD.astype(self.dtype)),
                                  self.pre_fc_norm_hidden(hidden_NxD.astype(self.dtype))], axis=-1)
        return dense(x_Nx2D, self.fc, self.dtype)

    def __call__(self, hidden_NxD, next_embed_NxD, positions_N, segment_ids_BxS, batch) -> tuple[jax.Array, dict]:
        """(y_NxD, aux): the final MTP hidden state (after its norm) and the block's MoE auxiliary
        values ({} for a dense FFN)."""
        x_NxD, aux = self.block(self.combine(hidden_NxD, next_embed_NxD), positions_N, segment_ids_BxS, batch)
        return self.norm(x_NxD), aux

    def decode(self, hidden_NxD, next_embed_NxD, positions_N, k_BxHxTxK, v_BxHxTxK, mask_BxSxT, index):
        """(y_NxD, k cache, v cache): S new MTP inputs per row against the layer's own kv cache."""
        x_NxD, k_BxHxTxK, v_BxHxTxK = self.block.decode(self.combine(hidden_NxD, next_embed_NxD), positions_N,
                                                        k_BxHxTxK, v_BxHxTxK, mask_BxSxT, index)
        return self.norm(x_NxD), k_BxHxTxK, v_BxHxTxK
