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

    spec      Study, Cell, cells, cell_config, load (a study file), comparison (a one-seed study of
              variants: the main job, the demo), describe, planned_steps
    runner    run_cell, run_cells, run (cells, then the report), the same-study check
    stats     aggregate (mean ± std over seeds), compare (a difference against the seed spread)
    claims    Claim, CLAIMS (the paper's claims as data), claims (their verdicts)
    report    table, stability_table, write_report, markdown, cell_row
    command   main (the command line)
"""

from gattn.experiments.study.claims import CLAIMS, GATED, REFERENCE, REMOVED, WORDS, Claim, claims
from gattn.experiments.study.report import cell_row, markdown, stability_table, table, write_report
from gattn.experiments.study.runner import _losses, read_metrics, run, run_cell, run_cells
from gattn.experiments.study.spec import Cell, Study, cell_config, cells, comparison, describe, load, planned_steps
from gattn.experiments.study.stats import aggregate, compare
from gattn.experiments.study.command import main  # noqa: E402  (last: it reads this module's __doc__)

__all__ = ["CLAIMS", "GATED", "REFERENCE", "REMOVED", "WORDS", "Cell", "Claim", "Study", "aggregate", "cell_config",
           "cell_row", "cells", "claims", "comparison", "compare", "describe", "load", "main", "markdown", "planned_steps",
           "read_metrics", "run", "run_cell", "run_cells", "stability_table", "table", "write_report"]
