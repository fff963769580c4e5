"""CPU forward + backward time of a small MoE with its experts split over simulated devices:
dropless expert parallelism (exec.moe_impl=ragged) against the capacity all-to-all
(exec.moe_impl=all_to_all, capacity 1.25), for E in 16, 64, 128.

    python bench/moe_ep_step_time.py [--experts 16,64,128] [--mesh 1,8,1] [--devices 8]
                                     [--moe-buffer 1.25]

Prints JSON: per E and path the median time of one jitted forward + backward (loss with the aux
losses, gradients of every parameter) on the mesh, the dropped rows (0 for dropless), and
ragged / capacity. What this measures on CPU is not what a TPU pays: XLA:CPU has no
ragged-all-to-all, so the dropless path runs gattn.model.dropless_ep's emulation (an all_gather
of every shard's rows, n x the traffic), and XLA's CPU ragged_dot computes every local expert for
every received row (cost grows with E / n), where TPU's grouped matmul does not. The TPU cost is
in bench/aot_train_step.py (docs/moe-and-mesh.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", default="16,64,128")
    ap.add_argument("--mesh", default="1,8,1", help="data,expert,model")
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    ap.add_argument("--moe-buffer", type=float, default=None, help="exec.moe_buffer of the ragged path")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-width", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                               f"--xla_force_host_platform_device_count={args.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax  # noqa: PLC0415  (after XLA_FLAGS: the simulated devices)
    from flax import nnx  # noqa: PLC0415

    from gattn.config import Config, ExecConfig, MeshConfig, ModelConfig, MoESpec  # noqa: PLC0415
    from gattn.model import sharding  # noqa: PLC0415
    from gattn.model.transformer import Transformer  # noqa: PLC0415
    from gattn.train.loss import aux_loss, lm_loss_and_aux  # noqa: PLC0415

    mesh_cfg = MeshConfig(*(int(x) for x in args.mesh.split(",")))
    mesh = sharding.make_mesh(mesh_cfg)
    base = ModelConfig(vocab_size=4096, d_model=256, num_layers=2, q_heads=4, kv_heads=2, head_dim=64,
                       d_ff=args.top_k * args.expert_width)
    batch, seq = 8, 256
    tokens = jax.device_put(jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, base.vocab_size),
                            sharding.batch_sharding(mesh))

    def timer(cfg: ModelConfig, ex: ExecConfig):
        Config(model=cfg, mesh=mesh_cfg, exec=ex)  # a valid run config
        graphdef, params = nnx.split(Transformer(cfg, ex, rngs=nnx.Rngs(0)), nnx.Param)
        params = jax.device_put(params, sharding.param_shardings(params, mesh))

        @jax.jit
        def grad(p):
            def loss(p):
                ce, aux = lm_loss_and_aux(nnx.merge(graphdef, p), tokens)
                return ce + aux_loss(cfg.moe, aux), aux["dropped"]
            return jax.grad(loss, has_aux=True)(p)

        def timed():
            t = time.perf_counter()
            with jax.set_mesh(mesh):
                _, dropped = jax.block_until_ready(grad(params))
            return time.perf_counter() - t, int(dropped.sum())

        timed()
        return timed

    runs = {}
    for e in (int(x) for x in args.experts.split(",")):
        spec = MoESpec(num_experts=e, top_k=args.top_k, expert_width=args.expert_width)
        runs[(e, "capacity")] = timer(dataclasses.replace(base, moe=dataclasses.replace(spec, capacity_factor=1.25)),
                                      ExecConfig(moe_impl="all_to_all"))
        runs[(e, "ragged")] = timer(dataclasses.replace(base, moe=spec),
                                    ExecConfig(moe_impl="ragged", moe_buffer=args.moe_buffer))
    times, dropped = {k: [] for k in runs}, {}
    for _ in range(args.rounds):  # interleaved, so host-speed drifts hit every path alike
        for k, run in runs.items():
            t, dropped[k] = run()
            times[k].append(t)
    median = {k: sorted(t)[len(t) // 2] for k, t in times.items()}
    out = {}
    for e in sorted({e for e, _ in runs}):
        out[f"e{e}"] = {"capacity_s": round(median[(e, "capacity")], 4), "ragged_s": round(median[(e, "ragged")], 4),
                        "ragged_vs_capacity": round(median[(e, "ragged")] / median[(e, "capacity")], 2),
                        "capacity_dropped": dropped[(e, "capacity")], "ragged_dropped": dropped[(e, "ragged")]}
    print(json.dumps({"mesh": dataclasses.asdict(mesh_cfg), "batch": batch, "seq": seq, "top_k": args.top_k,
                      "expert_width": args.expert_width, "moe_buffer": args.moe_buffer, "models": out}, indent=1))


if __name__ == "__main__":
    main()
