"""The statistics of a study: mean and sample standard deviation over seeds of every table column
(`aggregate`), and whether one group's mean is below another's by more than the seed spread
(`compare`)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from gattn import cli, variants


def trained_model(study, variant: str | None = None):
    """The model a cell of `variant` trains (None: the baseline), the study's overrides included
    (the report's parameter counts; before, they were counted without the overrides)."""
    model = study.baseline if variant is None else variants.apply(variant, study.baseline)
    if not study.overrides:
        return model
    return cli.apply_overrides(dataclasses.replace(study.base, model=model), list(study.overrides)).model


def _stat(values) -> dict | None:
    """mean, sample std (0 for one value) and n of the finite values; None if there are none."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    return {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
            "n": len(vals)}


def fmt(s: dict | None, digits: int = 2) -> str:
    """A `_stat` as text: "mean ± std" ("mean" for one value, "-" for none)."""
    if s is None:
        return "-"
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}" if s["n"] > 1 else f"{s['mean']:.{digits}f}"


def _mean_curves(rows: list[list[dict]], keys: tuple[str, ...]) -> list[dict]:
    """Per-layer (or per-checkpoint) rows averaged over seeds, for the keys every seed has."""
    if not rows:
        return []
    n = min(len(r) for r in rows)
    out = []
    for i in range(n):
        entry = {k: v for k, v in rows[0][i].items() if not isinstance(v, (float, list, dict))}
        for k in keys:
            if all(k in r[i] for r in rows):  # (None: an attention measure on a hybrid's GDN layer)
                values = [r[i][k] for r in rows]
                entry[k] = None if any(v is None for v in values) else float(np.mean(values))
        out.append(entry)
    return out


def _mean_by_step(curves: list[list[dict]]) -> list[dict]:
    """F-Attn / M-Act curves averaged over seeds at the steps every seed measured."""
    if not curves:
        return []
    common = set.intersection(*({r["step"] for r in c} for c in curves))
    out = []
    for step in sorted(common):
        rows = [next(r for r in c if r["step"] == step) for c in curves]
        keys = [k for k in ("f_attn", "m_act", "sink_share", "sink_share_non_trigger") if all(k in r for r in rows)]
        out.append({"step": step, "tokens": rows[0]["tokens"], **{k: float(np.mean([r[k] for r in rows])) for k in keys}})
    return out


def aggregate(study, records: list[dict]) -> list[dict]:
    """One entry per (variant, learning rate) of `study`: mean and std over seeds of every table
    column. Added parameters are counted against the study's base model (the baseline)."""
    from gattn.model.params import count_params  # noqa: PLC0415

    base_params = count_params(trained_model(study))
    groups = []
    for clip, lr in ((c, lr) for c in study.clips for lr in study.lrs):
        for v in study.variants:
            rs = [r for r in records if r["variant"] == v and r["lr"] == lr and r.get("clip", study.clips[0]) == clip]
            ok = [r for r in rs if not r["diverged"]]
            domains = sorted({d for r in ok for d in r["perplexity"]})
            g = {"variant": v, "lr": lr, "clip": clip, "seeds": len(rs), "diverged": sum(bool(r["diverged"]) for r in rs),
                 "added_params": count_params(trained_model(study, v)) - base_params,
                 # (a diverged seed's last finite loss is no final loss; the per-seed list keeps it)
                 "final_loss": _stat(r["final_loss"] for r in ok),
                 "final_loss_per_seed": [r["final_loss"] for r in rs],
                 "loss_spikes": _stat(r.get("loss_spikes") for r in rs),
                 "ppl": {d: _stat(r["perplexity"][d] for r in ok) for d in domains},
                 "ppl_avg": _stat(np.mean([r["perplexity"][d] for d in domains]) for r in ok)}
            for key in ("gate_score", "m_act", "f_attn", "sink_head_share", "m_act_per_token", "ffn_act",
                        "mean_abs_y", "mean_abs_y_gated"):
                g[key] = _stat(r["measurements"]["overall"].get(key) for r in ok) if ok else None
            # Gu et al.'s Sink_1^eps share and uniform attention's F-Attn on the same data (gattn/eval/sinks.py)
            for key in ("sink_share", "uniform_f_attn", "sink_share_non_trigger"):
                g[key] = _stat(r.get("sinks", {}).get("overall", {}).get(key) for r in ok) if ok else None
            per_layer = [r["measurements"]["per_layer"] for r in ok]
            g["per_layer"] = _mean_curves(per_layer, ("m_act", "f_attn", "sink_head_share", "gate_score",
                                                      "m_act_per_token", "ffn_act", "mean_abs_y", "mean_abs_y_gated"))
            g["sink_curve"] = _mean_by_step([r["sink_curve"] for r in ok])
            groups.append(g)
    return groups


def compare(better: dict | None, worse: dict | None, metric: str) -> dict:
    """Is `better`'s mean below `worse`'s by more than the seed spread (the larger of the two
    sample stds)? verdict: supported / contradicted / inconclusive / untested."""
    if better is None or worse is None:
        return {"verdict": "untested", "metric": metric}
    diff = worse["mean"] - better["mean"]
    spread = max(better["std"], worse["std"])
    if min(better["n"], worse["n"]) < 2:  # one seed: no spread to judge a difference by
        verdict = "inconclusive"
    else:
        verdict = "supported" if diff > spread else "contradicted" if diff < -spread else "inconclusive"
    return {"verdict": verdict, "metric": metric, "better": better, "worse": worse, "diff": diff, "spread": spread}
