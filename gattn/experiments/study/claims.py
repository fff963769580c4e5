"""The paper's claims as data, and their verdicts computed from a study's numbers.

A `Claim` names the variants it compares in `pairs` of (the variant the paper favours, the one it
beats), and how they are compared (`test`):

    "ppl"   every pair's average held-out perplexity at the reference LR
    "sink"  F-Attn and M-Act of its one pair: lower, and at most REMOVED x the reference's
    "lr"    divergence of its one pair across the study's learning rates (then the final losses)

A pair names registered variants, or the roles GATED and REFERENCE, which a study sets
(`Study.gated`, `Study.reference`; by default sdpa_elementwise and baseline, or the study's only
gated and only ungated variant when it runs no sdpa_elementwise or no baseline), so that the
generic claims (gating beats the baseline, removes the sink, tolerates a higher LR) can be pointed
at other variants. `CLAIMS` is the paper's table; a study may bring its own (`Study.claims`). A
claim the study cannot test says why and which field (and flag) would make it testable.
"""

from __future__ import annotations

from dataclasses import dataclass

from gattn import variants
from gattn.config import ConfigError
from gattn.experiments.study.stats import compare, fmt

GATED, REFERENCE = "<gated>", "<reference>"  # the roles a claim's pairs may name
PAPER_GATED, PAPER_REFERENCE = "sdpa_elementwise", "baseline"  # what they stand for by default
TESTS = ("ppl", "sink", "lr")


@dataclass(frozen=True)
class Claim:
    key: str
    title: str
    pairs: tuple[tuple[str, str], ...]  # (expected better, expected worse): variant names or roles
    test: str = "ppl"

    def __post_init__(self):
        if self.test not in TESTS:
            raise ConfigError(f"claims.{self.key}.test", self.test, f"expected one of {', '.join(TESTS)}")
        if not self.pairs or any(len(p) != 2 or p[0] == p[1] for p in self.pairs):
            raise ConfigError(f"claims.{self.key}.pairs", self.pairs, "expected (better, worse) pairs of two variants")
        if self.test != "ppl" and len(self.pairs) != 1:
            raise ConfigError(f"claims.{self.key}.pairs", self.pairs, f"a {self.test!r} claim compares one pair")
        for name in (n for p in self.pairs for n in p):
            if name not in variants.REGISTRY and name not in (GATED, REFERENCE):
                raise ConfigError(f"claims.{self.key}.pairs", name,
                                  f"expected registered variant names or the roles {GATED}, {REFERENCE}")


CLAIMS = (
    Claim("gated_beats_baseline", "Gating the SDPA output lowers perplexity (Tables 1 and 4)",
          ((GATED, REFERENCE),)),
    Claim("position_order", "G1 (SDPA output) beats G2 (values), which beats G3/G4/G5 (Table 1)",
          (("sdpa_elementwise", "v_elementwise"), ("v_elementwise", "k_elementwise"),
           ("v_elementwise", "q_elementwise"), ("v_elementwise", "dense_output"))),
    Claim("head_specific_beats_shared", "Head-specific gates beat head-shared ones (Table 1 rows 5 vs 12)",
          (("sdpa_elementwise", "sdpa_head_shared"),)),
    Claim("sparse_beats_ns_sigmoid", "The sparse sigmoid gate beats the non-sparse NS-sigmoid (Table 4 rows 2 vs 7)",
          (("sdpa_elementwise", "sdpa_ns_sigmoid"),)),
    Claim("input_dependent_beats_independent", "Input-dependent gates beat input-independent ones (Table 4 rows 2 vs 6)",
          (("sdpa_elementwise", "sdpa_input_independent"),)),
    Claim("gating_removes_sink_and_massive_activations",
          "Gating removes the attention sink and massive activations (Table 4, Figs. 2 and 6)",
          ((GATED, REFERENCE),), test="sink"),
    Claim("gating_tolerates_higher_lr", "Gating tolerates a higher learning rate (Table 2 rows 5-14)",
          ((GATED, REFERENCE),), test="lr"),
)

WORDS = {"supported": "This run supports it", "partly supported": "This run supports part of it",
         "contradicted": "This run contradicts it", "inconclusive": "This run cannot tell",
         "untested": "This run does not test it"}

REMOVED = 0.5  # a sink or massive activations count as removed at <= half the baseline's value


def claims(groups: list[dict], reference_lr: float, *, table: tuple[Claim, ...] = CLAIMS,
           gated: str = PAPER_GATED, reference: str = PAPER_REFERENCE) -> list[dict]:
    """The claims of `table`, each with a verdict computed from `groups` (see `aggregate`) and a
    paragraph stating it with the numbers and the seed spread; the roles GATED and REFERENCE
    stand for `gated` and `reference`."""
    roles = {GATED: gated, REFERENCE: reference}
    at = {g["variant"]: g for g in groups if g["lr"] == reference_lr}
    ran = list(dict.fromkeys(g["variant"] for g in groups))
    out = []
    for claim in table:
        pairs = [(roles.get(a, a), roles.get(b, b)) for a, b in claim.pairs]
        missing = {roles.get(n, n): _missing(n, roles, ran) for p in claim.pairs for n in p
                   if roles.get(n, n) not in ran}  # the variants it needs that the study does not run
        if claim.test == "ppl":
            out.append(_ppl_claim(claim, pairs, at, missing))
        elif claim.test == "sink":
            out.append(_sink_claim(claim, *pairs[0], at, missing))
        else:
            out.append(_lr_claim(claim, *pairs[0], groups, missing))
    return out


def _missing(name: str, roles: dict, ran: list[str]) -> str:
    """Why a claim naming the role `name` cannot be tested by a study of the variants `ran`, and
    the field (and flag) that would make it testable ("" for a variant named by itself: `_why`)."""
    if name not in roles:
        return ""
    field, what = ("gated", "gated variant") if name == GATED else ("reference", "reference")
    other = roles[REFERENCE if name == GATED else GATED]
    choices = [v for v in ran if v != other]
    fix = (f"set Study.{field} (--{field}) to one of {', '.join(choices)}, or add {roles[name]} to Study.variants "
           "(--variants)" if choices else f"add {roles[name]} to Study.variants (--variants)")
    return f"needs the {what} {roles[name]}, which this study does not run: {fix}"


def _why(names: tuple[str, ...], missing: dict) -> str:
    """Why a comparison of `names` cannot be tested because the study does not run some of them
    ("" if it runs them all); `missing`: the variants it does not run, with `_missing`'s reason."""
    absent = [n for n in dict.fromkeys(names) if n in missing]
    plain = [n for n in absent if not missing[n]]
    reasons = [missing[n] for n in absent if missing[n]]
    if plain:
        reasons.append(f"the study has no {' or '.join(plain)} run: add {'it' if len(plain) == 1 else 'them'} "
                       "to Study.variants (--variants)")
    return "; ".join(reasons)


def _compare_groups(better: dict | None, worse: dict | None, metric: str) -> dict:
    """`compare` on a metric of two variants' groups; a side that lost seeds to divergence makes
    the comparison inconclusive (its surviving seeds are a selection)."""
    c = compare((better or {}).get(metric), (worse or {}).get(metric), metric)
    lost = {g["variant"]: (g["diverged"], g["seeds"]) for g in (better, worse) if g and g["diverged"]}
    if lost and c["verdict"] != "untested":
        c.update(verdict="inconclusive", lost=lost)
    return c


def _pair_text(c: dict, a: str, b: str, what: str, digits: int = 2, missing: dict | None = None) -> str:
    """One comparison in words; `missing`: the variants the study does not run (`_why`)."""
    if c["verdict"] == "untested":
        return f"{a} vs {b} not tested ({_why((a, b), missing or {}) or 'every seed of one of them diverged'})"
    n = min(c["better"]["n"], c["worse"]["n"])
    beyond = abs(c["diff"]) > c["spread"]
    rel = ("lower, by more than" if c["diff"] > 0 else "higher, by more than") if beyond else "within"
    seeds = f"{n} seeds" if n > 1 else "one seed, so no spread to judge by"
    text = (f"{a} {what} {fmt(c['better'], digits)} vs {b} {fmt(c['worse'], digits)} ({seeds}): "
            f"{abs(c['diff']):.{digits}f} {rel} the seed spread ({c['spread']:.{digits}f})" if n > 1 else
            f"{a} {what} {fmt(c['better'], digits)} vs {b} {fmt(c['worse'], digits)} ({seeds}): "
            f"{abs(c['diff']):.{digits}f} {'lower' if c['diff'] > 0 else 'higher'}")
    for v, (k, total) in c.get("lost", {}).items():
        text += f"; {k} of {total} seeds of {v} diverged and are left out"
    return text


def _combine(verdicts: list[str]) -> str:
    tested = [v for v in verdicts if v != "untested"]
    if not tested:
        return "untested"
    if "contradicted" in tested:
        return "contradicted"
    if all(v == "supported" for v in tested):
        return "supported" if len(tested) == len(verdicts) else "partly supported"
    return "inconclusive"


def _ppl_claim(claim: Claim, pairs: list[tuple[str, str]], at: dict, missing: dict) -> dict:
    parts = [(a, b, _compare_groups(at.get(a), at.get(b), "ppl_avg")) for a, b in pairs]
    verdict = _combine([c["verdict"] for _, _, c in parts])
    details = "; ".join(_pair_text(c, a, b, "PPL", missing=missing) for a, b, c in parts)
    return {"claim": claim.key, "title": claim.title, "verdict": verdict,
            "comparisons": [{"better": a, "worse": b, **c} for a, b, c in parts],
            "text": f"**{claim.title}.** {WORDS[verdict]}: {details}."}


def _sink_claim(claim: Claim, gated: str, reference: str, at: dict, missing: dict) -> dict:
    """Sinks and massive activations: lower F-Attn and M-Act with the gate. "Removes": lower by
    more than the seed spread and at most REMOVED x the reference's (the paper: F-Attn 0.467 ->
    0.048, M-Act 1053 -> 94); merely lower is "partly supported"."""
    parts = [(what, _compare_groups(at.get(gated), at.get(reference), key))
             for what, key in (("F-Attn", "f_attn"), ("M-Act", "m_act"))]
    verdicts, texts = [], []
    for what, c in parts:
        v = c["verdict"]
        texts.append(_pair_text(c, gated, reference, what, 3, missing=missing))
        if v == "supported" and c["better"]["mean"] > REMOVED * c["worse"]["mean"]:
            v = "partly supported"
            texts[-1] += (f", but not removed ({c['better']['mean'] / c['worse']['mean']:.0%} of the baseline's; "
                          f"'removed' means at most {REMOVED:.0%})")
        verdicts.append(v)
    no_sink = _no_sink(at.get(reference))
    if no_sink and parts[0][1]["verdict"] != "untested":
        # Nothing to remove: F-Attn says nothing about the claim; M-Act is judged on its own.
        verdicts[0] = "inconclusive"
        texts[0] = f"no sink formed in the baseline ({no_sink}), so F-Attn says nothing about removing one ({texts[0]})"
        texts[1] = f"M-Act, judged on its own: {WORDS[verdicts[1]].lower()}: {texts[1]}"
    verdict = _combine(["supported" if v == "partly supported" else v for v in verdicts])
    if verdict == "supported" and "partly supported" in verdicts:  # lower, but not removed
        verdict = "partly supported"
    return {"claim": claim.key, "title": claim.title, "verdict": verdict,
            "parts": {"sink": verdicts[0], "m_act": verdicts[1]}, "no_sink_in_reference": bool(no_sink),
            "comparisons": [{"metric": c["metric"], **c} for _, c in parts],
            "text": f"**{claim.title}.** {WORDS[verdict]}: {'; '.join(dict.fromkeys(texts))}."}


def _no_sink(ref: dict | None) -> str:
    """Why the reference formed no sink ('' if it did, or if its numbers are missing): its share of
    sink heads is 0 (Sink_1^eps when measured, else F-Attn > threshold), or its F-Attn is within
    the seed spread of what uniform attention gives on the same data (`uniform_f_attn`)."""
    if not ref or not ref.get("f_attn"):
        return ""
    name = "Sink_1^0.3 share" if ref.get("sink_share") else "F-Attn sink heads share"  # (named apart: docs/sinks.md)
    share = ref.get("sink_share") or ref.get("sink_head_share")
    f, uniform = ref["f_attn"], ref.get("uniform_f_attn")
    if share is not None and share["mean"] == 0:
        return f"its {name} is 0 in every seed; F-Attn {fmt(f, 3)}" + (
            f", uniform attention gives {uniform['mean']:.3f}" if uniform else "")
    if uniform is not None and abs(f["mean"] - uniform["mean"]) <= f["std"]:
        return f"its F-Attn {fmt(f, 3)} is within the seed spread of uniform attention's {uniform['mean']:.3f}"
    return ""


def _lr_claim(claim: Claim, gated: str, reference: str, groups: list[dict], missing: dict) -> dict:
    """Gating tolerates a higher learning rate: a learning rate at which the reference diverged
    and the gated model did not (and none the other way round). The rows' "baseline_*" keys are
    the reference's."""
    by = {(g["variant"], g["lr"]): g for g in groups}
    lrs = sorted({lr for v, lr in by if v == reference and (gated, lr) in by})
    rows = [{"lr": lr, "baseline_diverged": by[(reference, lr)]["diverged"],
             "gated_diverged": by[(gated, lr)]["diverged"],
             "seeds": by[(reference, lr)]["seeds"],
             "baseline_final_loss": by[(reference, lr)]["final_loss"],
             "gated_final_loss": by[(gated, lr)]["final_loss"]} for lr in lrs]
    if len(lrs) < 2:
        why = _why((gated, reference), missing)
        verdict, details = "untested", (f"{gated} vs {reference} not tested ({why})" if why else
                                        f"it needs {reference} and {gated} at two or more learning rates: set "
                                        "Study.learning_rates (--lrs) to two or more")
    else:
        gated_better = [r["lr"] for r in rows if r["baseline_diverged"] > r["gated_diverged"]]
        base_better = [r["lr"] for r in rows if r["gated_diverged"] > r["baseline_diverged"]]
        top = rows[-1]  # when divergence does not separate them: the final losses at the highest LR
        loss = compare(top["gated_final_loss"], top["baseline_final_loss"], "final_loss")
        lost = top["baseline_diverged"] or top["gated_diverged"]  # (then those losses cannot decide)
        if gated_better and not base_better:
            verdict = "supported"
        elif base_better and not gated_better:
            verdict = "contradicted"
        elif not gated_better and not base_better and not lost and loss["verdict"] in ("supported", "contradicted"):
            verdict = "partly supported" if loss["verdict"] == "supported" else "contradicted"
        else:
            verdict = "inconclusive"
        details = "; ".join(
            f"LR {r['lr']:g}: {reference} diverged in {r['baseline_diverged']}/{r['seeds']} seeds "
            f"(final loss {fmt(r['baseline_final_loss'], 3)}), {gated} in {r['gated_diverged']}/{r['seeds']} "
            f"(final loss {fmt(r['gated_final_loss'], 3)})" for r in rows)
        if not gated_better and not base_better:
            details += (" — no learning rate separates them by divergence" if any(r["baseline_diverged"] for r in rows)
                        else " — nothing diverged at these learning rates")
            if lost:
                details += (f"; both lost seeds at the highest LR ({top['lr']:g}), so its final losses (of the "
                            "finished seeds) cannot decide" if top["baseline_diverged"] and top["gated_diverged"]
                            else f"; {reference if top['baseline_diverged'] else gated} lost seeds at the "
                            f"highest LR ({top['lr']:g}), so its final losses cannot decide")
            elif loss["verdict"] != "untested":
                details += "; at the highest LR, " + _pair_text(loss, gated, reference, "final loss", 3)
    return {"claim": claim.key, "title": claim.title, "verdict": verdict, "rows": rows,
            "text": f"**{claim.title}.** {WORDS[verdict]}: {details}."}
