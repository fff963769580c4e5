"""Figures of the paper's measurements (matplotlib, written as PNG): per-layer curves (Fig. 2 left,
Fig. 6), mean |SDPA output| before and after the gate (Fig. 4), the gate-score histogram (Fig. 3),
SDPA-output sparsity (Fig. 5), per-head F-Attn, and per-head attention maps (Fig. 2 right). Each takes `gattn.eval.analysis` results (`measurements` in
eval.py's results.json) and a path; `ruler` takes gattn.ruler results (Table 5 as a figure); the
study figures (loss curves with spikes, gate histograms and attention maps side by side, F-Attn
against training tokens, stability across learning rates) take gattn.study records; eval.py
--compare's overlays (`loss_overlay`, `gate_overlay`) take the data it writes beside them as JSON."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # no pyplot: no global backend is touched (notebooks keep theirs)
from matplotlib.ticker import MaxNLocator

# The per-layer panels: (key, title, y label, log scale), drawn as a grid of PER_LAYER_COLUMNS.
PER_LAYER = (("m_act", "M-Act (log scale)", "max |hidden state|", True),
             ("m_act_per_token", "M-Act per token (log scale)", "mean of each token's max |h|", True),
             ("ffn_act", "FFN-Act, Fig. 6 (log scale)", "max |FFN output|", True),
             ("f_attn", "F-Attn", "attention on the first token", False),
             ("sink_head_share", "F-Attn sink heads", "share of heads over threshold", False),
             ("gate_score", "gate score", "mean gate score", False))
PER_LAYER_COLUMNS = 3


# Per run: a marker, a line style and a marker size that shrinks with each run drawn later, so
# that where runs coincide (two runs without sink heads: both at 0) each stays visible.
MARKERS, LINESTYLES = ("o", "s", "^", "D", "v", "P"), ("-", "--", ":", "-.")


def run_style(j: int) -> dict:
    """Line properties of the j-th run in an overlay."""
    return {"color": f"C{j % 10}", "marker": MARKERS[j % len(MARKERS)], "ls": LINESTYLES[j % len(LINESTYLES)],
            "ms": max(8.0 - 2.0 * j, 3.0), "zorder": 2 + j}


def dodge(j: int, n: int, width: float = 0.12) -> float:
    """The j-th of n runs' offset along x (within `width`): a shared value (a sink-head share of 0)
    draws n markers side by side rather than on top of each other."""
    return (j - (n - 1) / 2) * width / max(n - 1, 1) if n > 1 else 0.0


def _values(rows: list[dict], key: str) -> np.ndarray:
    """rows[i][key] as floats; None (an attention measure on a hybrid's Gated DeltaNet layer) is
    NaN, a gap in the line."""
    return np.asarray([r[key] for r in rows], float)


def per_layer(runs: dict[str, dict], path: Path, title: str = "") -> Path:
    """One panel per quantity in a grid of `PER_LAYER_COLUMNS` (`PER_LAYER`: title, y label), one
    line per run (name -> measurements; `run_style`); gate scores only for the gated runs. In the
    sink-head panel the runs are dodged along x (`dodge`) and the panel has its own legend."""
    lines = -(-len(PER_LAYER) // PER_LAYER_COLUMNS)  # rows of panels
    fig, axes = _subplots(lines, PER_LAYER_COLUMNS, figsize=(4.4 * PER_LAYER_COLUMNS, 3.4 * lines + 0.4),
                          squeeze=False)
    axes = axes.ravel()
    for ax, (key, label, ylabel, log) in zip(axes, PER_LAYER):
        for j, (name, m) in enumerate(runs.items()):  # one style per run in every panel
            rows = m["per_layer"]
            if key in rows[0]:
                dx = dodge(j, len(runs)) if key == "sink_head_share" else 0.0
                ax.plot([r["layer"] + dx for r in rows], _values(rows, key), label=name, **run_style(j))
        if key == "sink_head_share":
            ax.set_ylim(-0.05, 1.05)
            if ax.lines:
                ax.legend(fontsize=8)
        ax.set(xlabel="layer", ylabel=ylabel, title=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if log:
            ax.set_yscale("log")
        else:
            ax.ticklabel_format(axis="y", useOffset=False)
        ax.grid(alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, "no gated run", ha="center", va="center", transform=ax.transAxes)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "per-layer measurements on held-out data")
    return _save(fig, path)


def loss_overlay(curves: dict[str, dict], path: Path) -> Path:
    """Training loss per logged step (left) and validation loss per domain at the eval steps
    (right), one colour per run (`evaluate.loss_curves` data: name -> {"train", "val"}); in the
    right panel one marker and line style per domain."""
    fig, (a, b) = _subplots(1, 2, figsize=(11, 3.8))
    domains = sorted({d for c in curves.values() for d in c["val"]})
    for j, (name, c) in enumerate(curves.items()):
        loss = [np.nan if x is None else x for x in c["train"]["loss"]]
        a.plot(c["train"]["steps"], loss, color=f"C{j % 10}", lw=1, label=name)
        for k, d in enumerate(domains):
            if d in c["val"]:
                v = c["val"][d]
                b.plot(v["steps"], [np.nan if x is None else x for x in v["loss"]], color=f"C{j % 10}",
                       marker=MARKERS[k % len(MARKERS)], ls=LINESTYLES[k % len(LINESTYLES)], label=f"{name}: {d}")
    a.set(xlabel="step", ylabel="training loss", title="training loss")
    b.set(xlabel="step", ylabel="validation loss", title="validation loss per held-out domain")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    return _save(fig, path)


def gate_overlay(hists: dict[str, dict], path: Path) -> Path:
    """Fig. 3 for several runs on one axis: each gated run's gate-score distribution over all
    layers as a step line (`evaluate.gate_shares` data: name -> {"edges", "share", "mean"})."""
    fig, ax = _subplots(1, 1, figsize=(6, 3.8))
    for j, (name, h) in enumerate(hists.items()):
        ax.stairs(h["share"], h["edges"], color=f"C{j % 10}", ls=LINESTYLES[j % len(LINESTYLES)], lw=1.5,
                  label=f"{name} (mean {h['mean']:.3f})")
    ax.set(xlabel="gate score", ylabel="share of scores", title="gate scores, all layers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def mean_abs_y(runs: dict[str, dict], path: Path, title: str = "") -> Path:
    """Fig. 4: mean |Y| of the SDPA output per layer, before the G1 gate (solid; the ungated
    model's Y) and after it (dashed, gated runs only), one colour per run."""
    fig, ax = _subplots(1, 1, figsize=(5.5, 3.8))
    for j, (name, m) in enumerate(runs.items()):
        rows = m["per_layer"]
        if "mean_abs_y" not in rows[0]:
            continue
        layers = [r["layer"] for r in rows]
        ax.plot(layers, _values(rows, "mean_abs_y"), marker="o", color=f"C{j % 10}", label=f"{name}: Y")
        if "mean_abs_y_gated" in rows[0]:
            ax.plot(layers, _values(rows, "mean_abs_y_gated"), marker="s", ls="--", color=f"C{j % 10}",
                    label=f"{name}: Y' (after the gate)")
    ax.set(xlabel="layer", ylabel="mean |value|", yscale="log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title or "mean |SDPA output| before and after the gate")
    return _save(fig, path)


def gate_histogram(m: dict, path: Path, name: str = "") -> Path:
    """Fig. 3: the distribution of gate scores over all layers, and per layer."""
    hist = m["gate_histogram"]
    lo, hi = hist["range"]
    counts = np.asarray(hist["per_layer"], float)
    edges = np.linspace(lo, hi, counts.shape[1] + 1)
    centres = (edges[:-1] + edges[1:]) / 2
    fig, (a, b) = _subplots(1, 2, figsize=(10, 3.6))
    total = counts.sum(0)
    a.bar(centres, total / total.sum(), width=edges[1] - edges[0])
    a.set(xlabel="gate score", ylabel="share of scores", title=f"gate scores, all layers (mean {m['overall']['gate_score']:.3f})")
    for i, c in enumerate(counts):
        b.plot(centres, c / max(c.sum(), 1), label=f"layer {i}")
    b.set(xlabel="gate score", ylabel="share of scores", title="per layer")
    b.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{name}: gate score distribution (values outside [{lo}, {hi}] in the edge bins)")
    return _save(fig, path)


def sparsity(m: dict, path: Path, name: str = "") -> Path:
    """Fig. 5: share of SDPA-output values below each threshold per layer, before and after the
    gate and after scaling by the mean gate score instead."""
    rows = [r for r in m["per_layer"] if r["sparsity"] is not None]  # (a hybrid's attention layers)
    kinds = list(rows[0]["sparsity"])
    thresholds = list(rows[0]["sparsity"][kinds[0]])
    fig, axes = _subplots(1, len(thresholds), figsize=(5.5 * len(thresholds), 3.6), squeeze=False)
    layers = np.asarray([r["layer"] for r in rows])
    width = 0.8 / len(kinds)
    labels = {"sdpa_out": "SDPA output", "gated": "after the gate", "mean_gate_scaled": "x mean gate score"}
    for ax, t in zip(axes[0], thresholds):
        for j, kind in enumerate(kinds):
            ax.bar(np.arange(len(rows)) + j * width, [r["sparsity"][kind][t] for r in rows], width, label=labels[kind])
        ax.set(xlabel="layer", ylabel=f"share of |values| < {t}", title=f"sparsity below {t}")
        ax.set_xticks(np.arange(len(rows)) + width * (len(kinds) - 1) / 2, layers)
        ax.legend(fontsize=8)
    fig.suptitle(f"{name}: SDPA-output sparsity")
    return _save(fig, path)


def f_attn_heads(m: dict, path: Path, name: str = "") -> Path:
    """Per-head first-token attention, layers x heads."""
    grid = np.asarray([r["f_attn_per_head"] for r in m["per_layer"]], float)  # (None: a GDN layer, blank)
    fig, ax = _subplots(figsize=(1.0 + 0.45 * grid.shape[1], 1.0 + 0.35 * grid.shape[0]))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set(xlabel="head", ylabel="layer", title=f"{name}: F-Attn per head")
    fig.colorbar(im, ax=ax, label="attention on the first token")
    return _save(fig, path)


def sink_heads(sinks: dict, path: Path, name: str = "") -> Path:
    """Gu et al.'s alpha_1 per head (layers x heads; gattn/eval/sinks.py), with each head's value
    printed and the sink threshold and uniform level in the title; a second panel for the
    non-trigger queries of Bigram-Backcopy data."""
    o = sinks["overall"]
    keys = ["alpha_1_per_head"] + [k for k in sinks["per_layer"][0] if k.startswith("alpha_1_") and
                                   k.endswith("_per_head") and k != "alpha_1_per_head"]
    grids = [np.asarray([r[k] for r in sinks["per_layer"]]) for k in keys]
    h, w = grids[0].shape
    fig, axes = _subplots(1, len(keys), figsize=(len(keys) * (2.6 + 0.6 * w), 1.9 + 0.45 * h), squeeze=False)
    for ax, grid, key in zip(axes[0], grids, keys):
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for (i, j), a in np.ndenumerate(grid):
            ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=7, color="w" if a < 0.6 else "k")
        queries = key.removeprefix("alpha_1").removesuffix("_per_head").strip("_").replace("_", "-") or "all"
        ax.set(xlabel="head", ylabel="layer", title=f"alpha_1, {queries} queries", xticks=range(w), yticks=range(h))
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"{name}: Sink_1 (T = {o['window']}): sink head if alpha_1 > {o['eps']:g}; "
                 f"uniform attention {o['uniform_alpha_1']:.3f}", fontsize=9)
    return _save(fig, path)


def attention_maps(m: dict, path: Path, name: str = "", max_heads: int = 8) -> Path | None:
    """Fig. 2 right: per-head mean attention maps (query x key) of the chosen layers."""
    maps = {int(k): np.asarray(v) for k, v in m.get("attn_maps", {}).items()}
    if not maps:
        return None
    heads = min(max_heads, next(iter(maps.values())).shape[0])
    fig, axes = _subplots(len(maps), heads, figsize=(2.2 * heads, 2.2 * len(maps)), squeeze=False)
    for row, (layer, mp) in zip(axes, sorted(maps.items())):
        for h, ax in enumerate(row):
            ax.imshow(mp[h] ** 0.5, cmap="magma", vmin=0, vmax=1)  # sqrt: faint structure visible
            ax.set_title(f"layer {layer}, head {h}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
        row[0].set_ylabel("query position")
    for ax in axes[-1]:
        ax.set_xlabel("key position")
    fig.suptitle(f"{name}: mean attention maps (sqrt of the probability)")
    return _save(fig, path)


def ruler(runs: dict[str, dict], path: Path) -> Path:
    """Table 5 as a figure: exact-match score against context length, the mean over tasks and each
    task, then the held-out window perplexity per domain (the same text at every length); one line
    per checkpoint (name -> eval.py --ruler results); each checkpoint's trained length dotted."""
    first = next(iter(runs.values()))
    domains = sorted({d for r in runs.values() for v in r["per_length"].values() for d in v.get("perplexity", {})})
    panels = ["mean over tasks"] + list(first["tasks"]) + [f"PPL {d}" for d in domains]
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = _subplots(rows, cols, figsize=(3.8 * cols, 3.2 * rows), squeeze=False)
    ticks = sorted({int(n) for r in runs.values() for n in r["per_length"]})
    for ax, panel in zip(axes.flat, panels):
        ppl = panel.startswith("PPL ")
        for j, (name, r) in enumerate(runs.items()):
            if ppl:
                ys = [v.get("perplexity", {}).get(panel[4:], {}).get("ppl", np.nan)
                      for v in r["per_length"].values()]
            elif panel == panels[0]:
                ys = [v["exact"] for v in r["per_length"].values()]
            else:
                ys = [v["tasks"].get(panel, {}).get("exact", np.nan) for v in r["per_length"].values()]
            ax.plot([int(n) for n in r["per_length"]], ys, marker="o", color=f"C{j % 10}", label=name)
            ax.axvline(r["trained_len"], color=f"C{j % 10}", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(n) for n in ticks], rotation=45 if len(ticks) > 4 else 0)
        if ppl:
            ax.set(xlabel="context length (tokens)", ylabel="window perplexity", title=f"held-out {panel}")
        else:
            ax.set(xlabel="context length (tokens)", ylabel="exact match (%)", title=panel, ylim=(-3, 103))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("long context: RULER-style accuracy and window perplexity (dotted: the trained length)")
    return _save(fig, path)


def loss_curves(by_lr: dict[float, list[dict]], path: Path) -> Path:
    """Fig. 1 right: training loss per step, one panel per learning rate, one colour per variant
    (a thin line per seed), loss spikes marked x; a diverged run's curve ends where it stopped."""
    fig, axes = _subplots(1, len(by_lr), figsize=(5.5 * len(by_lr), 3.8), squeeze=False)
    for ax, (lr, records) in zip(axes[0], by_lr.items()):
        names = list(dict.fromkeys(r["variant"] for r in records))
        for r in records:
            c = f"C{names.index(r['variant']) % 10}"
            steps, loss = r["losses"]["steps"], np.asarray([np.nan if x is None else x for x in r["losses"]["loss"]])
            first = r is next(x for x in records if x["variant"] == r["variant"])
            ax.plot(steps, loss, color=c, lw=0.8, alpha=0.8, label=r["variant"] if first else None)
            at = {s: i for i, s in enumerate(steps)}
            spikes = [s for s in r["losses"]["spike_steps"] if s in at]
            ax.plot(spikes, [loss[at[s]] for s in spikes], "x", color=c, ms=7, mew=2)
        ax.set(xlabel="step", ylabel="training loss", title=f"LR {lr:g} (x: loss spikes)")
        finite = np.concatenate([np.asarray([x for x in r["losses"]["loss"] if x is not None], float)
                                 for r in records] or [np.zeros(1)])
        if finite.size:
            ax.set_ylim(max(0.0, finite.min() - 0.2), min(finite.max(), np.percentile(finite, 2) * 3) + 0.2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def gate_histograms(runs: dict[str, dict], path: Path) -> Path | None:
    """Fig. 3 for several gated runs: the gate-score distribution over all layers, one panel each."""
    if not runs:
        return None
    fig, axes = _subplots(1, len(runs), figsize=(4.2 * len(runs), 3.4), squeeze=False)
    for ax, (name, m) in zip(axes[0], runs.items()):
        hist = m["gate_histogram"]
        lo, hi = hist["range"]
        total = np.asarray(hist["per_layer"], float).sum(0)
        edges = np.linspace(lo, hi, total.size + 1)
        ax.bar((edges[:-1] + edges[1:]) / 2, total / max(total.sum(), 1), width=edges[1] - edges[0])
        ax.set(xlabel="gate score", ylabel="share of scores", title=f"{name} (mean {m['overall']['gate_score']:.3f})")
    return _save(fig, path)


def attention_map_pair(runs: dict[str, dict], path: Path) -> Path | None:
    """Fig. 2 right, baseline against gated: the head-averaged attention map of one layer (the
    last layer every run has a map of) for each run, side by side."""
    maps = {n: {int(k): np.asarray(v) for k, v in m.get("attn_maps", {}).items()} for n, m in runs.items()}
    common = set.intersection(*(set(v) for v in maps.values())) if maps else set()
    if not common:
        return None
    layer = max(common)
    fig, axes = _subplots(1, len(maps), figsize=(3.4 * len(maps), 3.4), squeeze=False)
    for ax, (name, mp) in zip(axes[0], maps.items()):
        ax.imshow(mp[layer].mean(0) ** 0.5, cmap="magma", vmin=0, vmax=1)
        ax.set(title=f"{name}", xlabel="key position")
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0][0].set_ylabel("query position")
    fig.suptitle(f"layer {layer}: attention averaged over heads (sqrt of the probability)")
    return _save(fig, path)


def sink_curves(curves: dict[str, list[dict]], path: Path) -> Path | None:
    """F-Attn and M-Act against training tokens (measured at the saved checkpoints): whether and
    when an attention sink and massive activations form."""
    if not curves:
        return None
    share = all("sink_share" in r for rows in curves.values() for r in rows)  # (gattn/eval/sinks.py)
    fig, axes = _subplots(1, 3 if share else 2, figsize=(15 if share else 10, 3.6))
    a, b = axes[0], axes[1]
    for j, (name, rows) in enumerate(curves.items()):
        tokens = [r["tokens"] for r in rows]
        a.plot(tokens, [r["f_attn"] for r in rows], label=name, **run_style(j))
        b.plot(tokens, [r["m_act"] for r in rows], label=name, **run_style(j))
        if share:  # (`run_style`: runs that share a value, e.g. no sink head, stay visible)
            axes[2].plot(tokens, [r["sink_share"] for r in rows], label=name, **run_style(j))
    a.set(xlabel="training tokens", ylabel="F-Attn", title="attention on the first token")
    b.set(xlabel="training tokens", ylabel="M-Act", title="max |hidden state| (mean over layers)")
    if share:
        from gattn.eval.sinks import share_label  # noqa: PLC0415 (sinks imports JAX; plots does not)

        axes[2].set(xlabel="training tokens", ylabel="share of heads", ylim=(-0.05, 1.05),
                    title=share_label())
        axes[2].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    return _save(fig, path)


def stability(groups: list[dict], threshold: float, path: Path) -> Path:
    """Table 2 rows 5-14 as a figure: final training loss against learning rate per variant (mean
    over seeds), diverged runs marked x at the divergence threshold."""
    fig, ax = _subplots(figsize=(6, 4))
    names = list(dict.fromkeys(g["variant"] for g in groups))
    for j, name in enumerate(names):
        gs = sorted((g for g in groups if g["variant"] == name), key=lambda g: g["lr"])
        xs = [g["lr"] for g in gs if g["final_loss"] is not None and g["diverged"] < g["seeds"]]
        ax.plot(xs, [g["final_loss"]["mean"] for g in gs if g["lr"] in xs], marker="o", color=f"C{j % 10}",
                label=name)
        bad = [g["lr"] * (1 + 0.06 * j) for g in gs if g["diverged"]]  # (nudged apart)
        ax.plot(bad, [threshold] * len(bad), "x", color=f"C{j % 10}", ms=10, mew=2)
    ax.axhline(threshold, color="grey", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set(xlabel="peak learning rate", ylabel="final training loss",
           title="stability (x: a seed diverged; dotted: divergence threshold)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _subplots(*args, figsize, **kwargs):
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*args, **kwargs)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
