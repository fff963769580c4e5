"""Sharded training math equals one device's: for each model (dense; MoE with experts split over
the mesh's expert axis) and each mesh (data, expert, model[, fsdp], MeshConfig's order), the loss
and every gradient of the sharded jitted step equal the single-device values (float32, to 1e-5
relative). With fsdp > 1 each device holds about 1/fsdp of the parameters (measured on the
arrays: the bytes on device 0 over the whole).

    python -m multidevice.sharded_step [--models dense moe] [--meshes 2,2,2 1,4,2 1,8,1 1,1,2,4]

Prints "ok MODEL MESH" per pair (tests/test_sharding.py counts them)."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gattn.config import GateSpec, LinearAttentionSpec, MeshConfig, MoESpec, hybrid_layer_types
from gattn.model import sharding
from gattn.model.transformer import Transformer
from gattn.train.loss import aux_loss, lm_loss_and_aux

from conftest import tiny_model
from multidevice import check_devices, shape

MODELS = ("dense", "moe", "hybrid")


def config(name: str):
    if name == "hybrid":  # Qwen3-Next-shaped: 3 GDN : 1 gated attention, a shared expert
        return tiny_model(vocab_size=64, num_layers=4, layer_types=hybrid_layer_types(4), qk_norm=True,
                          zero_centered_norm=True, gate=GateSpec(), linear_attention=LinearAttentionSpec(2, 4, 8, 8),
                          moe=MoESpec(num_experts=8, top_k=2, expert_width=16, shared_expert_width=16))
    moe = MoESpec(num_experts=8, top_k=2, expert_width=16, z_loss_coef=1e-3) if name == "moe" else None
    return tiny_model(vocab_size=64, moe=moe)


def on_device(tree, device) -> int:
    """The bytes of `tree`'s arrays held on `device`."""
    return sum(shard.data.nbytes for x in jax.tree.leaves(tree) for shard in x.addressable_shards
               if shard.device == device)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--meshes", nargs="+", type=shape, default=[(2, 2, 2), (1, 4, 2), (1, 8, 1)])
    args = ap.parse_args(argv)
    check_devices()
    tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, 64)
    for name in args.models:
        cfg = config(name)
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)

        def loss(params, tokens, graphdef=graphdef, cfg=cfg):
            ce, aux = lm_loss_and_aux(nnx.merge(graphdef, params), tokens)
            return ce + aux_loss(cfg.moe, aux)

        step = jax.jit(jax.value_and_grad(loss))
        ref_loss, ref_grads = step(params, tokens)
        for mesh_shape in args.meshes:
            mesh = sharding.make_mesh(MeshConfig(*mesh_shape))
            p = jax.device_put(params, sharding.param_shardings(params, mesh))
            t = jax.device_put(tokens, sharding.batch_sharding(mesh))
            if name == "moe" and mesh_shape[1] > 1:  # experts really are split
                assert "expert" in str(p["blocks"][0]["ffn"]["w1"].sharding.spec)
            if mesh_shape[2] > 1 and cfg.hybrid:  # GDN heads (key and value) over the model axis
                gdn = p["blocks"][0]["linear_attn"]
                assert all("model" in str(gdn[w].sharding.spec) for w in ("wq", "wk", "wv", "wo", "a_log"))
            elif mesh_shape[2] > 1:
                assert "model" in str(p["blocks"][0]["attn"]["wq"].sharding.spec)
            fsdp = mesh.shape["fsdp"]
            l, g = step(p, t)
            np.testing.assert_allclose(l, ref_loss, rtol=1e-5)
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_grads)):
                np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-9)
            if fsdp > 1:  # the parameters and their gradients split over fsdp: ~1/fsdp of them per device
                share = on_device(p, jax.devices()[0]) / on_device(params, jax.devices()[0])
                per_model = mesh.shape["model"] * (mesh.shape["expert"] if name != "dense" else 1)
                assert share <= 1.05 / fsdp, (share, fsdp)  # (a few small arrays stay whole)
                assert share >= 0.5 / (fsdp * per_model), share
                print(f"share {name} {mesh_shape} {share:.4f}", flush=True)
            print("ok", name, mesh_shape, flush=True)


if __name__ == "__main__":
    main()
