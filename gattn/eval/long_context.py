"""Long-context evaluation of a run (the paper's Table 5): the RULER-style tasks (gattn/eval/ruler.py)
and window perplexity at each length, and their comparison across checkpoints.

    evaluate_ruler(workdir, lengths) -> WORKDIR/eval/ruler.json, ruler.md, ruler.png
    compare_ruler([dir or ruler.json, ...]) -> a Table-5-like table and accuracy against length
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from gattn.config import ConfigError
from gattn.data import pipeline
from gattn.data.tokenizer import load_tokenizer
from gattn.eval import analysis, plots, ruler
from gattn.eval.evaluate import out_path
from gattn.model.transformer import off_mesh, with_exec
from gattn.train import checkpoint, rundir


def evaluate_ruler(workdir: str | Path, lengths: list[int], *, step: int | None = None,
                   overrides: list[str] = (), tasks: tuple[str, ...] = ruler.TASKS, num_samples: int = 8,
                   seed: int = 0, batch_size: int = 4, prefill_chunk: int = 512,
                   out_dir: str | Path | None = None, figures: bool = True) -> dict:
    """The RULER-style benchmark (gattn/eval/ruler.py) and the window perplexity on `workdir`'s
    checkpoint at each length, with the run's config plus `overrides` (e.g. a new rope_base, or
    YaRN: model.yarn.factor=4; its original_len defaults to the run's train.seq_len). Writes
    ruler.json (which records the overrides), ruler.md and ruler.png to `out_dir` (default
    WORKDIR/eval)."""
    workdir = Path(workdir).absolute()
    run_cfg = rundir.load_config(workdir, overrides)
    tokenizer = load_tokenizer(run_cfg, workdir)
    bos = tokenizer.bos_id() if run_cfg.data.bos else None  # its training documents open with BOS

    def count(text):
        return (bos is not None) + len(tokenizer.encode(text))

    # Checked before anything is restored (other samples' keys and numbers take a few more tokens).
    short = {t: n + 16 for t, n in ruler.shortest(tasks, count, seed).items() if n + 16 > min(lengths)}
    if short:
        raise ConfigError("--lengths", min(lengths), "every length must hold each task's instructions and "
                          f"answer: {', '.join(f'{t} needs about {n}' for t, n in short.items())}")
    if not any("attention_query_chunk" in o for o in overrides):  # long windows: queries in chunks
        run_cfg = dataclasses.replace(run_cfg, exec=dataclasses.replace(
            run_cfg.exec, attention_query_chunk=prefill_chunk))
    cfg, model, step = rundir.load(workdir, step, overrides, cfg=run_cfg)
    try:
        # No mesh is set here: an expert-parallel MoE runs as the partitioned one.
        res = ruler.run(with_exec(model, off_mesh(model.ex)), tokenizer, lengths, tasks=tasks,
                        num_samples=num_samples, seed=seed, batch_size=batch_size, prefill_chunk=prefill_chunk,
                        bos=bos)
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
