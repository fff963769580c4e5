"""Running a study: each cell trained by the one training loop (gattn.train.trainer), measured as
eval.py measures (gattn.eval.evaluate) plus F-Attn at its checkpoints, and marked finished by its
cell.json; a rerun skips finished cells and resumes the unfinished one. `cell_row`: a cell's
record as a flat row, for the presets that print their own tables (the main job, the demo)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from gattn.config import Config, ConfigError, flat_fields, from_dict, to_dict
from gattn.experiments.study.spec import Cell, Study, cell_config, cells, describe, planned_steps
from gattn.experiments.study.stats import trained_model

STOPPED = "stopped (SIGTERM); rerun the same command to resume"
MEASURED = ("gate_score", "f_attn", "sink_head_share", "m_act", "m_act_per_token", "ffn_act", "mean_abs_y",
            "mean_abs_y_gated")  # the overall measurements in a `cell_row`


def _share(workdir: Path, shared: Path) -> None:
    """The cell reads the study's one tokenizer and prepared dataset (relative symlinks, so the
    study folder can move)."""
    for name in ("tokenizer", "tfds"):
        (shared / name).mkdir(parents=True, exist_ok=True)
        link = workdir / name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(shared / name, workdir), target_is_directory=True)


def read_metrics(workdir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl (none if it has none)."""
    path = Path(workdir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _losses(workdir: Path) -> dict:
    rows = read_metrics(workdir)
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


def _sink_curve(cfg: Config, workdir: Path, max_batches: int) -> list[dict]:
    """F-Attn and M-Act at the planned checkpoints, restored as eval.py restores them (the one
    loader, gattn.train.rundir), on the batches the table's measurements use."""
    from gattn.data import pipeline  # noqa: PLC0415
    from gattn.data.tokenizer import load_tokenizer  # noqa: PLC0415
    from gattn.eval import analysis, sinks  # noqa: PLC0415
    from gattn.train import checkpoint, rundir  # noqa: PLC0415

    batches = pipeline.validation_batches(cfg, load_tokenizer(cfg, workdir), workdir)
    chosen = [b for d in sorted(batches) for b in batches[d][:max_batches]]
    out = []
    for step in sorted(set(checkpoint.saved_steps(workdir)) & set(planned_steps(cfg))):
        model = rundir.load(workdir, step).model
        overall = analysis.measure(model, chosen, analysis.Options(moe_shards=analysis.moe_shards(cfg)))["overall"]
        sink = sinks.measure(model, cfg, chosen)["overall"]
        out.append({"step": step, "tokens": step * cfg.train.batch_size * cfg.train.seq_len,
                    "f_attn": overall["f_attn"], "m_act": overall["m_act"], "sink_share": sink["sink_share"],
                    **{k: sink[k] for k in ("alpha_1_max", "sink_share_non_trigger") if k in sink}})
    return out


def run_cell(study: Study, cell: Cell, root: Path, *, shared: Path | None = None,
             progress: bool = False) -> dict | None:
    """Trains and measures one cell (or returns its record if it is finished); None if training
    was stopped by SIGTERM (its checkpoint is saved: rerunning resumes it)."""
    from gattn.eval import evaluate  # noqa: PLC0415
    from gattn.train import trainer  # noqa: PLC0415

    workdir = root / cell.path
    done = workdir / "cell.json"
    if done.is_file():
        return json.loads(done.read_text())
    cfg = cell_config(study, cell)
    workdir.mkdir(parents=True, exist_ok=True)
    _share(workdir, shared or root / "shared")
    record = {"variant": cell.variant, "lr": cell.lr, "seed": cell.seed, "clip": cfg.train.grad_clip,
              "path": str(cell.path)}
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
        record["sinks"] = res["sinks"]
        record["sink_curve"] = _sink_curve(cfg, workdir, study.measure_batches) if study.sink_points else []
    # Wall time of this session's part (a resumed cell counts from its resume).
    record["seconds"] = {"train": trained - start, "measure": time.perf_counter() - trained}
    _write_atomically(done, json.dumps(record))  # a cell is finished or not
    return record


def _write_atomically(path: Path, text: str) -> None:
    """Writes `path` whole or not at all: a process reading it meanwhile (a second process of the
    same study started beside this one) sees the old file or the new one, never a truncated one."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_study(study: Study, root: Path) -> None:
    """ROOT/study.json: the study a later run of the same directory must match (_check_same_study)."""
    _write_atomically(root / "study.json", json.dumps(describe(study), indent=2))


def run_cells(study: Study, root: str | Path, *, shared: str | Path | None = None, progress: bool = False,
              log=print) -> list[dict] | None:
    """Runs every cell in turn (finished ones are skipped) in `root`, all reading one tokenizer
    and dataset in `shared` (default ROOT/shared); their records, or None if a cell was stopped
    by SIGTERM."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _check_same_study(study, root)
    write_study(study, root)
    records, grid = [], cells(study)
    for i, cell in enumerate(grid, 1):
        finished = (root / cell.path / "cell.json").is_file()
        log(f"[{i}/{len(grid)}] {cell.variant} lr={cell.lr:g} seed={cell.seed}: "
            + ("finished earlier, skipped" if finished else "training"), flush=True)
        rec = run_cell(study, cell, root, shared=Path(shared) if shared else None, progress=progress)
        if rec is None:
            log(STOPPED, flush=True)
            return None
        records.append(rec)
    return records


def run(study: Study, root: str | Path, *, progress: bool = False, log=print) -> dict | None:
    """Runs every cell in turn (finished ones are skipped), then writes the report. None if a
    cell was stopped by SIGTERM."""
    from gattn.experiments.study.report import write_report  # noqa: PLC0415

    records = run_cells(study, root, progress=progress, log=log)
    return None if records is None else write_report(study, records, Path(root))


def _check_same_study(study: Study, root: Path) -> None:
    """A study directory continues only the study it was started with: finished cells of another
    budget, model or data would be mixed into the report."""
    path = root / "study.json"
    if not path.is_file():
        return
    old = json.loads(path.read_text())
    try:  # a study.json written before a config schema change: its base as the schema reads it now
        old["base"] = to_dict(from_dict(Config, old["base"]))
    except (ConfigError, KeyError, TypeError):
        pass
    old, new = flat_fields(old), flat_fields(describe(study))
    changed = sorted(k for k in set(old) | set(new) if k != "description" and old.get(k) != new.get(k)
                     and not (k in ("sink_points", "measure_batches", "cell_dir") and k not in old))
    if changed:
        k = changed[0]
        raise ConfigError(k, new.get(k), f"{root} holds a study run with {k} = {old.get(k)!r} "
                          f"({len(changed)} field(s) differ): rerun it unchanged, or use a new --workdir")


def cell_row(study: Study, record: dict, root: Path) -> dict:
    """One cell's record as a flat row: variant, lr, seed, params, added_params (vs the base
    model), and unless it diverged ("diverged": the reason): step, first_loss, final_loss,
    skipped_steps, loss_spikes, val_loss/DOMAIN, val_ppl/DOMAIN, held_out_loss (their mean
    loss), the overall measurements (gate_score only for a gated model), tokens_per_sec, seconds."""
    from gattn.model.params import count_params  # noqa: PLC0415

    cell = next(c for c in cells(study) if (c.variant, c.lr, c.seed, c.clip) ==
                (record["variant"], record["lr"], record["seed"], record.get("clip", study.clips[0])))
    params = count_params(cell_config(study, cell).model)
    row = {"variant": cell.variant, "lr": cell.lr, "seed": cell.seed, "params": params,
           "added_params": params - count_params(trained_model(study))}
    if record["diverged"]:
        return {**row, "diverged": record["diverged"], "final_loss": record["final_loss"]}
    finite = [x for x in record["losses"]["loss"] if x is not None]
    val_loss = {d: math.log(p) for d, p in record["perplexity"].items()}
    metrics = read_metrics(root / cell.path)
    overall = record["measurements"]["overall"]
    return {**row, "step": record["losses"]["steps"][-1], "first_loss": finite[0], "final_loss": record["final_loss"],
            "skipped_steps": record["skipped_steps"], "loss_spikes": record["loss_spikes"],
            **{f"val_loss/{d}": v for d, v in val_loss.items()},
            **{f"val_ppl/{d}": p for d, p in record["perplexity"].items()},
            "held_out_loss": sum(val_loss.values()) / len(val_loss),
            **{k: overall[k] for k in MEASURED if k in overall},
            "tokens_per_sec": metrics[-1].get("tokens_per_sec") if metrics else None,
            "seconds": sum(record["seconds"].values())}
