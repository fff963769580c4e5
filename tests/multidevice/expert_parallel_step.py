"""Expert parallelism with an explicit all-to-all (gattn/model/expert_parallel.py): a model built
with exec.moe_impl="all_to_all" runs its MoE in shard_map on meshes with an expert axis, and with a
capacity that drops nothing (capacity_factor = E / k: every expert can take every local token)
its loss, aux values and gradients equal the single-device model's (the default "partitioned"
MoE, same parameters), which stays one program under the same mesh: the mesh never picks the path.

With a capacity that drops tokens, the all_to_all model's logits on a mesh equal the
partitioned model's run on one data x expert shard's rows at a time, the single-device path
eval's measurements take (gattn.eval.analysis: `for_analysis`, `moe_shards`).

    python -m multidevice.expert_parallel_step [--meshes 1,4,2 2,2,2 1,8,1]

Prints "ok MESH" per mesh and "shards ok MESH" once (tests/test_expert_parallel.py counts them)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dataclasses

from gattn.config import Config, ExecConfig, MeshConfig, MoESpec
from gattn.eval import analysis
from gattn.model import sharding
from gattn.model.transformer import Transformer, with_exec
from gattn.train.loss import aux_loss, lm_loss_and_aux

from conftest import tiny_model
from multidevice import expert_meshes


def main(argv=None):
    meshes = expert_meshes(__doc__, argv)
    cfg = tiny_model(vocab_size=64, moe=MoESpec(num_experts=8, top_k=2, expert_width=16,
                                                capacity_factor=4.0, z_loss_coef=1e-3))
    a2a = ExecConfig(moe_impl="all_to_all")
    tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, 64)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    a2a_graphdef, _ = nnx.split(with_exec(model, a2a), nnx.Param)

    def step_fn(graphdef):
        def loss(params, tokens):
            ce, aux = lm_loss_and_aux(nnx.merge(graphdef, params), tokens)
            return ce + aux_loss(cfg.moe, aux), aux
        return jax.jit(jax.value_and_grad(loss, has_aux=True))

    reference = step_fn(graphdef)
    (ref_loss, ref_aux), ref_grads = reference(params, tokens)
    assert int(ref_aux["dropped"].sum()) == 0
    step = step_fn(a2a_graphdef)
    for mesh_shape in meshes:
        Config(model=cfg, mesh=MeshConfig(*mesh_shape), exec=a2a)  # a valid run config
        mesh = sharding.make_mesh(MeshConfig(*mesh_shape))
        p = jax.device_put(params, sharding.param_shardings(params, mesh))
        t = jax.device_put(tokens, sharding.batch_sharding(mesh))
        with jax.set_mesh(mesh):
            (l, aux), g = step(p, t)
            text = step.lower(p, t).as_text()
            partitioned = reference.lower(p, t).as_text()
        assert "all_to_all" in text or "all-to-all" in text, "no explicit token exchange"
        explicit = ("all_to_all", "all-to-all", "shard_map", "manual_computation")
        assert not any(op in partitioned for op in explicit), "a set mesh chose the explicit path"
        np.testing.assert_allclose(l, ref_loss, rtol=1e-5)
        np.testing.assert_allclose(aux["lbl"], ref_aux["lbl"], rtol=1e-5)
        np.testing.assert_array_equal(aux["load"], ref_aux["load"])
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-9)
        print("ok", mesh_shape, flush=True)
    # Once (a compile each): on a mesh whose shards split both data and expert, if one is given.
    shard_mesh = next((m for m in meshes if m[0] > 1), meshes[0])
    check_shard_capacity(cfg, a2a, tokens, shard_mesh)
    print("shards ok", shard_mesh, flush=True)


def check_shard_capacity(cfg, a2a, tokens, mesh_shape):
    """all_to_all counts capacity per data x expert shard; the partitioned MoE (which eval runs,
    with no mesh) over each forward pass. With drops they agree when each pass is one shard's rows."""
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=0.5))
    shards = analysis.moe_shards(Config(model=cfg, mesh=MeshConfig(*mesh_shape), exec=a2a))
    assert shards == mesh_shape[0] * mesh_shape[1], shards
    model = with_exec(Transformer(cfg, rngs=nnx.Rngs(1)), a2a)
    graphdef, params = nnx.split(model)
    mesh = sharding.make_mesh(MeshConfig(*mesh_shape))
    with jax.set_mesh(mesh):
        logits, aux = jax.jit(lambda p, t: nnx.merge(graphdef, p).forward(t))(params, tokens)
    assert int(aux["dropped"].sum()) > 0, "the capacity drops nothing: the check would be empty"
    off_graphdef, off_params = nnx.split(analysis.for_analysis(model))  # partitioned, no mesh
    off = jax.jit(lambda t: nnx.merge(off_graphdef, off_params)(t))
    rows = len(tokens) // shards
    per_shard = np.concatenate([off(tokens[i:i + rows]) for i in range(0, len(tokens), rows)])
    np.testing.assert_allclose(per_shard, logits, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(off(tokens)) - np.asarray(logits)).max() > 1e-3  # the whole batch drops others


if __name__ == "__main__":
    main()
