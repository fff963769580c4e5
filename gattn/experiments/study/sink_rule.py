"""The preset sink rule in a study's report (`Study.sink_rule`, gattn/eval/verdict.py): each gated
variant against the reference, paired by seed, the verdict for the sink and for each measure judged
alone, a table of means and paired intervals, and the mechanism figure (gate score against alpha_1
per head)."""

from __future__ import annotations

import math
from pathlib import Path

from gattn.eval.verdict import paired, verdict

# Measures shown beside the judged ones (not judged): name -> where it is in a cell record.
SHOWN = ("ablation_cost", "alpha_1_gated_non_trigger_rest_mean", "head_out_norm_non_trigger_rest_mean",
         "value_norm_first_gated", "gate_score_non_trigger_rest_mean", "gate_score_trigger_mean",
         "sink_share", "final_loss")
LABELS = {"alpha_1_non_trigger_rest_mean": "non-trigger alpha_1 (queries after the first)",
          "f_attn": "F-Attn", "m_act": "M-Act", "residual_norm_first": "first token's residual norm",
          "ablation_cost": "<s>-ablation cost (nats)",
          "alpha_1_gated_non_trigger_rest_mean": "non-trigger alpha_1 x gate score",
          "head_out_norm_non_trigger_rest_mean": "head output norm, non-trigger (after the gate)",
          "value_norm_first_gated": "first token's value norm after the gate",
          "gate_score_non_trigger_rest_mean": "gate score, non-trigger queries",
          "gate_score_trigger_mean": "gate score, trigger queries",
          "sink_share": "Sink_1^0.3 share (shown, not judged)", "final_loss": "final training loss"}


def values(record: dict) -> dict:
    """A cell record's measures by name: its sink measures, then the paper's, then its final loss."""
    out = {"final_loss": record.get("final_loss")}
    out.update(record.get("measurements", {}).get("overall", {}))
    out.update(record.get("sinks", {}).get("overall", {}))
    return {k: v for k, v in out.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def evaluate(study, records: list[dict]) -> list[dict]:
    """The rule for each gated variant of the study against its reference, at the reference LR and
    the first grad_clip setting: [{"variant", "reference", **verdict(...), "shown": {...}}]."""
    rule, ref_name = study.sink_rule, study.reference_variant
    ok = [r for r in records if not r["diverged"] and r["lr"] == study.reference_lr
          and r.get("clip", study.clips[0]) == study.clips[0]]
    by = {v: {r["seed"]: values(r) for r in ok if r["variant"] == v} for v in study.variants}
    out = []
    for v in study.variants:
        if v == ref_name or not by[v]:
            continue
        res = verdict(by[ref_name], by[v], rule)
        shown = {}
        for name in SHOWN:
            seeds = [s for s in sorted(set(by[ref_name]) & set(by[v])) if name in by[ref_name][s] and name in by[v][s]]
            if seeds:
                shown[name] = paired([by[ref_name][s][name] for s in seeds], [by[v][s][name] for s in seeds], rule)
        out.append({"variant": v, "reference": ref_name, **res, "shown": shown})
    return out


def _num(x: float, digits: int = 3) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _row(name: str, p: dict, judged: str) -> str:
    interval = f"{_num(p['diff'])} [{_num(p['lo'])}, {_num(p['hi'])}]"
    change = "-" if not math.isfinite(p["change"]) else f"{p['change']:+.0%}"
    return (f"| {LABELS.get(name, name)} | {_num(p['reference_mean'])} | {_num(p['gated_mean'])} | {interval} | "
            f"{change} | {p['n']} | {judged} |")


def markdown_lines(results: list[dict], rule: dict) -> list[str]:
    """report.md's section: the rule, then per gated variant its verdicts and table."""
    lines = ["## The preset sink rule", "",
             f"Set in the study before its runs (study.json `sink_rule`): a verdict only if the reference's mean "
             f"<s>-ablation cost is >= {rule['min_ablation_cost']:g} nats; per measure, the paired differences "
             f"(gated - reference, same seed) and their {rule['confidence']:.0%} interval ({rule['interval']}): "
             f"\"removes\" = interval below 0 and a drop >= {rule['removes']:.0%} of the reference's mean; "
             f"\"reduces\" = interval below 0; \"increases\" = above 0; \"does not change\" = interval within "
             f"+-{rule['same']:.0%} of the reference's mean; else \"cannot tell\". The sink: "
             f"{' and '.join(rule['sink'])} together; judged alone: {', '.join(rule['alone'])}.", ""]
    for r in results:
        head = (f"**{r['variant']} against {r['reference']}** ({r['pairs']} paired seeds; the reference's "
                f"<s>-ablation cost {_num(r['ablation_cost'], 4)} nats): sink: **{r['sink']}**; " +
                "; ".join(f"{LABELS.get(k, k)}: **{v}**" for k, v in r["alone"].items()))
        lines += [head + (f" ({r['why']})" if r.get("why") else ""), "",
                  f"| measure | {r['reference']} | {r['variant']} | paired difference [{rule['confidence']:.0%} "
                  "interval] | change | pairs | verdict |", "|---|---|---|---|---|---|---|"]
        lines += [_row(k, p, p["verdict"]) for k, p in r["measures"].items()]
        lines += [_row(k, p, "(shown)") for k, p in r["shown"].items()]
        lines.append("")
    return lines


def mechanism_figure(study, records: list[dict], path: Path) -> Path | None:
    """Gate score against non-trigger alpha_1, one point per (seed, layer, head), one panel per
    variant: the gate score at non-trigger queries (filled) and at triggers (open); an ungated
    model's heads sit at 1 (no gate). None if the records lack the per-head measures."""
    from matplotlib.figure import Figure  # noqa: PLC0415

    ok = [r for r in records if not r["diverged"] and r["lr"] == study.reference_lr and "sinks" in r
          and r.get("clip", study.clips[0]) == study.clips[0]]
    key = "alpha_1_non_trigger_rest_per_head"
    if not ok or key not in ok[0]["sinks"]["per_layer"][0]:
        return None
    names = [v for v in study.variants if any(r["variant"] == v for r in ok)]
    fig = Figure(figsize=(4 * len(names), 3.6))
    axes = fig.subplots(1, len(names), sharex=True, sharey=True, squeeze=False)[0]
    for ax, v in zip(axes, names):
        for r in (r for r in ok if r["variant"] == v):
            for layer in r["sinks"]["per_layer"]:
                a = layer[key]
                ax.scatter(a, layer.get("gate_score_non_trigger_rest_per_head", [1.0] * len(a)), c="C0", s=18)
                ax.scatter(a, layer.get("gate_score_trigger_per_head", [1.0] * len(a)), facecolors="none",
                           edgecolors="C3", s=18)
        gated = any("gate_score_trigger_per_head" in layer for r in ok if r["variant"] == v
                    for layer in r["sinks"]["per_layer"])
        ax.set_title(v if gated else f"{v} (no gate: 1)")
        ax.set_xlabel("non-trigger alpha_1 on <s> (per head)")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.05)
    axes[0].set_ylabel("gate score (filled: non-trigger, open: trigger)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
