"""Expert parallelism with an explicit all-to-all (gattn/model/expert_parallel.py): a model built
with exec.moe_impl="all_to_all" runs its MoE in shard_map on meshes with an expert axis, and with a
capacity that drops nothing (capacity_factor = E / k: every expert can take every local token)
its loss, aux values and gradients equal the single-device model's (the default "partitioned"
MoE, same parameters), which stays one program under the same mesh: the mesh never picks the path.

    python -m multidevice.expert_parallel_step [--meshes 1,4,2 2,2,2 1,8,1]

Prints "ok MESH" per mesh (tests/test_expert_parallel.py counts them)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gattn.config import Config, ExecConfig, MeshConfig, MoESpec
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


if __name__ == "__main__":
    main()
