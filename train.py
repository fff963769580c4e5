"""Train a model: python train.py --config configs/NAME.py --workdir DIR [--steps N] [--variant NAME]
                                  [--init-from RUN_DIR] [--config.FIELD=VALUE ...]

Rerunning the same command in the same DIR resumes from the latest complete checkpoint. --steps
below the config's warmup scales the warmup down with it (one note line says so). Writes
DIR/metrics.jsonl, DIR/tensorboard/, DIR/checkpoints/ and DIR/summary.json. --init-from starts a
new run from another run's parameters (continued training, e.g. configs/extend_tiny.py).
--resume-step N resumes from an earlier saved step (a divergence stop names the one to use; a plain
rerun after a divergence stop is refused, --resume-anyway goes on from the newest checkpoint).
A resume on changed data (DIR/data.json records it) is refused unless --allow-corpus-change.
Errors are one line (exit 2: a usage error; exit 1: a runtime failure); --debug shows the traceback.
"""

import argparse
import sys

from gattn import cli
from gattn.config.train import fit_warmup


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=cli.HelpWithDefaults)
    ap.add_argument("--config", required=True, help="a config file (configs/NAME.py), a preset name (tiny), or a run's config.json")
    ap.add_argument("--workdir", required=True, help="run directory (created; resumed if it exists)")
    ap.add_argument("--steps", type=int, help="total training steps (sets train.steps)")
    ap.add_argument("--variant", help="a registered variant (python -m gattn.variants)")
    ap.add_argument("--init-from", metavar="RUN_DIR", help="start from this run's parameters "
                    "(sets train.init_from; its latest checkpoint, or --config.train.init_step=N)")
    ap.add_argument("--resume-step", type=int, metavar="N", help="resume from saved step N instead of "
                    "the latest (e.g. the checkpoint kept before a divergence); later checkpoints are "
                    "moved to DIR/checkpoints_set_aside/, not deleted")
    ap.add_argument("--resume-anyway", action="store_true", help="resume a run that stopped for divergence "
                    "from its newest checkpoint (a plain rerun is refused: that checkpoint was saved in the "
                    "trouble; --resume-step N is the usual way on)")
    ap.add_argument("--allow-corpus-change", action="store_true", help="resume although the data "
                    "changed since the run was trained (files added to data.source, another Python's "
                    "embedded corpus): continue on the new data with the run's tokenizer")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    cli.add_distributed_flags(ap)
    args, overrides = cli.parse_args(ap, argv, steps_set_train_steps=True)
    if args.init_from:
        overrides.append(f"train.init_from={args.init_from}")
    warmup, note = fit_warmup(cli.load(args.config).train, overrides) if args.steps is not None else ([], "")
    cfg = cli.load(args.config, overrides + warmup, variant=args.variant)
    cli.check_workdir(args.workdir)  # gs:// without gcsfs: one line now, not an ImportError later
    cli.start_distributed(args)  # one process, or all of a pod slice's (docs/pod-slice.md)

    from gattn.train import hosts, trainer  # noqa: PLC0415 (config errors come before any JAX import)

    if note and hosts.primary():  # --steps below the config's warmup: the warmup shrank with it
        print(note, file=sys.stderr, flush=True)

    # A diverged run, unreadable checkpoints or a failed save raise cli.Failure: one line, exit 1.
    summary = trainer.train(cfg, args.workdir, progress=not args.quiet, resume_step=args.resume_step,
                            allow_corpus_change=args.allow_corpus_change, resume_anyway=args.resume_anyway)
    if hosts.primary():  # one summary line for the run, not one per host
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    cli.run_entry_point(main)
