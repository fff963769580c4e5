"""Ablation studies: grids of variants x learning rates x seeds trained on identical data and
budgets, measured, and reported with a verdict per claim of the paper (`python -m gattn.study`;
the command and what it writes: command.py).

    spec      Study, Cell, cells, cell_config, load (a study file or preset), comparison (a
              one-seed study of variants: the main job, the demo), describe, planned_steps
    runner    run_cell, run_cells, run (the cells, then the report), the same-study check,
              cell_row (a cell's record as a flat row)
    stats     aggregate (mean ± std over seeds), compare (a difference against the seed spread)
    claims    Claim, CLAIMS (the paper's claims as data), claims (their verdicts)
    report    table, stability_table, write_report, markdown
    command   main (the command line), parse (the study a command line describes; nothing trains)

(`claims` here is the function; the module is gattn.experiments.study.claims.)
"""

from gattn.experiments.study.claims import CLAIMS, GATED, REFERENCE, REMOVED, WORDS, Claim, claims
from gattn.experiments.study.report import markdown, stability_table, table, write_report
from gattn.experiments.study.runner import MEASURED, cell_row, read_metrics, run, run_cell, run_cells
from gattn.experiments.study.spec import Cell, Study, cell_config, cells, comparison, describe, load, planned_steps
from gattn.experiments.study.stats import aggregate, compare
from gattn.experiments.study.command import main

__all__ = ["CLAIMS", "GATED", "MEASURED", "REFERENCE", "REMOVED", "WORDS", "Cell", "Claim", "Study", "aggregate", "cell_config",
           "cell_row", "cells", "claims", "comparison", "compare", "describe", "load", "main", "markdown", "planned_steps",
           "read_metrics", "run", "run_cell", "run_cells", "stability_table", "table", "write_report"]
