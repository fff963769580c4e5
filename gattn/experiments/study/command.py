"""The paper at small scale, in one command: train a grid of variants x learning rates x seeds
with identical data and token budget, measure each, and write the paper's tables and figures.

    python -m gattn.study configs/study/NAME.py --workdir DIR [--steps N] [--config.FIELD=VALUE ...]

A study file (or a preset's name: table4_tiny) defines `get_study() -> Study`. Each cell (variant,
learning rate, seed) trains in DIR/runs/VARIANT/lr_LR/seed_SEED (`Study.cell_dir`) and is then
measured (eval.py's perplexity and measurements, and F-Attn at each saved checkpoint);
DIR/runs/.../cell.json marks it finished. Rerunning the command skips finished cells, resumes the
unfinished one from its checkpoint, and goes on. All cells share one tokenizer and one prepared
dataset (DIR/shared). The report: DIR/report.json, DIR/report.md and PNG figures in DIR/figures,
with mean and sample standard deviation over seeds, and a verdict per claim of the paper computed
from the numbers (`claims`).
"""

from __future__ import annotations

import argparse

from gattn import cli
from gattn.experiments.study.report import markdown
from gattn.experiments.study.runner import run
from gattn.experiments.study.spec import load


def main(argv=None):
    cli.single_process("python -m gattn.study")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
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
