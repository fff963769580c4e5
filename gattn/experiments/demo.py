"""A first look at every variant of the paper on the embedded corpus.

    python -m gattn.demo [--config configs/demo.py] [--variants a,b,...|all] [--steps 40]
                         [--workdir workdir/demo] [--json] [--config.FIELD=VALUE ...]

A preset of the study runner (gattn.experiments.study), as the main job is: each variant trains
with the training loop of train.py (`--steps` steps of the config's batch, identical data and
seed), then is measured on held-out text: parameters (and those added to the baseline), the
first and last training loss, the held-out loss (mean over domains), and the paper's gate
statistics from the real forward pass: mean gate score, F-Attn (attention on the first token)
and M-Act (max hidden activation). Runs are kept in WORKDIR/KEY/VARIANT, KEY naming the settings
(a rerun with the same settings reuses them); all share one tokenizer and dataset (WORKDIR/shared).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from gattn import cli, variants
from gattn.experiments import study as study_lib

COLUMNS = ("variant", "params", "added_params", "first_loss", "last_loss", "held_out_loss", *study_lib.MEASURED,
           "seconds")


def main(argv=None):
    cli.single_process("python -m gattn.demo")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/demo.py")
    ap.add_argument("--variants", default="all", help="comma-separated names, or 'all' (those that apply to the model)")
    ap.add_argument("--steps", type=int, help="training steps per variant (sets train.steps; the config has 40)")
    ap.add_argument("--workdir", default="workdir/demo")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON (progress goes to stderr)")
    args, overrides = cli.parse_args(ap, argv, steps_set_train_steps=True)
    names = (variants.applicable(cli.load(args.config, overrides).model) if args.variants == "all"
             else args.variants.split(","))
    study = study_lib.comparison(args.config, names, overrides, description="the demo", sink_points=0,
                                 measure_batches=1)
    key = hashlib.sha256(json.dumps(study_lib.describe(study), sort_keys=True).encode()).hexdigest()[:10]
    root = Path(args.workdir) / key
    out = sys.stderr if args.json else sys.stdout
    t = study.base.train
    print(f"{len(names)} variant(s), {t.steps} steps of {t.batch_size}x{t.seq_len} tokens each -> {root}",
          file=out, flush=True)
    records = study_lib.run_cells(study, root, shared=Path(args.workdir) / "shared",
                                  log=lambda *a, **k: print(*a, **k, file=out))
    if records is None:
        return 1
    rows = [row(study_lib.cell_row(study, r, root)) for r in records]
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0


def row(cell: dict) -> dict:
    """A demo row (`COLUMNS`; a diverged run: variant, params, added_params, diverged)."""
    cell = {**cell, "last_loss": cell.get("final_loss")}
    keys = ("variant", "params", "added_params", "diverged") if cell.get("diverged") else COLUMNS
    return {k: cell[k] for k in keys if k in cell}


def table(rows: list[dict]) -> str:
    out = [f"{'variant':<30}{'params':>10}{'added':>9}{'loss@1':>8}{'loss@N':>8}{'held-out':>9}{'gate':>7}"
           f"{'F-Attn':>8}{'M-Act':>8}"]
    for r in rows:
        head = f"{r['variant']:<30}{r['params']:>10,}{r['added_params']:>+9,}"
        if r.get("diverged"):
            out.append(f"{head}  diverged ({r['diverged']})")
            continue
        gate = f"{r['gate_score']:.3f}" if "gate_score" in r else "-"
        out.append(f"{head}{r['first_loss']:>8.3f}{r['last_loss']:>8.3f}{r['held_out_loss']:>9.3f}"
                   f"{gate:>7}{r['f_attn']:>8.3f}{r['m_act']:>8.2f}")
    return "\n".join(out)


if __name__ == "__main__":
    cli.run_entry_point(main)
