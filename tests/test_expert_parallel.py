"""Expert parallelism with an explicit all-to-all (gattn/expert_parallel.py): on meshes with an
expert axis the MoE runs in shard_map, and (with a capacity that drops nothing) its loss, aux
values and gradients equal the single-device model's. 8 simulated CPU devices, in a subprocess."""

import subprocess
import sys
import textwrap


def test_explicit_expert_parallel_moe_equals_one_device():
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        from gattn.model import sharding
        from gattn.config import MeshConfig, ModelConfig, MoESpec
        from gattn.train.loss import aux_loss, lm_loss_and_aux
        from gattn.model.transformer import Transformer
        # capacity_factor = E / k: every expert can take every local token, so nothing is dropped
        # and the result must equal the dropless single-device model.
        cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, q_heads=4, kv_heads=2, head_dim=8,
                          d_ff=64, moe=MoESpec(num_experts=8, top_k=2, expert_width=16,
                                               capacity_factor=4.0, z_loss_coef=1e-3))
        tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, 64)
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        def loss(params, tokens):
            ce, aux = lm_loss_and_aux(nnx.merge(graphdef, params), tokens)
            return ce + aux_loss(cfg.moe, aux), aux
        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (ref_loss, ref_aux), ref_grads = step(params, tokens)
        assert int(ref_aux["dropped"].sum()) == 0
        for shape in [(1, 4, 2), (2, 2, 2), (1, 8, 1)]:
            mesh = sharding.make_mesh(MeshConfig(*shape))
            p = jax.device_put(params, sharding.param_shardings(params, mesh))
            t = jax.device_put(tokens, sharding.batch_sharding(mesh))
            with jax.set_mesh(mesh):
                (l, aux), g = step(p, t)
                text = step.lower(p, t).as_text()
            assert "all_to_all" in text or "all-to-all" in text, "no explicit token exchange"
            np.testing.assert_allclose(l, ref_loss, rtol=1e-5)
            np.testing.assert_allclose(aux["lbl"], ref_aux["lbl"], rtol=1e-5)
            np.testing.assert_array_equal(aux["load"], ref_aux["load"])
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_grads)):
                np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-9)
            print(shape, "ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ok") == 3, out.stdout
