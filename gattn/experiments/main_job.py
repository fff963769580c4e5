"""The main job: baseline vs SDPA-gated attention, trained on the embedded corpus, side by side.

    python -m gattn.main_job [--workdir workdir/main] [--variants baseline,sdpa_elementwise]
                             [--config configs/tiny.py] [--steps N] [--config.FIELD=VALUE ...]

Each variant trains in WORKDIR/VARIANT with identical data, seed and budget (rerunning resumes or
skips finished runs), then is measured on held-out text from the real forward pass: perplexity
per domain, loss spikes, mean gate score, F-Attn (attention on the row's first token) and M-Act
(max hidden activation). The table is printed and written to WORKDIR/results.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


from gattn.eval import analysis
from gattn.train import trainer
from gattn import config as config_lib
from gattn.data import pipeline
from gattn.data.tokenizer import load_tokenizer
from gattn.model.params import count_params
from gattn.cli import ensure_malloc_tunables


def measure(cfg, workdir: Path) -> dict:
    """Gate score, F-Attn, sink-head share and M-Act on the first held-out batch of every domain."""
    model = trainer.load_model(cfg, workdir)
    batches = pipeline.validation_batches(cfg, load_tokenizer(cfg, workdir), workdir)
    overall = analysis.measure(model, [b[0] for b in batches.values()])["overall"]
    return {k: overall[k] for k in ("gate_score", "f_attn", "sink_head_share", "m_act") if k in overall}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workdir", default="workdir/main")
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--variants", default="baseline,sdpa_elementwise")
    ap.add_argument("--steps", type=int, help="training steps per variant (sets train.steps)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args, overrides = config_lib.parse_args(ap, argv, steps_set_train_steps=True)
    names = args.variants.split(",")
    cfgs = {n: config_lib.load(args.config, overrides, variant=n) for n in names}  # all checked first
    rows = []
    for name, cfg in cfgs.items():
        workdir = Path(args.workdir) / name
        print(f"== {name}: {count_params(cfg.model):,} parameters, {cfg.train.steps} steps of "
              f"{cfg.train.batch_size}x{cfg.train.seq_len} tokens -> {workdir}", flush=True)
        try:
            summary = trainer.train(cfg, workdir, progress=not args.quiet)
        except trainer.TrainingStopped as e:  # the paper's high-LR baselines do this
            print(f"{name} diverged: {e}", flush=True)
            rows.append({"variant": name, "params": count_params(cfg.model), "diverged": True})
            continue
        if not summary["completed"]:  # SIGTERM: the checkpoint is saved; a rerun resumes
            print(f"{name} stopped at step {summary['step']}; rerun the same command to resume.")
            return 1
        tok_s = [json.loads(line).get("tokens_per_sec") for line in
                 (workdir / "metrics.jsonl").read_text().splitlines()]
        rows.append({"variant": name, "params": count_params(cfg.model), **summary,
                     "tokens_per_sec": tok_s[-1] if tok_s else None, **measure(cfg, workdir)})
    Path(args.workdir, "results.json").write_text(json.dumps(rows, indent=2))
    print()
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    """A markdown table, one column per variant ('diverged' where a run stopped on NaNs)."""
    domains = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("val_ppl/")})
    lines = [("params", lambda r: f"{r['params']:,}")]
    lines += [(f"val PPL {d}", lambda r, d=d: f"{r[f'val_ppl/{d}']:.2f}") for d in domains]
    lines += [("final train loss", lambda r: f"{r['final_loss']:.3f}"),
              ("loss spikes", lambda r: str(r["loss_spikes"])),
              ("skipped (non-finite) steps", lambda r: str(r["skipped_steps"])),
              ("gate score (mean)", lambda r: f"{r['gate_score']:.3f}" if "gate_score" in r else "-"),
              ("F-Attn (first token)", lambda r: f"{r['f_attn']:.3f}"),
              ("sink heads (F-Attn > 0.3)", lambda r: f"{r['sink_head_share']:.0%}"),
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
    ensure_malloc_tunables()
    raise SystemExit(config_lib.run_cli(main))
