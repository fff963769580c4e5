"""The paper at small scale, in one command: train a grid of variants x learning rates x seeds
with identical data and token budget, measure each, and write the paper's tables and figures.

    python -m gattn.study configs/study/NAME.py --workdir DIR [--steps N] [--config.FIELD=VALUE ...]

A study file defines `get_study() -> Study`. Each cell (variant, learning rate, seed) trains in
DIR/runs/VARIANT/lr_LR/seed_SEED and is then measured (eval.py's perplexity and measurements, and
F-Attn at each saved checkpoint); DIR/runs/.../cell.json marks it finished. Rerunning the command
skips finished cells, resumes the unfinished one from its checkpoint, and goes on. All cells share
one tokenizer and one prepared dataset (DIR/shared). The report: DIR/report.json, DIR/report.md
and PNG figures in DIR/figures, with mean and sample standard deviation over seeds, and a
verdict per claim of the paper computed from the numbers (`claims`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gattn import config as config_lib
from gattn import variants
from gattn.config import Config, ConfigError


@dataclass(frozen=True)
class Study:
    """A grid of runs. `base` sets the model size, data and token budget (train.steps x
    batch_size x seq_len); each cell applies a variant, a learning rate and a seed to it."""

    base: Config
    variants: tuple[str, ...] = ("baseline", "sdpa_elementwise")
    seeds: tuple[int, ...] = (0, 1, 2)
    learning_rates: tuple[float, ...] = ()  # () = base.train.learning_rate only
    # A run diverged if training stopped on non-finite losses, or if its final training loss is
    # above this (0: ln(vocab_size), the loss of a uniform guess).
    diverged_loss: float = 0.0
    sink_points: int = 4                     # checkpoints at which F-Attn is measured (vs tokens)
    measure_batches: int = 2                 # held-out batches per domain for the measurements
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.base, Config):
            raise ConfigError("base", self.base, "expected a gattn.config.Config")
        if not self.variants or len(set(self.variants)) != len(self.variants):
            raise ConfigError("variants", self.variants, "expected distinct registered variant names")
        for v in self.variants:
            if v not in variants.REGISTRY:
                raise ConfigError("variants", v, f"expected registered names ({', '.join(variants.REGISTRY)})")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or \
                any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in self.seeds):
            raise ConfigError("seeds", self.seeds, "expected distinct integers >= 0")
        if any(not isinstance(lr, (int, float)) or not lr > 0 for lr in self.learning_rates) or \
                len(set(self.learning_rates)) != len(self.learning_rates):
            raise ConfigError("learning_rates", self.learning_rates, "expected distinct numbers > 0, or ()")
        if not isinstance(self.diverged_loss, (int, float)) or self.diverged_loss < 0:
            raise ConfigError("diverged_loss", self.diverged_loss, "expected a number >= 0 (0: ln(vocab_size))")
        steps = self.base.train.steps
        if not isinstance(self.sink_points, int) or not 1 <= self.sink_points <= steps:
            raise ConfigError("sink_points", self.sink_points, f"expected an integer in [1, train.steps={steps}]")
        if not isinstance(self.measure_batches, int) or self.measure_batches < 1:
            raise ConfigError("measure_batches", self.measure_batches, "expected an integer >= 1")

    @property
    def lrs(self) -> tuple[float, ...]:
        return tuple(float(x) for x in self.learning_rates) or (self.base.train.learning_rate,)

    @property
    def reference_lr(self) -> float:
        """The learning rate of the tables and the per-variant claims: the base config's when it
        is in the sweep, else the sweep's first."""
        return self.base.train.learning_rate if self.base.train.learning_rate in self.lrs else self.lrs[0]

    @property
    def divergence_threshold(self) -> float:
        return self.diverged_loss or math.log(self.base.model.vocab_size)

    @property
    def tokens(self) -> int:
        t = self.base.train
        return t.steps * t.batch_size * t.seq_len


@dataclass(frozen=True)
class Cell:
    variant: str
    lr: float
    seed: int

    @property
    def path(self) -> Path:
        return Path("runs") / self.variant / f"lr_{self.lr:g}" / f"seed_{self.seed}"


def cells(study: Study) -> list[Cell]:
    """In training order: learning rate, then variant, then seed."""
    return [Cell(v, lr, s) for lr in study.lrs for v in study.variants for s in study.seeds]


def cell_config(study: Study, cell: Cell) -> Config:
    base = study.base
    t = base.train
    every = max(1, t.steps // study.sink_points)
    train = dataclasses.replace(
        t, seed=cell.seed, learning_rate=cell.lr, min_learning_rate=t.min_learning_rate * cell.lr / t.learning_rate,
        log_every=1, checkpoint_every=every, keep_checkpoints=study.sink_points + 6,  # (+ SIGTERM saves)
        eval_every=t.steps)  # (validated once at the end; the cell's measurements follow)
    return dataclasses.replace(base, model=variants.apply(cell.variant, base.model), train=train, variant=cell.variant)


def load(path: str | Path, overrides: list[str] = ()) -> Study:
    """`get_study()` of a study file, with `--config.FIELD=VALUE` overrides applied to its base
    config (sizes, steps, data) and checked."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("study", str(path), "expected the path of a study file under configs/study/")
    study = config_lib.call_file(path, "get_study", "study", "Study")
    if overrides:
        study = dataclasses.replace(study, base=config_lib.apply_overrides(study.base, list(overrides)))
    for cell in cells(study):  # every cell's config is checked before anything trains
        cell_config(study, cell)
    return study


# --------------------------------------------------------------------------- running


def _share(workdir: Path, shared: Path) -> None:
    """The cell reads the study's one tokenizer and prepared dataset (relative symlinks, so the
    study folder can move)."""
    for name in ("tokenizer", "tfds"):
        (shared / name).mkdir(parents=True, exist_ok=True)
        link = workdir / name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(shared / name, workdir), target_is_directory=True)


def _losses(workdir: Path) -> dict:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()] \
        if (workdir / "metrics.jsonl").exists() else []
    steps = [r["step"] for r in rows]
    spikes, before = [], 0
    for r in rows:  # the logged count rises at each spike (logged every step in a study)
        if r.get("loss_spikes", 0) > before:
            spikes.append(r["step"])
        before = r.get("loss_spikes", before)
    # (a non-finite loss is logged as null)
    loss = [r["loss"] if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"]) else None
            for r in rows]
    return {"steps": steps, "loss": loss, "spike_steps": spikes}


def planned_steps(cfg: Config) -> list[int]:
    """The checkpoints the F-Attn curve is measured at: the first step, every checkpoint_every
    steps, the last (a SIGTERM's extra checkpoint is left out, so seeds share their steps)."""
    t = cfg.train
    return sorted({1, t.steps, *range(t.checkpoint_every, t.steps + 1, t.checkpoint_every)})


def _sink_curve(cfg: Config, workdir: Path, max_batches: int) -> list[dict]:
    """F-Attn and M-Act at the planned checkpoints, restored as eval.py restores them (scanned
    layers unrolled, the xla attention off TPU), on the batches the table's measurements use."""
    from gattn.eval import analysis  # noqa: PLC0415
    from gattn.train import checkpoint
    from gattn.eval import evaluate
    from gattn.data import pipeline  # noqa: PLC0415
    from gattn.data.tokenizer import load_tokenizer  # noqa: PLC0415

    batches = pipeline.validation_batches(cfg, load_tokenizer(cfg, workdir), workdir)
    chosen = [b for d in sorted(batches) for b in batches[d][:max_batches]]
    out = []
    for step in sorted(set(checkpoint.saved_steps(workdir)) & set(planned_steps(cfg))):
        _, model, _ = evaluate.restore(workdir, step)
        overall = analysis.measure(model, chosen)["overall"]
        out.append({"step": step, "tokens": step * cfg.train.batch_size * cfg.train.seq_len,
                    "f_attn": overall["f_attn"], "m_act": overall["m_act"]})
    return out


def run_cell(study: Study, cell: Cell, root: Path, *, progress: bool = False) -> dict | None:
    """Trains and measures one cell (or returns its record if it is finished); None if training
    was stopped by SIGTERM (its checkpoint is saved: rerunning resumes it)."""
    from gattn.eval import evaluate  # noqa: PLC0415
    from gattn.train import trainer

    workdir = root / cell.path
    done = workdir / "cell.json"
    if done.is_file():
        return json.loads(done.read_text())
    cfg = cell_config(study, cell)
    workdir.mkdir(parents=True, exist_ok=True)
    _share(workdir, root / "shared")
    record = {"variant": cell.variant, "lr": cell.lr, "seed": cell.seed, "path": str(cell.path)}
    start = time.perf_counter()
    try:
        summary = trainer.train(cfg, workdir, progress=progress)
        if not summary["completed"]:
            return None
        record.update(loss_spikes=summary["loss_spikes"], skipped_steps=summary["skipped_steps"], diverged=None)
    except trainer.TrainingStopped as e:
        record["diverged"] = f"training stopped: {e}"
    record["losses"] = _losses(workdir)
    finite = [x for x in record["losses"]["loss"] if x is not None]
    record["final_loss"] = finite[-1] if finite else None  # (a skipped step's NaN is not the result)
    if not record["diverged"] and (not finite or finite[-1] > study.divergence_threshold):
        record["diverged"] = f"final loss above {study.divergence_threshold:.3f}" if finite else "no finite loss"
    trained = time.perf_counter()
    if not record["diverged"]:
        res = evaluate.evaluate(workdir, max_batches=study.measure_batches, figures=False)
        record["perplexity"] = {d: v["ppl"] for d, v in res["perplexity"].items()}
        record["measurements"] = res["measurements"]
        record["sink_curve"] = _sink_curve(cfg, workdir, study.measure_batches)
    # Wall time of this session's part (a resumed cell counts from its resume).
    record["seconds"] = {"train": trained - start, "measure": time.perf_counter() - trained}
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, done)  # atomic: a cell is finished or not
    return record


def run(study: Study, root: str | Path, *, progress: bool = False, log=print) -> dict | None:
    """Runs every cell in turn (finished ones are skipped), then writes the report. None if a
    cell was stopped by SIGTERM."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _check_same_study(study, root)
    (root / "study.json").write_text(json.dumps(describe(study), indent=2))
    records, grid = [], cells(study)
    for i, cell in enumerate(grid, 1):
        finished = (root / cell.path / "cell.json").is_file()
        log(f"[{i}/{len(grid)}] {cell.variant} lr={cell.lr:g} seed={cell.seed}: "
            + ("finished earlier, skipped" if finished else "training"), flush=True)
        rec = run_cell(study, cell, root, progress=progress)
        if rec is None:
            log("stopped (SIGTERM); rerun the same command to resume", flush=True)
            return None
        records.append(rec)
    return write_report(study, records, root)


def _check_same_study(study: Study, root: Path) -> None:
    """A study directory continues only the study it was started with: finished cells of another
    budget, model or data would be mixed into the report."""
    path = root / "study.json"
    if not path.is_file():
        return
    old, new = (config_lib.flat_fields(d) for d in (json.loads(path.read_text()), describe(study)))
    changed = sorted(k for k in set(old) | set(new) if k != "description" and old.get(k) != new.get(k))
    if changed:
        k = changed[0]
        raise ConfigError(k, new.get(k), f"{root} holds a study run with {k} = {old.get(k)!r} "
                          f"({len(changed)} field(s) differ): rerun it unchanged, or use a new --workdir")


def describe(study: Study) -> dict:
    t = study.base.train
    return {"description": study.description, "variants": list(study.variants), "seeds": list(study.seeds),
            "learning_rates": list(study.lrs), "reference_lr": study.reference_lr,
            "steps": t.steps, "batch_size": t.batch_size, "seq_len": t.seq_len, "tokens": study.tokens,
            "diverged_loss": study.divergence_threshold, "base": json.loads(json.dumps(dataclasses.asdict(study.base)))}


# --------------------------------------------------------------------------- aggregation


def _stat(values) -> dict:
    """mean, sample std (0 for one value) and n of the finite values; None if there are none."""
    vals = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    return {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
            "n": len(vals)}


def _mean_curves(rows: list[list[dict]], keys: tuple[str, ...]) -> list[dict]:
    """Per-layer (or per-checkpoint) rows averaged over seeds, for the keys every seed has."""
    if not rows:
        return []
    n = min(len(r) for r in rows)
    out = []
    for i in range(n):
        entry = {k: v for k, v in rows[0][i].items() if not isinstance(v, (float, list, dict))}
        for k in keys:
            if all(k in r[i] for r in rows):
                entry[k] = float(np.mean([r[i][k] for r in rows]))
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
        out.append({"step": step, "tokens": rows[0]["tokens"],
                    **{k: float(np.mean([r[k] for r in rows])) for k in ("f_attn", "m_act")}})
    return out


def aggregate(study: Study, records: list[dict]) -> list[dict]:
    """One entry per (variant, learning rate): mean and std over seeds of every table column."""
    from gattn.model.params import count_params  # noqa: PLC0415

    base_params = count_params(variants.apply("baseline", study.base.model))
    groups = []
    for lr in study.lrs:
        for v in study.variants:
            rs = [r for r in records if r["variant"] == v and r["lr"] == lr]
            ok = [r for r in rs if not r["diverged"]]
            domains = sorted({d for r in ok for d in r["perplexity"]})
            g = {"variant": v, "lr": lr, "seeds": len(rs), "diverged": sum(bool(r["diverged"]) for r in rs),
                 "added_params": count_params(variants.apply(v, study.base.model)) - base_params,
                 "final_loss": _stat(r["final_loss"] for r in rs),
                 "final_loss_per_seed": [r["final_loss"] for r in rs],
                 "loss_spikes": _stat(r.get("loss_spikes") for r in rs),
                 "ppl": {d: _stat(r["perplexity"][d] for r in ok) for d in domains},
                 "ppl_avg": _stat(np.mean([r["perplexity"][d] for d in domains]) for r in ok)}
            for key in ("gate_score", "m_act", "f_attn", "sink_head_share"):
                g[key] = _stat(r["measurements"]["overall"].get(key) for r in ok) if ok else None
            per_layer = [r["measurements"]["per_layer"] for r in ok]
            g["per_layer"] = _mean_curves(per_layer, ("m_act", "f_attn", "sink_head_share", "gate_score"))
            g["sink_curve"] = _mean_by_step([r["sink_curve"] for r in ok])
            groups.append(g)
    return groups


# --------------------------------------------------------------------------- claims


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


def _compare_groups(better: dict | None, worse: dict | None, metric: str) -> dict:
    """`compare` on a metric of two variants' groups; a side that lost seeds to divergence makes
    the comparison inconclusive (its surviving seeds are a selection)."""
    c = compare((better or {}).get(metric), (worse or {}).get(metric), metric)
    lost = {g["variant"]: (g["diverged"], g["seeds"]) for g in (better, worse) if g and g["diverged"]}
    if lost and c["verdict"] != "untested":
        c.update(verdict="inconclusive", lost=lost)
    return c


CLAIMS = (
    ("gated_beats_baseline", "Gating the SDPA output lowers perplexity (Tables 1 and 4)",
     [("sdpa_elementwise", "baseline")]),
    ("position_order", "G1 (SDPA output) beats G2 (values), which beats G3/G4/G5 (Table 1)",
     [("sdpa_elementwise", "v_elementwise"), ("v_elementwise", "k_elementwise"),
      ("v_elementwise", "q_elementwise"), ("v_elementwise", "dense_output")]),
    ("head_specific_beats_shared", "Head-specific gates beat head-shared ones (Table 1 rows 5 vs 12)",
     [("sdpa_elementwise", "sdpa_head_shared")]),
    ("sparse_beats_ns_sigmoid", "The sparse sigmoid gate beats the non-sparse NS-sigmoid (Table 4 rows 2 vs 7)",
     [("sdpa_elementwise", "sdpa_ns_sigmoid")]),
    ("input_dependent_beats_independent", "Input-dependent gates beat input-independent ones (Table 4 rows 2 vs 6)",
     [("sdpa_elementwise", "sdpa_input_independent")]),
)


def _fmt(s: dict | None, digits: int = 2) -> str:
    if s is None:
        return "-"
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}" if s["n"] > 1 else f"{s['mean']:.{digits}f}"


def _pair_text(c: dict, a: str, b: str, what: str, digits: int = 2, present=()) -> str:
    if c["verdict"] == "untested":
        missing = [v for v in (a, b) if v not in present]
        why = (f"the study has no {' or '.join(missing)} run" if missing else "every seed of one of them diverged")
        return f"{a} vs {b} not tested ({why})"
    n = min(c["better"]["n"], c["worse"]["n"])
    beyond = abs(c["diff"]) > c["spread"]
    rel = ("lower, by more than" if c["diff"] > 0 else "higher, by more than") if beyond else "within"
    seeds = f"{n} seeds" if n > 1 else "one seed, so no spread to judge by"
    text = (f"{a} {what} {_fmt(c['better'], digits)} vs {b} {_fmt(c['worse'], digits)} ({seeds}): "
            f"{abs(c['diff']):.{digits}f} {rel} the seed spread ({c['spread']:.{digits}f})")
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


WORDS = {"supported": "This run supports it", "partly supported": "This run supports part of it",
         "contradicted": "This run contradicts it", "inconclusive": "This run cannot tell",
         "untested": "This run does not test it"}


REMOVED = 0.5  # a sink or massive activations count as removed at <= half the baseline's value


def claims(groups: list[dict], reference_lr: float) -> list[dict]:
    """The paper's claims, each with a verdict computed from `groups` (see `aggregate`) and a
    paragraph stating it with the numbers and the seed spread."""
    at = {g["variant"]: g for g in groups if g["lr"] == reference_lr}
    out = []
    for key, title, pairs in CLAIMS:
        parts = [(a, b, _compare_groups(at.get(a), at.get(b), "ppl_avg")) for a, b in pairs]
        verdict = _combine([c["verdict"] for _, _, c in parts])
        details = "; ".join(_pair_text(c, a, b, "PPL", present=at) for a, b, c in parts)
        out.append({"claim": key, "title": title, "verdict": verdict, "comparisons": [
            {"better": a, "worse": b, **c} for a, b, c in parts],
            "text": f"**{title}.** {WORDS[verdict]}: {details}."})
    # Sinks and massive activations: lower F-Attn and M-Act with the gate.
    # "Removes": lower by more than the seed spread and at most REMOVED x the baseline's (the
    # paper: F-Attn 0.467 -> 0.048, M-Act 1053 -> 94); merely lower is "partly supported".
    parts = [(what, _compare_groups(at.get("sdpa_elementwise"), at.get("baseline"), key))
             for what, key in (("F-Attn", "f_attn"), ("M-Act", "m_act"))]
    verdict = _combine([c["verdict"] for _, c in parts])
    title = "Gating removes the attention sink and massive activations (Table 4, Figs. 2 and 6)"
    texts = []
    for what, c in parts:
        texts.append(_pair_text(c, "sdpa_elementwise", "baseline", what, 3, present=at))
        if c["verdict"] == "supported" and c["better"]["mean"] > REMOVED * c["worse"]["mean"]:
            verdict = "partly supported" if verdict == "supported" else verdict
            texts[-1] += (f", but not removed ({c['better']['mean'] / c['worse']['mean']:.0%} of the baseline's; "
                          f"'removed' means at most {REMOVED:.0%})")
    details = "; ".join(texts)
    out.append({"claim": "gating_removes_sink_and_massive_activations", "title": title, "verdict": verdict,
                "comparisons": [{"metric": c["metric"], **c} for _, c in parts],
                "text": f"**{title}.** {WORDS[verdict]}: {details}."})
    out.append(_lr_claim(groups))
    return out


def _lr_claim(groups: list[dict]) -> dict:
    """Gating tolerates a higher learning rate: a learning rate at which the baseline diverged and
    the gated model did not (and none the other way round)."""
    title = "Gating tolerates a higher learning rate (Table 2 rows 5-14)"
    by = {(g["variant"], g["lr"]): g for g in groups}
    lrs = sorted({lr for v, lr in by if v == "baseline" and ("sdpa_elementwise", lr) in by})
    rows = [{"lr": lr, "baseline_diverged": by[("baseline", lr)]["diverged"],
             "gated_diverged": by[("sdpa_elementwise", lr)]["diverged"],
             "seeds": by[("baseline", lr)]["seeds"],
             "baseline_final_loss": by[("baseline", lr)]["final_loss"],
             "gated_final_loss": by[("sdpa_elementwise", lr)]["final_loss"]} for lr in lrs]
    if len(lrs) < 2:
        verdict, details = "untested", "it needs baseline and sdpa_elementwise at two or more learning rates"
    else:
        gated_better = [r["lr"] for r in rows if r["baseline_diverged"] > r["gated_diverged"]]
        base_better = [r["lr"] for r in rows if r["gated_diverged"] > r["baseline_diverged"]]
        top = rows[-1]  # when divergence does not separate them: the final losses at the highest LR
        loss = compare(top["gated_final_loss"], top["baseline_final_loss"], "final_loss")
        if gated_better and not base_better:
            verdict = "supported"
        elif base_better and not gated_better:
            verdict = "contradicted"
        elif not gated_better and not base_better and loss["verdict"] in ("supported", "contradicted"):
            verdict = "partly supported" if loss["verdict"] == "supported" else "contradicted"
        else:
            verdict = "inconclusive"
        details = "; ".join(
            f"LR {r['lr']:g}: baseline diverged in {r['baseline_diverged']}/{r['seeds']} seeds "
            f"(final loss {_fmt(r['baseline_final_loss'], 3)}), sdpa_elementwise in {r['gated_diverged']}/{r['seeds']} "
            f"(final loss {_fmt(r['gated_final_loss'], 3)})" for r in rows)
        if not gated_better and not base_better:
            details += (" — no learning rate separates them by divergence" if any(r["baseline_diverged"] for r in rows)
                        else " — nothing diverged at these learning rates")
            if loss["verdict"] != "untested":
                details += "; at the highest LR, " + _pair_text(loss, "sdpa_elementwise", "baseline", "final loss", 3)
    return {"claim": "gating_tolerates_higher_lr", "title": title, "verdict": verdict, "rows": rows,
            "text": f"**{title}.** {WORDS[verdict]}: {details}."}


# --------------------------------------------------------------------------- report


def table(groups: list[dict], lr: float) -> str:
    """Table 1/3/4 at this scale: one row per variant at learning rate `lr`."""
    rows = [g for g in groups if g["lr"] == lr]
    domains = sorted({d for g in rows for d in g["ppl"]})
    head = (["variant", "added params"] + [f"PPL {d}" for d in domains] +
            ["PPL avg", "final loss", "gate score", "M-Act", "F-Attn", "loss spikes", "diverged"])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in rows:
        cells_ = ([g["variant"], f"{g['added_params']:,}"] + [_fmt(g["ppl"].get(d)) for d in domains] +
                  [_fmt(g["ppl_avg"]), _fmt(g["final_loss"], 3), _fmt(g["gate_score"], 3), _fmt(g["m_act"], 1),
                   _fmt(g["f_attn"], 3), _fmt(g["loss_spikes"], 1), f"{g['diverged']}/{g['seeds']}"])
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
    verdicts = claims(groups, ref)
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("study", help="a study file (configs/study/NAME.py)")
    ap.add_argument("--workdir", required=True, help="study directory (created; resumed if it exists)")
    ap.add_argument("--steps", type=int, help="training steps per cell (sets train.steps)")
    ap.add_argument("--progress", action="store_true", help="a progress bar per cell")
    args, overrides = config_lib.parse_args(ap, argv, steps_set_train_steps=True)
    study = load(args.study, overrides)
    report = run(study, args.workdir, progress=args.progress)
    if report is None:
        return 1
    print(markdown(report))
    return 0


if __name__ == "__main__":
    from gattn.cli import ensure_malloc_tunables

    ensure_malloc_tunables()
    sys.exit(config_lib.run_cli(main))
