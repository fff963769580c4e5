"""The sink verdict's rule, set before a study's runs (`Study.sink_rule`, docs/sinks.md): does a
gate remove the baseline's attention sink, judged on seeds paired by seed (the same data order)?

- No verdict unless the sink matters: the baseline's mean `<s>`-ablation cost (the loss of hiding
  the first token from every later query, gattn/eval/sinks.py) is at least `min_ablation_cost`.
- Each measure is judged on the paired differences d = gated - baseline, with a `confidence`
  interval of their mean (Student's t, or a percentile bootstrap):
    removes          the interval lies below 0 and the mean drop is >= `removes` x the baseline's mean
    reduces          the interval lies below 0, a smaller drop
    increases        the interval lies above 0
    does not change  the interval lies within +-`same` x the baseline's mean
    cannot tell      anything else (a wide interval across 0; fewer than 2 pairs)
- The sink: every measure of `sink` (non-trigger alpha_1 and F-Attn) removes it -> "removes"; all
  at least reduce it -> "reduces"; all agree otherwise -> that; they disagree -> "cannot tell".
- Each measure of `alone` (M-Act, the first token's residual norm) is judged alone by the same rule.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from gattn.config import ConfigError

REMOVES, REDUCES, INCREASES, SAME, CANNOT, NONE = (
    "removes", "reduces", "increases", "does not change", "cannot tell", "no verdict")
INTERVALS = ("t", "bootstrap")


@dataclass(frozen=True)
class SinkRule:
    min_ablation_cost: float = 0.05   # nats: the baseline's mean <s>-ablation cost a verdict needs
    removes: float = 0.5              # the paired drop, as a share of the baseline's mean, that removes
    same: float = 0.1                 # "does not change": the interval within +- this share of the baseline's mean
    confidence: float = 0.95
    interval: str = "t"               # "t" (Student's t) or "bootstrap" (percentile, `resamples` draws)
    resamples: int = 10_000
    sink: tuple[str, ...] = ("alpha_1_non_trigger_rest_mean", "f_attn")
    alone: tuple[str, ...] = ("m_act", "residual_norm_first")

    def __post_init__(self):
        for name in ("min_ablation_cost", "removes", "same"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ConfigError(f"sink_rule.{name}", v, "expected a number >= 0")
        if not 0 < self.confidence < 1:
            raise ConfigError("sink_rule.confidence", self.confidence, "expected a number in (0, 1), e.g. 0.95")
        if self.interval not in INTERVALS:
            raise ConfigError("sink_rule.interval", self.interval, f"expected one of {', '.join(INTERVALS)}")
        if not self.sink:
            raise ConfigError("sink_rule.sink", self.sink, "expected at least one measure")

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def paired(reference: list[float], gated: list[float], rule: SinkRule) -> dict:
    """The paired differences' mean and `rule`'s interval, with the means and the relative change."""
    ref, gat = np.asarray(reference, float), np.asarray(gated, float)
    if ref.shape != gat.shape:
        raise ValueError(f"paired values need one gated value per reference value: {ref.shape} vs {gat.shape}")
    d, n = gat - ref, len(ref)
    lo = hi = math.nan
    if n >= 2:
        if rule.interval == "t":
            from scipy import stats  # noqa: PLC0415

            half = stats.t.ppf(0.5 + rule.confidence / 2, n - 1) * d.std(ddof=1) / math.sqrt(n)
            lo, hi = d.mean() - half, d.mean() + half
        else:
            rng = np.random.default_rng(0)
            means = d[rng.integers(0, n, (rule.resamples, n))].mean(axis=1)
            lo, hi = np.quantile(means, [0.5 - rule.confidence / 2, 0.5 + rule.confidence / 2])
    base = float(ref.mean()) if n else math.nan
    rel = (lambda x: float(x) / abs(base) if base else math.nan)
    return {"n": n, "reference_mean": base, "gated_mean": float(gat.mean()) if n else math.nan,
            "diff": float(d.mean()) if n else math.nan, "lo": float(lo), "hi": float(hi),
            "change": rel(d.mean()) if n else math.nan, "change_lo": rel(lo), "change_hi": rel(hi)}


def judge(p: dict, rule: SinkRule) -> str:
    """One measure's verdict from its `paired` statistics."""
    if p["n"] < 2 or not (math.isfinite(p["lo"]) and math.isfinite(p["hi"])):
        return CANNOT
    if p["hi"] < 0:
        return REMOVES if -p["diff"] >= rule.removes * abs(p["reference_mean"]) else REDUCES
    if p["lo"] > 0:
        return INCREASES
    band = rule.same * abs(p["reference_mean"])
    return SAME if -band <= p["lo"] and p["hi"] <= band else CANNOT


def combine(verdicts: list[str]) -> str:
    """The sink's verdict from its measures' (see the module's docstring)."""
    if all(v == REMOVES for v in verdicts):
        return REMOVES
    if all(v in (REMOVES, REDUCES) for v in verdicts):
        return REDUCES
    return verdicts[0] if len(set(verdicts)) == 1 else CANNOT


def verdict(reference: dict[int, dict], gated: dict[int, dict], rule: SinkRule) -> dict:
    """The rule applied to runs keyed by seed ({seed: {measure: value}}; only the seeds both have
    are paired): {"ablation_cost", "matters", "pairs", "measures": {name: paired + "verdict"},
    "sink": the sink's verdict, "alone": {name: verdict}, "why": a sentence when there is none}."""
    seeds = sorted(set(reference) & set(gated))
    costs = [reference[s].get("ablation_cost") for s in reference]
    costs = [c for c in costs if c is not None and math.isfinite(c)]
    cost = float(np.mean(costs)) if costs else math.nan
    out = {"ablation_cost": cost, "min_ablation_cost": rule.min_ablation_cost, "pairs": len(seeds),
           "matters": bool(costs) and cost >= rule.min_ablation_cost, "measures": {}}
    for name in rule.sink + rule.alone:
        both = [s for s in seeds if _finite(reference[s].get(name)) and _finite(gated[s].get(name))]
        p = paired([reference[s][name] for s in both], [gated[s][name] for s in both], rule)
        out["measures"][name] = {**p, "verdict": judge(p, rule)}
    if not out["matters"]:
        out["why"] = ("the baseline's <s>-ablation cost was not measured" if not costs else
                      f"the baseline's sink does not matter: hiding <s> costs {cost:.4f} nats "
                      f"< {rule.min_ablation_cost:g}")
        out["sink"] = NONE
        out["alone"] = {name: NONE for name in rule.alone}
        return out
    out["sink"] = combine([out["measures"][m]["verdict"] for m in rule.sink])
    out["alone"] = {name: out["measures"][name]["verdict"] for name in rule.alone}
    return out


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
