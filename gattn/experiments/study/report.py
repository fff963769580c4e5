"""A study's report: DIR/report.json, DIR/report.md (the table, the stability table, F-Attn
against tokens, the claims) and the figures in DIR/figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

from gattn.experiments.study.claims import claims
from gattn.experiments.study.sink_rule import evaluate as sink_verdicts, markdown_lines, mechanism_figure
from gattn.experiments.study.spec import Study, describe
from gattn.experiments.study.stability_rule import evaluate as stability_verdicts, markdown_lines as stability_lines
from gattn.experiments.study.stats import aggregate, fmt


def table(groups: list[dict], lr: float) -> str:
    """Table 1/3/4 at this scale: one row per variant at learning rate `lr`."""
    rows = [g for g in groups if g["lr"] == lr]
    domains = sorted({d for g in rows for d in g["ppl"]})
    head = (["variant", "added params"] + [f"PPL {d}" for d in domains] +
            ["PPL avg", "final loss", "gate score", "M-Act", "M-Act per token", "FFN-Act",
             "mean abs Y (before / after gate)",
             "F-Attn", "Sink_1^0.3 share", "loss spikes",
             "diverged"])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in rows:
        cells_ = ([g["variant"], f"{g['added_params']:,}"] + [fmt(g["ppl"].get(d)) for d in domains] +
                  [fmt(g["ppl_avg"]), fmt(g["final_loss"], 3), fmt(g["gate_score"], 3), fmt(g["m_act"], 1),
                   fmt(g.get("m_act_per_token"), 1), fmt(g.get("ffn_act"), 1),
                   f"{fmt(g.get('mean_abs_y'), 3)} / {fmt(g.get('mean_abs_y_gated'), 3)}",
                   fmt(g["f_attn"], 3), fmt(g.get("sink_share"), 2), fmt(g["loss_spikes"], 1),
                   f"{g['diverged']}/{g['seeds']}"])
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


def clip_claims(study: Study, groups: list[dict]) -> list[dict]:
    """The claims' verdicts; with several `grad_clips`, once per setting (keys "CLAIM@grad_clip=C")."""
    out = []
    for clip in study.clips:
        for c in claims([g for g in groups if g.get("clip", clip) == clip], study.reference_lr, table=study.claims,
                        gated=study.gated_variant, reference=study.reference_variant):
            if len(study.clips) > 1:
                c = {**c, "claim": f"{c['claim']}@grad_clip={clip:g}", "grad_clip": clip,
                     "text": f"*{_clip_words(clip)}:* {c['text']}"}
            out.append(c)
    return out


def write_report(study: Study, records: list[dict], root: Path) -> dict:
    from gattn.eval import plots  # noqa: PLC0415

    all_groups, all_records = aggregate(study, records), records
    ref, clips = study.reference_lr, study.clips
    # With several grad_clips the claims, the stability table and its figures are given per
    # setting; the other tables and figures are of the first setting.
    verdicts = clip_claims(study, all_groups)
    groups = [g for g in all_groups if g["clip"] == clips[0]]
    records = [r for r in records if r.get("clip", clips[0]) == clips[0]]
    figdir = root / "figures"
    ref_records = [r for r in records if r["lr"] == ref]
    at = {g["variant"]: g for g in groups if g["lr"] == ref}
    per_clip = [] if len(clips) == 1 else [
        p for clip in clips for p in (
            plots.loss_curves({lr: [r for r in all_records if r["lr"] == lr and r.get("clip") == clip] for lr in study.lrs},
                              figdir / f"loss_curves_clip_{clip:g}.png"),
            plots.stability([g for g in all_groups if g["clip"] == clip], study.divergence_threshold,
                            figdir / f"stability_clip_{clip:g}.png") if len(study.lrs) > 1 else None)]
    figures = per_clip + [
        plots.loss_curves({lr: [r for r in records if r["lr"] == lr] for lr in study.lrs}, figdir / "loss_curves.png")
        if len(clips) == 1 else None,
        plots.per_layer({v: {"per_layer": g["per_layer"]} for v, g in at.items() if g["per_layer"]},
                        figdir / "per_layer.png", title=f"per layer, mean over seeds (LR {ref:g})")
        if any(g["per_layer"] for g in at.values()) else None,
        plots.mean_abs_y({v: {"per_layer": g["per_layer"]} for v, g in at.items() if g["per_layer"]},
                         figdir / "mean_abs_y.png", title=f"mean |SDPA output| before and after the gate (LR {ref:g})")
        if any(g["per_layer"] and "mean_abs_y" in g["per_layer"][0] for g in at.values()) else None,
        plots.gate_histograms({r["variant"]: r["measurements"] for r in ref_records
                               if not r["diverged"] and r["seed"] == study.seeds[0]
                               and "gate_histogram" in r["measurements"]}, figdir / "gate_scores.png"),
        plots.attention_map_pair({r["variant"]: r["measurements"] for r in ref_records
                                  if not r["diverged"] and r["seed"] == study.seeds[0]}, figdir / "attention_maps.png"),
        plots.sink_curves({v: g["sink_curve"] for v, g in at.items() if g["sink_curve"]},
                          figdir / "f_attn_vs_tokens.png"),
        plots.stability(groups, study.divergence_threshold, figdir / "stability.png")
        if len(study.lrs) > 1 and len(clips) == 1 else None,
    ]
    if study.sink_rule is not None:
        figures.append(mechanism_figure(study, records, figdir / "gate_vs_alpha_1.png"))
    figures = [str(p.relative_to(root)) for p in figures if p]
    timed = [r["seconds"] for r in records if "seconds" in r]
    seconds = {k: sum(t[k] for t in timed) for k in ("train", "measure")} if timed else None
    report = {"study": describe(study), "groups": all_groups, "claims": verdicts, "figures": figures,
              "roles": {"gated": study.gated_variant, "reference": study.reference_variant},
              "seconds": seconds,
              **({"sink_rule": sink_verdicts(study, records)} if study.sink_rule is not None else {}),
              **({"stability_rule": stability_verdicts(study, records)} if study.stability_rule is not None else {}),
              "cells": [{k: v for k, v in r.items() if k not in ("measurements", "losses")} for r in all_records]}
    (root / "report.json").write_text(json.dumps(report, indent=1))
    (root / "report.md").write_text(markdown(report))
    return report


def _clip_words(clip: float) -> str:
    return f"gradient clipping at {clip:g}" if clip else "no gradient clipping"


def divergence_words(s: dict) -> str:
    """What 'diverged' counts in the tables: the runner's stop (non-finite losses, or a final loss
    above `Study.diverged_loss` when that is finite); a stability rule judges by its own margin."""
    words = "A run diverged if training stopped on non-finite losses"
    if math.isfinite(s["diverged_loss"]):
        words += f" or its final loss is above {s['diverged_loss']:.3f}"
    if s.get("stability_rule"):
        words += " (the preset stability rule below also counts a run that ends far above its own best)"
    return words + "."


def markdown(report: dict) -> str:
    s = report["study"]
    clips = s.get("grad_clips", [])
    all_groups = report["groups"]
    report = {**report, "groups": [g for g in all_groups if not clips or g.get("clip") == clips[0]]}
    lines = [f"# Study: {s['description'] or ', '.join(s['variants'])}", "",
             f"{len(s['variants'])} variants x {len(s['learning_rates'])} learning rate(s) x {len(s['seeds'])} seeds; "
             f"{s['steps']} steps of {s['batch_size']} x {s['seq_len']} tokens ({s['tokens']:,} tokens) per run. "
             f"Mean ± sample std over seeds. {divergence_words(s)} Perplexity: held-out text per domain."
             + (f" Wall time: {sum(report['seconds'].values()) / 60:.1f} min ({report['seconds']['train'] / 60:.1f} "
                f"training, {report['seconds']['measure'] / 60:.1f} measuring)." if report.get("seconds") else ""), "",
             f"## Table (LR {s['reference_lr']:g}" + (f", {_clip_words(clips[0])})" if clips else ")"), "",
             table(report["groups"], s["reference_lr"]), ""]
    uniform = [g["uniform_f_attn"]["mean"] for g in report["groups"] if g.get("uniform_f_attn")]
    if uniform:  # what the sink numbers are to be read against (docs/sinks.md)
        lines += [f"Uniform attention would give F-Attn {uniform[0]:.3f} on the measured rows and alpha_1 "
                  f"H_T/T = {sum(1 / k for k in range(1, 65)) / 64:.3f} on Sink_1's windows of T = 64.", ""]
    for clip in clips or [None]:
        if len(s["learning_rates"]) > 1:
            lines += ["## Stability across learning rates" + (f" ({_clip_words(clip)})" if clips else ""), "",
                      stability_table([g for g in all_groups if clip is None or g.get("clip") == clip]), ""]
        elif clips and clip != clips[0]:
            lines += [f"## Table (LR {s['reference_lr']:g}, {_clip_words(clip)})", "",
                      table([g for g in all_groups if g.get("clip") == clip], s["reference_lr"]), ""]
    curves = [g for g in report["groups"] if g["lr"] == s["reference_lr"] and g["sink_curve"]]
    if curves:
        tokens = [r["tokens"] for r in curves[0]["sink_curve"]]
        lines += ["## F-Attn against training tokens (mean over seeds)", "",
                  "| variant | " + " | ".join(f"{t:,}" for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
        lines += [f"| {g['variant']} | " + " | ".join(f"{r['f_attn']:.3f}" for r in g["sink_curve"]) + " |"
                  for g in curves]
        lines.append("")
        for key, what in (("sink_share", "all queries"), ("sink_share_non_trigger", "non-trigger queries")):
            if all(key in r for g in curves for r in g["sink_curve"]):  # (gattn/eval/sinks.py)
                lines += [f"Sink_1^0.3 share (Gu et al.: alpha_1 > 0.3, T = 64; {what}), mean over seeds:", "",
                          "| variant | " + " | ".join(f"{t:,}" for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
                lines += [f"| {g['variant']} | " + " | ".join(f"{r[key]:.2f}" for r in g["sink_curve"]) + " |"
                          for g in curves]
                lines.append("")
    lines += ["## The paper's claims at this scale", ""]
    if report.get("roles"):
        r = report["roles"]
        lines += [f"The claims about gating compare {r['gated']} (`Study.gated`, `--gated`) with {r['reference']} "
                  "(`Study.reference`, `--reference`).", ""]
    lines += [c["text"] + "\n" for c in report["claims"]]
    if "sink_rule" in report:
        lines += markdown_lines(report["sink_rule"], s["sink_rule"])
    if "stability_rule" in report:
        lines += stability_lines(report["stability_rule"], s["stability_rule"])
    lines += ["## Figures", ""] + [f"![{Path(f).stem}]({f})" for f in report["figures"]]
    return "\n".join(lines) + "\n"
