"""The preset stability rule (`Study.stability_rule`, docs/instability.md): does a variant tolerate
a high learning rate better than the reference, judged on seeds paired by seed (the same data
order and initialisation seed), at each learning rate of the study, by numbers fixed before the runs:

- A run diverged if training stopped on non-finite losses, or if its final loss (the mean of its
  last `window` logged losses) is above its best (the lowest mean of `window` consecutive losses)
  by more than `margin` nats: a run that got worse and did not come back.
- Divergence counts: an exact one-sided McNemar test on the discordant pairs (b: the reference
  diverged and the variant did not; c: the other way): under "no difference" b ~ Bin(b + c, 1/2);
  "fewer divergences" if P(X >= b) < `alpha`, "more divergences" if P(X >= c) < `alpha`.
- Loss spikes (the trainer's counter, train.spike_window / spike_margin): the paired differences
  variant - reference and their `confidence` interval: "fewer spikes" below 0, "more spikes" above
  0, else "cannot tell".
- No verdict at a learning rate where the reference is stable: none of its seeds diverged and its
  mean spike count is below `min_spikes`.
- The learning rate's verdict: "more stable" = fewer divergences (and not more spikes); "fewer
  spikes" = no divergence difference shown and fewer spikes; "less stable" = more divergences, or
  no divergence difference and more spikes; else "cannot tell".
- The claim ("tolerates a higher LR"): "supported" if some rate is "more stable" and none "less
  stable"; "partly supported" if some rate has only "fewer spikes" and none is "less stable";
  "contradicted" if some rate is "less stable" and none better; "cannot tell" otherwise; "no
  verdict" if the reference is stable at every rate.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from gattn.config import ConfigError
from gattn.eval.verdict import INTERVALS, paired

FEWER_DIV, MORE_DIV, NO_DIFF, NEITHER = "fewer divergences", "more divergences", "no difference shown", "none diverged"
FEWER_SPIKES, MORE_SPIKES, CANNOT = "fewer spikes", "more spikes", "cannot tell"
MORE_STABLE, LESS_STABLE, STABLE_REF = "more stable", "less stable", "no verdict: the reference is stable here"
SUPPORTED, PARTLY, CONTRADICTED, NONE = "supported", "partly supported", "contradicted", "no verdict"


@dataclass(frozen=True)
class StabilityRule:
    margin: float = 1.0        # nats: final loss above the run's best by more than this = diverged
    window: int = 10           # losses averaged for "final" and "best"
    alpha: float = 0.05        # the exact test's one-sided level
    confidence: float = 0.95   # the paired spike interval
    interval: str = "t"        # "t" (Student's t) or "bootstrap" (percentile, `resamples` draws)
    resamples: int = 10_000
    min_spikes: float = 1.0    # the reference's mean spike count that makes a rate unstable without a divergence

    def __post_init__(self):
        for name in ("margin", "min_spikes"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ConfigError(f"stability_rule.{name}", v, "expected a number >= 0")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ConfigError("stability_rule.window", self.window, "expected an integer >= 1")
        for name in ("alpha", "confidence"):
            if not 0 < getattr(self, name) < 1:
                raise ConfigError(f"stability_rule.{name}", getattr(self, name), "expected a number in (0, 1)")
        if self.interval not in INTERVALS:
            raise ConfigError("stability_rule.interval", self.interval, f"expected one of {', '.join(INTERVALS)}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def run_outcome(losses: list[float | None], stopped: bool, rule: StabilityRule) -> dict:
    """{"diverged", "why", "final", "best", "max"} of one run's logged losses (None: non-finite)."""
    finite = [x for x in losses if x is not None and math.isfinite(x)]
    w = min(rule.window, len(finite)) if finite else 0
    means = np.convolve(finite, np.ones(w) / w, mode="valid") if w else np.array([])
    final, best = (float(means[-1]), float(means.min())) if len(means) else (math.nan, math.nan)
    out = {"final": final, "best": best, "max": max(finite) if finite else math.nan}
    if stopped or not finite:
        return {**out, "diverged": True, "why": "training stopped on non-finite losses"}
    if final - best > rule.margin:
        return {**out, "diverged": True, "why": f"final loss {final:.3f} above its best {best:.3f} by more than "
                                                f"{rule.margin:g}"}
    return {**out, "diverged": False, "why": ""}


def exact_one_sided(b: int, c: int) -> float:
    """P(X >= b) for X ~ Bin(b + c, 1/2): the exact McNemar test that the first side's b
    discordant pairs are more than chance gives (1.0 when there are none)."""
    n = b + c
    return float(sum(math.comb(n, k) for k in range(b, n + 1)) / 2 ** n) if n else 1.0


def judge_rate(reference: dict[int, dict], variant: dict[int, dict], rule: StabilityRule) -> dict:
    """The rule at one learning rate; each side {seed: {"diverged": bool, "spikes": int}}; only
    the seeds both have are paired."""
    seeds = sorted(set(reference) & set(variant))
    rd = [bool(reference[s]["diverged"]) for s in seeds]
    vd = [bool(variant[s]["diverged"]) for s in seeds]
    b = sum(r and not v for r, v in zip(rd, vd))
    c = sum(v and not r for r, v in zip(rd, vd))
    p_fewer, p_more = exact_one_sided(b, c), exact_one_sided(c, b)
    div = FEWER_DIV if p_fewer < rule.alpha else MORE_DIV if p_more < rule.alpha else NO_DIFF if any(rd + vd) else NEITHER
    spikes = paired([reference[s]["spikes"] for s in seeds], [variant[s]["spikes"] for s in seeds], rule)
    ok = spikes["n"] >= 2 and math.isfinite(spikes["lo"])
    spk = FEWER_SPIKES if ok and spikes["hi"] < 0 else MORE_SPIKES if ok and spikes["lo"] > 0 else CANNOT
    unstable = any(rd) or (bool(seeds) and spikes["reference_mean"] >= rule.min_spikes)
    if not unstable:
        verdict = STABLE_REF
    elif div == FEWER_DIV:
        verdict = MORE_STABLE if spk != MORE_SPIKES else CANNOT
    elif div == MORE_DIV:
        verdict = LESS_STABLE
    else:
        verdict = FEWER_SPIKES if spk == FEWER_SPIKES else LESS_STABLE if spk == MORE_SPIKES else CANNOT
    return {"pairs": len(seeds), "reference_diverged": sum(rd), "variant_diverged": sum(vd), "b": b, "c": c,
            "p_fewer": p_fewer, "p_more": p_more, "divergence": div, "spikes": {**spikes, "verdict": spk},
            "reference_unstable": unstable, "verdict": verdict}


def claim(rates: dict[float, dict]) -> str:
    """The claim's verdict from the learning rates' (`judge_rate` results keyed by LR)."""
    vs = [r["verdict"] for r in rates.values()]
    if not vs or all(v == STABLE_REF for v in vs):
        return NONE
    better, worse = MORE_STABLE in vs, LESS_STABLE in vs
    if better and not worse:
        return SUPPORTED
    if FEWER_SPIKES in vs and not worse:
        return PARTLY
    if worse and not better and FEWER_SPIKES not in vs:
        return CONTRADICTED
    return CANNOT


def cell_outcome(record: dict, rule: StabilityRule) -> dict:
    """A study cell's record (gattn/experiments/study/runner.py) judged by the rule: run_outcome
    plus "spikes" (the counter's, from its logged steps, so a stopped run counts too)."""
    stopped = bool(record.get("diverged")) and str(record["diverged"]).startswith("training stopped")
    out = run_outcome(record["losses"]["loss"], stopped, rule)
    return {**out, "spikes": len(record["losses"]["spike_steps"])}


def evaluate(study, records: list[dict]) -> list[dict]:
    """Each variant of the study against the reference at every learning rate (the first
    grad_clip setting): [{"variant", "reference", "rates": {lr: judge_rate(...)}, "claim"}]."""
    rule, ref = study.stability_rule, study.reference_variant
    clip = study.clips[0]
    ok = [r for r in records if r.get("clip", clip) == clip]
    by = {(r["variant"], r["lr"]): {} for r in ok}
    for r in ok:
        by[(r["variant"], r["lr"])][r["seed"]] = cell_outcome(r, rule)
    out = []
    for v in study.variants:
        if v == ref:
            continue
        rates = {lr: judge_rate(by.get((ref, lr), {}), by.get((v, lr), {}), rule) for lr in study.lrs
                 if by.get((v, lr)) and by.get((ref, lr))}
        if rates:
            out.append({"variant": v, "reference": ref, "rates": rates, "claim": claim(rates)})
    return out


def _num(x, digits=2) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def markdown_lines(results: list[dict], rule: dict) -> list[str]:
    """report.md's section: the rule, then one row per variant and learning rate."""
    lines = ["## The preset stability rule", "",
             f"Set in the study before its runs (study.json `stability_rule`): a run diverged if training stopped "
             f"on non-finite losses or its final loss (mean of the last {rule['window']}) is above its best by more "
             f"than {rule['margin']:g} nats; divergence counts by an exact one-sided McNemar test on the paired seeds "
             f"(alpha {rule['alpha']:g}); loss spikes by the {rule['confidence']:.0%} {rule['interval']} interval of "
             f"the paired differences; no verdict at a rate where the reference neither diverged nor averaged "
             f">= {rule['min_spikes']:g} spikes.", "",
             "| variant | LR | pairs | diverged (reference / variant) | b, c | p (fewer / more) | spikes (reference / "
             "variant) | spike difference [interval] | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for lr, j in r["rates"].items():
            s = j["spikes"]
            lines.append(f"| {r['variant']} | {lr:g} | {j['pairs']} | {j['reference_diverged']} / {j['variant_diverged']}"
                         f" | {j['b']}, {j['c']} | {j['p_fewer']:.3f} / {j['p_more']:.3f} | {_num(s['reference_mean'], 1)}"
                         f" / {_num(s['gated_mean'], 1)} | {_num(s['diff'], 1)} [{_num(s['lo'], 1)}, {_num(s['hi'], 1)}]"
                         f" ({s['verdict']}) | {j['verdict']} |")
    lines.append("")
    lines += [f"- **{r['variant']} against {r['reference']}: {r['claim']}**" for r in results]
    return lines + [""]
