"""Does data preparation overlap device compute? Step time with data only, compute only, both.

    python bench/overlap.py [--config tiny] [--steps 40] [--config.FIELD=VALUE ...]

On the run's real data path (embedded corpus, its tokenizer, Grain packing, placement on the
mesh) and the trainer's real step, in one process:

- data:       `feed(next(data))` alone, per step (tokenise, pack, place);
- compute:    the jitted train step alone on one fixed batch, per step;
- sequential: the two one after the other with the step's loss read at once (the trainer's loop
              before the prefetch thread and one-step-late reads);
- trainer:    `trainer.train` itself (prefetch thread, scalars read one step late), its step time
              from metrics.jsonl's tokens/s (compilation and validation left out).

Prints JSON with the ratios `trainer / max(data, compute)` (target <= 1.15) and
`sequential / trainer` (>= 1.0: no slower than the loop it replaces). The default case makes data
a large share: a very small model (1 layer, d_model 32, vocabulary 512) over 64 x 256-token
rows, so tokenising and packing take a large part of the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gattn.cli import ensure_malloc_tunables, keep_jax_off_absent_tpu  # noqa: E402

keep_jax_off_absent_tpu()
ensure_malloc_tunables()

import jax  # noqa: E402

from gattn import cli  # noqa: E402
from gattn.model import sharding  # noqa: E402
from gattn.train import trainer  # noqa: E402

DEFAULT = ["model.vocab_size=512", "model.num_layers=1", "model.d_model=32", "model.q_heads=2", "model.kv_heads=1",
           "model.head_dim=16", "model.d_ff=64", "train.batch_size=64", "train.seq_len=256", "train.warmup_steps=2"]


def per_step(fn, steps: int) -> float:
    fn()  # compile / warm up
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--steps", type=int, default=64, help="steps per measurement (a multiple of data.shuffle_window: "
                    "every stream refills its window once per that many steps)")
    ap.add_argument("--rounds", type=int, default=3, help="each measurement is the median of this many")
    args, rest = ap.parse_known_args(argv)
    overrides = [a.removeprefix("--config.") for a in rest] if rest else DEFAULT
    steps = args.steps
    cfg = cli.load(args.config, overrides + [f"train.steps={10 * steps}", f"train.log_every={steps}",
                                             f"train.eval_every={10 * steps}",
                                             f"train.checkpoint_every={10 * steps}"])
    t = cfg.train
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp) / "run"
        tokenizer, _, _ = trainer.prepare(cfg, workdir, None)
        pipeline = trainer.data_source(cfg)
        mesh = sharding.make_mesh(cfg.mesh)
        where = sharding.batch_sharding(mesh)
        data = pipeline.train_iterator(cfg, tokenizer, workdir)

        def feed():
            return {k: jax.make_array_from_process_local_data(where, v) for k, v in next(data).items()}

        graphdef, state = trainer.init_state(cfg, mesh)
        step = trainer.make_train_step(cfg, graphdef, jax.tree.map(lambda x: x.sharding, state), mesh)
        batch = feed()
        box = {"state": state}

        def compute():
            with jax.set_mesh(mesh):
                box["state"], m = step(box["state"], batch)
            return m

        def sequential():
            with jax.set_mesh(mesh):
                box["state"], m = step(box["state"], feed())
            float(m["loss"])

        def compute_synced():
            jax.block_until_ready(compute())

        def trainer_run(i):
            run = Path(tmp) / f"trainer{i}"
            run_cfg = cli.load(args.config, overrides + [f"train.steps={steps + 1}", f"train.log_every={steps + 1}",
                                                         f"train.eval_every={10 * steps}",
                                                         f"train.checkpoint_every={10 * steps}"])
            trainer.train(run_cfg, run, progress=False)
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            return t.batch_size * t.seq_len / rows[-1]["tokens_per_sec"]

        results = {"data": [], "compute": [], "sequential": [], "trainer": []}
        for i in range(args.rounds):  # interleaved, so host load moves all alike
            results["data"].append(per_step(feed, steps))
            results["compute"].append(per_step(compute_synced, steps))
            results["sequential"].append(per_step(sequential, steps))
            results["trainer"].append(trainer_run(i))
    ms = {k: 1e3 * statistics.median(v) for k, v in results.items()}
    out = {"config": args.config, "overrides": overrides, "steps": steps, "rounds": args.rounds,
           "step_ms": {k: round(v, 2) for k, v in ms.items()},
           "trainer_over_max_data_compute": round(ms["trainer"] / max(ms["data"], ms["compute"]), 3),
           "sequential_over_trainer": round(ms["sequential"] / ms["trainer"], 3),
           "data_share_of_sequential": round(ms["data"] / ms["sequential"], 3)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
