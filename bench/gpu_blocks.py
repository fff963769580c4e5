"""The fused GPU kernel's block sizes, timed (docs/gpu.md): forward alone and forward + backward.

    python bench/gpu_blocks.py --out OUTDIR [--seq 8192] [--budget 150] [--dry-run]

gpu_check.py times the kernel at its default blocks (64 x 64, 4 warps, 2 stages). This times a few
other `GpuBlockSizes` at gpu_125m's heads (12 query / 4 kv of 64, causal, elementwise gate, bf16,
batch 32k / S) beside cuDNN + the separate gate, writing OUTDIR/gpu_blocks.json after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (block_q, block_k, block_q_bwd, block_k_bwd, num_warps, num_stages)
CANDIDATES = [(64, 64, 64, 64, 4, 2), (128, 64, 64, 64, 4, 2), (128, 64, 64, 64, 8, 3), (128, 128, 64, 64, 8, 2),
              (64, 64, 128, 64, 8, 2), (64, 64, 64, 128, 8, 2), (128, 64, 128, 128, 8, 2), (64, 64, 32, 64, 4, 3)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpret mode, tiny shapes")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from bench.gpu_check import _timed  # noqa: PLC0415
    from gattn import kernels  # noqa: PLC0415

    deadline = time.monotonic() + args.budget
    hq, hk, d = (4, 2, 16) if args.dry_run else (12, 4, 64)
    s = 32 if args.dry_run else args.seq
    b = max(1, (64 if args.dry_run else 32768) // s)
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (b, s, hq, d), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (b, s, hk, d), jnp.bfloat16) for kk in ks[1:3])
    g, dy = (jax.random.normal(kk, (b, s, hq, d), jnp.bfloat16) for kk in ks[3:5])
    flops_fwd = 4 * b * s * s * hq * d / 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"seq": s, "batch": b, "heads": [hq, hk, d], "rows": {}}

    def time_one(name, fn):
        fwd = jax.jit(fn)
        both = jax.jit(lambda q, k, v, g: (lambda y, vjp: (y, vjp(dy)))(*jax.vjp(fn, q, k, v, g)))
        row = {}
        for label, f, flops in (("fwd", fwd, flops_fwd), ("fwd_bwd", both, 3.5 * flops_fwd)):
            try:
                r = _timed(f, (q, k, v, g), reps=3 if args.dry_run else 20, budget_s=1.0 if args.dry_run else 3.0,
                           sync=jax.block_until_ready)
                row[label] = {"ms": round(r["s"] * 1e3, 3), "tflops": round(flops / r["s"] / 1e12, 1)}
            except Exception as e:  # noqa: BLE001 - a candidate Triton refuses is reported, the rest still run
                row[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        report["rows"][name] = row
        (out / "gpu_blocks.json").write_text(json.dumps(report, indent=1))
        print(name, json.dumps(row), flush=True)

    time_one("cudnn_plus_gate", lambda q, k, v, g: kernels.attention_cudnn(q, k, v, g))
    for c in CANDIDATES[:2] if args.dry_run else CANDIDATES:
        if time.monotonic() > deadline:
            break
        bs = kernels.GpuBlockSizes(*(min(x, 16) for x in c[:4]), c[4], c[5]) if args.dry_run else kernels.GpuBlockSizes(*c)
        time_one("pallas_gpu " + "x".join(map(str, c)),
                 lambda q, k, v, g, bs=bs: kernels.gated_flash_attention_gpu(q, k, v, g, block_sizes=bs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
