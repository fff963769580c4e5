"""The GPU check (docs/gpu.md): one script, three parts, one JSON.

    python bench/gpu_check.py --out OUTDIR [--dry-run] [--part all|kernels|steps|torch]

kernels  forward+backward of causal GQA attention with an elementwise gate, bf16, at S = 2k, 8k,
         32k (batch 32k / S; GPU_CHECK_SEQS=8192,32768 picks lengths): the fused Pallas GPU
         kernel, the same kernel without a gate, cuDNN plus a separate gate, cuDNN alone, and (at
         the first length only) the XLA path, with the fused kernel's error against it.
steps    the trainer's step (AdamW, the non-finite guard; synthetic tokens) in bf16: tokens/s and
         MFU for tiny, small and gpu_125m, baseline and sdpa_elementwise, attention `auto`; then,
         at gpu_125m, `cudnn` and `xla`. MFU = (6 N + 12 L Hq K S) flops per token (PaLM's count,
         N the non-embedding parameters with the LM head) over the bf16 dense peak (989 TFLOP/s
         for an H100/H200 SXM), and over a measured 8192^3 bf16 matmul.
torch    the PyTorch peer at gpu_125m's shapes: transformers Qwen3 (baseline) and Qwen3-Next with
         every layer full (gated) attention and dense MLPs (gated), SDPA, bf16 autocast over
         float32 parameters, AdamW (fused on CUDA), random init, eager.

`all` runs each part in its own process (JAX and PyTorch never share the GPU's memory) with a
time cap, so the whole check stays under 8 minutes; each part writes its JSON after every
measurement, so a part that runs out of time still reports what it measured. --dry-run runs the
same code on CPU with tiny shapes (the Pallas kernel in interpret mode) in well under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BF16_PEAK_FLOPS = 989e12  # dense bf16 tensor-core peak, H100/H200 SXM spec sheet
BUDGET_S = {"kernels": 150, "steps": 210, "torch": 90}  # all: ~7.5 min with start-ups
SEQS = (2048, 8192, 32768)  # the kernels' lengths; GPU_CHECK_SEQS=8192,32768 picks some
DRY_BUDGET_S = {"kernels": 60, "steps": 60, "torch": 60}
CONFIGS = ("tiny", "small", "gpu_125m")
VARIANTS = ("baseline", "sdpa_elementwise")
# gpu_125m's shapes at a size that runs in seconds on CPU: the same code path, not the same numbers
DRY_OVERRIDES = ["model.num_layers=1", "model.d_model=64", "model.d_ff=128", "model.vocab_size=256",
                 "train.batch_size=2", "train.seq_len=32"]


class Report:
    """The part's JSON, rewritten after every measurement."""

    def __init__(self, path: Path, part: str):
        self.path, self.data = path, {"part": part}

    def set(self, keys: tuple, value) -> None:
        node = self.data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
        self.path.write_text(json.dumps(self.data, indent=1))


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}


def _timed(fn, args, reps: int, budget_s: float, sync) -> dict:
    """Median seconds of `fn(*args)` after a compile/warm-up call, up to `reps` runs or `budget_s`."""
    t0 = time.perf_counter()
    sync(fn(*args))
    first = time.perf_counter() - t0
    sync(fn(*args))
    times, end = [], time.perf_counter() + budget_s
    while len(times) < reps and (len(times) < 2 or time.perf_counter() < end):
        t = time.perf_counter()
        sync(fn(*args))
        times.append(time.perf_counter() - t)
    return {"s": sorted(times)[len(times) // 2], "runs": len(times), "first_call_s": round(first, 2)}


def _jax_env() -> dict:
    import jax  # noqa: PLC0415

    return {"jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d.device_kind) for d in jax.devices()]}


# ---------------------------------------------------------------- kernels

def part_kernels(rep: Report, dry: bool, deadline: float) -> None:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from gattn import kernels  # noqa: PLC0415

    rep.set(("env",), _jax_env())
    hq, hk, d = (4, 2, 16) if dry else (12, 4, 64)  # gpu_125m's heads
    seqs, tokens = ((32,), 64) if dry else (SEQS, 32768)
    seqs = tuple(int(x) for x in os.environ.get("GPU_CHECK_SEQS", ",".join(map(str, seqs))).split(","))
    dtype = jnp.bfloat16
    blocks = kernels.GpuBlockSizes(16, 16, 16, 16) if dry else kernels.GpuBlockSizes()
    paths = {
        "pallas_gpu_fused": lambda q, k, v, g: kernels.gated_flash_attention_gpu(q, k, v, g, block_sizes=blocks),
        "pallas_gpu_ungated": lambda q, k, v, g: kernels.gated_flash_attention_gpu(q, k, v, None, block_sizes=blocks),
        "cudnn_plus_gate": lambda q, k, v, g: kernels.attention_cudnn(q, k, v, g),
        "cudnn_ungated": lambda q, k, v, g: kernels.attention_cudnn(q, k, v, None),
        "xla_plus_gate": lambda q, k, v, g: kernels.attention_xla(q, k, v, g),
    }
    rep.set(("shapes",), {"q_heads": hq, "kv_heads": hk, "head_dim": d, "dtype": "bfloat16",
                          "causal": True, "gate": "elementwise", "batch": f"{tokens} // S",
                          "blocks": vars(blocks) if hasattr(blocks, "__dict__") else str(blocks)})
    for s in seqs:
        b = max(1, tokens // s)
        ks = jax.random.split(jax.random.key(s), 5)
        q = jax.random.normal(ks[0], (b, s, hq, d), dtype)
        k, v = (jax.random.normal(kk, (b, s, hk, d), dtype) for kk in ks[1:3])
        g, dy = (jax.random.normal(kk, (b, s, hq, d), dtype) for kk in ks[3:5])
        flops = 3.5 * 4 * b * s * s * hq * d / 2  # causal fwd (2 matmuls) + bwd (2.5x fwd)
        grads = {}
        for name, fn in paths.items():
            if name == "xla_plus_gate" and s != seqs[0]:
                # the reference for the error check, timed at the first length only: at 8k its compile
                # and runs took the rest of the part's cap on an H200 and 32k was never reached
                continue
            if time.monotonic() > deadline:
                rep.set(("kernels", str(s), name), {"skipped": "time budget"})
                continue

            def step(q, k, v, g, fn=fn):
                y, vjp = jax.vjp(fn, q, k, v, g)
                return y, vjp(dy)

            try:
                f = jax.jit(step)
                r = _timed(f, (q, k, v, g), reps=3 if dry else 20, budget_s=1.0 if dry else 5.0,
                           sync=jax.block_until_ready)
                rep.set(("kernels", str(s), name), {"ms": round(r["s"] * 1e3, 3), "runs": r["runs"],
                                                    "tflops": round(flops / r["s"] / 1e12, 1)})
                if s == seqs[0] and name in ("pallas_gpu_fused", "xla_plus_gate"):
                    grads[name] = f(q, k, v, g)
            except Exception as e:  # noqa: BLE001 - a path that fails is reported, the others still run
                rep.set(("kernels", str(s), name), _error(e))
            for name_a, name_b, key in (("pallas_gpu_fused", "pallas_gpu_ungated", "fused_over_ungated"),
                                        ("pallas_gpu_fused", "cudnn_plus_gate", "fused_over_cudnn_plus_gate")):
                a, bb = rep.data["kernels"][str(s)].get(name_a, {}), rep.data["kernels"][str(s)].get(name_b, {})
                if "ms" in a and "ms" in bb:  # after every path: a part cut short still reports its ratios
                    rep.set(("kernels", str(s), key), round(a["ms"] / bb["ms"], 3))
        if len(grads) == 2:  # the fused kernel against the XLA path on the same bf16 inputs
            (y, dx), (y_ref, dx_ref) = grads["pallas_gpu_fused"], grads["xla_plus_gate"]
            err = lambda a, r: float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32)))  # noqa: E731
                                     / (jnp.max(jnp.abs(r.astype(jnp.float32))) + 1e-9))
            rep.set(("kernels", str(s), "fused_vs_xla_rel_err"),
                    {"y": err(y, y_ref), **{f"d{n}": err(a, r) for n, a, r in zip("qkvg", dx, dx_ref)}})


# ---------------------------------------------------------------- trainer steps

def step_flops_per_token(model_cfg, seq: int) -> float:
    from gattn.model.params import count_params  # noqa: PLC0415

    n = count_params(model_cfg) - model_cfg.vocab_size * model_cfg.d_model  # the embedding is a lookup
    return 6 * n + 12 * model_cfg.num_layers * model_cfg.q_heads * model_cfg.head_dim * seq


def matmul_tflops(dry: bool) -> float:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    n = 256 if dry else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    r = _timed(jax.jit(lambda x: x @ x), (a,), reps=10, budget_s=2.0, sync=jax.block_until_ready)
    return 2 * n**3 / r["s"] / 1e12


def part_steps(rep: Report, dry: bool, deadline: float) -> None:
    import jax  # noqa: PLC0415

    from gattn import cli, kernels  # noqa: PLC0415
    from gattn.data import synthetic  # noqa: PLC0415
    from gattn.train import trainer  # noqa: PLC0415

    rep.set(("env",), _jax_env())
    peak = matmul_tflops(dry)
    rep.set(("matmul_bf16_tflops",), round(peak, 1))
    runs = [(c, v, "auto") for c in CONFIGS for v in VARIANTS]
    runs += [("gpu_125m", v, impl) for impl in ("cudnn", "xla") for v in VARIANTS]
    if dry:  # one shrunken config, the fused gate through the GPU kernel (interpret mode)
        runs = [("gpu_125m", "sdpa_elementwise", "pallas_gpu")]
    for config, variant, impl in runs:
        key = f"{config}/{variant}/{impl}"
        if time.monotonic() > deadline:
            rep.set(("steps", key), {"skipped": "time budget"})
            continue
        try:
            overrides = ["exec.dtype=bfloat16", f"exec.attention_impl={impl}", "data.source=synthetic"]
            cfg = cli.load(config, overrides + (DRY_OVERRIDES if dry else []), variant=variant)
            t = cfg.train
            graphdef, state = trainer.init_state(cfg)
            step = trainer.make_train_step(cfg, graphdef)
            batch = {k: jax.numpy.asarray(v) for k, v in next(synthetic.train_iterator(cfg)).items()}
            box = [state]

            def run(batch):
                box[0], m = step(box[0], batch)
                return m["loss"]

            r = _timed(run, (batch,), reps=5 if dry else 20, budget_s=1.0 if dry else 8.0,
                       sync=jax.block_until_ready)
            tok_s = t.batch_size * t.seq_len / r["s"]
            flops = step_flops_per_token(cfg.model, t.seq_len) * tok_s
            rep.set(("steps", key), {
                "attention": kernels.resolve(impl),
                "batch": t.batch_size, "seq": t.seq_len, "step_ms": round(r["s"] * 1e3, 2),
                "runs": r["runs"], "compile_and_first_step_s": r["first_call_s"],
                "tokens_per_s": round(tok_s), "mfu": round(flops / BF16_PEAK_FLOPS, 4),
                "of_measured_matmul": round(flops / (peak * 1e12), 4)})
            state = box[0] = None  # free the device memory before the next config
        except Exception as e:  # noqa: BLE001
            rep.set(("steps", key), _error(e))


# ---------------------------------------------------------------- the PyTorch peer

def part_torch(rep: Report, dry: bool, deadline: float) -> None:
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: PLC0415

    from gattn import cli  # noqa: PLC0415

    cfg = cli.load("gpu_125m", DRY_OVERRIDES if dry else [])
    m, t = cfg.model, cfg.train
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rep.set(("env",), {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
                       "gpu": torch.cuda.get_device_name() if device == "cuda" else None})
    common = dict(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
                  num_hidden_layers=m.num_layers, num_attention_heads=m.q_heads,
                  num_key_value_heads=m.kv_heads, head_dim=m.head_dim, tie_word_embeddings=False,
                  max_position_embeddings=t.seq_len + 1, attn_implementation="sdpa")
    peers = {
        "qwen3 (baseline)": lambda: Qwen3ForCausalLM(Qwen3Config(**common)),
        "qwen3_next, all layers gated full attention, dense MLP (sdpa_elementwise)": lambda: Qwen3NextForCausalLM(
            Qwen3NextConfig(**common, layer_types=["full_attention"] * m.num_layers,
                            mlp_only_layers=list(range(m.num_layers)),
                            rope_parameters={"rope_type": "default", "rope_theta": m.rope_base,
                                             "partial_rotary_factor": 1.0})),
    }
    sync = (lambda _: torch.cuda.synchronize()) if device == "cuda" else (lambda _: None)
    for name, build in peers.items():
        if time.monotonic() > deadline:
            rep.set(("torch", name), {"skipped": "time budget"})
            continue
        try:
            torch.manual_seed(0)
            model = build().to(device)
            params = sum(p.numel() for p in model.parameters())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
            x = torch.randint(0, m.vocab_size, (t.batch_size, t.seq_len), device=device)

            def step(x):
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss

            r = _timed(step, (x,), reps=3 if dry else 20, budget_s=1.0 if dry else 10.0, sync=sync)
            rep.set(("torch", name), {"params": params, "batch": t.batch_size, "seq": t.seq_len,
                                      "step_ms": round(r["s"] * 1e3, 2), "runs": r["runs"],
                                      "tokens_per_s": round(t.batch_size * t.seq_len / r["s"])})
            model = opt = None
            if device == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            rep.set(("torch", name), _error(e))


PARTS = {"kernels": part_kernels, "steps": part_steps, "torch": part_torch}


def run_all(out: Path, dry: bool, skip: set = frozenset()) -> dict:
    """Each part in its own process under its time cap; the parts' JSON merged, with the targets."""
    budgets = DRY_BUDGET_S if dry else BUDGET_S
    merged = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "dry_run": dry}
    for part, budget in budgets.items():
        if part in skip:
            continue
        path = out / f"{part}.json"
        path.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--part", part, "--out", str(out), "--budget", str(budget - 20)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd + (["--dry-run"] if dry else []), timeout=budget, capture_output=True, text=True)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"
        except subprocess.TimeoutExpired:
            status = f"killed after {budget} s"
        merged[part] = json.loads(path.read_text()) if path.is_file() else {}
        merged[part]["status"], merged[part]["wall_s"] = status, round(time.perf_counter() - t0, 1)
    merged["targets"] = targets(merged)
    if dry:
        merged["targets"]["note"] = "dry run: CPU and shrunken shapes; these ratios test the script, not gattn"
    return merged


def targets(r: dict) -> dict:
    """The issue's targets, read off the measurements (None where a number is missing)."""
    steps, peer, kern = r.get("steps", {}).get("steps", {}), r.get("torch", {}).get("torch", {}), r.get("kernels", {}).get("kernels", {})
    get = lambda d, *ks: next((d[k] for k in ks if isinstance(d.get(k), (int, float))), None)  # noqa: E731
    base, gated = steps.get("gpu_125m/baseline/auto", {}), steps.get("gpu_125m/sdpa_elementwise/auto", {})
    peer_base = next((v for k, v in peer.items() if k.startswith("qwen3 ")), {})
    peer_gated = next((v for k, v in peer.items() if k.startswith("qwen3_next")), {})
    ratio = lambda a, b: round(a / b, 3) if a and b else None  # noqa: E731
    k8 = kern.get("8192", {})
    return {
        "baseline_vs_torch_tokens_per_s (>= 1.5)": ratio(get(base, "tokens_per_s"), get(peer_base, "tokens_per_s")),
        "gated_vs_torch_tokens_per_s (>= 1.5)": ratio(get(gated, "tokens_per_s"), get(peer_gated, "tokens_per_s")),
        "mfu_125m_baseline (>= 0.40)": get(base, "mfu"), "mfu_125m_gated (>= 0.40)": get(gated, "mfu"),
        "fused_over_ungated_8k (<= 1.05)": k8.get("fused_over_ungated"),
        "fused_over_cudnn_plus_gate_8k (< 1)": k8.get("fused_over_cudnn_plus_gate"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_check.json (and each part's JSON)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the same code, in seconds")
    ap.add_argument("--part", default="all", choices=["all", *PARTS])
    ap.add_argument("--budget", type=float, default=None, help="seconds for one part (set by --part all)")
    ap.add_argument("--skip", default="", help="comma-separated parts that --part all leaves out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.part != "all":
        from gattn.cli import keep_jax_off_absent_tpu  # noqa: PLC0415

        keep_jax_off_absent_tpu()
        budget = args.budget or (DRY_BUDGET_S if args.dry_run else BUDGET_S)[args.part]
        PARTS[args.part](Report(out / f"{args.part}.json", args.part), args.dry_run, time.monotonic() + budget)
        return 0
    merged = run_all(out, args.dry_run, skip=set(filter(None, args.skip.split(","))))
    text = json.dumps(merged, indent=1)
    (out / "gpu_check.json").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
