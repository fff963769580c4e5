"""Figures of the paper's measurements (matplotlib, written as PNG): per-layer curves (Fig. 2 left,
Fig. 6), the gate-score histogram (Fig. 3), SDPA-output sparsity (Fig. 5), per-head F-Attn, and
per-head attention maps (Fig. 2 right). Each takes `gattn.analysis` results (`measurements` in
eval.py's results.json) and a path; `ruler` takes gattn.ruler results (Table 5 as a figure)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # no pyplot: no global backend is touched (notebooks keep theirs)
from matplotlib.ticker import MaxNLocator

PER_LAYER = (("m_act", "M-Act: max |hidden state| (log scale)", True),
             ("f_attn", "F-Attn: attention on the first token", False),
             ("sink_head_share", "share of sink heads (F-Attn > threshold)", False),
             ("gate_score", "mean gate score", False))


def per_layer(runs: dict[str, dict], path: Path, title: str = "") -> Path:
    """One panel per quantity, one line per run (name -> measurements); gate scores only for the
    gated runs."""
    fig, axes = _subplots(1, len(PER_LAYER), figsize=(4.2 * len(PER_LAYER), 3.6))
    for ax, (key, label, log) in zip(axes, PER_LAYER):
        for j, (name, m) in enumerate(runs.items()):  # one colour per run in every panel
            rows = m["per_layer"]
            if key in rows[0]:
                ax.plot([r["layer"] for r in rows], [r[key] for r in rows], marker="o", label=name,
                        color=f"C{j % 10}")
        if key == "sink_head_share":
            ax.set_ylim(-0.03, 1.03)
        ax.set(xlabel="layer", title=label)
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
    rows = m["per_layer"]
    kinds = list(rows[0]["sparsity"])
    thresholds = list(rows[0]["sparsity"][kinds[0]])
    fig, axes = _subplots(1, len(thresholds), figsize=(5.5 * len(thresholds), 3.6), squeeze=False)
    layers = np.arange(len(rows))
    width = 0.8 / len(kinds)
    labels = {"sdpa_out": "SDPA output", "gated": "after the gate", "mean_gate_scaled": "x mean gate score"}
    for ax, t in zip(axes[0], thresholds):
        for j, kind in enumerate(kinds):
            ax.bar(layers + j * width, [r["sparsity"][kind][t] for r in rows], width, label=labels[kind])
        ax.set(xlabel="layer", ylabel=f"share of |values| < {t}", title=f"sparsity below {t}")
        ax.set_xticks(layers + width * (len(kinds) - 1) / 2, layers)
        ax.legend(fontsize=8)
    fig.suptitle(f"{name}: SDPA-output sparsity")
    return _save(fig, path)


def f_attn_heads(m: dict, path: Path, name: str = "") -> Path:
    """Per-head first-token attention, layers x heads."""
    grid = np.asarray([r["f_attn_per_head"] for r in m["per_layer"]])
    fig, ax = _subplots(figsize=(1.0 + 0.45 * grid.shape[1], 1.0 + 0.35 * grid.shape[0]))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set(xlabel="head", ylabel="layer", title=f"{name}: F-Attn per head")
    fig.colorbar(im, ax=ax, label="attention on the first token")
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


def _subplots(*args, figsize, **kwargs):
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*args, **kwargs)


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
