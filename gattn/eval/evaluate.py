"""Evaluation of a run's checkpoint: perplexity per held-out domain, the paper's measurements
(`gattn.eval.analysis`), optional few-shot tasks (`gattn.eval.fewshot`), figures (`gattn.eval.plots`), and the
comparison of several runs (Table 4 of the paper, for your checkpoints).

    evaluate(workdir)  ->  WORKDIR/eval/results.json (with the `settings` it was measured with), results.md, *.png
    compare([dir, ...]) -> a Table-4-like markdown table with each run's training rows, and overlay
                           figures (per-layer curves, loss curves, gate scores) with their data as JSON

Long context (RULER) is gattn/eval/long_context.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from flax import nnx

from gattn import variants
from gattn.config import ConfigError
from gattn.data import pipeline
from gattn.data.tokenizer import load_tokenizer
from gattn.eval import analysis, plots, sinks
from gattn.model import sharding
from gattn.train import checkpoint, rundir, trainer


def evaluate(workdir: str | Path, *, step: int | None = None, overrides: list[str] = (),
             options: analysis.Options | None = None, max_batches: int | None = None,
             tasks: list[str] = (), shots: int = 0, limit: int | None = None, harness_model=None,
             out_dir: str | Path | None = None, figures: bool = True, log=None) -> dict:
    """Evaluates `workdir`'s checkpoint and writes results.json, results.md and the figures to
    `out_dir` (default WORKDIR/eval). `max_batches`: held-out batches per domain for the
    measurements (default: all of `data.eval_batches`); perplexity always uses all of them. `tasks`
    (few-shot task files, gattn/eval/fewshot.py) are scored through lm-eval with the model
    `harness_model(cfg, model, tokenizer, workdir, step)` returns (eval.py's: gattn's GattnLM).
    `log(line)`: progress, a line per measured batch (None: quiet)."""
    workdir = Path(workdir)
    say = log or (lambda line: None)
    options = options or analysis.Options()
    run_cfg = rundir.load_config(workdir, overrides)  # an architecture change is refused here
    # Checked before anything is restored, named as eval.py's flag.
    analysis.check_map_layers(options.map_layers or (), run_cfg.model.num_layers, "--map-layers",
                              attention_layers=run_cfg.model.full_attention_layers)
    check_map_len(options, run_cfg)
    cfg, model, step = rundir.load(workdir, step, overrides, cfg=run_cfg)
    out_dir = out_path(workdir, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(cfg, workdir)
    batches = pipeline.validation_batches(cfg, tokenizer, workdir)
    graphdef, params = nnx.split(model, nnx.Param)
    say(perplexity_line(workdir.name, step, batches, cfg))
    # Under the run's mesh, as training validated: the same attention kernel and MoE path.
    val = trainer.validate(trainer.make_eval_step(graphdef), params, batches, sharding.make_mesh(cfg.mesh))
    domains = sorted(batches)
    perplexity = {d: {"loss": val[f"val_loss/{d}"], "ppl": val[f"val_ppl/{d}"]} for d in domains}
    chosen = [b for d in domains for b in batches[d][:max_batches]]
    # No mesh is set from here on: an expert-parallel MoE runs as the partitioned one (`off_mesh`),
    # an all_to_all one on one data x expert shard's rows at a time, as the mesh counts capacity.
    options = dataclasses.replace(options, moe_shards=analysis.moe_shards(cfg))
    measurements = analysis.measure(model, _announced(chosen, f"{workdir.name}: measuring batch", say), options)
    say(f"{workdir.name}: sink metrics over the same {len(chosen)} batches")
    sink = sinks.measure(model, cfg, chosen)  # Gu et al.'s Sink_1^eps, T = 64 (docs/sinks.md)
    results = {"workdir": str(workdir), "step": step, "variant": variants.checked(cfg.variant, cfg.model),
               "overrides": list(overrides),
               "gate": dataclasses.asdict(cfg.model.gate) if cfg.model.gate else None,
               "perplexity": perplexity, "measurements": measurements, "sinks": sink,
               "measured_on": {"batches": len(chosen), "rows": sum(len(b["tokens"]) for b in chosen),
                               "seq_len": cfg.train.seq_len},
               "settings": settings(run_cfg, step, overrides, options, max_batches, workdir=workdir)}
    if tasks:  # scored by lm-eval through `harness_model(cfg, model, tokenizer, workdir, step)` (eval.py's)
        from gattn.eval import fewshot  # noqa: PLC0415

        results["fewshot"] = fewshot.evaluate_tasks(harness_model(cfg, model, tokenizer, workdir, step), tasks,
                                                    shots=shots, limit=limit)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(report(results))
    if figures:
        results["figures"] = [str(p) for p in write_figures(results, out_dir) if p]
    return results


def perplexity_line(name: str, step: int, batches: dict[str, list], cfg) -> str:
    """The progress line of the perplexity pass, its batches counted per domain as --max-batches
    and the reuse lines count them: a domain with little held-out text has fewer than
    data.eval_batches."""
    counts, most = {d: len(b) for d, b in sorted(batches.items())}, cfg.data.eval_batches
    lo, hi = min(counts.values()), max(counts.values())
    n = f"{lo}" if lo == hi else f"{lo} to {hi}"
    head = f"{name}: step {step}: perplexity over {n} held-out batch{'' if hi == 1 else 'es'} per domain"
    if lo != hi:
        return head + f" ({', '.join(f'{d} {c}' for d, c in counts.items())}; data.eval_batches = {most})"
    return head + f" ({', '.join(counts)})" + (f", all their held-out text: fewer than data.eval_batches = {most}"
                                               if hi < most else "")


def _announced(batches: list, what: str, say):
    for i, batch in enumerate(batches, 1):
        say(f"{what} {i}/{len(batches)}")
        yield batch


# Bumped when a change to the measurement code changes what results.json holds: results written
# before are then measured again by `compare`, not mixed with new ones.
MEASUREMENT_VERSION = 1


def check_map_len(options: analysis.Options | None, cfg) -> None:
    """The attention maps cover at most a row, or the default's positions (before: --map-len 100000
    asked for 298 GiB after the perplexity pass; past the row, a map's rows are zero)."""
    most = max(cfg.train.seq_len, analysis.Options().map_len)  # (the default's maps stay as they were)
    if options is not None and options.map_len > most:
        raise ConfigError("--map-len", options.map_len, f"at most {most}, the run's train.seq_len or the default "
                          "map length: the maps cover the first positions of a held-out row")


def settings(cfg, step: int, overrides: list[str], options: analysis.Options | None,
             max_batches: int | None, *, workdir: str | Path | None = None) -> dict:
    """What results.json's numbers depend on (as JSON holds them): the step, which checkpoint of
    that step (`checkpoint`: a short sha256 of WORKDIR/checkpoints/STEP's seals, or of Orbax's
    _CHECKPOINT_METADATA where it has none, as an older gattn saved it; None without a `workdir`
    or either file), the overrides, the held-out batches measured per domain (M-Act, a running
    maximum, grows with them) and the measurement options. `compare` reuses a results.json only
    when they equal the ones it asks for. batch_rows and moe_shards only split the work, so they
    are left out."""
    import hashlib  # noqa: PLC0415

    o = options or analysis.Options()
    per_domain = min(max_batches or cfg.data.eval_batches, cfg.data.eval_batches)
    # The checkpoint's identity (before: none, so a results.json of a step-4 checkpoint that a
    # --resume-step set aside stood for the new step 4 trained since). Its seals hold the sha256 of
    # every file it has; Orbax's metadata its save's timestamps.
    folder = Path(workdir) / "checkpoints" / str(step) if workdir is not None else None
    seals = sorted((folder / checkpoint.CHECKSUMS).glob("process_*.json")) if folder else []
    files = seals or [f for f in ([folder / "_CHECKPOINT_METADATA"] if folder else []) if f.is_file()]
    ident = hashlib.sha256(b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)).hexdigest()[:16]
    return json.loads(json.dumps({
        "version": MEASUREMENT_VERSION, "step": step, "checkpoint": ident if files else None,
        "overrides": list(overrides),
        "batches_per_domain": per_domain, "eval_batches": cfg.data.eval_batches,
        "eval_batch_size": cfg.data.eval_batch_size, "seq_len": cfg.train.seq_len,
        "sink_threshold": o.sink_threshold, "sparsity_thresholds": o.sparsity_thresholds, "gate_bins": o.gate_bins,
        "map_layers": o.map_layers, "map_len": o.map_len}))


def why_measure(res: dict | None, asked: dict) -> str | None:
    """Why a run's results.json `res` cannot stand for the measurement `asked` (None: it can)."""
    if res is None:
        return "it has no eval/results.json yet"
    old = res.get("settings")
    if old is None:
        return "its results.json records no measurement settings (written by an older eval.py)"
    if old.get("version") != asked["version"]:
        return (f"its results.json was measured by measurement code version {old.get('version')}, "
                f"this is version {asked['version']}")
    # A results.json of no recorded checkpoint (an older eval.py) may be of one set aside since.
    changed = [k for k in asked if k not in ("version", "eval_batches")
               and (old.get(k) != asked[k] or k == "checkpoint" and k not in old)]
    if "step" in changed and "checkpoint" in changed:
        changed.remove("checkpoint")  # another step is another checkpoint: the step says it
    if not changed:
        return None
    return (f"its results.json was measured {', '.join(_setting(old, k, True) for k in changed)}, "
            f"this comparison asks for {', '.join(_setting(asked, k, False) for k in changed)}")


def _setting(s: dict, key: str, measured: bool) -> str:
    """One setting in words: `measured` as results.json was measured ("at step 200"), else as asked."""
    v = s.get(key)
    if key == "step":
        return f"at step {v}" if measured else f"step {v} (the latest checkpoint)"
    if key == "checkpoint":  # (only when the steps agree: `why_measure`)
        if not measured:
            return f"the checkpoint now at step {s.get('step')}"
        if key not in s:
            return (f"on a checkpoint of step {s.get('step')} that it does not identify (written by an older "
                    "eval.py: that checkpoint may have been set aside since, e.g. by a --resume-step)")
        return f"on another checkpoint of step {s.get('step')} (set aside since, e.g. by a --resume-step)"
    if key == "batches_per_domain":
        # "up to": a domain with less held-out text has fewer batches (`perplexity_line` counts them)
        every = v == s.get("eval_batches") and v != 1
        n = f"all (up to {v}) batches" if every else f"{v} batch" + ("" if v == 1 else "es")
        return ("over " if measured else "") + n + " per domain"
    if key == "overrides":
        return ("with " if measured else "") + (" ".join(v) if v else "no overrides")
    return ("with " if measured else "") + f"{key} = {v}"


def out_path(workdir: str | Path, out_dir: str | Path | None = None) -> Path:
    return Path(out_dir) if out_dir else Path(workdir) / "eval"


def write_figures(results: dict, out_dir: Path) -> list[Path | None]:
    m, name = results["measurements"], f"{results['variant']} (step {results['step']})"
    paths = [plots.per_layer({name: m}, out_dir / "per_layer.png", name),
             plots.sparsity(m, out_dir / "sparsity.png", name),
             plots.mean_abs_y({name: m}, out_dir / "mean_abs_y.png", name) if "mean_abs_y" in m["overall"] else None,
             plots.f_attn_heads(m, out_dir / "f_attn_heads.png", name),
             plots.sink_heads(results["sinks"], out_dir / "sink_heads.png", name) if "sinks" in results else None,
             plots.attention_maps(m, out_dir / "attention_maps.png", name)]
    if "gate_histogram" in m:
        paths.append(plots.gate_histogram(m, out_dir / "gate_scores.png", name))
    return paths


def report(results: dict) -> str:
    """A short markdown summary: perplexity per domain, the overall measurements, per-layer rows."""
    m, o = results["measurements"], results["measurements"]["overall"]
    lines = [f"# {results['variant']} at step {results['step']} ({results['workdir']})", "",
             "| domain | loss | PPL |", "|---|---|---|"]
    lines += [f"| {d} | {p['loss']:.4f} | {p['ppl']:.2f} |" for d, p in results["perplexity"].items()]
    gate = f"{o['gate_score']:.3f}" if "gate_score" in o else "- (ungated)"
    lines += ["", f"- gate score (mean): {gate}",
              f"- M-Act (mean over layers of the max |hidden|): {o['m_act']:.2f} "
              f"(max over layers {o['m_act_max']:.2f}; "
              f"a running max over every token measured, so it grows with the eval set)",
              *([f"- M-Act per token (mean over tokens of each token's max |hidden|, mean over layers): "
                 f"{o['m_act_per_token']:.2f}",
                 f"- FFN-Act (max |FFN output|, mean over layers): {o['ffn_act']:.3g} (max {o['ffn_act_max']:.3g})",
                 f"- mean |SDPA output| (mean over layers): {o['mean_abs_y']:.4f} before the gate"
                 + (f", {o['mean_abs_y_gated']:.4f} after" if "mean_abs_y_gated" in o else "")]
                if "ffn_act" in o else []),
              f"- F-Attn (first token): {o['f_attn']:.3f}",
              f"- {analysis.sink_heads_label(m['sink_threshold'])}: {o['sink_head_share']:.0%}", "",
              "| layer | M-Act | M-Act per token | FFN-Act | F-Attn | F-Attn sink heads | gate score "
              "| SDPA values < 1e-3 (before / after gate) | mean abs SDPA output (before / after gate) |",
              "|---|---|---|---|---|---|---|---|---|"]
    if "not_measured" in o:
        lines[-3:-3] = [f"- hybrid: {o['not_measured']} (attention layers {o['attention_layers']})"]
    for r in m["per_layer"]:
        if r["f_attn"] is None:  # a hybrid's Gated DeltaNet layer
            lines.append(f"| {r['layer']} | {r['m_act']:.2f} | {r['m_act_per_token']:.2f} | {r['ffn_act']:.3g} "
                         "| - (Gated DeltaNet) | - | - | - | - |")
            continue
        sp = r["sparsity"]
        after = f"{sp['gated']['0.001']:.1%}" if "gated" in sp and "0.001" in sp["gated"] else "-"
        before = f"{sp['sdpa_out']['0.001']:.1%}" if "0.001" in sp["sdpa_out"] else "-"
        g = f"{r['gate_score']:.3f}" if "gate_score" in r else "-"
        y = (f"{r['mean_abs_y']:.4f} / " + (f"{r['mean_abs_y_gated']:.4f}" if "mean_abs_y_gated" in r else "-")
             if "mean_abs_y" in r else "-")
        lines.append(f"| {r['layer']} | {r['m_act']:.2f} | {r.get('m_act_per_token', float('nan')):.2f} "
                     f"| {r.get('ffn_act', float('nan')):.3g} | {r['f_attn']:.3f} | {r['sink_head_share']:.0%} "
                     f"| {g} | {before} / {after} | {y} |")
    if "sinks" in results:
        lines += ["", "## Attention sinks (docs/sinks.md)", ""] + sinks.report_lines(results["sinks"])
    for task, res in results.get("fewshot", {}).items():
        lines.append("")
        lines.append(f"- few-shot {task}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in res.items() if k != "examples"))
    return "\n".join(lines) + "\n"


def compare(workdirs: list[str | Path], *, out_dir: str | Path | None = None, overrides: list[str] = (),
            log=None, **eval_kwargs) -> str:
    """Table 4 across runs (PPL per domain, gate score, M-Act, F-Attn, F-Attn sink heads) with each run's
    training rows (params, final loss, loss spikes, tokens/s), and overlay figures: per-layer
    curves, train and validation loss curves, gate-score histograms (the last two with their data
    as JSON; `figures`=False: the JSON only). A run's eval/results.json is reused when it was
    measured with the settings asked for (`settings`); otherwise the run is measured again and its
    results.json replaced. Without `max_batches`, the batch count the runs' results were measured
    over is taken, when they agree (the main job's one batch per domain). `log(line)`: what is
    reused or measured, and why (default: stderr)."""
    say = log or _stderr
    for w in workdirs:  # every argument is checked before any run is measured (or its results replaced)
        if not Path(w).is_dir():
            raise ConfigError("--compare", str(w), "a run directory (this folder does not exist)")
        rundir.check_workdir(w)
        if not (Path(w) / rundir.CONFIG).is_file():
            raise ConfigError("--compare", str(w), f"a gattn run directory (it has no {rundir.CONFIG})")
        if not checkpoint.saved_steps(w):
            raise ConfigError("--compare", str(w), "a run with a saved checkpoint (it has none yet)")
    workdirs = [Path(w) for w in workdirs]
    cfgs = {w: rundir.load_config(w, overrides) for w in workdirs}  # (overrides refused before any measuring)
    for c in cfgs.values():
        check_map_len(eval_kwargs.get("options"), c)
    latest = {w: max(checkpoint.saved_steps(w)) for w in workdirs}
    if (line := steps_warning(workdirs, cfgs, latest)) is not None:
        say(line)
    found = {w: _read_json(w / "eval" / "results.json") for w in workdirs}
    options = eval_kwargs.get("options")
    if eval_kwargs.get("max_batches") is None:
        eval_kwargs["max_batches"] = _recorded_batches(found, cfgs, latest, overrides, options, say)
    runs, dirs = {}, {}
    for w in workdirs:
        asked = settings(cfgs[w], latest[w], overrides, options, eval_kwargs["max_batches"], workdir=w)
        res, why = found[w], why_measure(found[w], asked)
        if why is None:
            say(f"reusing {w.name}: its eval/results.json was measured "
                f"{', '.join(_setting(asked, k, True) for k in ('step', 'batches_per_domain', 'overrides'))}, as asked")
        else:
            say(f"re-measuring {w.name}: {why}")
            res = evaluate(w, overrides=overrides, log=say, **eval_kwargs)
            say(f"{w.name}: wrote {w / 'eval' / 'results.json'}"
                + (" (replacing the one measured with other settings)" if found[w] else ""))
        rows = training(w, cfgs[w], res["step"])
        if "logged_to" in rows:
            last = rows["logged_to"]
            say(f"{w.name}: measured at checkpoint step {res['step']}, the newest usable; its training log goes on "
                f"to step {last['step']} (train loss {_fmt(last['loss'])} there): the table's training rows are "
                f"step {res['step']}'s")
        name = _label(w, res, runs)  # (the label checked against the model: the run's results.json may be older)
        runs[name] = res | {"variant": variants.checked(cfgs[w].variant, cfgs[w].model), "training": rows}
        dirs[name] = w
    out_dir = Path(out_dir) if out_dir else Path(os.path.commonpath([w.absolute() for w in workdirs])) / "compare"
    text = table(runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(text + "\n")
    (out_dir / "results.json").write_text(json.dumps(
        {name: {k: r.get(k) for k in ("workdir", "step", "variant", "perplexity", "settings", "training")}
         | {"overall": r["measurements"]["overall"]} for name, r in runs.items()}, indent=1))
    write_comparison_figures(runs, {n: loss_curves(w) for n, w in dirs.items()}, out_dir,
                             figures=eval_kwargs.get("figures", True))
    return text


def steps_warning(workdirs: list[Path], cfgs: dict, latest: dict) -> str | None:
    """One line naming the step each run is compared at, when they differ or a run's train.py is
    still running (its lock.json held: gattn/train/lease.py); None when the runs all end at one
    step. A comparison of a finished run with one at its first checkpoint is no comparison."""
    from gattn.train import lease  # noqa: PLC0415

    parts, training = [], False
    for w in workdirs:
        holder = _read_json(w / lease.LOCK) if (w / lease.LOCK).is_file() else None
        steps = cfgs[w].train.steps
        if holder and not lease.stale(holder):
            training = True
            parts.append(f"{w.name} at step {latest[w]} of {steps} (still training: {lease.LOCK} held by "
                         f"{holder.get('host')} pid {holder.get('pid')})")
        elif latest[w] < steps:
            parts.append(f"{w.name} at step {latest[w]} of {steps} (stopped before its last step)")
        else:
            parts.append(f"{w.name} at step {latest[w]} (its last)")
    if not training and len(set(latest.values())) == 1:
        return None
    return ("warning: comparing " + ", ".join(parts) + ": each run's row is its newest checkpoint's"
            + ("; rerun --compare once training ends" if training else ""))


def write_comparison_figures(runs: dict[str, dict], curves: dict[str, dict], out_dir: Path, *,
                             figures: bool = True) -> list[Path]:
    """loss_curves.json (`loss_curves` of each run) and gate_scores.json (`gate_shares` of each
    gated run, where any is); with `figures`, per_layer.png, loss_curves.png and gate_scores.png."""
    (out_dir / "loss_curves.json").write_text(json.dumps(curves, indent=1))
    hists = {n: gate_shares(r["measurements"]) for n, r in runs.items() if "gate_histogram" in r["measurements"]}
    if hists:
        (out_dir / "gate_scores.json").write_text(json.dumps(hists, indent=1))
    if not figures:
        return []
    return [plots.per_layer({n: r["measurements"] for n, r in runs.items()}, out_dir / "per_layer.png",
                            "per-layer measurements across runs"),
            plots.loss_overlay(curves, out_dir / "loss_curves.png"),
            *([plots.gate_overlay(hists, out_dir / "gate_scores.png")] if hists else [])]


def _recorded_batches(found: dict, cfgs: dict, latest: dict, overrides, options, say) -> int | None:
    """The held-out batches per domain the runs' results.json were measured over, when those
    that are otherwise as asked agree on one (None, all of data.eval_batches, when none is)."""
    counts = set()
    for w, res in found.items():
        n = ((res or {}).get("settings") or {}).get("batches_per_domain")
        if n is not None and why_measure(res, settings(cfgs[w], latest[w], overrides, options, n, workdir=w)) is None:
            counts.add(n)
    if len(counts) == 1:
        n = counts.pop()
        say(f"no --max-batches given: {n} batch{'' if n == 1 else 'es'} per domain, what the runs' "
            "eval/results.json were measured over")
        return n
    if counts:
        say(f"no --max-batches given and the runs' eval/results.json disagree ({' vs '.join(map(str, sorted(counts)))} "
            "batches per domain): measuring over all of each run's data.eval_batches")
    return None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _finite(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _metrics(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def loss_curves(workdir: Path) -> dict:
    """The run's training loss per logged step and validation loss per domain at its eval steps,
    from its metrics.jsonl ({"train": {"steps", "loss"}, "val": {DOMAIN: {"steps", "loss"}}};
    a non-finite loss as null)."""
    rows = _metrics(workdir)
    val = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("val_loss/"):
                d = val.setdefault(k.removeprefix("val_loss/"), {"steps": [], "loss": []})
                d["steps"].append(r["step"])
                d["loss"].append(_finite(v))
    logged = [r for r in rows if "loss" in r]
    train = {"steps": [r["step"] for r in logged], "loss": [_finite(r["loss"]) for r in logged]}
    return {"train": train, "val": dict(sorted(val.items()))}


def training(workdir: Path, cfg, step: int | None = None) -> dict:
    """The main job's rows of a run at `step` (the evaluated checkpoint; None: the end of its
    log): parameters (of the built model), the final training loss (the last finite one logged at
    or before `step`), loss spikes and tokens/s (the last logged by then; at the end of the log,
    summary.json's loss spikes). A log that goes past `step` (a run killed after its newest usable
    checkpoint) adds "logged_to": its last step and loss."""
    from gattn.model.params import count_params  # noqa: PLC0415

    rows, summary = _metrics(workdir), _read_json(workdir / "summary.json") or {}
    past = bool(rows) and step is not None and rows[-1]["step"] > step
    upto = [r for r in rows if r["step"] <= step] if past else rows
    finite = [x for x in (_finite(r.get("loss")) for r in upto) if x is not None]
    last = upto[-1] if upto else {}
    out = {"params": count_params(cfg.model), "final_loss": finite[-1] if finite else None,
           "loss_spikes": last.get("loss_spikes") if past else summary.get("loss_spikes", last.get("loss_spikes")),
           "tokens_per_sec": last.get("tokens_per_sec") or None}
    if past:
        logged = [x for x in (_finite(r.get("loss")) for r in rows) if x is not None]
        out["logged_to"] = {"step": rows[-1]["step"], "loss": logged[-1] if logged else None}
    return out


def _fmt(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.3f}"


def gate_shares(m: dict) -> dict:
    """A run's gate scores over all layers as shares per bin, with the bin edges and the mean."""
    hist = m["gate_histogram"]
    lo, hi = hist["range"]
    counts = [sum(c) for c in zip(*hist["per_layer"])]
    edges = [lo + (hi - lo) * i / len(counts) for i in range(len(counts) + 1)]
    return {"edges": edges, "share": [c / max(sum(counts), 1) for c in counts], "counts": counts,
            "mean": m["overall"]["gate_score"]}


def _label(workdir: Path, res: dict, taken: dict) -> str:
    name = workdir.name or res["variant"]
    return name if name not in taken else f"{name} ({workdir})"


def table(runs: dict[str, dict]) -> str:
    """Markdown, one row per run, like the paper's Table 4: M-Act is the mean over layers of each
    layer's max |hidden state| (Sec. 4.3), max M-Act the largest of them; then the main job's
    training rows (`training`), "-" where a run has none."""
    domains = sorted({d for r in runs.values() for d in r["perplexity"]})
    head = ["run", "variant", "step"] + [f"PPL {d}" for d in domains] + [
        "gate score", "M-Act", "F-Attn", "F-Attn sink heads", "max M-Act", "params", "final train loss", "loss spikes",
        "tokens/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in runs.items():
        o = r["measurements"]["overall"]
        ppl = [f"{r['perplexity'][d]['ppl']:.2f}" if d in r["perplexity"] else "-" for d in domains]
        cells = [name, r["variant"], str(r["step"]), *ppl,
                 f"{o['gate_score']:.3f}" if "gate_score" in o else "-", f"{o['m_act']:.2f}",
                 f"{o['f_attn']:.3f}", f"{o['sink_head_share']:.0%}", f"{o['m_act_max']:.2f}", *_training_cells(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _training_cells(r: dict) -> list[str]:
    t = r.get("training", {})
    fmt = (("params", "{:,}"), ("final_loss", "{:.3f}"), ("loss_spikes", "{}"), ("tokens_per_sec", "{:,.0f}"))
    return [f.format(t[k]) if t.get(k) is not None else "-" for k, f in fmt]
