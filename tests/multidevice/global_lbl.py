"""The MoE's global-batch load-balancing loss on a data mesh: for a batch sharded over SHARDS
devices it equals the single-device value on the whole batch; on a skewed batch (each shard's
tokens from a different region, so shards prefer different experts) it differs from the mean of
the per-shard LBLs, which is what lbl_scope="micro" with micro_batches=SHARDS computes.

    python -m multidevice.global_lbl [--shards 4]

Prints "ok" (tests/test_moe.py)."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from gattn.config import MoESpec
from gattn.model.moe import MoE

from conftest import tiny_model
from multidevice import check_devices


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=4, help="devices on the data axis")
    args = ap.parse_args(argv)
    check_devices()
    n = args.shards
    cfg = tiny_model(num_layers=1, moe=MoESpec(num_experts=8, top_k=2, expert_width=16))
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = jnp.concatenate([jax.random.normal(jax.random.key(i), (16, 32)) + 3.0 * i for i in range(n)])
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    graphdef, state = nnx.split(moe)
    lbl = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)[1]["lbl"])
    sharded, single = float(lbl(state, xs)), float(lbl(state, x))
    micro = float(np.mean([lbl(state, x[16 * i:16 * (i + 1)]) for i in range(n)]))
    print(sharded, single, micro)
    assert abs(sharded - single) < 1e-5, (sharded, single)
    assert abs(micro - single) > 1e-2, (micro, single)
    scoped_moe = nnx.merge(graphdef, state)
    scoped_moe.spec = MoESpec(num_experts=8, top_k=2, expert_width=16, lbl_scope="micro", micro_batches=n)
    g2, s2 = nnx.split(scoped_moe)
    scoped = float(jax.jit(lambda s, x: nnx.merge(g2, s)(x)[1]["lbl"])(s2, xs))
    assert abs(scoped - micro) < 1e-5, (scoped, micro)
    print("ok", flush=True)


if __name__ == "__main__":
    main()
