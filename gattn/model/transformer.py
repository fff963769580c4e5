"""The decoder-only LM: embedding, pre-RMSNorm blocks (gated attention + SwiGLU), final norm, head.

A hybrid model (model.layer_types, Qwen3-Next's) has Gated DeltaNet layers (gattn/model/gdn.py)
in place of attention in some blocks; everything else about the block is the same.

The residual stream is 2-D, x_NxD with N = batch * sequence: every projection is then a plain
[N, D] x [D, *] matmul and every weight gradient a single contraction (docs/performance.md).

With exec.scan_layers the blocks are stacked and run by one scan: a dense model's blocks
one by one, a hybrid's in groups of its repeating pattern (`LayerGroup`, model.layer_period
layers: Qwen3-Next's 3 Gated DeltaNet + 1 attention), so a 48-layer hybrid compiles one group.

`Transformer.decode` runs new tokens against a kv cache (gattn/eval/decode.py generates with it);
`unscanned` turns a scan_layers model into the equivalent layer list. With model.mtp_layers = 1 the
model also holds Qwen3-Next's multi-token-prediction layer (`mtp`, gattn/model/mtp.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from gattn.config import ExecConfig, ModelConfig
from gattn.model.attention import Attention
from gattn.model.capture import NOTHING, Capture
from gattn.model.gdn import GatedDeltaNet, GDNSpec, GDNState
from gattn.model import context, sharding
from gattn.model.layers import DTYPES, RMSNorm, SwiGLU, dense, param
from gattn.model.moe import MoE
from gattn.model.mtp import MTP

# The activations a block names (jax.ad_checkpoint.checkpoint_name; MaxText's names), which the
# named remat policies save. Attention and Gated DeltaNet alike:
#   attn_in       the token mixer's input, after the pre-attention RMSNorm [N, D]
#   query_proj, key_proj, value_proj   X W_Q, X W_K, X W_V (before QK-norm, gates, RoPE or the conv)
#   gate_proj     the gate's logits X W_theta (an input-dependent gate; GDN's output gate X W_z)
#   attn_out      the attention's output after the G1 non-linearity and gate: W_O's input
#   out_proj      W_O's output (before a G5 gate)
#   mlp_in        the FFN's input, after the pre-FFN RMSNorm [N, D]
#   mlpwi_0, mlpwi_1   the FFN's up projections X W1 and X W3 (a MoE's: per routed row)
#   mlpwo         W2's output (a MoE's: per routed row, before the router's weights combine them)
QKV_NAMES = ("query_proj", "key_proj", "value_proj", "gate_proj")
SAVED_NAMES = {
    "qkv_proj": QKV_NAMES,
    "save_attn_out": ("attn_in", "attn_out", "out_proj", "mlp_in"),
    "minimal": QKV_NAMES + ("attn_out", "out_proj", "mlp_in", "mlpwo"),
}
OFFLOADED = {"qkv_proj_offloaded": "qkv_proj", "minimal_offloaded": "minimal"}


def _offload(names: tuple[str, ...]):
    """Saves `names` in the host's pinned memory, not HBM (copied out in the forward pass, back in
    the backward)."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
        offload_src="device", offload_dst="pinned_host")


# exec.remat: what a block's forward pass keeps for the backward pass (docs/performance.md, "Rematerialisation")
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    **{name: jax.checkpoint_policies.save_only_these_names(*names) for name, names in SAVED_NAMES.items()},
    **{name: _offload(SAVED_NAMES[kept]) for name, kept in OFFLOADED.items()},
}


class Block(nnx.Module):
    """x + attn(norm(x)), then x + ffn(norm(x)); sandwich norm and clipping act on the branch.
    In a "linear_attention" layer (`layer_type`) the token mixer is a Gated DeltaNet
    (`linear_attn`) instead of `attn`."""

    def __init__(self, cfg: ModelConfig, ex: ExecConfig, *, rngs: nnx.Rngs, layer_type: str = "full_attention"):
        self.layer_type = layer_type
        self.attn_norm = RMSNorm(cfg)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(GDNSpec.of(cfg), rngs=rngs, param_dtype=DTYPES[cfg.param_dtype],
                                             dtype=DTYPES[ex.dtype], init_std=cfg.init_std, chunk_size=ex.gdn_chunk,
                                             impl=ex.gdn_impl)
        else:
            self.attn = Attention(cfg, ex, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg)
        self.ffn = MoE(cfg, ex, rngs=rngs) if cfg.moe is not None else SwiGLU(cfg, cfg.ffn_width, ex, rngs=rngs)
        if cfg.sandwich_norm:
            self.attn_post_norm = RMSNorm(cfg)
            self.ffn_post_norm = RMSNorm(cfg)
        self.clip = cfg.output_clip

    def _branch_out(self, h, post_norm):
        if post_norm is not None:
            h = post_norm(h)
        if self.clip is not None:
            h = jnp.clip(h, -self.clip, self.clip)
        return h

    def _ffn_residual(self, x_NxD, rows: int, capture: Capture = NOTHING, decoding: bool = False):
        x_in = checkpoint_name(self.ffn_norm(x_NxD), "mlp_in")
        h, aux = self.ffn(x_in, rows, decoding=decoding) if isinstance(self.ffn, MoE) else (self.ffn(x_in), {})
        h = self._branch_out(h, getattr(self, "ffn_post_norm", None))
        if capture.ffn_out:  # what the FFN adds to the residual stream (Fig. 6, Appendix A.3)
            self.sow(nnx.Intermediate, "ffn_out", h)
        return x_NxD + h, aux

    def __call__(self, x_NxD, positions_N, segment_ids_BxS, batch, capture: Capture = NOTHING,
                 prefix_ids_BxSxK=None):
        """(x, aux): aux holds the MoE's auxiliary values ({} for a dense FFN). `prefix_ids_BxSxK`:
        a shared prefix each token also sees (Transformer.hidden)."""
        x_in = checkpoint_name(self.attn_norm(x_NxD), "attn_in")
        if self.layer_type == "linear_attention":
            if prefix_ids_BxSxK is not None:
                raise ValueError("prefix_ids: a Gated DeltaNet layer's recurrence cannot share a prefix "
                                 "between segments; lay each segment out whole")
            h = sharding.stream(self.linear_attn(sharding.unstream(x_in, *batch), segment_ids_BxS))
        else:
            h = self.attn(x_in, positions_N, segment_ids_BxS, batch, capture, prefix_ids_BxSxK)
        x_NxD = x_NxD + self._branch_out(h, getattr(self, "attn_post_norm", None))
        x_NxD, aux = self._ffn_residual(x_NxD, batch[0], capture)
        if capture.block_out:
            self.sow(nnx.Intermediate, "block_out", x_NxD)
        return x_NxD, aux

    def decode(self, x_NxD, positions_N, k_BxHxTxK, v_BxHxTxK, mask_BxSxT, index):
        """The block on S new tokens per row with this layer's kv cache: (x, k cache, v cache).
        Each row computes what it would alone: a MoE runs dropless (gattn/model/moe.py)."""
        h, k_BxHxTxK, v_BxHxTxK = self.attn.decode(self.attn_norm(x_NxD), positions_N, k_BxHxTxK,
                                                   v_BxHxTxK, mask_BxSxT, index)
        x_NxD = x_NxD + self._branch_out(h, getattr(self, "attn_post_norm", None))
        return self._ffn_residual(x_NxD, mask_BxSxT.shape[0], decoding=True)[0], k_BxHxTxK, v_BxHxTxK

    def decode_linear(self, x_NxD, state: GDNState, valid_BxS, stepwise: bool = False):
        """A Gated DeltaNet block on S new tokens per row with this layer's recurrent and conv
        state: (x, state). One token runs the recurrent rule; more (a prompt) the chunked one,
        where invalid tokens (left padding) form a segment of their own, so the state after the
        prompt is the real tokens' alone. A row whose new tokens are all padding (a prompt
        prefilled in pieces, shorter than its padding) keeps its state.

        `stepwise` (all S tokens valid): the recurrent rule token by token, as S one-token steps
        compute it, returning (x, state, the state after each token): a speculative step keeps
        the state after its last accepted token."""
        b, s = valid_BxS.shape
        x_BxSxD = self.attn_norm(x_NxD).reshape(b, s, -1)
        each = []
        if stepwise:
            pieces, new = [], state
            for i in range(s):
                h_i, new = self.linear_attn.step(x_BxSxD[:, i:i + 1], new)
                pieces.append(h_i)
                each.append(new)
            h = jnp.concatenate(pieces, axis=1)
        elif s == 1:
            h, new = self.linear_attn.step(x_BxSxD, state)
        else:
            h, new = self.linear_attn.prefill(x_BxSxD, valid_BxS.astype(jnp.int32), state)
        state = jax.tree.map(lambda n, o: jnp.where(valid_BxS[:, -1].reshape((b,) + (1,) * (n.ndim - 1)), n, o),
                             new, state)
        x_NxD = x_NxD + self._branch_out(h.reshape(x_NxD.shape), getattr(self, "attn_post_norm", None))
        x_NxD = self._ffn_residual(x_NxD, b, decoding=True)[0]
        return (x_NxD, state, tuple(each)) if stepwise else (x_NxD, state)


class LayerGroup(nnx.Module):
    """One period of a hybrid's layer pattern (`layers`, a Block per layer type): the unit a
    scanned hybrid stacks, model.num_layers / model.layer_period times."""

    def __init__(self, cfg: ModelConfig, ex: ExecConfig, *, rngs: nnx.Rngs):
        self.layers = nnx.List([Block(cfg, ex, rngs=rngs, layer_type=cfg.layer_type(j))
                                for j in range(cfg.layer_period)])


class Transformer(nnx.Module):
    """The model `cfg` (its architecture), computed as `ex` says (dtype, kernel, scan, remat)."""

    def __init__(self, cfg: ModelConfig, ex: ExecConfig = ExecConfig(), *, rngs: nnx.Rngs):
        self.cfg, self.ex = cfg, ex
        pd = DTYPES[cfg.param_dtype]
        self.dtype = DTYPES[ex.dtype]
        self.embed = param("weight", rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                           std=cfg.init_std, dtype=pd)
        if ex.scan_layers:  # stacked [L, ...] blocks; a hybrid's stacked [L / period, ...] groups
            grouped = cfg.hybrid

            @nnx.split_rngs(splits=cfg.num_layers // cfg.layer_period if grouped else cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(rngs):
                return LayerGroup(cfg, ex, rngs=rngs) if grouped else Block(cfg, ex, rngs=rngs)

            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, ex, rngs=rngs, layer_type=cfg.layer_type(i))
                                    for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = param("weight", rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                 std=cfg.init_std, dtype=pd)
        if cfg.mtp_layers:  # (built last: the main model's parameters are those of the model without it)
            self.mtp = MTP(cfg, Block(cfg, ex, rngs=rngs), rngs=rngs, dtype=self.dtype)

    def __call__(self, tokens_BxS: jax.Array, positions_BxS: jax.Array | None = None,
                 segment_ids_BxS: jax.Array | None = None) -> jax.Array:
        """Returns float32 logits [B, S, V]. Positions default to 0..S-1; segment ids (packed
        documents, 0 = padding) default to one document per row."""
        return self.forward(tokens_BxS, positions_BxS, segment_ids_BxS)[0]

    def forward(self, tokens_BxS: jax.Array, positions_BxS: jax.Array | None = None,
                segment_ids_BxS: jax.Array | None = None, capture: Capture = NOTHING) -> tuple[jax.Array, dict]:
        """(logits, aux): aux maps each MoE auxiliary value to its per-layer stack ([L, ...]);
        empty for a dense model. `capture` sows intermediates for analysis (gattn.model.capture)."""
        b, s = tokens_BxS.shape
        x_NxD, aux = self.hidden(tokens_BxS, positions_BxS, segment_ids_BxS, capture)
        return head_logits(x_NxD, self.head_weight(), self.dtype).reshape(b, s, self.cfg.vocab_size), aux

    def hidden(self, tokens_BxS: jax.Array, positions_BxS: jax.Array | None = None,
               segment_ids_BxS: jax.Array | None = None, capture: Capture = NOTHING,
               prefix_ids_BxSxK: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """(x_NxD, aux): the final hidden state (after the final norm, in the compute dtype) that
        `head_logits(x_NxD, self.head_weight(), self.dtype)` turns into logits; a loss can do that
        a chunk at a time (gattn/train/loss.py, exec.loss_chunk).

        `prefix_ids_BxSxK` (with segment ids; [B, S] for K = 1): each token also sees the earlier
        tokens of the K segments its prefix ids name (0: none), so several segments can share one
        copy of a prefix (the contexts of multiple-choice scoring, gattn/interop/harness.py). The
        attention runs in XLA then; a hybrid's Gated DeltaNet layers refuse it."""
        ex = self.ex
        b, s = tokens_BxS.shape
        if positions_BxS is None:
            if context.size() > 1:
                raise ValueError("context parallelism (mesh.context > 1): pass the positions of rows arranged "
                                 "for it (gattn.model.context.arrange; gattn/train/loss.py does)")
            positions_BxS = jnp.broadcast_to(jnp.arange(s), (b, s))
        positions_N = sharding.stream(positions_BxS)  # (the stream's token order)
        x_NxD = self._embed(tokens_BxS)

        def run(block, x):  # the residual stream stays split by rows (sharding.rows)
            x, aux = block(x, positions_N, segment_ids_BxS, (b, s), capture, prefix_ids_BxSxK)
            return sharding.rows(x), aux

        if ex.remat != "none":
            run = nnx.remat(run, policy=REMAT_POLICIES[ex.remat])
        if ex.scan_layers:
            if capture.any:
                raise ValueError("capturing intermediates needs exec.scan_layers=False: convert the "
                                 "model with gattn.model.transformer.unscanned(model)")
            if self.grouped:
                def body(x, group):  # the group's layers in order; aux [period, ...]
                    return _run_layers(run, group.layers, x)
            else:
                def body(x, block):
                    return run(block, x)
            x_NxD, aux = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(x_NxD, self.blocks)
            if self.grouped:  # [groups, period, ...] -> [L, ...], layer g * period + j
                aux = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), aux)
        else:
            x_NxD, aux = _run_layers(run, self.blocks, x_NxD)
        return self.final_norm(sharding.row_major(x_NxD, b, s)), aux

    def mtp_hidden(self, hidden_NxD: jax.Array, next_tokens_BxS: jax.Array, positions_BxS: jax.Array | None = None,
                   segment_ids_BxS: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """(y_NxD, aux): the MTP layer's final hidden state at each position t, from the main
        model's `hidden` output h_t there and the token after it (`next_tokens_BxS[:, t]` =
        x_{t+1}); `head_logits(y, self.head_weight(), self.dtype)` predicts x_{t+2}. Positions
        and segment ids are those of t (defaults as in `hidden`); aux holds the MTP block's MoE
        values, unstacked."""
        b, s = next_tokens_BxS.shape
        if positions_BxS is None:
            positions_BxS = jnp.broadcast_to(jnp.arange(s), (b, s))

        def run(mtp, h, e):
            return mtp(h, e, sharding.stream(positions_BxS), segment_ids_BxS, (b, s))

        if self.ex.remat != "none":
            run = nnx.remat(run, policy=REMAT_POLICIES[self.ex.remat])
        hidden_NxD = sharding.rows(sharding.stream(hidden_NxD.reshape(b, s, -1)))  # (`hidden` returns row-major)
        y_NxD, aux = run(self.mtp, hidden_NxD, self._embed(next_tokens_BxS))
        return sharding.row_major(sharding.rows(y_NxD), b, s), aux

    @property
    def grouped(self) -> bool:
        """Whether the blocks are stacked groups of the layer pattern (a scanned hybrid)."""
        return self.ex.scan_layers and self.cfg.hybrid

    def layers(self) -> list[Block]:
        """The blocks as a list of L modules, layer by layer. A scanned model's are sliced from
        its stacked parameters (copies, in a jitted function: the decoding loop of a scanned
        hybrid uses them)."""
        if not self.ex.scan_layers:
            return list(self.blocks)
        graphdef, state = nnx.split(self.blocks)
        count = jax.tree.leaves(state)[0].shape[0]
        units = [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(count)]
        return [blk for unit in units for blk in unit.layers] if self.grouped else units

    def head_weight(self) -> jax.Array:
        """The LM head [D, V]: the tied embedding transposed, or lm_head."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

    def _embed(self, tokens_BxS):
        return sharding.rows(jnp.take(self.embed[...], sharding.stream(tokens_BxS), axis=0).astype(self.dtype))

    def init_cache(self, batch: int, max_len: int) -> dict:
        """An empty kv cache: k and v per layer, [B, Hk, T, K] in the compute dtype (what SDPA
        attends to: after QK-norm, K/V gates and RoPE; heads before slots, the layout attention
        reads); valid [B, T] (slots that hold a real token); index (int32, the next slot to write,
        shared by all rows). GQA: Hk = kv_heads, q_heads / kv_heads times smaller than MHA's.

        A layer loop keeps a tuple of L per-layer arrays, each updated in place by a decode step;
        a scanned model keeps one stacked [L, B, Hk, T, K] array, which its scan slices and
        re-stacks every step (a copy of the whole cache: ~2x slower decoding at long lengths;
        `unscanned(model)` decodes with the tuple). A scanned hybrid keeps the tuples too and
        decodes layer by layer, its blocks sliced from the stacked groups (`layers`) in every
        call (a copy of its block weights per step: decode.generate slices them once, `unscanned`).

        A hybrid model's Gated DeltaNet layers keep no kv slots (None in k and v) but a GDNState
        each in "gdn" (None for the attention layers): the conv's last inputs and the rule's
        state, whose size does not grow with max_len."""
        cfg = self.cfg
        shape = (batch, cfg.kv_heads, max_len, cfg.head_dim)
        full = [cfg.layer_type(i) == "full_attention" for i in range(cfg.num_layers)]
        if self.ex.scan_layers and not self.grouped:  # (two buffers: a decode step donates both)
            k, v = (jnp.zeros((cfg.num_layers, *shape), self.dtype) for _ in "kv")
        else:
            k, v = (tuple(jnp.zeros(shape, self.dtype) if f else None for f in full) for _ in "kv")
        cache = {"k": k, "v": v, "valid": jnp.zeros((batch, max_len), bool), "index": jnp.zeros((), jnp.int32)}
        if cfg.hybrid:  # (from the config's shapes: slicing a scanned hybrid's blocks would copy its weights)
            spec = GDNSpec.of(cfg)
            cache["gdn"] = tuple(None if f else spec.init_state(batch) for f in full)
        return cache

    def decode(self, tokens_BxS: jax.Array, positions_BxS: jax.Array, cache: dict,
               valid_BxS: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """(logits [B, S, V], cache): runs S new tokens per row into cache slots index..index+S-1.
        The query in slot i sees slot j iff j <= i and slot j is valid; `valid_BxS` (default all
        True) marks padding among the new tokens. The caller keeps index + S <= the cache length
        (a write past the end is clamped by dynamic_update_slice, silently)."""
        b, s = tokens_BxS.shape
        x_NxD, cache = self.decode_hidden(tokens_BxS, positions_BxS, cache, valid_BxS)
        logits_NxV = head_logits(x_NxD, self.head_weight(), self.dtype)
        return logits_NxV.reshape(b, s, self.cfg.vocab_size), cache

    def decode_hidden(self, tokens_BxS: jax.Array, positions_BxS: jax.Array, cache: dict,
                      valid_BxS: jax.Array | None = None, stepwise: bool = False) -> tuple[jax.Array, dict]:
        """`decode` up to the final hidden state (after the final norm) x_NxD. `stepwise` runs
        the Gated DeltaNet layers token by token and adds cache["gdn_each"]: per layer, the
        state after each new token (None for attention layers), for a speculative step to
        keep the state after its last accepted token (Block.decode_linear)."""
        b, s = tokens_BxS.shape
        index = cache["index"]
        if valid_BxS is None:
            valid_BxS = jnp.ones((b, s), bool)
        valid_BxT, mask_BxSxT = _decode_mask(cache, valid_BxS)
        positions_N = positions_BxS.reshape(-1)
        x_NxD = self._embed(tokens_BxS)

        def run(x, block, k, v):
            return block.decode(x, positions_N, k, v, mask_BxSxT, index)

        if self.ex.scan_layers and not self.grouped:
            def step(x, block, k, v):
                x, k, v = run(x, block, k, v)
                return x, (k, v)

            scan = nnx.scan(step, in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0))
            x_NxD, (k_L, v_L) = scan(x_NxD, self.blocks, cache["k"], cache["v"])
        else:
            ks, vs, states, each = [], [], [], []
            blocks = self.layers()  # (a scanned hybrid's: sliced from its groups)
            for block, k, v, state in zip(blocks, cache["k"], cache["v"],
                                          cache.get("gdn", (None,) * len(blocks)), strict=True):
                after = None
                if state is not None and stepwise:
                    x_NxD, state, after = block.decode_linear(x_NxD, state, valid_BxS, stepwise=True)
                elif state is not None:
                    x_NxD, state = block.decode_linear(x_NxD, state, valid_BxS)
                else:
                    x_NxD, k, v = run(x_NxD, block, k, v)
                ks.append(k)
                vs.append(v)
                states.append(state)
                each.append(after)
            k_L, v_L = tuple(ks), tuple(vs)
        new = {"k": k_L, "v": v_L, "valid": valid_BxT, "index": index + s}
        if "gdn" in cache:
            new["gdn"] = tuple(states)
            if stepwise:
                new["gdn_each"] = tuple(each)
        return self.final_norm(x_NxD), new

    def init_mtp_cache(self, batch: int, max_len: int) -> dict:
        """An empty kv cache for the MTP layer's attention (k, v [B, Hk, T, K], valid, index), laid
        out as one layer of `init_cache`'s."""
        cfg = self.cfg
        k, v = (jnp.zeros((batch, cfg.kv_heads, max_len, cfg.head_dim), self.dtype) for _ in "kv")
        return {"k": k, "v": v, "valid": jnp.zeros((batch, max_len), bool), "index": jnp.zeros((), jnp.int32)}

    def mtp_decode(self, hidden_NxD: jax.Array, next_tokens_BxS: jax.Array, positions_BxS: jax.Array,
                   cache: dict, valid_BxS: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """(logits [B, S, V] of x_{t+2}, cache): S new MTP inputs per row (the main model's final
        hidden states h_t from `decode_hidden` and the tokens after them) into the MTP cache's
        slots index..index+S-1, as `decode` does for the main model."""
        b, s = next_tokens_BxS.shape
        if valid_BxS is None:
            valid_BxS = jnp.ones((b, s), bool)
        valid_BxT, mask_BxSxT = _decode_mask(cache, valid_BxS)
        y_NxD, k, v = self.mtp.decode(hidden_NxD, self._embed(next_tokens_BxS), positions_BxS.reshape(-1),
                                      cache["k"], cache["v"], mask_BxSxT, cache["index"])
        logits_NxV = head_logits(y_NxD, self.head_weight(), self.dtype)
        cache = {"k": k, "v": v, "valid": valid_BxT, "index": cache["index"] + s}
        return logits_NxV.reshape(b, s, self.cfg.vocab_size), cache


def _run_layers(run, blocks, x_NxD) -> tuple[jax.Array, dict]:
    """(x, aux stacked per layer [len(blocks), ...]): `run(block, x)` through the blocks in order."""
    per_layer = []
    for block in blocks:
        x_NxD, layer_aux = run(block, x_NxD)
        per_layer.append(layer_aux)
    return x_NxD, jax.tree.map(lambda *a: jnp.stack(a), *per_layer)


def _decode_mask(cache: dict, valid_BxS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the cache's valid slots with the S new ones written at its index [B, T], the new queries'
    attention mask [B, S, T]): slot i sees slot j iff j <= i and slot j is valid."""
    index, s = cache["index"], valid_BxS.shape[1]
    valid_BxT = jax.lax.dynamic_update_slice(cache["valid"], valid_BxS.astype(bool), (0, index))
    visible_SxT = jnp.arange(valid_BxT.shape[1])[None, :] <= index + jnp.arange(s)[:, None]
    return valid_BxT, visible_SxT[None] & valid_BxT[:, None, :]


def head_logits(x_NxD: jax.Array, head_DxV: jax.Array, dtype) -> jax.Array:
    """float32 logits [N, V] of final hidden states: the LM head's one matmul, inputs in the
    compute dtype, the result in float32 so bf16 logits are not rounded."""
    return dense(x_NxD, head_DxV, dtype, out_dtype=jnp.float32)


def with_exec(model: Transformer, ex: ExecConfig) -> Transformer:
    """The same parameters computed as `ex` says: another kernel, dtype or remat, and scanned
    or unscanned blocks (the parameters restacked or sliced accordingly)."""
    if ex == model.ex:
        return model
    graphdef, like = nnx.split(nnx.eval_shape(lambda: Transformer(model.cfg, ex, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, relayout(nnx.state(model), like))


def unscanned(model: Transformer) -> Transformer:
    """The same model with exec.scan_layers=False: each block's parameters sliced from the
    stacked ones (a model that is already unscanned is returned as is)."""
    return with_exec(model, dataclasses.replace(model.ex, scan_layers=False))


def off_mesh(ex: ExecConfig) -> ExecConfig:
    """`ex` with an expert-parallel MoE (exec.moe_impl ragged or all_to_all: shard_map over the
    mesh's expert axis, so they run only under a mesh that has one) replaced by the partitioned
    MoE, one program that runs on any devices. Dropless, it is the same function as ragged
    (which differs only where a small exec.moe_buffer overflowed). With a capacity, all_to_all
    counts it per data x expert shard; partitioned counts it over each forward pass's tokens,
    so the two agree when each forward pass holds one shard's rows (docs/moe-and-mesh.md)."""
    if ex.moe_impl == "partitioned":
        return ex
    return dataclasses.replace(ex, moe_impl="partitioned", moe_buffer=None, grouped_matmul="ragged_dot")


def relayout(tree, like: nnx.State):
    """Every nnx.State in `tree` (parameters, or optimizer moments shaped like them) in the block
    layout of `like` (an abstract state of the same model). The layouts (exec.scan_layers):
    listed as ("blocks", i, ...); stacked under "blocks" with [L, ...] leaves; and a scanned
    hybrid's groups, ("blocks", "layers", j, ...) with [L / period, ...] leaves, layer
    g * period + j. Values come from `tree`, variable types and metadata (logical axes) from `like`."""
    target = list(nnx.to_flat_state(like))
    to_layout = _block_layout(p for p, _ in target)

    def convert(state):
        if not isinstance(state, nnx.State) or "blocks" not in state:
            return state
        flat = {p: v[...] for p, v in nnx.to_flat_state(state)}
        if set(flat) == {p for p, _ in target}:
            return state  # already in this layout
        layer = _layer_reader(flat)

        def value(path):
            if path[0] != "blocks":
                return flat[path]
            kind, period = to_layout
            if kind == "listed":  # ("blocks", i, ...)
                return layer(path[1], path[2:])
            if kind == "stacked":  # ("blocks", ...): [L, ...]
                return jnp.stack([layer(i, path[1:]) for i in range(layer.num_layers)])
            j = path[2]  # ("blocks", "layers", j, ...): [L / period, ...]
            return jnp.stack([layer(g * period + j, path[3:]) for g in range(layer.num_layers // period)])
        return nnx.from_flat_state([(p, v.replace(value(p))) for p, v in target])
    return jax.tree.map(convert, tree, is_leaf=lambda x: isinstance(x, nnx.State))


def _block_layout(paths) -> tuple[str, int]:
    """(layout, period) of parameter paths: ("listed", 1), ("stacked", 1) or ("grouped", period)."""
    blocks = [p for p in paths if p[0] == "blocks" and len(p) > 1]
    if any(isinstance(p[1], int) for p in blocks):
        return "listed", 1
    if any(p[1] == "layers" and len(p) > 2 and isinstance(p[2], int) for p in blocks):
        return "grouped", 1 + max(p[2] for p in blocks)
    return "stacked", 1


def _layer_reader(flat: dict):
    """read(i, rest): layer i's parameter `rest` from a flat state in any block layout, with
    read.num_layers."""
    kind, period = _block_layout(flat)
    blocks = {p: v for p, v in flat.items() if p[0] == "blocks"}
    if kind == "listed":
        def read(i, rest):
            return flat[("blocks", i) + rest]
        read.num_layers = 1 + max(p[1] for p in blocks)
    elif kind == "stacked":
        def read(i, rest):
            return flat[("blocks",) + rest][i]
        read.num_layers = next(iter(blocks.values())).shape[0]
    else:
        def read(i, rest):
            return flat[("blocks", "layers", i % period) + rest][i // period]
        read.num_layers = period * next(iter(blocks.values())).shape[0]
    return read
