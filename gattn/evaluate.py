"""Evaluation of a run's checkpoint: perplexity per held-out domain, the paper's measurements
(`gattn.analysis`), optional few-shot tasks (`gattn.fewshot`), figures (`gattn.plots`), and the
comparison of several runs (Table 4 of the paper, for your checkpoints).

    evaluate(workdir)  ->  WORKDIR/eval/results.json, results.md, *.png
    compare([dir, ...]) -> a Table-4-like markdown table and one overlay figure of per-layer curves
    evaluate_ruler(workdir, lengths) -> WORKDIR/eval/ruler.json, ruler.md, ruler.png (gattn.ruler)
    compare_ruler([dir or ruler.json, ...]) -> a Table-5-like table and accuracy against length
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import jax
from flax import nnx

from gattn import analysis, checkpoint, plots, ruler, sharding, trainer
from gattn import config as config_lib
from gattn.config import ConfigError, MeshConfig
from gattn.data import pipeline
from gattn.data.tokenizer import load_tokenizer


def _fit_mesh(cfg):
    """The run's mesh if the present devices can hold it, else all devices on the data axis."""
    try:
        sharding.make_mesh(cfg.mesh)
        return cfg
    except ConfigError as e:
        print(f"note: {e}; evaluating on all {jax.device_count()} device(s) on the data axis instead "
              "(set --config.mesh.* to choose)", file=sys.stderr)
        return dataclasses.replace(cfg, mesh=MeshConfig())


def restore(workdir: str | Path, step: int | None = None, overrides: list[str] = (), *, run_cfg=None):
    """(cfg, model, step) of `workdir`'s checkpoint `step` (default: the latest) with the run's own
    config plus `overrides` (`run_cfg`, if the caller has loaded it already), on the devices present
    now; scanned layers are unrolled, as the measurements need, and a pallas-attention run uses the
    xla attention off TPU (unless `model.attention_impl` is overridden)."""
    from gattn.model import unscanned  # noqa: PLC0415

    cfg = _fit_mesh(run_cfg if run_cfg is not None else config_lib.load_run(workdir, overrides))
    chosen = any("model.attention_impl" in o for o in overrides)
    if cfg.model.attention_impl == "pallas" and jax.default_backend() != "tpu" and not chosen:
        # Off TPU the kernel runs in interpret mode (~100x slower); the xla path computes the same.
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl="xla"))
    steps = checkpoint.saved_steps(workdir)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {Path(workdir) / 'checkpoints'}")
    if step is not None and step not in steps:
        raise ConfigError("--step", step, f"one of the saved steps {steps}")
    step = steps[-1] if step is None else step
    model = trainer.load_model(cfg, workdir, step)
    if cfg.model.scan_layers:
        model = unscanned(model)
        cfg = dataclasses.replace(cfg, model=model.cfg)
    return cfg, model, step


def evaluate(workdir: str | Path, *, step: int | None = None, overrides: list[str] = (),
             options: analysis.Options | None = None, max_batches: int | None = None,
             tasks: list[str] = (), shots: int = 0, limit: int | None = None,
             out_dir: str | Path | None = None, figures: bool = True) -> dict:
    """Evaluates `workdir`'s checkpoint and writes results.json, results.md and the figures to
    `out_dir` (default WORKDIR/eval). `max_batches`: held-out batches per domain for the
    measurements (default: all of `data.eval_batches`); perplexity always uses all of them."""
    workdir = Path(workdir)
    options = options or analysis.Options()
    run_cfg = config_lib.load_run(workdir, overrides)
    # Checked before anything is restored, named as eval.py's flag.
    analysis.check_map_layers(options.map_layers or (), run_cfg.model.num_layers, "--map-layers")
    cfg, model, step = restore(workdir, step, overrides, run_cfg=run_cfg)
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
    measurements = analysis.measure(model, chosen, options)
    results = {"workdir": str(workdir), "step": step, "variant": cfg.variant,
               "gate": dataclasses.asdict(cfg.model.gate) if cfg.model.gate else None,
               "perplexity": perplexity, "measurements": measurements,
               "measured_on": {"batches": len(chosen), "rows": sum(len(b["tokens"]) for b in chosen),
                               "seq_len": cfg.train.seq_len}}
    if tasks:
        from gattn import fewshot  # noqa: PLC0415

        # Prompts longer than the trained length lose tokens from their left end.
        results["fewshot"] = {Path(t).stem: fewshot.evaluate_task(model, tokenizer, t, shots=shots, limit=limit,
                                                                  max_len=cfg.train.seq_len)
                              for t in tasks}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(report(results))
    if figures:
        results["figures"] = [str(p) for p in write_figures(results, out_dir) if p]
    return results


def out_path(workdir: str | Path, out_dir: str | Path | None = None) -> Path:
    return Path(out_dir) if out_dir else Path(workdir) / "eval"


def write_figures(results: dict, out_dir: Path) -> list[Path | None]:
    m, name = results["measurements"], f"{results['variant']} (step {results['step']})"
    paths = [plots.per_layer({name: m}, out_dir / "per_layer.png", name),
             plots.sparsity(m, out_dir / "sparsity.png", name),
             plots.f_attn_heads(m, out_dir / "f_attn_heads.png", name),
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
              f"- M-Act (mean over layers of the max |hidden|): {o['m_act']:.2f} (max over layers {o['m_act_max']:.2f})",
              f"- F-Attn (first token): {o['f_attn']:.3f}",
              f"- sink heads (F-Attn > {m['sink_threshold']}): {o['sink_head_share']:.0%}", "",
              "| layer | M-Act | F-Attn | sink heads | gate score | SDPA values < 1e-3 (before / after gate) |",
              "|---|---|---|---|---|---|"]
    for r in m["per_layer"]:
        sp = r["sparsity"]
        after = f"{sp['gated']['0.001']:.1%}" if "gated" in sp and "0.001" in sp["gated"] else "-"
        before = f"{sp['sdpa_out']['0.001']:.1%}" if "0.001" in sp["sdpa_out"] else "-"
        g = f"{r['gate_score']:.3f}" if "gate_score" in r else "-"
        lines.append(f"| {r['layer']} | {r['m_act']:.2f} | {r['f_attn']:.3f} | {r['sink_head_share']:.0%} "
                     f"| {g} | {before} / {after} |")
    for task, res in results.get("fewshot", {}).items():
        lines.append("")
        lines.append(f"- few-shot {task}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                       for k, v in res.items() if k != "examples"))
    return "\n".join(lines) + "\n"


def compare(workdirs: list[str | Path], *, out_dir: str | Path | None = None, overrides: list[str] = (),
            **eval_kwargs) -> str:
    """Table 4 across runs: PPL per domain, gate score, M-Act, F-Attn, sink heads; overlays their
    per-layer curves in one figure. A run without WORKDIR/eval/results.json is evaluated first."""
    runs = {}
    for w in workdirs:
        path = Path(w) / "eval" / "results.json"
        res = json.loads(path.read_text()) if path.is_file() else None
        if res is None or res["step"] != max(checkpoint.saved_steps(w), default=None):  # missing or of an older checkpoint
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


# --------------------------------------------------------------------------- long context (RULER)


def evaluate_ruler(workdir: str | Path, lengths: list[int], *, step: int | None = None,
                   overrides: list[str] = (), tasks: tuple[str, ...] = ruler.TASKS, num_samples: int = 8,
                   seed: int = 0, batch_size: int = 4, prefill_chunk: int = 512,
                   out_dir: str | Path | None = None, figures: bool = True) -> dict:
    """The RULER-style benchmark (gattn/ruler.py) and the window perplexity on `workdir`'s
    checkpoint at each length, with the run's config plus `overrides` (e.g. a new rope_base, or
    YaRN: model.yarn.factor=4; its original_len defaults to the run's train.seq_len). Writes
    ruler.json (which records the overrides), ruler.md and ruler.png to `out_dir` (default
    WORKDIR/eval)."""
    workdir = Path(workdir).absolute()
    run_cfg = config_lib.load_run(workdir, overrides)
    tokenizer = load_tokenizer(run_cfg, workdir)

    def count(text):
        return len(tokenizer.encode(text))

    # Checked before anything is restored (other samples' keys and numbers take a few more tokens).
    short = {t: n + 16 for t, n in ruler.shortest(tasks, count, seed).items() if n + 16 > min(lengths)}
    if short:
        raise ConfigError("--lengths", min(lengths), "every length must hold each task's instructions and "
                          f"answer: {', '.join(f'{t} needs about {n}' for t, n in short.items())}")
    if not any("attention_query_chunk" in o for o in overrides):  # long windows: queries in chunks
        run_cfg = dataclasses.replace(run_cfg, model=dataclasses.replace(
            run_cfg.model, attention_query_chunk=prefill_chunk))
    cfg, model, step = restore(workdir, step, overrides, run_cfg=run_cfg)
    try:
        res = ruler.run(model, tokenizer, lengths, tasks=tasks, num_samples=num_samples, seed=seed,
                        batch_size=batch_size, prefill_chunk=prefill_chunk)
    except ruler.TooShort as e:
        raise ConfigError("--lengths", min(lengths), str(e)) from None
    # The same text at every length: per domain, up to 4 windows of the longest length.
    text = {d: t[:min(len(t) - 1, 4 * max(lengths)) + 1]
            for d, t in pipeline.held_out_text(cfg, tokenizer, workdir).items()}
    for n, row in res["per_length"].items():
        row["perplexity"] = {d: p for d, stream in text.items()
                             if (p := analysis.window_perplexity(model, stream, int(n))) is not None}
    yarn = dataclasses.asdict(cfg.model.yarn) if cfg.model.yarn else None
    label = workdir.name + (f" + YaRN x{yarn['factor']:g}" if yarn else "")
    res = {"label": label, "workdir": str(workdir), "step": step, "variant": cfg.variant,
           "overrides": list(overrides), "trained_len": cfg.train.seq_len, "rope_base": cfg.model.rope_base,
           "yarn": yarn, **res}
    out_dir = out_path(workdir, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ruler.json").write_text(json.dumps(res, indent=1))
    (out_dir / "ruler.md").write_text(ruler_table([res]) + "\n\n" + ruler_task_table(res) + "\n")
    if figures:
        res["figures"] = [str(plots.ruler({label: res}, out_dir / "ruler.png"))]
    return res


def reusable(res: dict | None, workdir: Path, lengths, settings: dict) -> bool:
    """Whether a run's earlier ruler.json answers a comparison: the latest checkpoint, every
    requested length, and the same settings (tasks, samples, seed, overrides)."""
    return (res is not None and set(lengths) <= set(res["lengths"])
            and all(res.get(k) == v for k, v in settings.items())
            and res["step"] == max(checkpoint.saved_steps(workdir), default=None))


def compare_ruler(entries: list[str | Path], lengths: list[int], *, out_dir: str | Path | None = None,
                  **ruler_kwargs) -> str:
    """Table 5 across checkpoints. Each entry is a run directory (its eval/ruler.json is reused if
    `reusable`, else the run is evaluated with `ruler_kwargs`) or a ruler.json written earlier
    (e.g. a YaRN evaluation with --out), which must have the same tasks, samples and seed. Writes
    ruler_table.md, ruler.json and ruler.png to `out_dir` (default COMMON_PARENT/compare)."""
    settings = {"tasks": list(ruler_kwargs.get("tasks", ruler.TASKS)),
                "num_samples": ruler_kwargs.get("num_samples", 8), "seed": ruler_kwargs.get("seed", 0)}
    results = []
    for entry in map(Path, entries):
        if entry.is_file() or (entry / "ruler.json").is_file() and not (entry / "config.json").is_file():
            res = json.loads((entry if entry.is_file() else entry / "ruler.json").read_text())
            for k, v in settings.items():
                if res.get(k) != v:
                    raise ConfigError("--compare", str(entry), f"it was evaluated with {k} = {res.get(k)!r}, "
                                      f"this comparison uses {v!r}: pass the same --ruler-tasks, --samples, --seed")
            results.append(res)
            continue
        path = entry / "eval" / "ruler.json"
        res = json.loads(path.read_text()) if path.is_file() else None
        want = settings | {"overrides": list(ruler_kwargs.get("overrides", []))}
        results.append(res if reusable(res, entry, lengths, want) else evaluate_ruler(entry, lengths, **ruler_kwargs))
    for r in results:  # the requested lengths only, in the order asked
        r["per_length"] = {str(n): r["per_length"][str(n)] for n in sorted(lengths) if str(n) in r["per_length"]}
    labels = [r["label"] for r in results]
    for r in results:  # runs of the same name in different folders (e.g. main/ and extend/)
        if labels.count(r["label"]) > 1:
            r["label"] = f"{Path(r['workdir']).parent.name}/{r['label']}"
    parents = [Path(e).absolute() if Path(e).is_dir() else Path(e).absolute().parent for e in entries]
    out_dir = Path(out_dir) if out_dir else Path(os.path.commonpath(parents)) / "compare"
    out_dir.mkdir(parents=True, exist_ok=True)
    text = ruler_table(results) + "\n\n" + perplexity_table(results)
    (out_dir / "ruler_table.md").write_text(text + "\n")
    (out_dir / "ruler.json").write_text(json.dumps(results, indent=1))
    plots.ruler({r["label"]: r for r in results}, out_dir / "ruler.png")
    return text


def ruler_table(results: list[dict]) -> str:
    """Markdown like the paper's Table 5: one row per checkpoint, the mean exact-match score over
    tasks at each length; a YaRN row also shows its change against the same run without YaRN."""
    lengths = sorted({int(n) for r in results for n in r["per_length"]})
    head = ["checkpoint", "trained at", "RoPE base", "YaRN"] + [_length_name(n) for n in lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        plain = (next((q for q in results if q["workdir"] == r["workdir"] and not q["yarn"]), None)
                 if r["yarn"] else None)
        cells = [r["label"], str(r["trained_len"]), f"{r['rope_base']:,.0f}",
                 f"x{r['yarn']['factor']:g} from {r['yarn']['original_len']}" if r["yarn"] else "-"]
        for n in map(str, lengths):
            if n not in r["per_length"]:
                cells.append("-")
                continue
            score = r["per_length"][n]["exact"]
            delta = (f" ({score - plain['per_length'][n]['exact']:+.1f})"
                     if plain is not None and n in plain["per_length"] else "")
            cells.append(f"{score:.1f}{delta}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def perplexity_table(results: list[dict]) -> str:
    """Held-out perplexity of windows of each length (second half in parentheses), one row per
    checkpoint and domain: where RULER scores are all zero, this still shows extrapolation."""
    lengths = sorted({int(n) for r in results for n in r["per_length"]})
    lines = ["| checkpoint | domain | " + " | ".join(_length_name(n) for n in lengths) + " |",
             "|" + "---|" * (len(lengths) + 2)]
    for r in results:
        for domain in _ppl_domains(r):
            cells = [_ppl_cell(r["per_length"].get(str(n), {}), domain) for n in lengths]
            lines.append(f"| {r['label']} | {domain} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ppl_domains(res: dict) -> list[str]:
    return sorted({d for v in res["per_length"].values() for d in v.get("perplexity", {})})


def _ppl_cell(row: dict, domain: str) -> str:
    """A length's window perplexity of `domain`, its second half in parentheses ("-" if none)."""
    p = row.get("perplexity", {}).get(domain)
    return f"{p['ppl']:.1f} ({p['ppl_second_half']:.1f})" if p else "-"


def ruler_task_table(res: dict) -> str:
    """Exact-match (and partial) score of each task at each length, held-out perplexity of windows
    of that length (and of their second half), and the cost of each length."""
    lengths = list(res["per_length"])
    lines = ["| task | " + " | ".join(_length_name(int(n)) for n in lengths) + " |", "|" + "---|" * (len(lengths) + 1)]
    for task in res["tasks"]:
        lines.append(f"| {task} | " + " | ".join(
            f"{res['per_length'][n]['tasks'][task]['exact']:.0f} ({res['per_length'][n]['tasks'][task]['partial']:.0f})"
            for n in lengths) + " |")
    for domain in _ppl_domains(res):
        lines.append(f"| PPL {domain} (second half) | "
                     + " | ".join(_ppl_cell(res["per_length"][n], domain) for n in lengths) + " |")
    lines.append("| seconds | " + " | ".join(f"{res['per_length'][n]['seconds']:.0f}" for n in lengths) + " |")
    lines.append("| peak memory (MiB) | " + " | ".join(f"{res['per_length'][n]['peak_rss_mb']:.0f}" for n in lengths) + " |")
    return "\n".join(lines)


def _length_name(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)
