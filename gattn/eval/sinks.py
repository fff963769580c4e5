"""The attention-sink measures of the literature, beside the paper's F-Attn (docs/sinks.md).

Gu et al. 2024's Sink_1^eps: on windows of T = 64 tokens read from their start, each head's

    alpha_1 = (1/T) * sum_{t=0}^{T-1} A[t, 0]          (the first query included: A[0, 0] = 1)

and a head is a sink head if alpha_1 > eps = 0.3; the share of sink heads over all (layer, head)
pairs is the model's Sink_1^eps share (`sink_share`). It is not analysis.py's "F-Attn sink heads"
(`sink_head_share`: F-Attn > 0.3, over every query of the rows but each document's first), which
can disagree with it: docs/sinks.md, "Two sink-head shares". Uniform attention gives alpha_1 =
H_T / T (0.074 at T = 64), which is printed beside it. With Bigram-Backcopy data the same alpha_1
is also given over the queries that are no trigger (Guo et al. 2024's measure: a copy head's
attention where it has nothing to copy; a layer-0 head that looks at <s> only AT triggers scores
a high all-query alpha_1 without being a sink).

The first token's value norm and residual norm (Guo et al.: a sink's value shrinks and its residual
grows) come from the same forward pass: the first query attends only to itself, so its SDPA output
is its value vector (before any gate); its residual is the block's output at position 0.
"""

from __future__ import annotations

import numpy as np

from gattn.config import BACKCOPY
from gattn.eval import analysis

WINDOW = 64  # Gu et al.'s T
EPS = 0.3    # Gu et al.'s threshold


def share_label(eps: float = EPS, window: int = WINDOW) -> str:
    """The name of `sink_share` wherever it is shown, apart from the F-Attn sink heads
    (`analysis.sink_heads_label`): Gu et al.'s share of heads with alpha_1 > eps."""
    return f"Sink_1^{eps:g} share (Gu et al.: alpha_1 > {eps:g}, T = {window})"


SHARE_DEFINITION = ("Gu et al.'s Sink_1^eps: the share of (layer, head) pairs whose alpha_1 (the attention on "
                    "token 0 averaged over the first T queries of each row, the first query included) exceeds eps")


def uniform_level(window: int = WINDOW) -> float:
    """alpha_1 of uniform causal attention over `window` tokens: H_T / T (the mean of 1/(t+1))."""
    return float(np.sum(1.0 / np.arange(1, window + 1)) / window)


def windows(batches: list[dict], window: int = WINDOW) -> dict:
    """The first `window` model inputs of every row of `batches` (pipeline batches, rows of S + 1
    tokens whose last is only a target); rows shorter than that give windows of S."""
    return {k: np.concatenate([np.asarray(b[k])[:, :-1][:, :window] for b in batches])
            for k in ("tokens", "segment_ids", "positions")}


def uniform_f_attn(batches: list[dict]) -> float:
    """The paper's F-Attn that uniform attention would give on these pipeline batches: the mean,
    over F-Attn's queries, of 1 / (the number of keys the query sees in its document)."""
    total, count = 0.0, 0
    for b in batches:
        seg = np.asarray(b["segment_ids"])[:, :-1]  # (as analysis.measure reads them)
        keep = np.asarray(analysis.f_attn_mask(seg))
        seen = np.arange(seg.shape[1]) - np.asarray(analysis.document_starts(seg)) + 1
        total += float((keep / seen).sum())
        count += int(keep.sum())
    return total / max(count, 1)


def first_document_BxT(segment_ids_BxT) -> np.ndarray:
    """[B, T] True for the queries of each window's first document (their first token is token 0)."""
    seg = np.asarray(segment_ids_BxT)
    return (np.asarray(analysis.document_starts(seg)) == 0) & (seg != 0)


class SinkStats:
    """Accumulates alpha_1 (per named query set) and the first token's norms over windows."""

    def __init__(self, num_layers: int, heads: int, eps: float = EPS):
        self.eps, self.n, self.h = eps, num_layers, heads
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, float] = {}
        self.value_norm = np.zeros((num_layers, heads))
        self.residual_first, self.residual_rest = np.zeros(num_layers), np.zeros(num_layers)
        self.rows, self.rest = 0, 0

    def add(self, layers: list[dict], segment_ids_BxT, masks: dict[str, np.ndarray]) -> None:
        """`layers`: `analysis.collect`'s output on the windows; `masks`: {name: [B, T] queries}."""
        first = first_document_BxT(segment_ids_BxT)
        b, t = first.shape
        for name, mask in {"all": first, **{k: first & m for k, m in masks.items()}}.items():
            q = mask.astype(np.float64)[:, None, :]
            s = np.stack([(layer["first_probs"] * q).sum(axis=(0, 2)) for layer in layers])
            self.sums[name] = self.sums.get(name, 0.0) + s
            self.counts[name] = self.counts.get(name, 0.0) + float(mask.sum())
        rest = first.copy()
        rest[:, 0] = False
        real_B = np.asarray(segment_ids_BxT)[:, 0] != 0  # padding rows (segment 0) have no first token
        for i, layer in enumerate(layers):
            h_BxTxD = layer["block_out"].reshape(b, t, -1)
            v_BxHxK = layer["sdpa_out"].reshape(b, t, *layer["sdpa_out"].shape[1:])[:, 0]
            self.value_norm[i] += np.linalg.norm(v_BxHxK[real_B], axis=-1).sum(axis=0)
            norms_BxT = np.linalg.norm(h_BxTxD, axis=-1)
            self.residual_first[i] += norms_BxT[real_B, 0].sum()
            self.residual_rest[i] += (norms_BxT * rest).sum()
        self.rows += int(real_B.sum())
        self.rest += int(rest.sum())

    def result(self, window: int) -> dict:
        alphas = {k: self.sums[k] / max(self.counts[k], 1.0) for k in self.sums}
        per_layer = []
        for i in range(self.n):
            row = {"layer": i, "value_norm_first": float(self.value_norm[i].mean() / max(self.rows, 1)),
                   "value_norm_first_per_head": [float(x) for x in self.value_norm[i] / max(self.rows, 1)],
                   "residual_norm_first": float(self.residual_first[i] / max(self.rows, 1)),
                   "residual_norm_rest": float(self.residual_rest[i] / max(self.rest, 1))}
            for k, a in alphas.items():
                suffix = "" if k == "all" else f"_{k}"
                row[f"alpha_1{suffix}_per_head"] = [float(x) for x in a[i]]
                row[f"sink_share{suffix}"] = float(np.mean(a[i] > self.eps))
            per_layer.append(row)
        overall = {"uniform_alpha_1": uniform_level(window), "window": window, "eps": self.eps,
                   "windows": self.rows}
        for k, a in alphas.items():
            suffix = "" if k == "all" else f"_{k}"
            overall[f"sink_share{suffix}"] = float(np.mean(a > self.eps))
            overall[f"alpha_1{suffix}_mean"] = float(a.mean())
            overall[f"alpha_1{suffix}_max"] = float(a.max())
        return {"overall": overall, "per_layer": per_layer}


def query_masks(cfg, tokens_BxT) -> dict[str, np.ndarray]:
    """Extra query sets of the run's data: Bigram-Backcopy's non-trigger queries."""
    if cfg.data.source != BACKCOPY:
        return {}
    from gattn.data import backcopy  # noqa: PLC0415

    return {"non_trigger": ~backcopy.trigger_mask(backcopy.task(cfg.data.backcopy), tokens_BxT)}


def measure(model, cfg, batches: list[dict], *, window: int = WINDOW, eps: float = EPS,
            rows: int = 64) -> dict:
    """Sink_1^eps and the first token's norms on the first `window` tokens of each row of the
    pipeline `batches`, `rows` windows per forward pass: {"overall": {...}, "per_layer": [...]}."""
    w = windows(batches, window)
    window = w["tokens"].shape[1]
    stats = SinkStats(model.cfg.num_layers, model.cfg.q_heads, eps)
    model = analysis.for_analysis(model)
    for r in range(0, len(w["tokens"]), rows):
        part = {k: v[r:r + rows] for k, v in w.items()}
        layers = analysis.collect(model, part["tokens"], part["segment_ids"], part["positions"])
        stats.add(layers, part["segment_ids"], query_masks(cfg, part["tokens"]))
    out = stats.result(window)
    out["overall"]["uniform_f_attn"] = uniform_f_attn(batches)
    return out


def report_lines(sinks: dict) -> list[str]:
    """Markdown lines for results.md: the overall share beside the uniform level, then per head."""
    o = sinks["overall"]
    extra = [k.removeprefix("sink_share_") for k in o if k.startswith("sink_share_")]
    lines = [f"- {share_label(o['eps'], o['window'])}: {o['sink_share']:.0%}; alpha_1 mean "
             f"{o['alpha_1_mean']:.3f}, max {o['alpha_1_max']:.3f} (uniform attention: H_T/T = "
             f"{o['uniform_alpha_1']:.3f})",
             f"  ({SHARE_DEFINITION}; not the F-Attn sink heads, which average every query but each "
             "document's first: docs/sinks.md, \"Two sink-head shares\")"]
    if "uniform_f_attn" in o:
        lines.append(f"- uniform attention's F-Attn on the measured rows: {o['uniform_f_attn']:.3f}")
    for k in extra:
        lines.append(f"- the same on {k.replace('_', '-')} queries: share {o[f'sink_share_{k}']:.0%}, "
                     f"alpha_1 mean {o[f'alpha_1_{k}_mean']:.3f}, max {o[f'alpha_1_{k}_max']:.3f}")
    head = ["layer", "alpha_1 per head"] + [f"alpha_1 {k.replace('_', '-')} per head" for k in extra] + [
        "first token value norm", "first token residual norm (others)"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sinks["per_layer"]:
        cells = [str(r["layer"]), " ".join(f"{a:.2f}" for a in r["alpha_1_per_head"])]
        cells += [" ".join(f"{a:.2f}" for a in r[f"alpha_1_{k}_per_head"]) for k in extra]
        cells += [f"{r['value_norm_first']:.2f}", f"{r['residual_norm_first']:.2f} ({r['residual_norm_rest']:.2f})"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
