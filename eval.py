"""Evaluate a run's checkpoint, or compare runs:

    python eval.py --workdir DIR [--step N] [--tasks FILE.jsonl,...] [--shots K] [--config.FIELD=VALUE ...]
    python eval.py --compare DIR1 DIR2 ... [--out DIR]

Restores the Orbax checkpoint of DIR (the latest, or --step N) onto the devices present, with the
run's own config (DIR/config.json) plus any overrides, and writes DIR/eval/results.json,
DIR/eval/results.md and PNG figures: perplexity per held-out domain and, per layer and overall,
the gate score and its histogram, F-Attn (first-token attention, per head, sink-head share),
M-Act (max hidden activation), SDPA-output sparsity before and after the gate, and per-head
attention maps. --tasks adds few-shot evaluation (gattn/fewshot.py). --compare prints a
Table-4-like table across runs (evaluating those without results) and overlays their per-layer
curves in one figure.
"""

import argparse
import json
import sys

from gattn import config as config_lib
from gattn.runtime import ensure_malloc_tunables


def _layers(text):
    return tuple(int(x) for x in text.split(",")) if text else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workdir", help="the run directory (holds config.json and checkpoints/)")
    ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ap.add_argument("--compare", nargs="+", metavar="DIR", help="run directories to compare")
    ap.add_argument("--out", help="output folder (default DIR/eval; for --compare, COMMON_PARENT/compare)")
    ap.add_argument("--max-batches", type=int, help="held-out batches per domain for the measurements")
    ap.add_argument("--sink-threshold", type=float, default=0.3, help="F-Attn above which a head is a sink head")
    ap.add_argument("--map-layers", type=_layers, help="layers whose attention maps to draw, e.g. 0,5,11 "
                    "(default: first, middle, last)")
    ap.add_argument("--map-len", type=int, default=64, help="positions covered by the attention maps")
    ap.add_argument("--batch-rows", type=int, help="rows per forward pass of the measurements (lower it "
                    "for long sequences: each layer's [rows, heads, S, S] attention is in memory at once)")
    ap.add_argument("--tasks", help="comma-separated few-shot task files (JSONL, see README)")
    ap.add_argument("--shots", type=int, default=0, help="in-context examples per few-shot prompt")
    ap.add_argument("--limit", type=int, help="evaluate only the first N examples of each task")
    ap.add_argument("--no-figures", action="store_true")
    args, overrides = config_lib.parse_args(ap, argv)
    if bool(args.workdir) == bool(args.compare):
        ap.error("give either --workdir DIR or --compare DIR1 DIR2 ...")
    for name in ("max_batches", "map_len", "limit", "batch_rows"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise config_lib.ConfigError(f"--{name.replace('_', '-')}", value, "expected a positive integer")
    if args.shots < 0:
        raise config_lib.ConfigError("--shots", args.shots, "expected >= 0")

    from gattn import analysis, evaluate  # noqa: PLC0415 (argument errors come before any JAX import)

    options = analysis.Options(sink_threshold=args.sink_threshold, map_layers=args.map_layers,
                               map_len=args.map_len, batch_rows=args.batch_rows)
    kwargs = dict(options=options, max_batches=args.max_batches, figures=not args.no_figures,
                  tasks=args.tasks.split(",") if args.tasks else (), shots=args.shots, limit=args.limit)
    if args.compare:
        print(evaluate.compare(args.compare, out_dir=args.out, overrides=overrides, **kwargs))
        return 0
    results = evaluate.evaluate(args.workdir, step=args.step, overrides=overrides, out_dir=args.out, **kwargs)
    print(evaluate.report(results))
    print(json.dumps({"results": str(evaluate.out_path(args.workdir, args.out) / "results.json"),
                      "figures": results.get("figures", [])}))
    return 0


if __name__ == "__main__":
    ensure_malloc_tunables()
    sys.exit(config_lib.run_cli(main))
