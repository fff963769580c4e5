"""The decoder-only LM: embedding, pre-RMSNorm blocks (gated attention + SwiGLU), final norm, head.

The residual stream is 2-D, x_NxD with N = batch * sequence: every projection is then a plain
[N, D] x [D, *] matmul and every weight gradient a single contraction (PERFORMANCE.md, item 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gattn.attention import Attention
from gattn.config import ModelConfig
from gattn.layers import DTYPES, RMSNorm, SwiGLU, dense, param
from gattn.moe import MoE

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Block(nnx.Module):
    """x + attn(norm(x)), then x + ffn(norm(x)); sandwich norm and clipping act on the branch."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype=pd)
        self.attn = Attention(cfg, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype=pd)
        self.ffn = MoE(cfg, rngs=rngs) if cfg.moe is not None else SwiGLU(cfg, cfg.ffn_width, rngs=rngs)
        if cfg.sandwich_norm:
            self.attn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype=pd)
            self.ffn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype=pd)
        self.clip = cfg.output_clip
        self.collect_intermediates = False

    def _branch_out(self, h, post_norm):
        if post_norm is not None:
            h = post_norm(h)
        if self.clip is not None:
            h = jnp.clip(h, -self.clip, self.clip)
        return h

    def __call__(self, x_NxD, positions_N, segment_ids_BxS, batch):
        """(x, aux): aux holds the MoE's auxiliary values ({} for a dense FFN)."""
        h = self.attn(self.attn_norm(x_NxD), positions_N, segment_ids_BxS, batch)
        x_NxD = x_NxD + self._branch_out(h, getattr(self, "attn_post_norm", None))
        h, aux = (self.ffn(self.ffn_norm(x_NxD)) if isinstance(self.ffn, MoE)
                  else (self.ffn(self.ffn_norm(x_NxD)), {}))
        x_NxD = x_NxD + self._branch_out(h, getattr(self, "ffn_post_norm", None))
        if self.collect_intermediates:
            self.sow(nnx.Intermediate, "block_out", x_NxD)
        return x_NxD, aux


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = DTYPES[cfg.param_dtype]
        self.dtype = DTYPES[cfg.dtype]
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                           std=cfg.init_std, dtype=pd)
        if cfg.scan_layers:
            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(rngs):
                return Block(cfg, rngs=rngs)

            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, param_dtype=pd)
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                 std=cfg.init_std, dtype=pd)

    def __call__(self, tokens_BxS: jax.Array, positions_BxS: jax.Array | None = None,
                 segment_ids_BxS: jax.Array | None = None) -> jax.Array:
        """Returns float32 logits [B, S, V]. Positions default to 0..S-1; segment ids (packed
        documents, 0 = padding) default to one document per row."""
        return self.forward(tokens_BxS, positions_BxS, segment_ids_BxS)[0]

    def forward(self, tokens_BxS: jax.Array, positions_BxS: jax.Array | None = None,
                segment_ids_BxS: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """(logits, aux): aux maps each MoE auxiliary value to its per-layer stack ([L, ...]);
        empty for a dense model."""
        cfg = self.cfg
        b, s = tokens_BxS.shape
        if positions_BxS is None:
            positions_BxS = jnp.broadcast_to(jnp.arange(s), (b, s))
        positions_N = positions_BxS.reshape(-1)
        x_NxD = jnp.take(self.embed[...], tokens_BxS.reshape(-1), axis=0).astype(self.dtype)

        def run(block, x):
            return block(x, positions_N, segment_ids_BxS, (b, s))

        if cfg.remat != "none":
            run = nnx.remat(run, policy=REMAT_POLICIES[cfg.remat])
        if cfg.scan_layers:
            if any(getattr(m, "collect_intermediates", False) for _, m in nnx.iter_graph(self.blocks)):
                raise ValueError("collecting intermediates needs scan_layers=False "
                                 "(load the same checkpoint with --config.model.scan_layers=false)")
            x_NxD, aux = nnx.scan(lambda x, blk: run(blk, x), in_axes=(nnx.Carry, 0),
                                  out_axes=(nnx.Carry, 0))(x_NxD, self.blocks)
        else:
            per_layer = []
            for block in self.blocks:
                x_NxD, layer_aux = run(block, x_NxD)
                per_layer.append(layer_aux)
            aux = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        x_NxD = self.final_norm(x_NxD)
        head = self.embed[...].T if cfg.tie_embeddings else self.lm_head[...]
        logits_NxV = dense(x_NxD, head, self.dtype, out_dtype=jnp.float32)
        return logits_NxV.reshape(b, s, cfg.vocab_size), aux
