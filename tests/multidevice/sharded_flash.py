"""The Pallas kernel (interpret mode) sharded with `kernels.shard_attention` over a (data, model)
mesh: each device runs it on its rows and heads; values and gradients equal the unsharded xla
reference, and the lowered program is a shard_map.

    python -m multidevice.sharded_flash [--mesh 2,4]

Prints "ok DEVICES" (tests/test_flash.py)."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from gattn import kernels

from multidevice import check_devices, shape


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", type=shape, default=(2, 4), help="data,model")
    args = ap.parse_args(argv)
    check_devices()
    mesh = jax.make_mesh(args.mesh, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k, v, g = arr(2, 24, 8, 16), arr(2, 24, 4, 16), arr(2, 24, 4, 16), arr(2, 24, 8)
    seg = jnp.asarray([[1] * 20 + [0] * 4, [1] * 10 + [2] * 14], jnp.int32)
    attn = kernels.shard_attention(kernels.attention_pallas, mesh)
    f = lambda q, k, v, g: attn(q, k, v, g, segment_ids=seg, block_q=8, block_k=8)  # noqa: E731
    r = lambda q, k, v, g: kernels.attention_xla(q, k, v, g, segment_ids=seg)  # noqa: E731
    np.testing.assert_allclose(jax.jit(f)(q, k, v, g), r(q, k, v, g), atol=1e-5)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), (0, 1, 2, 3)))(q, k, v, g)
    ref = jax.grad(lambda *a: jnp.sum(r(*a) ** 2), (0, 1, 2, 3))(q, k, v, g)
    for a, b in zip(grads, ref):
        np.testing.assert_allclose(a, b, atol=2e-5)
    text = jax.jit(f).lower(q, k, v, g).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text, "not sharded"
    print("ok", len(jax.devices()), flush=True)


if __name__ == "__main__":
    main()
