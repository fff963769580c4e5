"""Memory of the Gated DeltaNet rule per layer: the Pallas kernel against the jnp chunked path,
compiled ahead of time for one TPU chip with libtpu on this CPU machine (no TPU needed).

Shape: one Qwen3-Next / Qwen3.5-35B-A3B GDN layer (16 key heads, 32 value heads, K = V = 128),
batch 1, chunk 64, the rule's inputs as the layer hands them over (q, k, v, g, beta float32:
the conv and the L2 norm compute in float32; `--dtype bfloat16` for bf16 q, k, v), packed-row
resets and an initial state. For each sequence length and each of

    xla               gattn.model.gdn.chunk_gated_delta_rule (exec.gdn_impl=xla)
    pallas            gattn.kernels.gdn.gated_delta_rule (exec.gdn_impl=pallas): the forward saves
                      the state at every chunk start for the backward
    pallas_recompute  the same kernels with save_states=False: the backward recomputes them

it compiles the forward (prefill: outputs and the final state) and the training step's part
(the value and the VJP for given cotangents of o and the final state), and prints as JSON
XLA's `memory_analysis` (temp bytes: what the program allocates besides its arguments and
outputs, so for the VJP the residuals too) and the residual bytes a layer keeps from its forward
to its backward when it is not rematerialised (the leaves of `jax.vjp`'s pullback, inputs
included). Configurations that do not fit the chip's HBM are reported with the compiler's error.

    python bench/gdn_kernel.py [--topology v5p:2x2x1] [--seqs 4096,32768] [--dtype float32]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu is only a compiler here
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gattn.kernels import gdn as kernel
from gattn.model import gdn

K_HEADS, V_HEADS, HEAD_DIM, CHUNK = 16, 32, 128, 64
IMPLS = {
    "xla": functools.partial(gdn.chunk_gated_delta_rule, chunk_size=CHUNK),
    "pallas": functools.partial(kernel.gated_delta_rule, chunk_size=CHUNK, interpret=False),
    "pallas_recompute": functools.partial(kernel.gated_delta_rule, chunk_size=CHUNK, interpret=False,
                                          save_states=False),
}


def _nbytes(tree) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _memory(compiled) -> dict:
    mem = compiled.memory_analysis()
    return {"temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes}


def report(topology: str, seqs: list[int], dtype) -> list[dict]:
    from jax.experimental import topologies
    device = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]
    mesh = Mesh(np.asarray([device]), ("data",))
    rows = []
    for seq in seqs:
        def sds(shape, dt=jnp.float32):
            return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))

        b = 1
        args = (sds((b, seq, K_HEADS, HEAD_DIM), dtype), sds((b, seq, K_HEADS, HEAD_DIM), dtype),
                sds((b, seq, V_HEADS, HEAD_DIM), dtype), sds((b, seq, V_HEADS)), sds((b, seq, V_HEADS)),
                sds((b, seq), jnp.bool_), sds((b, V_HEADS, HEAD_DIM, HEAD_DIM)))
        cotangents = (sds((b, seq, V_HEADS, HEAD_DIM), dtype), sds((b, V_HEADS, HEAD_DIM, HEAD_DIM)))
        for name, rule in IMPLS.items():
            def forward(q, k, v, g, beta, resets, state, rule=rule):
                return rule(q, k, v, g, beta, resets, state)

            def vjp(q, k, v, g, beta, resets, state, do, dsf, rule=rule):
                out, pullback = jax.vjp(lambda *a: rule(*a[:5], resets, a[5]), q, k, v, g, beta, state)
                return out, pullback((do, dsf))

            def residuals(q, k, v, g, beta, resets, state, rule=rule):
                return jax.vjp(lambda *a: rule(*a[:5], resets, a[5]), q, k, v, g, beta, state)[1]

            with jax.set_mesh(mesh):
                saved = _nbytes(jax.eval_shape(residuals, *args))
                for part, f, extra in (("forward", forward, ()), ("vjp", vjp, cotangents)):
                    row = {"topology": topology, "device": device.device_kind, "seq": seq, "impl": name,
                           "part": part, "dtype": jnp.dtype(dtype).name}
                    if part == "vjp":
                        row["residual_bytes"] = saved
                    t0 = time.perf_counter()
                    try:
                        row.update(_memory(jax.jit(f).lower(*args, *extra).compile()))
                    except Exception as e:  # noqa: BLE001 - report, e.g. RESOURCE_EXHAUSTED
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    row["compile_s"] = round(time.perf_counter() - t0, 1)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    """Per sequence length and part: GiB per implementation (temp; residuals for the VJP)."""
    gib = lambda n: None if n is None else round(n / 2**30, 3)  # noqa: E731
    out = {}
    for r in rows:
        entry = out.setdefault(f"seq{r['seq']}", {}).setdefault(r["part"], {})
        entry[r["impl"]] = ({"temp_gib": gib(r.get("temp_bytes")), "residual_gib": gib(r.get("residual_bytes"))}
                            if "error" not in r else {"error": r["error"]})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--seqs", default="4096,32768")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a = p.parse_args()
    rows = report(a.topology, [int(x) for x in a.seqs.split(",")], jnp.dtype(a.dtype))
    print(json.dumps({"shape": {"batch": 1, "k_heads": K_HEADS, "v_heads": V_HEADS, "head_dim": HEAD_DIM,
                                "chunk": CHUNK}, "summary": summary(rows)}, indent=1))


if __name__ == "__main__":
    main()
