"""Fused gated flash attention vs kernel + separate gate vs the XLA reference, compiled for TPU.

Everything is compiled ahead of time with libtpu on this CPU machine (no TPU needed) for one chip
of a TPU topology, at batch 1, q_heads 32, kv_heads 4, head_dim 128, bfloat16, causal, with the
elementwise sigmoid gate on the SDPA output; q, k, v, gate and the output are [B, S, heads *
head_dim] as the model's projections produce and consume them. For each sequence length and each of

    fused    gated_flash_attention(q, k, v, gate): the gate in the kernel's epilogue
    unfused  gated_flash_attention(q, k, v) * sigmoid(gate): the same kernel, gate outside
    xla      attention_xla(q, k, v, gate): the plain-jnp path (full [S, S] scores)

it prints XLA's `cost_analysis` (bytes accessed, flops) and `memory_analysis` (temp bytes) of
the forward and of forward + backward (the VJP for a given output cotangent, w.r.t. q, k, v and
gate), as JSON. XLA counts a Mosaic kernel's
operands and results once: the K/V blocks a kernel re-reads from HBM are not in "bytes accessed",
so compare fused with unfused (same kernel) for the saving, and look at temp memory for the
scaling. Configurations that do not fit the chip's HBM are reported with the compiler's error.

On CPU the script also checks the kernel (interpret mode) against the reference on a small case
and times the xla path's forward+backward, the CPU baseline (`--cpu-only` runs only this part).

    python bench/flash_attention.py [--topology v5e:2x2] [--seqs 4096,8192,32768] [--cpu-only]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu is only a compiler here
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gattn.kernels import attention_xla, gated_flash_attention

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128


def _impls(interpret):
    return {
        "fused": lambda q, k, v, g: gated_flash_attention(q, k, v, g, interpret=interpret),
        "unfused": lambda q, k, v, g: (gated_flash_attention(q, k, v, interpret=interpret)
                                       * jax.nn.sigmoid(g.astype(jnp.float32))).astype(q.dtype),
        "xla": lambda q, k, v, g: attention_xla(q, k, v, g, block_q=0),
    }


_ITEMSIZE = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8}
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z\-]+)\((.*)$")
_FREE = {"parameter", "bitcast", "get-tuple-element", "tuple", "constant", "after-all"}


def _nbytes(shape_text):
    return sum(_ITEMSIZE.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
               for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape_text))


def hbm_breakdown(hlo_text):
    """HBM bytes per top-level op of a compiled TPU module: a Pallas kernel counts its own cost
    estimate (what its grid fetches, see gattn/kernels/flash.py); an XLA op counts its operands and
    result; copies that memory-space assignment adds to stage buffers on chip are listed apart."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    shapes, out = {}, {"kernels": {}, "xla_ops": 0, "msa_copies": 0}
    for line in entry.splitlines()[1:]:
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = _nbytes(shape)
        if op in _FREE:
            continue
        if op in ("copy-start", "copy-done"):
            out["msa_copies"] += shapes[name] if op == "copy-done" else 0  # bytes staged
        elif op == "custom-call":
            est = re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', rest)
            kernel = name.rsplit(".", 1)[0]
            out["kernels"][kernel] = out["kernels"].get(kernel, 0) + (int(est.group(1)) if est else 0)
        else:
            operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0])
            out["xla_ops"] += shapes[name] + sum(shapes.get(o, 0) for o in operands)
    out["total"] = sum(out["kernels"].values()) + out["xla_ops"]
    return out


def _analyse(compiled):
    cost = compiled.cost_analysis() or {}
    mem = compiled.memory_analysis()
    return {"bytes_accessed": cost.get("bytes accessed"), "flops": cost.get("flops"),
            "hbm": hbm_breakdown(compiled.as_text()),
            "temp_bytes": mem.temp_size_in_bytes if mem else None,
            "argument_bytes": mem.argument_size_in_bytes if mem else None,
            "output_bytes": mem.output_size_in_bytes if mem else None}


def tpu_report(topology: str, seqs: list[int]) -> list[dict]:
    from jax.experimental import topologies
    device = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]
    mesh = Mesh(np.asarray([device]), ("model",))  # one chip: all 32 heads
    spec = P(None, None, "model")
    rows = []
    for seq in seqs:
        # Inputs as the projections produce them, [B, S, heads * head_dim]; output likewise.
        sds = lambda h: jax.ShapeDtypeStruct((1, seq, h * HEAD_DIM), jnp.bfloat16,
                                             sharding=NamedSharding(mesh, spec))
        args = (sds(Q_HEADS), sds(KV_HEADS), sds(KV_HEADS), sds(Q_HEADS))
        for name, fn in _impls(interpret=False).items():
            def flat(q, k, v, g, fn=fn):
                heads = lambda x: x.reshape(x.shape[:2] + (-1, HEAD_DIM))
                y = fn(heads(q), heads(k), heads(v), heads(g))
                return y.reshape(y.shape[:2] + (-1,))
            on_mesh = jax.shard_map(flat, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
            # Forward + backward as in a training step: the output y goes on to the layer above,
            # which hands back its cotangent dy.
            def vjp(q, k, v, g, dy, f=on_mesh):
                y, pullback = jax.vjp(f, q, k, v, g)
                return y, pullback(dy)
            for part, f, extra in (("forward", on_mesh, ()), ("gradient", vjp, (args[0],))):
                row = {"topology": topology, "device": device.device_kind, "seq": seq, "impl": name,
                       "part": part}
                t0 = time.perf_counter()
                try:
                    row.update(_analyse(jax.jit(f).lower(*args, *extra).compile()))
                except Exception as e:  # noqa: BLE001 - report, e.g. RESOURCE_EXHAUSTED
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                row["compile_s"] = round(time.perf_counter() - t0, 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def summary(rows: list[dict], seqs: list[int]) -> dict:
    """Per sequence length: HBM bytes (kernel estimates + XLA ops) fused vs unfused and the
    saving, next to one round trip of the ungated output (what fusion should save); temp memory
    per implementation, or the compiler's out-of-memory message."""
    get = lambda seq, impl, part: next(r for r in rows if (r["seq"], r["impl"], r["part"]) == (seq, impl, part))
    out = {}
    for seq in seqs:
        o_bytes = seq * Q_HEADS * HEAD_DIM * 2  # batch 1, bf16
        entry = {"ungated_output_round_trip_bytes": 2 * o_bytes}
        for part in ("forward", "gradient"):
            fused, unfused = get(seq, "fused", part), get(seq, "unfused", part)
            if "hbm" in fused and "hbm" in unfused:
                f, u = fused["hbm"]["total"], unfused["hbm"]["total"]
                entry[part] = {"hbm_bytes_fused": f, "hbm_bytes_unfused": u, "saved_bytes": u - f,
                               "fused_over_unfused": round(f / u, 4)}
            entry[part]["temp_bytes"] = {
                impl: get(seq, impl, part).get("temp_bytes", get(seq, impl, part).get("error"))
                for impl in ("fused", "unfused", "xla")}
        out[f"seq{seq}"] = entry
    return out


def cpu_report() -> dict:
    rng = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    q, k, v, g = arr(1, 40, 4, 16), arr(1, 40, 2, 16), arr(1, 40, 2, 16), arr(1, 40, 4, 16)
    err = float(jnp.abs(gated_flash_attention(q, k, v, g, interpret=True) - attention_xla(q, k, v, g)).max())

    b, s = 4, 512  # the CPU baseline: the xla path's forward + backward at a model-like size
    q, k, v, g = arr(b, s, 8, 64), arr(b, s, 4, 64), arr(b, s, 4, 64), arr(b, s, 8, 64)
    step = jax.jit(jax.grad(lambda *a: jnp.sum(attention_xla(*a)), argnums=(0, 1, 2, 3)))
    jax.block_until_ready(step(q, k, v, g))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(step(q, k, v, g))
        times.append(time.perf_counter() - t0)
    return {"interpret_max_abs_err_vs_xla": err,
            "cpu_xla_fwd_bwd_ms": {"shape": [b, s, 8, 4, 64], "median": round(1e3 * float(np.median(times)), 2)}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", default="v5e:2x2")
    p.add_argument("--seqs", default="4096,8192,32768")
    p.add_argument("--cpu-only", action="store_true")
    a = p.parse_args()
    result = {"cpu": cpu_report()}
    if not a.cpu_only:
        seqs = [int(x) for x in a.seqs.split(",")]
        rows = tpu_report(a.topology, seqs)
        result["tpu_summary"] = summary(rows, seqs)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
