"""The stability trace: a finished run replayed step by step with the trainer's own pieces (its
initial state, its jitted step, its data iterator), measuring after each step what the paper and
Wortsman et al. (2023) tie training instability to, on the batch the step trained on:

    m_act          max |hidden state| over the blocks' outputs (the paper's M-Act)
    attn_logit     the largest attention logit q.k / sqrt(d_k) over layers, heads and causal pairs
    out_logit      max |output logit| and `log_z`, the mean |log Z| of the output softmax
    update_ratio   ||theta_after - theta_before|| / ||theta_before|| over all parameters
    gate           the mean gate score over layers (gated models)

The trainer is deterministic, so the replay is the run: `trace` checks that every replayed loss
equals the one the run logged (DIR/metrics.jsonl) and says so in its result. Written to
DIR/trace.jsonl. About 1.5x the run's training time (one extra forward per step)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gattn.config import ConfigError
from gattn.model.capture import Capture
from gattn.model.transformer import head_logits, unscanned

PROBE = Capture(block_out=True, gate=True, qk=True)
FIELDS = ("loss", "m_act", "attn_logit", "out_logit", "log_z", "update_ratio", "gate")


def max_attention_logit(q_NxHxK, k_NxGxK, segment_ids_BxS, batch: tuple[int, int]) -> jax.Array:
    """The largest q_i . k_j / sqrt(K) over heads and the pairs causal attention scores (j <= i, in
    the same document); GQA: each of the G kv heads serves H / G consecutive query heads."""
    b, s = batch
    n, h, d = q_NxHxK.shape
    g = k_NxGxK.shape[1]
    q = q_NxHxK.astype(jnp.float32).reshape(b, s, g, h // g, d)
    k = k_NxGxK.astype(jnp.float32).reshape(b, s, g, d)
    logits = jnp.einsum("bigrd,bjgd->bgrij", q, k) * d ** -0.5
    pos = jnp.arange(s)
    ok = (pos[None, :] <= pos[:, None])[None]
    if segment_ids_BxS is not None:
        ok = ok & (segment_ids_BxS[:, :, None] == segment_ids_BxS[:, None, :])
    return jnp.max(jnp.where(ok[:, None, None], logits, -jnp.inf))


@nnx.jit
def _probe(model, tokens_BxS, positions_BxS, segment_ids_BxS):
    b, s = tokens_BxS.shape
    x_NxD, _ = model.hidden(tokens_BxS, positions_BxS, segment_ids_BxS, capture=PROBE)
    logits_NxV = head_logits(x_NxD, model.head_weight(), model.dtype).astype(jnp.float32)
    inter = nnx.pop(model, nnx.Intermediate)
    blocks = [inter["blocks"][i] for i in range(len(model.blocks))]
    out = {"m_act": jnp.max(jnp.stack([jnp.max(jnp.abs(blk["block_out"][0])) for blk in blocks])),
           "attn_logit": jnp.max(jnp.stack([max_attention_logit(blk["attn"]["q"][0], blk["attn"]["k"][0],
                                                                segment_ids_BxS, (b, s)) for blk in blocks])),
           "out_logit": jnp.max(jnp.abs(logits_NxV)),
           "log_z": jnp.mean(jnp.abs(jax.nn.logsumexp(logits_NxV, axis=-1)))}
    gates = [jnp.mean(blk["attn"]["gate"]["gate_scores"][0]) for blk in blocks if "gate" in blk["attn"]]
    if gates:
        out["gate"] = jnp.mean(jnp.stack(gates))
    return out


def _norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


@jax.jit
def _update_ratio(before, after):
    return _norm(jax.tree.map(jnp.subtract, after, before)) / _norm(before)


def trace(workdir: str | Path, steps: int | None = None) -> dict:
    """Replays the run in `workdir` (its config.json, its tokenizer and data) for `steps` steps
    (default: the steps it logged); writes DIR/trace.jsonl and returns {"rows": [{step, loss, m_act,
    ...}], "matches_run": whether every replayed loss equals the logged one, "max_loss_diff"}."""
    from gattn.data.tokenizer import load_tokenizer  # noqa: PLC0415
    from gattn.experiments.study.runner import read_metrics  # noqa: PLC0415
    from gattn.model import sharding  # noqa: PLC0415
    from gattn.train import rundir, trainer  # noqa: PLC0415

    workdir = Path(workdir)
    cfg = rundir.read_config(workdir)
    logged = {r["step"]: r.get("loss") for r in read_metrics(workdir)}
    steps = steps or max(logged, default=cfg.train.steps)
    mesh = sharding.make_mesh(cfg.mesh)
    batch_sharding = sharding.batch_sharding(mesh)
    pipeline = trainer.data_source(cfg)
    data = pipeline.train_iterator(cfg, load_tokenizer(cfg, workdir), workdir,
                                   trainer.local_rows(batch_sharding, cfg.train.batch_size))
    graphdef, state = trainer.init_state(cfg, mesh)
    step_fn = trainer.make_train_step(cfg, graphdef, jax.tree.map(lambda x: x.sharding, state), mesh)
    rows, diffs = [], []
    for step in range(1, steps + 1):
        batch = {k: jax.make_array_from_process_local_data(batch_sharding, v, (cfg.train.batch_size, v.shape[1]))
                 for k, v in next(data).items()}
        model = nnx.merge(graphdef, state["params"])
        if cfg.exec.scan_layers:
            model = unscanned(model)
        probe = _probe(model, *(batch[k][:, :-1] for k in ("tokens", "positions", "segment_ids")))
        before = jax.tree.map(jnp.copy, state["params"])  # (the step donates the state)
        with jax.set_mesh(mesh):
            state, m = step_fn(state, batch)
        row = {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
               "update_ratio": float(_update_ratio(before, state["params"])),
               **{k: float(v) for k, v in probe.items()}}
        rows.append({k: (v if math.isfinite(v) else None) if isinstance(v, float) else v for k, v in row.items()})
        if isinstance(logged.get(step), (int, float)) and math.isfinite(row["loss"]):
            diffs.append(abs(row["loss"] - logged[step]))
    with (workdir / "trace.jsonl").open("w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return {"rows": rows, "matches_run": bool(diffs) and max(diffs) == 0.0,
            "max_loss_diff": float(max(diffs)) if diffs else math.nan}


def before_spikes(rows: list[dict], spike_steps: list[int], key: str, lead: int = 10, lag: int = 3) -> np.ndarray:
    """[spikes, lead + 1 + lag]: `key` in the steps around each spike (offsets -lead..lag; NaN
    where the run has no such step), for the spike-triggered curves of the mechanism figure."""
    by = {r["step"]: r.get(key) for r in rows}
    out = np.full((len(spike_steps), lead + 1 + lag), np.nan)
    for i, s in enumerate(spike_steps):
        for j, off in enumerate(range(-lead, lag + 1)):
            v = by.get(s + off)
            if isinstance(v, (int, float)):
                out[i, j] = v
    return out


PANELS = (("loss", "training loss", False), ("m_act", "M-Act: max |hidden state|", True),
          ("attn_logit", "largest attention logit", False), ("out_logit", "max |output logit|", True),
          ("update_ratio", "||update|| / ||weights||", True), ("gate", "mean gate score", False))


def figure(traces: dict[str, dict], path: Path, lead: int = 10, lag: int = 3, title: str = "") -> Path:
    """The mechanism figure: top row, each probe along each traced run (name -> {"rows",
    "spike_steps"}), spikes marked; bottom row, the same probes in the `lead` steps before and
    `lag` after each spike, averaged over the run's spikes (the spike-triggered mean)."""
    from matplotlib.figure import Figure  # noqa: PLC0415

    fig = Figure(figsize=(3.3 * len(PANELS), 6.4))
    axes = fig.subplots(2, len(PANELS), squeeze=False)
    offsets = np.arange(-lead, lag + 1)
    for j, (name, t) in enumerate(traces.items()):
        steps = [r["step"] for r in t["rows"]]
        for i, (key, label, log) in enumerate(PANELS):
            values = [r.get(key) for r in t["rows"]]
            if all(v is None for v in values):
                continue
            y = np.array([np.nan if v is None else v for v in values])
            ax = axes[0, i]
            ax.plot(steps, y, color=f"C{j}", lw=0.9, label=name)
            hit = [s for s in t["spike_steps"] if s in steps]
            ax.plot(hit, [y[steps.index(s)] for s in hit], "x", color=f"C{j}", ms=5)
            ax.set_title(label, fontsize=9)
            ax.set_xlabel("step")
            if t["spike_steps"]:
                m = np.nanmean(before_spikes(t["rows"], t["spike_steps"], key, lead, lag), axis=0)
                axes[1, i].plot(offsets, m, "o-", color=f"C{j}", ms=3, label=f"{name} ({len(t['spike_steps'])} spikes)")
            axes[1, i].set_xlabel("steps from a spike")
            for ax in axes[:, i]:
                ax.set_yscale("log" if log else "linear")
    axes[0, 0].legend(fontsize=7)
    axes[1, 0].legend(fontsize=7)
    axes[1, 0].set_ylabel("mean over the run's spikes")
    for ax in axes[1]:
        ax.axvline(0, color="grey", lw=0.6, ls=":")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def summary(rows: list[dict], spike_steps: list[int], lead: int = 10) -> dict:
    """Numbers of one traced run for the docs: each probe's largest value along the run (and its
    step), and its mean over the `lead` steps before the run's spikes against its mean at them."""
    out = {"steps": len(rows), "spikes": len(spike_steps)}
    for key in FIELDS[1:] + ("grad_norm",):
        vals = [(r.get(key), r["step"]) for r in rows if isinstance(r.get(key), (int, float))]
        if not vals:
            continue
        top = max(vals)
        win = before_spikes(rows, spike_steps, key, lead, 0) if spike_steps else np.full((0, lead + 1), np.nan)
        out[key] = {"max": top[0], "at": top[1], "median": float(np.median([v for v, _ in vals])),
                    "before_spikes": float(np.nanmean(win[:, :-1])) if len(win) else None,
                    "at_spikes": float(np.nanmean(win[:, -1])) if len(win) else None}
    return out


def main(argv=None) -> int:
    """python -m gattn.experiments.study.trace NAME=RUN_DIR [NAME=RUN_DIR ...] --out FIG.png
    [--title T] [--reuse]: traces each finished run (or, with --reuse, reads the DIR/trace.jsonl
    an earlier trace wrote), draws the mechanism figure of them all, and prints each run's
    `summary` (also written beside the figure as FIG.json)."""
    import argparse  # noqa: PLC0415

    from gattn.experiments.study.runner import _losses, read_metrics  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m gattn.experiments.study.trace", description=main.__doc__)
    ap.add_argument("runs", nargs="+", help="NAME=RUN_DIR: a finished training run (its metrics.jsonl, config.json)")
    ap.add_argument("--out", required=True, help="the figure (PNG); its numbers go to the same name with .json")
    ap.add_argument("--title", default="")
    ap.add_argument("--reuse", action="store_true", help="read RUN_DIR/trace.jsonl where it exists")
    args = ap.parse_args(argv)
    traces, numbers = {}, {}
    for item in args.runs:
        name, eq, path = item.partition("=")
        if not (name and eq and path):  # (before: "RUN" alone traced ".")
            raise ConfigError("runs", item, "NAME=RUN_DIR (the name labels the run in the figure)")
        path = Path(path)
        if not (path / "metrics.jsonl").is_file():
            raise ConfigError("runs", item, "a finished training run's folder (with metrics.jsonl and config.json)")
        done = path / "trace.jsonl"
        if args.reuse and done.is_file():
            rows = [json.loads(line) for line in done.read_text().splitlines()]
            logged = {r["step"]: r.get("loss") for r in read_metrics(path)}
            diffs = [abs(r["loss"] - logged[r["step"]]) for r in rows
                     if isinstance(r.get("loss"), float) and isinstance(logged.get(r["step"]), float)]
            res = {"rows": rows, "matches_run": bool(diffs) and max(diffs) == 0.0,
                   "max_loss_diff": max(diffs) if diffs else math.nan}
        else:
            res = trace(path)
        spikes = _losses(path)["spike_steps"]
        traces[name] = {"rows": res["rows"], "spike_steps": spikes}
        numbers[name] = {"run": str(path), "matches_run": res["matches_run"], "max_loss_diff": res["max_loss_diff"],
                         "spike_steps": spikes, **summary(res["rows"], spikes)}
        print(name, json.dumps(numbers[name]), flush=True)
    out = figure(traces, Path(args.out), title=args.title)
    out.with_suffix(".json").write_text(json.dumps(numbers, indent=1))
    print(f"figure: {out}", flush=True)
    return 0 if all(n["matches_run"] for n in numbers.values()) else 1


if __name__ == "__main__":
    from gattn.cli import run_entry_point

    run_entry_point(main)  # (errors as one line, exit 2; before: a traceback)
