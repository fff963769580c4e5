"""The Pallas Gated DeltaNet kernel (interpret mode) under a (data, model) mesh set with
`jax.set_mesh`: `gated_delta_rule_on_mesh` runs it in shard_map, rows over data and key heads
(with their value heads) over model; values, the final state and the gradients equal the jnp
chunked rule on one device, with packed resets and an initial state.

    python -m multidevice.sharded_gdn [--mesh 2,4]

Prints "ok DEVICES" (tests/test_gdn_kernel.py)."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from gattn.kernels import gdn as kernel
from gattn.model import gdn

from multidevice import check_devices, shape


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", type=shape, default=(2, 4), help="data,model")
    args = ap.parse_args(argv)
    check_devices()
    mesh = jax.make_mesh(args.mesh, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    b, s, g_, h, dk, dv = 2, 20, 4, 8, 8, 4  # model 4 splits the 4 key heads, 2 value heads each
    r = np.random.default_rng(0)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = (jnp.asarray(unit(r.normal(size=(b, s, g_, dk))), jnp.float32) for _ in range(2))
    v = jnp.asarray(r.normal(size=(b, s, h, dv)), jnp.float32)
    g = jnp.asarray(-np.geomspace(0.02, 2, h) * r.uniform(0.2, 1.5, size=(b, s, h)), jnp.float32)
    beta = jnp.asarray(r.uniform(0.1, 0.9, size=(b, s, h)), jnp.float32)
    state = jnp.asarray(0.5 * r.normal(size=(b, h, dk, dv)), jnp.float32)
    resets = jnp.zeros((b, s), bool).at[0, 6].set(True).at[1, 9].set(True)
    w_o = jnp.asarray(r.normal(size=(b, s, h, dv)), jnp.float32)

    def loss(rule):
        def f(q, k, v, g, beta, state):
            o, final = rule(q, k, v, g, beta, resets, state)
            return jnp.sum(o * w_o) + jnp.sum(final ** 2)
        return f

    def sharded(*a):
        return kernel.gated_delta_rule_on_mesh(*a, chunk_size=8)

    def reference(*a):
        return gdn.chunk_gated_delta_rule(*a, chunk_size=8)

    inputs = (q, k, v, g, beta, state)
    with jax.set_mesh(mesh):
        lowered = jax.jit(lambda *a: sharded(*a[:5], resets, a[5])).lower(*inputs)
        assert "shard_map" in lowered.as_text() or "sdy.manual_computation" in lowered.as_text()
        o, final = lowered.compile()(*inputs)
        grads = jax.jit(jax.grad(loss(sharded), argnums=range(6)))(*inputs)
    want_o, want_final = reference(q, k, v, g, beta, resets, state)
    want_grads = jax.grad(loss(reference), argnums=range(6))(*inputs)
    np.testing.assert_allclose(o, want_o, atol=2e-5)
    np.testing.assert_allclose(final, want_final, atol=2e-5)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "state"), grads, want_grads):
        assert float(jnp.max(jnp.abs(want))) > 1e-2, name
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-5, err_msg=name)
    print(f"ok {jax.device_count()}")


if __name__ == "__main__":
    main()
