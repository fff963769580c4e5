"""CPU training-step speed of variants, as a fraction of this machine's fp32 matmul peak.

    python bench/step_time.py [--configs configs/tiny.py,configs/small.py,configs/peer.py]
                              [--variants baseline,sdpa_elementwise]

Prints JSON: per variant the median AdamW step time (variants interleaved round by round),
tokens/s, GFLOP per step (6 * N_nonemb * B * T + 12 * L * B * T^2 * Hq * K, as in
docs/performance.md) and the fraction of the 2048x2048 fp32
matmul peak measured in the same process (median over the rounds; host load moves it), plus
the step-time ratio of each variant to the first one and that variant's share of extra FLOPs,
and tokens/s relative to the PyTorch peer's ~3,600 on the peer shapes. The step is the trainer's
(AdamW, the non-finite guard, packed-batch inputs).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gattn.cli import ensure_malloc_tunables, keep_jax_off_absent_tpu  # noqa: E402

keep_jax_off_absent_tpu()  # no libtpu start-up errors on a CPU host (libtpu is only a compiler here)
ensure_malloc_tunables()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from gattn import cli  # noqa: E402
from gattn.config import ExecConfig, ModelConfig  # noqa: E402
from gattn.kernels import reference  # noqa: E402
from gattn.model.params import count_params  # noqa: E402
from gattn.model.transformer import Transformer  # noqa: E402
from gattn.train import trainer  # noqa: E402

# PyTorch 2.13 + transformers Qwen3 on the peer shapes (configs/peer.py), docs/performance.md.
PEER_TOKENS_PER_S = 3600.0


def matmul_peak_gflops(n: int = 2048, reps: int = 10) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def step_gflop(cfg, batch: int, seq: int) -> float:
    n_nonemb = count_params(cfg) - cfg.vocab_size * cfg.d_model
    attn = 12 * cfg.num_layers * batch * seq**2 * cfg.q_heads * cfg.head_dim
    return (6 * n_nonemb * batch * seq + attn) / 1e9


def matmul_floor(cfg: ModelConfig, ex: ExecConfig, batch: int, seq: int):
    """A timer for the step's matmuls alone, at the step's shapes: for every dense projection
    (each 2-D weight but the embedding table; a scanned stack counts once per layer) the forward
    x @ W and the two backward dots g @ W^T and x^T @ g, plus the attention core (the xla
    implementation, forward and backward) once per layer. No norms, RoPE, loss, optimizer: the
    time a step could not go below with these dots, measured in the same process."""
    if cfg.moe is not None:
        raise ValueError("matmul_floor: dense configs only (an MoE step's dots depend on routing)")
    _, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, ex, rngs=nnx.Rngs(0))), nnx.Param)
    n = batch * seq
    shapes = collections.Counter()
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        if leaf.ndim >= 2 and "embed" not in [getattr(k, "key", None) for k in path]:
            shapes[leaf.shape[-2:]] += math.prod(leaf.shape[:-2])
    # Distinct weights, output gradients and queries per instance, or XLA would compute shared dots once.
    keys = iter(jax.random.split(jax.random.key(0), 2 * sum(shapes.values()) + len(shapes) + 2 * cfg.num_layers))
    xs = {i: jax.random.normal(next(keys), (n, i)) for i, _ in shapes}
    ws = [jax.random.normal(next(keys), s) for s, c in shapes.items() for _ in range(c)]
    gs = [jax.random.normal(next(keys), (n, w.shape[1])) for w in ws]
    qs = [jax.random.normal(next(keys), (batch, seq, cfg.q_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    kvs = [jax.random.normal(next(keys), (batch, seq, cfg.kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    core = jax.grad(lambda q, k, v: jnp.sum(reference.attention_xla(
        q, k, v, causal=True, block_q=ex.attention_block_q)), argnums=(0, 1, 2))

    @jax.jit
    def dots(xs, ws, gs, qs, kvs):
        out = []
        for w, g in zip(ws, gs):
            x = xs[w.shape[0]]
            out += [x @ w, g @ w.T, x.T @ g]
        return out + [core(q, kv, kv) for q, kv in zip(qs, kvs)]

    def timed() -> float:
        t = time.perf_counter()
        jax.block_until_ready(dots(xs, ws, gs, qs, kvs))
        return time.perf_counter() - t

    timed()
    return timed


def make_step(cfg, batch: int, seq: int):
    """The trainer's jitted step (AdamW, NaN guard, packed-batch inputs) on a fixed batch, warmed
    up; returns a callable that times one step."""
    graphdef, state = trainer.init_state(cfg)
    step = trainer.make_train_step(cfg, graphdef)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.model.vocab_size)
    data = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens),
            "positions": jnp.broadcast_to(jnp.arange(seq + 1), tokens.shape)}
    box = [state]

    def timed() -> float:
        t = time.perf_counter()
        box[0], metrics = step(box[0], data)
        metrics["loss"].block_until_ready()
        return time.perf_counter() - t

    for _ in range(2):
        timed()
    return timed


def bench_config(path: str, names: list[str], overrides: list[str], rounds: int, steps: int,
                 floor: bool = True) -> dict:
    cfgs = {n: cli.load(path, overrides, variant=n) for n in names}
    b, t = cfgs[names[0]].train.batch_size, cfgs[names[0]].train.seq_len
    timers = {n: make_step(cfgs[n], b, t) for n in names}
    floor_timer = matmul_floor(cfgs[names[0]].model, cfgs[names[0]].exec, b, t) if floor else None
    # Interleave the variants round by round so that drifts in host speed hit them all alike.
    times, peaks, floors = {n: [] for n in names}, [], []
    for _ in range(rounds):
        peaks.append(matmul_peak_gflops(reps=3))
        if floor_timer:
            floors.append(floor_timer())
        for n in names:
            times[n] += [timers[n]() for _ in range(steps)]
    peak = sorted(peaks)[len(peaks) // 2]
    results = {}
    for n in names:
        sec = sorted(times[n])[len(times[n]) // 2]
        gflop = step_gflop(cfgs[n].model, b, t)
        results[n] = {"params": count_params(cfgs[n].model), "step_s": round(sec, 4),
                      "step_s_min": round(min(times[n]), 4), "tokens_per_s": round(b * t / sec, 1),
                      "gflop_per_step": round(gflop, 2), "achieved_gflops": round(gflop / sec, 1),
                      "fraction_of_peak": round(gflop / sec / peak, 3),
                      "fraction_of_peak_best_step": round(gflop / min(times[n]) / peak, 3)}
    first = results[names[0]]
    for r in results.values():
        r["time_vs_" + names[0]] = round(r["step_s"] / first["step_s"], 3)
        r["extra_flops_vs_" + names[0]] = round(r["gflop_per_step"] / first["gflop_per_step"] - 1, 4)
    out = {"batch": b, "seq": t, "matmul_peak_gflops": round(peak, 1),
            "matmul_peak_gflops_range": [round(min(peaks), 1), round(max(peaks), 1)],
            "results": results}
    if floors:
        sec = sorted(floors)[len(floors) // 2]
        out["matmul_floor"] = {
            "what": f"the {names[0]} step's dots alone (projections fwd+bwd, attention core)",
            "step_s": round(sec, 4), "fraction_of_peak": round(first["gflop_per_step"] / sec / peak, 3),
            "step_over_floor": round(first["step_s"] / sec, 3)}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--configs", default="configs/tiny.py,configs/small.py,configs/peer.py",
                    help="comma-separated config files")
    ap.add_argument("--variants", default="baseline,sdpa_elementwise")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of interleaved steps")
    ap.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    ap.add_argument("--no-floor", action="store_true",
                    help="skip timing the step's matmuls alone (the matmul floor)")
    args, overrides = cli.parse_args(ap, argv)
    names = args.variants.split(",")
    out = {"jax": jax.__version__, "devices": str(jax.devices()),
           "peer_tokens_per_s": PEER_TOKENS_PER_S, "configs": {}}
    for path in args.configs.split(","):
        out["configs"][path] = r = bench_config(path, names, overrides, args.rounds, args.steps,
                                                     floor=not args.no_floor)
        for v in r["results"].values():
            v["vs_peer"] = round(v["tokens_per_s"] / PEER_TOKENS_PER_S, 3)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    raise SystemExit(cli.run_cli(main))
