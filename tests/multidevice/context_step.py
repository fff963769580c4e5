"""Context parallelism equals one device: for a dense gated model, a Qwen3.5-style hybrid (3 Gated
DeltaNet : 1 gated attention, more value heads than key heads, an MTP layer) and a hybrid MoE
(Qwen3-Next-shaped), and a hybrid whose conv has width 1, the loss and every gradient of the jitted step with the sequence split over
the mesh's context axis equal the single-device values (float32), on packed rows whose documents
cross the chunk boundaries (segment ids and positions restarting per document, padding at the
end of some rows).

    python -m multidevice.context_step [--models dense hybrid hybrid_moe hybrid_w1] [--meshes 4,1,2 1,2,4 1,1,8]

Meshes are (data, fsdp, context). Prints "ok MODEL MESH" per pair (tests/test_context.py counts
them). `--query-chunk` also checks exec.attention_query_chunk's memory bound on context 2 ("ok query_chunk"). `--checkpoint DIR` also runs the trainer's step on the hybrid: a train state saved with
Orbax from a mesh without the context axis restores onto one with it (and back), and the next
step's loss and updated parameters are the same on both layouts ("ok checkpoint ...")."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gattn.config import Config, ExecConfig, GateSpec, LinearAttentionSpec, MeshConfig, MoESpec, TrainConfig, hybrid_layer_types
from gattn.model import sharding
from gattn.train import checkpoint, trainer
from gattn.model.transformer import Transformer
from gattn.train.loss import aux_loss, lm_and_mtp_loss, lm_loss_and_aux

from conftest import tiny_model
from multidevice import check_devices, shape

MODELS = ("dense", "hybrid", "hybrid_moe", "dense_pallas", "hybrid_pallas", "hybrid_w1")
# How each model is computed: the dense model's loss a chunk of positions at a time (each device's
# pieces in every chunk, gattn/train/loss.py); *_pallas run the fused flash kernel (both kinds of
# chunk pair, merged by the kernel's lse) and the GDN rule's kernel, in interpret mode.
PALLAS = ExecConfig(attention_impl="pallas", flash_block_q=8, flash_block_k=8, gdn_impl="pallas", gdn_chunk=8)
EXEC = {"dense": ExecConfig(loss_chunk=16), "dense_pallas": PALLAS, "hybrid_pallas": PALLAS}
ROWS, LENGTH = 8, 64  # 64 input positions: chunks of 4 on a context axis of 8 (the conv's 3 inputs fit)


def config(name: str):
    gdn = LinearAttentionSpec(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
    if name in ("dense", "dense_pallas"):
        return tiny_model(vocab_size=64, gate=GateSpec(), qk_norm=True)
    if name == "hybrid_w1":  # a conv of width 1: no left context to carry (a reset is still seen)
        return tiny_model(vocab_size=64, num_layers=4, layer_types=hybrid_layer_types(4), qk_norm=True,
                          gate=GateSpec(), linear_attention=dataclasses.replace(gdn, conv_kernel=1))
    if name in ("hybrid", "hybrid_pallas"):  # Qwen3.5's dense pattern, with its MTP layer
        return tiny_model(vocab_size=64, num_layers=4, layer_types=hybrid_layer_types(4), qk_norm=True,
                          zero_centered_norm=True, gate=GateSpec(), linear_attention=gdn, mtp_layers=1)
    return tiny_model(vocab_size=64, num_layers=4, layer_types=hybrid_layer_types(4), qk_norm=True,
                      zero_centered_norm=True, gate=GateSpec(), linear_attention=gdn,
                      moe=MoESpec(num_experts=4, top_k=2, expert_width=16, shared_expert_width=16))


def packed_batch(seed: int = 0):
    """tokens, segment ids and positions [ROWS, LENGTH + 1]: documents of random lengths (3 to 40
    tokens) packed end to end, so they cross chunk boundaries anywhere; rows 1 and 5 end in padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 64, (ROWS, LENGTH + 1))
    seg = np.zeros((ROWS, LENGTH + 1), np.int32)
    pos = np.zeros((ROWS, LENGTH + 1), np.int32)
    for r in range(ROWS):
        t, doc = 0, 1
        end = LENGTH + 1 - (11 if r in (1, 5) else 0)
        while t < end:
            n = min(int(rng.integers(3, 41)), end - t)
            seg[r, t:t + n], pos[r, t:t + n] = doc, np.arange(n)
            t, doc = t + n, doc + 1
    return jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos)


def check_checkpoint(workdir: Path) -> None:
    """Save on (data 8), restore on (data 2, fsdp 2, context 2) and on (context 8), one step each."""
    tokens, seg, pos = (np.asarray(x) for x in packed_batch(1))
    batch = {"tokens": tokens, "segment_ids": seg, "positions": pos}
    base = Config(model=config("hybrid"), train=TrainConfig(batch_size=ROWS, seq_len=LENGTH, steps=10, warmup_steps=2,
                                                            learning_rate=1e-2, mtp_loss_weight=0.3),
                  mesh=MeshConfig(data=8))
    results = {}
    for i, mesh_cfg in enumerate([MeshConfig(data=8), MeshConfig(data=2, fsdp=2, context=2),
                                  MeshConfig(data=1, context=8)]):
        cfg = dataclasses.replace(base, mesh=mesh_cfg)
        mesh = sharding.make_mesh(mesh_cfg)
        graphdef, state = trainer.init_state(cfg, mesh)
        mngr = checkpoint.manager(workdir, keep=2, every=1)
        if i == 0:
            checkpoint.save(mngr, 0, state, {}, {}, force=True)
            mngr.wait_until_finished()
            saved = jax.device_get(state)
        else:  # the saved state, restored onto this mesh's layout: the same numbers, split over context
            state = checkpoint.restore(mngr, trainer.abstract_state(cfg, mesh), 0)[0]
            assert any("context" in str(x.sharding.spec) for x in jax.tree.leaves(state["params"])), mesh_cfg
            for a, r in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(saved)):
                np.testing.assert_array_equal(a, r)
        mngr.close()
        step = trainer.make_train_step(cfg, graphdef, jax.tree.map(lambda x: x.sharding, state), mesh)
        b = {k: trainer.global_array(v, sharding.batch_sharding(mesh)) for k, v in batch.items()}
        with jax.set_mesh(mesh):
            state, report = step(state, b)
        results[i] = (float(report["loss"]), float(report["grad_norm"]), jax.device_get(state["params"]))
    for i in (1, 2):
        np.testing.assert_allclose(results[i][:2], results[0][:2], rtol=2e-5)
        # (AdamW divides by the gradient's own size: where a gradient is ~1e-9 (A_log's) its rounding
        # moves the first update by up to ~1e-3 of the LR's 5e-3; the gradients themselves are
        # compared to 2e-5 by main's check)
        for a, r in zip(jax.tree.leaves(results[i][2]), jax.tree.leaves(results[0][2])):
            np.testing.assert_allclose(a, r, atol=1e-3)
        print("ok checkpoint data 8 ->", ("data 2 fsdp 2 context 2", "context 8")[i - 1], flush=True)


def check_query_chunk() -> None:
    """exec.attention_query_chunk bounds a device's attention memory under context parallelism
    too (before: dropped there, so a chunked forward pass took ~3x the memory of one device's): a
    dense layer's loss (the forward pass an evaluation or a long prefill runs; a gradient keeps
    every chunk's scores for the backward pass either way) on context 2, 2 rows of 1024, chunked at
    64 against not chunked: compiled temporaries and the loss."""
    cfg = tiny_model(vocab_size=64, num_layers=1, q_heads=8, kv_heads=2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 1025)))
    mesh = sharding.make_mesh(MeshConfig(data=1, context=2), jax.devices()[:2])
    out = {}
    for chunk in (0, 64):
        graphdef, params = nnx.split(Transformer(cfg, ExecConfig(attention_query_chunk=chunk), rngs=nnx.Rngs(0)),
                                     nnx.Param)
        with jax.set_mesh(mesh):
            p = jax.device_put(params, sharding.param_shardings(params, mesh))
            t = jax.device_put(tokens, sharding.batch_sharding(mesh))
            compiled = jax.jit(lambda p, t, g=graphdef: lm_loss_and_aux(nnx.merge(g, p), t)[0]).lower(p, t).compile()
            out[chunk] = compiled.memory_analysis().temp_size_in_bytes, compiled(p, t)
    (full, l0), (chunked, l1) = out[0], out[64]
    assert chunked < 0.5 * full, ("temp bytes a device, query_chunk 64 vs none", chunked, full)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    print("ok query_chunk", f"{chunked / 2**20:.1f} vs {full / 2**20:.1f} MiB", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=[m for m in MODELS if "pallas" not in m])
    ap.add_argument("--meshes", nargs="+", type=shape, default=[(4, 1, 2), (1, 2, 4), (1, 1, 8)])
    ap.add_argument("--checkpoint", type=Path, default=None, help="also: the checkpoint check, in this folder")
    ap.add_argument("--query-chunk", action="store_true", help="also: exec.attention_query_chunk's memory bound")
    args = ap.parse_args(argv)
    check_devices()
    if args.query_chunk:
        check_query_chunk()
    if args.checkpoint:
        check_checkpoint(args.checkpoint)
    batch = packed_batch()
    for name in args.models:
        cfg = config(name)
        graphdef, params = nnx.split(Transformer(cfg, EXEC.get(name, ExecConfig()), rngs=nnx.Rngs(0)), nnx.Param)

        def loss(params, tokens, seg, pos, graphdef=graphdef, cfg=cfg):
            model = nnx.merge(graphdef, params)
            if cfg.mtp_layers:
                ce, mtp, aux = lm_and_mtp_loss(model, tokens, seg, pos)
                return ce + 0.3 * mtp + aux_loss(cfg.moe, aux)
            ce, aux = lm_loss_and_aux(model, tokens, seg, pos)
            return ce + aux_loss(cfg.moe, aux)

        step = jax.jit(jax.value_and_grad(loss))
        ref_loss, ref_grads = step(params, *batch)
        for data, fsdp, ctx in args.meshes:
            mesh = sharding.make_mesh(MeshConfig(data=data, fsdp=fsdp, context=ctx))
            with jax.set_mesh(mesh):
                p = jax.device_put(params, sharding.param_shardings(params, mesh))
                b = [jax.device_put(x, sharding.batch_sharding(mesh)) for x in batch]
                lowered = jax.jit(jax.value_and_grad(loss)).lower(p, *b)
                text = lowered.as_text()
                assert "all-gather" in text or "all_gather" in text, "no collective over the context axis"
                l, g = lowered.compile()(p, *b)
            np.testing.assert_allclose(l, ref_loss, rtol=2e-5)
            # each leaf to 2e-5 of its own largest value, and of the largest gradient anywhere (a leaf of
            # ~1e-9, as A_log's can be, holds float32 rounding only)
            floor = 1e-6 * max(float(jnp.max(jnp.abs(r))) for r in jax.tree.leaves(ref_grads))
            for path, a, r in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g), jax.tree.leaves(ref_grads)):
                np.testing.assert_allclose(a, r, atol=2e-5 * float(jnp.max(jnp.abs(r))) + floor,
                                           err_msg=f"{name} {(data, fsdp, ctx)} {jax.tree_util.keystr(path[0])}")
            print("ok", name, (data, fsdp, ctx), flush=True)


if __name__ == "__main__":
    main()
