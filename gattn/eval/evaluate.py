"""Evaluation of a run's checkpoint: perplexity per held-out domain, the paper's measurements
(`gattn.eval.analysis`), optional few-shot tasks (`gattn.eval.fewshot`), figures (`gattn.eval.plots`), and the
comparison of several runs (Table 4 of the paper, for your checkpoints).

    evaluate(workdir)  ->  WORKDIR/eval/results.json, results.md, *.png
    compare([dir, ...]) -> a Table-4-like markdown table and one overlay figure of per-layer curves

Long context (RULER) is gattn/eval/long_context.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from flax import nnx

from gattn.config import ConfigError
from gattn.data import pipeline
from gattn.data.tokenizer import load_tokenizer
from gattn.eval import analysis, plots, sinks
from gattn.model import sharding
from gattn.train import checkpoint, rundir, trainer


def evaluate(workdir: str | Path, *, step: int | None = None, overrides: list[str] = (),
             options: analysis.Options | None = None, max_batches: int | None = None,
             tasks: list[str] = (), shots: int = 0, limit: int | None = None, harness_model=None,
             out_dir: str | Path | None = None, figures: bool = True) -> dict:
    """Evaluates `workdir`'s checkpoint and writes results.json, results.md and the figures to
    `out_dir` (default WORKDIR/eval). `max_batches`: held-out batches per domain for the
    measurements (default: all of `data.eval_batches`); perplexity always uses all of them. `tasks`
    (few-shot task files, gattn/eval/fewshot.py) are scored through lm-eval with the model
    `harness_model(cfg, model, tokenizer, workdir, step)` returns (eval.py's: gattn's GattnLM)."""
    workdir = Path(workdir)
    options = options or analysis.Options()
    asked = measured_with(options, max_batches)
    run_cfg = rundir.load_config(workdir, overrides)  # an architecture change is refused here
    # Checked before anything is restored, named as eval.py's flag.
    analysis.check_map_layers(options.map_layers or (), run_cfg.model.num_layers, "--map-layers")
    cfg, model, step = rundir.load(workdir, step, overrides, cfg=run_cfg)
    out_dir = out_path(workdir, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(cfg, workdir)
    batches = pipeline.validation_batches(cfg, tokenizer, workdir)
    graphdef, params = nnx.split(model, nnx.Param)
    # Under the run's mesh, as training validated: the same attention kernel and MoE path.
    val = trainer.validate(trainer.make_eval_step(graphdef), params, batches, sharding.make_mesh(cfg.mesh))
    domains = sorted(batches)
    perplexity = {d: {"loss": val[f"val_loss/{d}"], "ppl": val[f"val_ppl/{d}"]} for d in domains}
    chosen = [b for d in domains for b in batches[d][:max_batches]]
    # No mesh is set from here on: an expert-parallel MoE runs as the partitioned one (`off_mesh`),
    # an all_to_all one on one data x expert shard's rows at a time, as the mesh counts capacity.
    options = dataclasses.replace(options, moe_shards=analysis.moe_shards(cfg))
    measurements = analysis.measure(model, chosen, options)
    sink = sinks.measure(model, cfg, chosen)  # Gu et al.'s Sink_1^eps, T = 64 (docs/sinks.md)
    results = {"workdir": str(workdir), "step": step, "variant": cfg.variant, "overrides": list(overrides),
               "gate": dataclasses.asdict(cfg.model.gate) if cfg.model.gate else None,
               "perplexity": perplexity, "measurements": measurements, "sinks": sink,
               "measured_on": {"batches": len(chosen), "rows": sum(len(b["tokens"]) for b in chosen),
                               "seq_len": cfg.train.seq_len},
               "measured_with": asked}
    if tasks:  # scored by lm-eval through `harness_model(cfg, model, tokenizer, workdir, step)` (eval.py's)
        from gattn.eval import fewshot  # noqa: PLC0415

        results["fewshot"] = fewshot.evaluate_tasks(harness_model(cfg, model, tokenizer, workdir, step), tasks,
                                                    shots=shots, limit=limit)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(report(results))
    if figures:
        results["figures"] = [str(p) for p in write_figures(results, out_dir) if p]
    return results


def measured_with(options: analysis.Options | None, max_batches: int | None) -> dict:
    """The settings that change the measurements (as JSON holds them): results.json records them,
    and `compare` reuses a result only if they are the ones asked for. batch_rows and moe_shards
    only split the work, so they are left out."""
    o = options or analysis.Options()
    return json.loads(json.dumps({"max_batches": max_batches, "sink_threshold": o.sink_threshold,
                                  "sparsity_thresholds": o.sparsity_thresholds, "gate_bins": o.gate_bins,
                                  "map_layers": o.map_layers, "map_len": o.map_len}))


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
              f"- sink heads (F-Attn > {m['sink_threshold']}): {o['sink_head_share']:.0%}", "",
              "| layer | M-Act | M-Act per token | FFN-Act | F-Attn | sink heads | gate score "
              "| SDPA values < 1e-3 (before / after gate) | mean abs SDPA output (before / after gate) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in m["per_layer"]:
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
            **eval_kwargs) -> str:
    """Table 4 across runs: PPL per domain, gate score, M-Act, F-Attn, sink heads; overlays their
    per-layer curves in one figure. A run is evaluated first unless its WORKDIR/eval/results.json
    is of its latest checkpoint, measured with these overrides, --max-batches and options."""
    for w in workdirs:  # every argument is checked before any run is measured (or its results replaced)
        if not Path(w).is_dir():
            raise ConfigError("--compare", str(w), "a run directory (this folder does not exist)")
        rundir.check_workdir(w)
        if not (Path(w) / rundir.CONFIG).is_file():
            raise ConfigError("--compare", str(w), f"a gattn run directory (it has no {rundir.CONFIG})")
        if not checkpoint.saved_steps(w):
            raise ConfigError("--compare", str(w), "a run with a saved checkpoint (it has none yet)")
    runs = {}
    asked = measured_with(eval_kwargs.get("options"), eval_kwargs.get("max_batches"))
    for w in workdirs:
        path = Path(w) / "eval" / "results.json"
        res = json.loads(path.read_text()) if path.is_file() else None
        if (res is None or res["step"] != max(checkpoint.saved_steps(w), default=None)  # missing, older,
                or res.get("overrides", []) != list(overrides)  # or measured with other settings
                or res.get("measured_with") != asked):  # (M-Act grows with the batches measured)
            res = evaluate(w, overrides=overrides, **eval_kwargs)
        runs[_label(Path(w), res, runs)] = res
    out_dir = Path(out_dir) if out_dir else Path(os.path.commonpath([Path(w).absolute() for w in workdirs])) / "compare"
    text = table(runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "table.md").write_text(text + "\n")
    (out_dir / "results.json").write_text(json.dumps(
        {name: {k: r[k] for k in ("workdir", "step", "variant", "perplexity")} | {"overall": r["measurements"]["overall"]}
         for name, r in runs.items()}, indent=1))
    plots.per_layer({n: r["measurements"] for n, r in runs.items()}, out_dir / "per_layer.png",
                    "per-layer measurements across runs")
    return text


def _label(workdir: Path, res: dict, taken: dict) -> str:
    name = workdir.name or res["variant"]
    return name if name not in taken else f"{name} ({workdir})"


def table(runs: dict[str, dict]) -> str:
    """Markdown, one row per run, like the paper's Table 4: M-Act is the mean over layers of each
    layer's max |hidden state| (Sec. 4.3), max M-Act the largest of them."""
    domains = sorted({d for r in runs.values() for d in r["perplexity"]})
    head = ["run", "variant", "step"] + [f"PPL {d}" for d in domains] + [
        "gate score", "M-Act", "F-Attn", "sink heads", "max M-Act"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in runs.items():
        o = r["measurements"]["overall"]
        ppl = [f"{r['perplexity'][d]['ppl']:.2f}" if d in r["perplexity"] else "-" for d in domains]
        cells = [name, r["variant"], str(r["step"]), *ppl,
                 f"{o['gate_score']:.3f}" if "gate_score" in o else "-", f"{o['m_act']:.2f}",
                 f"{o['f_attn']:.3f}", f"{o['sink_head_share']:.0%}", f"{o['m_act_max']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


