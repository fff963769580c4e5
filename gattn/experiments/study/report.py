"""A study's report: DIR/report.json, DIR/report.md (the table, the stability table, F-Attn
against tokens, the claims) and the figures in DIR/figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

from gattn.experiments.study.claims import claims
from gattn.experiments.study.spec import Study, describe
from gattn.experiments.study.stats import aggregate, fmt


def table(groups: list[dict], lr: float) -> str:
    """Table 1/3/4 at this scale: one row per variant at learning rate `lr`."""
    rows = [g for g in groups if g["lr"] == lr]
    domains = sorted({d for g in rows for d in g["ppl"]})
    head = (["variant", "added params"] + [f"PPL {d}" for d in domains] +
            ["PPL avg", "final loss", "gate score", "M-Act", "F-Attn", "loss spikes", "diverged"])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in rows:
        cells_ = ([g["variant"], f"{g['added_params']:,}"] + [fmt(g["ppl"].get(d)) for d in domains] +
                  [fmt(g["ppl_avg"]), fmt(g["final_loss"], 3), fmt(g["gate_score"], 3), fmt(g["m_act"], 1),
                   fmt(g["f_attn"], 3), fmt(g["loss_spikes"], 1), f"{g['diverged']}/{g['seeds']}"])
        out.append("| " + " | ".join(cells_) + " |")
    return "\n".join(out)


def stability_table(groups: list[dict]) -> str:
    lrs = sorted({g["lr"] for g in groups})
    names = list(dict.fromkeys(g["variant"] for g in groups))
    by = {(g["variant"], g["lr"]): g for g in groups}
    out = ["| variant | " + " | ".join(f"LR {lr:g}" for lr in lrs) + " |", "|---|" + "---|" * len(lrs)]
    for v in names:
        cells_ = []
        for lr in lrs:
            g = by.get((v, lr))
            if g is None:
                cells_.append("-")
                continue
            finals = ", ".join("diverged" if x is None or not math.isfinite(x) else f"{x:.3f}"
                               for x in g["final_loss_per_seed"])
            cells_.append(f"{g['diverged']}/{g['seeds']} diverged; final loss {finals}")
        out.append(f"| {v} | " + " | ".join(cells_) + " |")
    return "\n".join(out)


def write_report(study: Study, records: list[dict], root: Path) -> dict:
    from gattn.eval import plots  # noqa: PLC0415

    groups = aggregate(study, records)
    ref = study.reference_lr
    verdicts = claims(groups, ref, table=study.claims, gated=study.gated, reference=study.reference)
    figdir = root / "figures"
    ref_records = [r for r in records if r["lr"] == ref]
    at = {g["variant"]: g for g in groups if g["lr"] == ref}
    figures = [
        plots.loss_curves({lr: [r for r in records if r["lr"] == lr] for lr in study.lrs}, figdir / "loss_curves.png"),
        plots.per_layer({v: {"per_layer": g["per_layer"]} for v, g in at.items() if g["per_layer"]},
                        figdir / "per_layer.png", title=f"per layer, mean over seeds (LR {ref:g})")
        if any(g["per_layer"] for g in at.values()) else None,
        plots.gate_histograms({r["variant"]: r["measurements"] for r in ref_records
                               if not r["diverged"] and r["seed"] == study.seeds[0]
                               and "gate_histogram" in r["measurements"]}, figdir / "gate_scores.png"),
        plots.attention_map_pair({r["variant"]: r["measurements"] for r in ref_records
                                  if not r["diverged"] and r["seed"] == study.seeds[0]}, figdir / "attention_maps.png"),
        plots.sink_curves({v: g["sink_curve"] for v, g in at.items() if g["sink_curve"]},
                          figdir / "f_attn_vs_tokens.png"),
        plots.stability(groups, study.divergence_threshold, figdir / "stability.png") if len(study.lrs) > 1 else None,
    ]
    figures = [str(p.relative_to(root)) for p in figures if p]
    timed = [r["seconds"] for r in records if "seconds" in r]
    seconds = {k: sum(t[k] for t in timed) for k in ("train", "measure")} if timed else None
    report = {"study": describe(study), "groups": groups, "claims": verdicts, "figures": figures,
              "seconds": seconds,
              "cells": [{k: v for k, v in r.items() if k not in ("measurements", "losses")} for r in records]}
    (root / "report.json").write_text(json.dumps(report, indent=1))
    (root / "report.md").write_text(markdown(report))
    return report


def markdown(report: dict) -> str:
    s = report["study"]
    lines = [f"# Study: {s['description'] or ', '.join(s['variants'])}", "",
             f"{len(s['variants'])} variants x {len(s['learning_rates'])} learning rate(s) x {len(s['seeds'])} seeds; "
             f"{s['steps']} steps of {s['batch_size']} x {s['seq_len']} tokens ({s['tokens']:,} tokens) per run. "
             f"Mean ± sample std over seeds. A run diverged if training stopped on non-finite losses or its final "
             f"loss is above {s['diverged_loss']:.3f}. Perplexity: held-out text per domain."
             + (f" Wall time: {sum(report['seconds'].values()) / 60:.1f} min ({report['seconds']['train'] / 60:.1f} "
                f"training, {report['seconds']['measure'] / 60:.1f} measuring)." if report.get("seconds") else ""), "",
             f"## Table (LR {s['reference_lr']:g})", "", table(report["groups"], s["reference_lr"]), ""]
    if len(s["learning_rates"]) > 1:
        lines += ["## Stability across learning rates", "", stability_table(report["groups"]), ""]
    curves = [g for g in report["groups"] if g["lr"] == s["reference_lr"] and g["sink_curve"]]
    if curves:
        tokens = [r["tokens"] for r in curves[0]["sink_curve"]]
        lines += ["## F-Attn against training tokens (mean over seeds)", "",
                  "| variant | " + " | ".join(f"{t:,}" for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
        lines += [f"| {g['variant']} | " + " | ".join(f"{r['f_attn']:.3f}" for r in g["sink_curve"]) + " |"
                  for g in curves]
        lines.append("")
    lines += ["## The paper's claims at this scale", ""]
    lines += [c["text"] + "\n" for c in report["claims"]]
    lines += ["## Figures", ""] + [f"![{Path(f).stem}]({f})" for f in report["figures"]]
    return "\n".join(lines) + "\n"
