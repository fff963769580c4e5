"""CPU training-step time of a small MoE with E experts, top-k, against the dense model with the
same activated parameters (d_ff = k x expert width), for E in 16, 64, 128.

    python bench/moe_step_time.py [--experts 16,64,128] [--top-k 2] [--expert-width 128]
                                  [--capacity-factor 1.25 | --dropless]

Prints JSON: per model the median time of the trainer's step (AdamW, guard, aux losses) and of
forward + backward alone (models interleaved round by round), total and activated parameters,
and each MoE's times relative to the dense model. Forward + backward should track activated
parameters; the full step also pays AdamW over every expert's weights, which tracks total ones. Cost should track activated parameters (the ratio stays near a constant as
E grows 8x), not total parameters (which grow ~8x); what grows with E is the router, the expert
weights' optimizer update (AdamW touches every expert every step) and the grouped matmul's
per-expert overhead. The default is the capacity path (an [E, C, D] buffer, C = 1.25 N k / E);
`--dropless` measures `jax.lax.ragged_dot`, whose CPU lowering computes every expert for every row
(measured: 4x, 16x and 32x the dense step for E = 16, 64, 128), unlike its TPU grouped matmul.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gattn.cli import ensure_malloc_tunables, keep_jax_off_absent_tpu  # noqa: E402

keep_jax_off_absent_tpu()  # no libtpu start-up errors on a CPU host (libtpu is only a compiler here)
ensure_malloc_tunables()

import time  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from gattn.config import Config, ModelConfig, MoESpec, TrainConfig  # noqa: E402
from gattn.train.loss import aux_loss, lm_loss_and_aux  # noqa: E402
from gattn.model.transformer import Transformer  # noqa: E402
from gattn.model.params import activated_params, count_params  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import make_step  # noqa: E402


def make_grad(cfg: ModelConfig, batch: int, seq: int):
    """Forward + backward alone (no optimizer), warmed up; returns a callable timing one call."""
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab_size)

    @jax.jit
    def grad(p):
        def loss(p):
            ce, aux = lm_loss_and_aux(nnx.merge(graphdef, p), tokens)
            return ce + aux_loss(cfg.moe, aux)
        return jax.grad(loss)(p)

    def timed() -> float:
        t = time.perf_counter()
        jax.block_until_ready(grad(params))
        return time.perf_counter() - t

    timed()
    return timed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", default="16,64,128")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-width", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--dropless", action="store_true")
    args = ap.parse_args(argv)
    base = ModelConfig(vocab_size=4096, d_model=256, num_layers=4, q_heads=4, kv_heads=2, head_dim=64,
                       d_ff=args.top_k * args.expert_width)
    train = TrainConfig(batch_size=8, seq_len=256)
    models = {"dense": base}
    for e in (int(x) for x in args.experts.split(",")):
        models[f"moe_e{e}"] = dataclasses.replace(
            base, moe=MoESpec(num_experts=e, top_k=args.top_k, expert_width=args.expert_width,
                              capacity_factor=None if args.dropless else args.capacity_factor))
    timers = {n: make_step(Config(model=m, train=train), train.batch_size, train.seq_len)
              for n, m in models.items()}
    grads = {n: make_grad(m, train.batch_size, train.seq_len) for n, m in models.items()}
    times, gtimes = {n: [] for n in models}, {n: [] for n in models}
    for _ in range(args.rounds):  # interleaved, so host-speed drifts hit every model alike
        for n in models:
            times[n] += [timers[n]() for _ in range(args.steps)]
            gtimes[n] += [grads[n]() for _ in range(args.steps)]
    median = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    gmedian = {n: sorted(t)[len(t) // 2] for n, t in gtimes.items()}
    out = {n: {"step_s": round(median[n], 4), "time_vs_dense": round(median[n] / median["dense"], 3),
               "fwd_bwd_s": round(gmedian[n], 4),
               "fwd_bwd_vs_dense": round(gmedian[n] / gmedian["dense"], 3),
               "params": count_params(m), "activated_params": activated_params(m),
               "total_vs_dense": round(count_params(m) / count_params(base), 2),
               "activated_vs_dense": round(activated_params(m) / activated_params(base), 3)}
           for n, m in models.items()}
    print(json.dumps({"top_k": args.top_k, "expert_width": args.expert_width,
                      "capacity_factor": None if args.dropless else args.capacity_factor,
                      "batch": train.batch_size, "seq": train.seq_len, "models": out}, indent=1))


if __name__ == "__main__":
    main()
