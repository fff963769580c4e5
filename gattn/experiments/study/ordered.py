"""A study trained in an order of its own, from a study file run as a script
(configs/study/instability_verdict.py, instability_noqk.py): the cells in `order(study)`, shared
between processes side by side (--part K/N), optionally one learning rate only (--lr), each cell
run and measured as `python -m gattn.study` runs it, and the report written from whatever cells
have finished (--report: only that)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def finished(study, root: Path) -> list[dict]:
    """The records of the cells finished in `root` (cell.json), in the study's own order."""
    from gattn.experiments.study import cells  # noqa: PLC0415

    return [json.loads((root / c.path / "cell.json").read_text()) for c in cells(study)
            if (root / c.path / "cell.json").is_file()]


def main(study, order, argv=None, description: str = "") -> int:
    """Trains `study`'s cells in `order(study)` (a list of cells) with the command line `argv`;
    0 when done, 1 when a SIGTERM stopped a cell (rerun to go on)."""
    from gattn.experiments import study as study_pkg  # noqa: PLC0415 (run_cell looked up per call: tests patch it)
    from gattn.experiments.study.runner import STOPPED, _check_same_study, write_study  # noqa: PLC0415

    rates = study.learning_rates
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--report", action="store_true", help="write the report from the finished cells; train nothing")
    ap.add_argument("--part", default="0/1", help="K/N: train only every N-th cell of the order from the K-th "
                    "(N processes side by side, one per core, K = 0..N-1)")
    ap.add_argument("--lr", type=float, default=None, help="train only the cells at this peak learning rate "
                    "(one of the study's learning rates)")
    args = ap.parse_args(argv)
    if args.lr is not None and args.lr not in rates:
        ap.error(f"--lr {args.lr:g}: expected one of the study's learning rates {', '.join(map(str, rates))}")
    k, _, n = args.part.partition("/")
    if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
        ap.error(f"--part {args.part!r}: expected K/N with 0 <= K < N")
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    _check_same_study(study, root)  # (the same check, and study.json, as python -m gattn.study)
    write_study(study, root)  # (atomically: --part's processes start side by side and read it)
    grid = order(study)
    todo = [c for c in grid if args.lr is None or c.lr == args.lr]
    stopped = False
    for i, cell in enumerate([] if args.report else todo, 1):
        if (i - 1) % int(n) != int(k):
            continue
        done = (root / cell.path / "cell.json").is_file()
        print(f"[{i}/{len(todo)}] {cell.variant} lr={cell.lr:g} seed={cell.seed}: "
              + ("finished earlier, skipped" if done else "training"), flush=True)
        if study_pkg.run_cell(study, cell, root) is None:
            print(STOPPED, flush=True)
            stopped = True
            break
    records = finished(study, root)
    if records:
        study_pkg.write_report(study, records, root)
        print(f"report of {len(records)}/{len(grid)} finished cells: {root / 'report.md'}", flush=True)
    return 1 if stopped else 0
