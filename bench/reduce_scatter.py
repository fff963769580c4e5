"""How libtpu compiles a reduce-scatter, per TPU topology (issue 58: "the gradient reduction as a
reduce-scatter where XLA allows it").

    python bench/reduce_scatter.py [--topologies v5p:2x2x1,v5p:4x4x2,...] [--mb 32]

For each topology, one float32 gradient of MB MiB per chip is reduce-scattered over all its chips
two ways, each AOT-compiled by libtpu on this CPU machine:

    psum_scatter  jax.lax.psum_scatter inside jax.shard_map (the explicit collective)
    constraint    a sum over a stacked axis with the output sharded (what FSDP's gradient is)

and the compiled HLO is read: the collective opcodes it holds, the emitter libtpu chose
(backend_config's collective_algorithm_config), whether it became TPU's all-reduce-scatter
fusion (an all-reduce and the slice of its shard, fused and sent as a reduce-scatter), and the
bytes each chip sends by gattn's counter (gattn/experiments/traffic.py) against a reduce-scatter's
(g - 1) / g of the gradient. Prints one JSON object. Measured 2026-12-06 with libtpu from jax
0.10.2: only v5p:2x2x1 (4 chips) fuses it; on v5p 2x2x2 and 4x4x2, v5e 4x4 and v6e 4x4 and 8x8
both forms are a full all-reduce (RotatedPincerEmitter) followed by a slice: 2x the bytes
(docs/presets.md, "The gradient's reduction").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu is only a compiler here
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from gattn.experiments import traffic  # noqa: E402

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")


def programs(mesh: Mesh, rows: int, cols: int):
    """{form: (jitted function, its argument)}: each chip's full-size gradient in, its shard of
    the sum out."""
    n = mesh.devices.size
    stacked = jax.ShapeDtypeStruct((n, rows, cols), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))

    def scatter(g):
        return jax.lax.psum_scatter(g[0], "fsdp", scatter_dimension=0, tiled=True)[None]
    explicit = jax.jit(jax.shard_map(scatter, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp")))
    summed = jax.jit(lambda g: jnp.sum(g, axis=0), out_shardings=NamedSharding(mesh, P("fsdp")))
    return {"psum_scatter": (explicit, stacked), "constraint": (summed, stacked)}


def read(text: str, per_chip_bytes: int, n: int) -> dict:
    ops = {k: len(re.findall(rf"= \S+ {k}(?:-start)?\(", text)) for k in COLLECTIVES}
    return {"collectives": {k: v for k, v in ops.items() if v},
            "emitters": sorted(set(re.findall(r'"emitter":"(\w+)"', text))),
            "all_reduce_scatter_fusion": "calls=%all-reduce-scatter" in text,
            "sent_gib": traffic.count(text)["total_gib"],
            "reduce_scatter_gib": round(per_chip_bytes * (n - 1) / n / 2**30, 4)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topologies", default="v5p:2x2x1,v5p:2x2x2,v5p:4x4x2,v5e:4x4,v6e:4x4,v6e:8x8")
    ap.add_argument("--mb", type=int, default=32, help="MiB of float32 gradient per chip")
    args = ap.parse_args(argv)
    rows, cols = args.mb * 2**20 // 4 // 2048, 2048
    out = {"jax": jax.__version__, "gradient_mib_per_chip": args.mb, "topologies": {}}
    for topo in args.topologies.split(","):
        devices = np.asarray(topologies.get_topology_desc(topology_name=topo, platform="tpu").devices)
        n = devices.size
        mesh = Mesh(devices.reshape(n), ("fsdp",))
        row = {"chips": n}
        for form, (fn, arg) in programs(mesh, rows - rows % n, cols).items():
            row[form] = read(fn.lower(arg).compile().as_text(), (rows - rows % n) * cols * 4, n)
        out["topologies"][topo] = row
        print(f"[reduce_scatter] {topo}: {row}", file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
