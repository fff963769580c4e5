"""The main job: baseline vs SDPA-gated attention, trained on the embedded corpus, side by side.

    python -m gattn.main_job [--workdir workdir/main] [--variants baseline,sdpa_elementwise]
                             [--config configs/tiny.py] [--steps N] [--quiet] [--config.FIELD=VALUE ...]

A preset of the study runner (gattn.experiments.study): one seed, the config file's model and
budget, each variant trained in WORKDIR/VARIANT with identical data, seed and budget (rerunning
skips finished runs and resumes an interrupted one), then measured on held-out text from the real
forward pass: perplexity per domain, loss spikes, mean gate score, F-Attn (attention on the row's
first token) and M-Act (max hidden activation), on one held-out batch per domain. The table is
printed and written to WORKDIR/results.json; each run's measurements are in eval.py's format, with
the settings they were measured with, in WORKDIR/VARIANT/eval/results.json, so
`python eval.py --compare WORKDIR/baseline WORKDIR/sdpa_elementwise` (the command printed last)
reuses them (the same numbers) and adds figures: per-layer curves, loss curves, gate scores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gattn import cli
from gattn.config.train import fit_warmup
from gattn.experiments import study as study_lib
from gattn.experiments.study.runner import MEASURED

# The keys of a results.json row (a diverged run's: variant, params, diverged).
KEYS = ("variant", "params", "step", "completed", "final_loss", "skipped_steps", "loss_spikes", "tokens_per_sec",
        *MEASURED)


def main(argv=None):
    cli.single_process("python -m gattn.main_job")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workdir", default="workdir/main")
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--variants", default="baseline,sdpa_elementwise")
    ap.add_argument("--steps", type=int, help="training steps per variant (sets train.steps; a warmup as "
                    "long is scaled down with it)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args, overrides = cli.parse_args(ap, argv, steps_set_train_steps=True)
    if args.steps is not None:  # below the config's warmup, the warmup shrinks with the steps
        warmup, note = fit_warmup(cli.load(args.config).train, overrides)
        overrides += warmup
        if note:
            print(note, file=sys.stderr, flush=True)
    study = study_lib.comparison(args.config, args.variants.split(","), overrides, description="the main job",
                                 sink_points=2, measure_batches=1)
    t = study.base.train
    print(f"== {', '.join(study.variants)}: {t.steps} steps of {t.batch_size}x{t.seq_len} tokens each "
          f"-> {args.workdir}/VARIANT", flush=True)
    records = study_lib.run_cells(study, args.workdir, progress=not args.quiet)
    if records is None:  # SIGTERM: the checkpoint is saved; the runner said to rerun
        return 1
    rows = [row(study_lib.cell_row(study, r, Path(args.workdir))) for r in records]
    Path(args.workdir, "results.json").write_text(json.dumps(rows, indent=2))
    print()
    print(table(rows))
    print("\nfigures (reusing these measurements): python eval.py --compare "
          + " ".join(str(Path(args.workdir, v)) for v in study.variants))
    return 0


def row(cell: dict) -> dict:
    """A results.json row: `KEYS` and the validation loss and perplexity per domain."""
    if cell.get("diverged"):
        return {"variant": cell["variant"], "params": cell["params"], "diverged": True, "reason": cell["diverged"]}
    return {**{k: cell[k] for k in KEYS if k in cell}, "completed": True,
            **{k: v for k, v in cell.items() if k.startswith(("val_loss/", "val_ppl/"))}}


def table(rows: list[dict]) -> str:
    """A markdown table, one column per variant ('diverged' where a run stopped on NaNs)."""
    from gattn.eval.analysis import sink_heads_label  # noqa: PLC0415 (the module imports JAX)

    domains = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("val_ppl/")})
    lines = [("params", lambda r: f"{r['params']:,}")]
    lines += [(f"val PPL {d}", lambda r, d=d: f"{r[f'val_ppl/{d}']:.2f}") for d in domains]
    lines += [("final train loss", lambda r: f"{r['final_loss']:.3f}"),
              ("loss spikes", lambda r: str(r["loss_spikes"])),
              ("skipped (non-finite) steps", lambda r: str(r["skipped_steps"])),
              ("gate score (mean)", lambda r: f"{r['gate_score']:.3f}" if "gate_score" in r else "-"),
              ("F-Attn (first token)", lambda r: f"{r['f_attn']:.3f}"),
              (sink_heads_label(0.3), lambda r: f"{r['sink_head_share']:.0%}"),
              ("M-Act (mean over layers of max abs hidden)", lambda r: f"{r['m_act']:.1f}"),
              ("tokens/s", lambda r: f"{r['tokens_per_sec']:,.0f}" if r["tokens_per_sec"] else "-")]
    out = ["| | " + " | ".join(r["variant"] for r in rows) + " |",
           "|---|" + "---|" * len(rows)]

    def cell(fmt, r):
        if r.get("diverged"):
            return "diverged"
        try:
            return fmt(r)
        except (KeyError, TypeError):
            return "-"
    out += [f"| {label} | " + " | ".join(cell(fmt, r) if label != "params" else fmt(r) for r in rows) + " |"
            for label, fmt in lines]
    return "\n".join(out)


if __name__ == "__main__":
    cli.run_entry_point(main)
