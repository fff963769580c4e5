"""CPU training-step time of the Qwen3-Next-shaped hybrid against the all-attention model of the
same width (issue 31, docs/hybrid.md).

    python bench/hybrid_step_time.py [--config hybrid_tiny] [--seqs 256,1024] [--batch 8]

Both models are configs/hybrid_tiny.py's: the hybrid (3 Gated DeltaNet : 1 gated attention
layer) and the same config with model.layer_types=None (every layer the gated attention), with
the same FFN (MoE and shared expert), width and depth. For each sequence length the trainer's
step (AdamW, the non-finite guard) is timed in interleaved rounds; prints JSON with the median
step time of each, tokens/s, parameters, and the hybrid / all-attention ratio. Ratios measured in
one run carry over between machines; absolute times do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gattn.cli import ensure_malloc_tunables, keep_jax_off_absent_tpu  # noqa: E402

keep_jax_off_absent_tpu()
ensure_malloc_tunables()

from gattn import cli  # noqa: E402
from gattn.model.params import count_params  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import make_step  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="hybrid_tiny")
    ap.add_argument("--seqs", default="256,1024")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="steps per model per round")
    args, overrides = cli.parse_args(ap, argv)
    hybrid = cli.load(args.config, overrides)
    if not hybrid.model.hybrid:
        raise SystemExit(f"{args.config} is not a hybrid model (model.layer_types has no 'linear_attention')")
    models = {"hybrid": hybrid,
              "all_attention": dataclasses.replace(hybrid, model=dataclasses.replace(
                  hybrid.model, layer_types=None, linear_attention=None))}
    out = {"config": args.config, "batch": args.batch, "d_model": hybrid.model.d_model,
           "layers": list(hybrid.model.layer_types), "gdn_chunk": hybrid.exec.gdn_chunk,
           "params": {k: count_params(c.model) for k, c in models.items()}, "by_seq": {}}
    for seq in (int(s) for s in args.seqs.split(",")):
        steps = {k: make_step(c, args.batch, seq) for k, c in models.items()}
        times = {k: [] for k in models}
        for _ in range(args.rounds):
            for k, step in steps.items():
                times[k] += [step() for _ in range(args.steps)]
        median = {k: statistics.median(v) for k, v in times.items()}
        out["by_seq"][seq] = {**{f"{k}_step_s": round(v, 4) for k, v in median.items()},
                              **{f"{k}_tokens_per_s": round(args.batch * seq / v) for k, v in median.items()},
                              "hybrid_over_all_attention": round(median["hybrid"] / median["all_attention"], 3)}
        print(json.dumps({"seq": seq, **out["by_seq"][seq]}), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    raise SystemExit(cli.run_cli(main))
