"""The Pallas kernel under a context mesh: a model with exec.attention_impl="pallas" run under
jax.set_mesh(MESH) calls the kernel in shard_map over batch and heads, and its loss and gradients
equal the single-device xla model's (same parameters).

    python -m multidevice.sharded_pallas_step [--mesh 2,2,2]

Prints "ok MESH" (tests/test_sharding.py)."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gattn import variants
from gattn.config import ExecConfig, MeshConfig
from gattn.model import sharding
from gattn.model.transformer import Transformer
from gattn.train.loss import lm_loss

from conftest import tiny_model
from multidevice import check_devices, shape


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", type=shape, default=(2, 2, 2), help="data,expert,model")
    args = ap.parse_args(argv)
    check_devices()
    cfg = variants.apply("sdpa_elementwise", tiny_model(vocab_size=64, num_layers=1))
    xla = ExecConfig(flash_block_q=8, flash_block_k=8)
    pallas = ExecConfig(attention_impl="pallas", flash_block_q=8, flash_block_k=8)
    tokens = jax.random.randint(jax.random.key(0), (4, 16), 0, 64)
    graphdef, params = nnx.split(Transformer(cfg, xla, rngs=nnx.Rngs(0)), nnx.Param)
    pallas_graph, _ = nnx.split(Transformer(cfg, pallas, rngs=nnx.Rngs(0)), nnx.Param)

    def grad_fn(g):
        return jax.jit(jax.value_and_grad(lambda p, t: lm_loss(nnx.merge(g, p), t)))

    ref_loss, ref_grads = grad_fn(graphdef)(params, tokens)
    mesh = sharding.make_mesh(MeshConfig(*args.mesh))
    p = jax.device_put(params, sharding.param_shardings(params, mesh))
    t = jax.device_put(tokens, sharding.batch_sharding(mesh))
    with jax.set_mesh(mesh):
        step = grad_fn(pallas_graph)
        loss, grads = step(p, t)
        text = step.lower(p, t).as_text()
    assert "shard_map" in text or "manual_computation" in text, "the kernel is not in shard_map"
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b))) + 1e-9)
    print("ok", args.mesh, flush=True)


if __name__ == "__main__":
    main()
