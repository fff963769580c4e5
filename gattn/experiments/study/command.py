"""`python -m gattn.study STUDY --workdir DIR [--steps N] [--progress] [--config.FIELD=VALUE ...]`."""

from __future__ import annotations

import argparse

from gattn import cli
from gattn.experiments.study import __doc__ as DOC
from gattn.experiments.study.report import markdown
from gattn.experiments.study.runner import run
from gattn.experiments.study.spec import load


def main(argv=None):
    ap = argparse.ArgumentParser(description=DOC, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("study", help=f"a study file (configs/study/NAME.py) or a preset ({', '.join(cli.presets('study'))})")
    ap.add_argument("--workdir", required=True, help="study directory (created; resumed if it exists)")
    ap.add_argument("--steps", type=int, help="training steps per cell (sets train.steps)")
    ap.add_argument("--progress", action="store_true", help="a progress bar per cell")
    args, overrides = cli.parse_args(ap, argv, steps_set_train_steps=True)
    study = load(args.study, overrides)
    report = run(study, args.workdir, progress=args.progress)
    if report is None:
        return 1
    print(markdown(report))
    return 0


if __name__ == "__main__":
    cli.run_entry_point(main)
