"""Evaluate a run's checkpoint, or compare runs:

    python eval.py --workdir DIR [--step N] [--tasks FILE.jsonl,...] [--shots K] [--config.FIELD=VALUE ...]
    python eval.py --workdir DIR --lm-eval paper_table4 --data-dir DATA [--shots K] [--limit N]
    python eval.py --compare DIR1 DIR2 ... [--out DIR]
    python eval.py --workdir DIR --ruler --lengths 512,1024,2048,4096 [--config.model.yarn.factor=4]
    python eval.py --ruler --lengths 512,1024,2048,4096 --compare DIR1 DIR2 ... [RULER.json ...]

Restores the Orbax checkpoint of DIR (the latest, or --step N) onto the devices present, with the
run's own config (DIR/config.json) plus any overrides, and writes DIR/eval/results.json,
DIR/eval/results.md and PNG figures: perplexity per held-out domain and, per layer and overall,
the gate score and its histogram, F-Attn (first-token attention, per head, sink-head share),
M-Act (max hidden activation), SDPA-output sparsity before and after the gate, and per-head
attention maps. --tasks adds few-shot evaluation (gattn/eval/fewshot.py). --lm-eval scores
lm-evaluation-harness tasks instead (gattn/interop/harness.py; the paper's benchmarks from local
files with --data-dir) and writes DIR/eval/lm_eval.json and lm_eval.md. --compare prints a
Table-4-like table across runs with their training rows (params, final loss, loss spikes, tokens/s)
and overlays their per-layer curves, loss curves and gate scores (PNG, the curves' data as JSON
beside them); it reuses each run's eval/results.json measured with the settings asked for, and
re-measures the others (saying why, with progress on stderr). --ruler runs the RULER-style
long-context benchmark instead (gattn/eval/ruler.py) at the given lengths and writes ruler.json,
ruler.md and ruler.png: per task and length, the exact-match score, seconds and peak memory; with
--compare, a Table-5-like table of several checkpoints (run folders, or ruler.json files of earlier
evaluations such as a YaRN one).
"""

import argparse
import json
import sys
from pathlib import Path

from gattn import cli
from gattn.config import ConfigError


def _layers(text):
    return tuple(int(x) for x in text.split(",")) if text else None


def _lengths(text):
    try:
        return sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, e.g. 512,1024; got {text!r}") from None


def main(argv=None):
    cli.single_process("eval.py")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpWithDefaults)
    ap.add_argument("--workdir", help="the run directory (holds config.json and checkpoints/)")
    ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ap.add_argument("--compare", nargs="+", metavar="DIR", help="run directories to compare")
    ap.add_argument("--out", help="output folder (default DIR/eval; for --compare, COMMON_PARENT/compare)")
    ap.add_argument("--max-batches", type=int, help="held-out batches per domain for the measurements "
                    "(default: all of the run's data.eval_batches; with --compare, the count the runs' "
                    "eval/results.json were measured over, where they agree: the main job's 1)")
    ap.add_argument("--sink-threshold", type=float, help="F-Attn above which a head is a sink head (default: 0.3)")
    ap.add_argument("--map-layers", type=_layers, help="layers whose attention maps to draw, e.g. 0,5,11 "
                    "(default: first, middle, last)")
    ap.add_argument("--map-len", type=int, help="positions covered by the attention maps (default: 64)")
    ap.add_argument("--batch-rows", type=int, help="rows per forward pass of the measurements (lower it "
                    "for long sequences: each layer's [rows, heads, S, S] attention is in memory at once; "
                    "default: a whole batch per pass)")
    ap.add_argument("--tasks", help="comma-separated few-shot task files (JSONL, docs/evaluation.md; needs the lm-eval extra)")
    ap.add_argument("--shots", type=int, help="in-context examples per few-shot prompt (default: 0 for "
                    "--tasks, each task's own for --lm-eval)")
    ap.add_argument("--limit", type=int, help="evaluate only the first N examples of each task")
    ap.add_argument("--no-figures", action="store_true")
    harness = ap.add_argument_group("lm-evaluation-harness (gattn/interop/harness.py, docs/evaluation.md)")
    harness.add_argument("--lm-eval", metavar="TASKS", help="comma-separated lm-eval tasks or groups, e.g. "
                         "paper_table4 or local_hellaswag,local_gsm8k; instead of the measurements")
    harness.add_argument("--data-dir", help="the benchmark files of the local_* tasks (docs/evaluation.md)")
    harness.add_argument("--allow-code-execution", action="store_true", help="let local_humaneval run "
                         "the model's code (a subprocess per completion, with a timeout)")
    harness.add_argument("--lm-batch-size", type=int, help="rows per forward pass of --lm-eval (default: 8)")
    ruler = ap.add_argument_group("long context (RULER-style, gattn/eval/ruler.py)")
    ruler.add_argument("--ruler", action="store_true", help="run the long-context benchmark instead")
    ruler.add_argument("--lengths", type=_lengths, help="context lengths in tokens, e.g. 512,1024,2048,4096")
    ruler.add_argument("--ruler-tasks", help="comma-separated subset of the tasks (default: all six)")
    ruler.add_argument("--samples", type=int, help="samples per task and length (default 8)")
    ruler.add_argument("--seed", type=int, help="the generator's seed (default 0)")
    ruler.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill pass, and query "
                       "chunk of the perplexity pass (default 512; bounds long-context memory)")
    args, overrides = cli.parse_args(ap, argv)
    if bool(args.workdir) == bool(args.compare):
        ap.error("give either --workdir DIR or --compare DIR1 DIR2 ...")
    if args.compare and args.step is not None:
        ap.error("--step applies to --workdir (a comparison uses each run's latest checkpoint)")
    _refuse_other_modes(args, ap)
    if args.ruler:
        return _ruler(args, overrides)
    if args.lm_eval or args.data_dir or args.allow_code_execution:
        return _lm_eval(args, overrides, ap)
    args.sink_threshold = 0.3 if args.sink_threshold is None else args.sink_threshold
    if not 0 <= args.sink_threshold < 1:  # (F-Attn is a share of attention: 7, -1 or nan meant 0% or 100%)
        raise ConfigError("--sink-threshold", args.sink_threshold, "a share of attention in [0, 1)")
    args.map_len = 64 if args.map_len is None else args.map_len
    for name in ("max_batches", "map_len", "limit", "batch_rows"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", value, "expected a positive integer")
    args.shots = 0 if args.shots is None else args.shots
    if args.shots < 0:
        raise ConfigError("--shots", args.shots, "expected >= 0")
    if args.tasks:  # every task file is read and checked before any model loads (exit 2, at once)
        from gattn.lm_eval import require  # noqa: PLC0415

        require()  # (the task files are scored through lm-eval)
        from gattn.eval import fewshot  # noqa: PLC0415

    for task in args.tasks.split(",") if args.tasks else ():
        if not Path(task).is_file():
            raise ConfigError("--tasks", task, "an existing JSONL task file (docs/evaluation.md); no such file")
        try:
            fewshot.load_task(task)
        except ValueError as e:
            raise ConfigError("--tasks", task, f"a task file in the format of docs/evaluation.md: {e}") from None

    from gattn.eval import analysis, evaluate  # noqa: PLC0415 (argument errors come before any JAX import)

    options = analysis.Options(sink_threshold=args.sink_threshold, map_layers=args.map_layers,
                               map_len=args.map_len, batch_rows=args.batch_rows)
    kwargs = dict(options=options, max_batches=args.max_batches, figures=not args.no_figures,
                  tasks=args.tasks.split(",") if args.tasks else (), shots=args.shots, limit=args.limit,
                  harness_model=_harness_model if args.tasks else None, log=_progress)
    if args.compare:
        print(evaluate.compare(args.compare, out_dir=args.out, overrides=overrides, **kwargs))
        return 0
    results = evaluate.evaluate(args.workdir, step=args.step, overrides=overrides, out_dir=args.out, **kwargs)
    print(evaluate.report(results))
    print(json.dumps({"results": str(evaluate.out_path(args.workdir, args.out) / "results.json"),
                      "figures": results.get("figures", [])}))
    return 0


# The flags that belong to one mode of eval.py: given in another mode they would be dropped
# without a word (before: --ruler with --lm-eval ran RULER only, --shots without --tasks did nothing).
RULER_ONLY = ("lengths", "ruler_tasks", "samples", "seed", "prefill_chunk")
LM_EVAL_ONLY = ("lm_eval", "data_dir", "allow_code_execution", "lm_batch_size")
MEASURE_ONLY = ("max_batches", "sink_threshold", "map_layers", "map_len", "batch_rows", "tasks")


def _flags(args, names) -> list[str]:
    """The flags among `names` that the command line gave."""
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n) is not None and getattr(args, n) is not False]


def _refuse_other_modes(args, ap) -> None:
    if not args.ruler and (given := _flags(args, RULER_ONLY)):
        ap.error(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --ruler (the long-context benchmark)")
    if args.ruler:
        if given := _flags(args, MEASURE_ONLY + LM_EVAL_ONLY + ("limit", "shots")):
            ap.error(f"--ruler runs the long-context benchmark only: drop {', '.join(given)} "
                     "(or run them without --ruler)")
    elif _flags(args, LM_EVAL_ONLY):
        if given := _flags(args, MEASURE_ONLY + ("compare",)):
            ap.error(f"--lm-eval scores lm-eval tasks on one run's checkpoint: drop {', '.join(given)}")
    elif not args.tasks and (given := _flags(args, ("shots", "limit"))):
        ap.error(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --tasks FILES or --lm-eval TASKS "
                 "(the measurements take neither)")


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _harness_model(cfg, model, tokenizer, workdir, step):
    """gattn's lm-eval model over a checkpoint evaluate() has restored (the --tasks files)."""
    from gattn.interop import harness  # noqa: PLC0415

    return harness.GattnLM(workdir=str(workdir), loaded=(cfg, model, tokenizer, step),
                           max_gen_toks=min(64, cfg.train.seq_len // 2))


def _lm_eval(args, overrides, ap):
    if not args.lm_eval:
        ap.error("--data-dir and --allow-code-execution go with --lm-eval TASKS")
    args.lm_batch_size = 8 if args.lm_batch_size is None else args.lm_batch_size
    for name in ("shots", "limit", "lm_batch_size"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "shots" else 1):
            raise ConfigError(f"--{name.replace('_', '-')}", value, "a non-negative integer" if name == "shots"
                              else "a positive integer")
    from gattn.lm_eval import require  # noqa: PLC0415

    require()
    from gattn.interop import harness  # noqa: PLC0415

    res = harness.evaluate(args.workdir, args.lm_eval.split(","), step=args.step, overrides=overrides,
                           num_fewshot=args.shots, limit=args.limit, batch_size=args.lm_batch_size,
                           data_dir=args.data_dir, allow_code=args.allow_code_execution, out_dir=args.out)
    print(res["table"])
    out = Path(args.out) if args.out else Path(args.workdir) / "eval"
    print(json.dumps({"results": str(out / "lm_eval.json")}))
    return 0


def _ruler(args, overrides):
    from gattn.eval.ruler import TASKS  # noqa: PLC0415 (no JAX)

    if not args.lengths:
        raise ConfigError("--lengths", args.lengths, "comma-separated token counts, e.g. 512,1024,2048")
    tasks = tuple(args.ruler_tasks.split(",")) if args.ruler_tasks else TASKS
    for task in tasks:
        if task not in TASKS:
            raise ConfigError("--ruler-tasks", task, f"one of {', '.join(TASKS)}")
    for name, default in (("samples", 8), ("seed", 0), ("prefill_chunk", 512)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("samples", "prefill_chunk"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", getattr(args, name), "expected a positive integer")

    from gattn.eval import evaluate, long_context  # noqa: PLC0415

    kwargs = dict(tasks=tasks, num_samples=args.samples, seed=args.seed, prefill_chunk=args.prefill_chunk,
                  overrides=overrides)
    if args.compare:
        print(long_context.compare_ruler(args.compare, args.lengths, out_dir=args.out, **kwargs))
        return 0
    res = long_context.evaluate_ruler(args.workdir, args.lengths, step=args.step, out_dir=args.out,
                                  figures=not args.no_figures, **kwargs)
    print(long_context.ruler_table([res]) + "\n\n" + long_context.ruler_task_table(res))
    print(json.dumps({"results": str(evaluate.out_path(args.workdir, args.out) / "ruler.json"),
                      "figures": res.get("figures", [])}))
    return 0


if __name__ == "__main__":
    cli.run_entry_point(main)
