"""The mesh and the logical-axis table: rules, divisibility fallback, and sharded training math
equal to one device's (8 simulated CPU devices, in a subprocess so the flag precedes jax)."""

import subprocess
import sys
import textwrap

import jax
import pytest
from jax.sharding import PartitionSpec as P

from gattn.model import sharding
from gattn.config import ConfigError, MeshConfig


def test_mesh_shape_fills_data_and_rejects_a_wrong_product():
    assert sharding.mesh_shape(MeshConfig(), 8) == (8, 1, 1)
    assert sharding.mesh_shape(MeshConfig(expert=2, model=2), 8) == (2, 2, 2)
    with pytest.raises(ConfigError, match="multiply to the 8 devices"):
        sharding.mesh_shape(MeshConfig(data=3), 8)
    with pytest.raises(ConfigError, match="'data' = 0"):
        MeshConfig(data=0)


def test_logical_rules_and_divisibility_fallback():
    mesh = jax.sharding.AbstractMesh((2, 2, 4), sharding.AXES)
    assert sharding.spec(("embed", "heads"), (32, 16), mesh) == P(None, "model")
    assert sharding.spec(("expert", "embed", "mlp"), (8, 32, 64), mesh) == P("expert", None, "model")
    assert sharding.spec(("batch", None), (8, 16), mesh) == P(("data", "expert"), None)
    assert sharding.spec(("embed", "kv_heads"), (32, 2), mesh) == P(None, None)  # 2 kv heads, model 4
    one = jax.sharding.AbstractMesh((1, 1, 1), sharding.AXES)
    assert sharding.spec(("vocab", "embed"), (64, 32), one) == P(None, None)


def test_sharded_loss_and_gradients_equal_one_device():
    """Dense and MoE models on meshes (data, expert, model) = (2,2,2), (1,4,2), (1,8,1):
    loss and every gradient equal the single-device values (float32, to 1e-5 relative)."""
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        from gattn.model import sharding
        from gattn.config import MeshConfig, ModelConfig, MoESpec
        from gattn.train.loss import aux_loss, lm_loss_and_aux
        from gattn.model.transformer import Transformer
        base = dict(vocab_size=64, d_model=32, num_layers=2, q_heads=4, kv_heads=2, head_dim=8, d_ff=64)
        cfgs = {"dense": ModelConfig(**base),
                "moe": ModelConfig(**base, moe=MoESpec(num_experts=8, top_k=2, expert_width=16,
                                                       z_loss_coef=1e-3))}
        tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, 64)
        for name, cfg in cfgs.items():
            graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
            def loss(params, tokens):
                ce, aux = lm_loss_and_aux(nnx.merge(graphdef, params), tokens)
                return ce + aux_loss(cfg.moe, aux)
            step = jax.jit(jax.value_and_grad(loss))
            ref_loss, ref_grads = step(params, tokens)
            for shape in [(2, 2, 2), (1, 4, 2), (1, 8, 1)]:
                mesh = sharding.make_mesh(MeshConfig(*shape))
                p = jax.device_put(params, sharding.param_shardings(params, mesh))
                t = jax.device_put(tokens, sharding.batch_sharding(mesh))
                if name == "moe" and shape[1] > 1:  # experts really are split
                    assert "expert" in str(p["blocks"][0]["ffn"]["w1"].sharding.spec)
                if shape[2] > 1:
                    assert "model" in str(p["blocks"][0]["attn"]["wq"].sharding.spec)
                l, g = step(p, t)
                np.testing.assert_allclose(l, ref_loss, rtol=1e-5)
                for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_grads)):
                    np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-9)
                print(name, shape, "ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("ok") == 6, out.stdout


def test_pallas_attention_runs_sharded_under_the_context_mesh():
    """attention_impl='pallas' under jax.set_mesh((2, 2, 2)) runs the kernel in shard_map over
    batch and heads and equals the single-device xla model (loss and gradients)."""
    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import dataclasses, jax, jax.numpy as jnp, numpy as np
        from flax import nnx
        from gattn import variants
        from gattn.model import sharding
        from gattn.config import MeshConfig, ModelConfig
        from gattn.train.loss import lm_loss
        from gattn.model.transformer import Transformer
        cfg = variants.apply("sdpa_elementwise", ModelConfig(
            vocab_size=64, d_model=32, num_layers=1, q_heads=4, kv_heads=2, head_dim=8, d_ff=64,
            flash_block_q=8, flash_block_k=8))
        tokens = jax.random.randint(jax.random.key(0), (4, 16), 0, 64)
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        pallas_graph, _ = nnx.split(Transformer(dataclasses.replace(cfg, attention_impl="pallas"),
                                                rngs=nnx.Rngs(0)), nnx.Param)
        grad_fn = lambda g: jax.jit(jax.value_and_grad(lambda p, t: lm_loss(nnx.merge(g, p), t)))
        ref_loss, ref_grads = grad_fn(graphdef)(params, tokens)
        mesh = sharding.make_mesh(MeshConfig(2, 2, 2))
        p = jax.device_put(params, sharding.param_shardings(params, mesh))
        t = jax.device_put(tokens, sharding.batch_sharding(mesh))
        with jax.set_mesh(mesh):
            step = grad_fn(pallas_graph)
            loss, grads = step(p, t)
            text = step.lower(p, t).as_text()
        assert "shard_map" in text or "manual_computation" in text
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-9)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok" in out.stdout
