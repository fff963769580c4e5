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

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gattn.config import BACKCOPY
from gattn.eval import analysis
from gattn.train.loss import token_nll

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
        self.value_norm_gated = np.zeros((num_layers, heads))  # after the gate (= before, ungated)
        self.residual_first, self.residual_rest = np.zeros(num_layers), np.zeros(num_layers)
        self.rows, self.rest = 0, 0
        # Per query set, per (layer, head): the gate score, alpha_1 weighted by it, |head output|.
        self.gate_sums: dict[str, np.ndarray] = {}
        self.gated_alpha_sums: dict[str, np.ndarray] = {}
        self.out_norm_sums: dict[str, np.ndarray] = {}
        self.gated = False

    def add(self, layers: list[dict], segment_ids_BxT, masks: dict[str, np.ndarray]) -> None:
        """`layers`: `analysis.collect`'s output on the windows; `masks`: {name: [B, T] queries}."""
        first = first_document_BxT(segment_ids_BxT)
        b, t = first.shape
        scores = [head_gate_BxHxT(layer, b, t) for layer in layers]
        self.gated = self.gated or scores[0] is not None
        outs = [np.linalg.norm(head_output(layer), axis=-1).reshape(b, t, -1).transpose(0, 2, 1) for layer in layers]
        for name, mask in {"all": first, **{k: first & m for k, m in masks.items()}}.items():
            q = mask.astype(np.float64)[:, None, :]
            s = np.stack([(layer["first_probs"] * q).sum(axis=(0, 2)) for layer in layers])
            self.sums[name] = self.sums.get(name, 0.0) + s
            self.counts[name] = self.counts.get(name, 0.0) + float(mask.sum())
            g = [np.ones_like(layer["first_probs"]) if sc is None else sc for layer, sc in zip(layers, scores)]
            self.gate_sums[name] = self.gate_sums.get(name, 0.0) + np.stack([(x * q).sum(axis=(0, 2)) for x in g])
            self.gated_alpha_sums[name] = self.gated_alpha_sums.get(name, 0.0) + np.stack(
                [(x * layer["first_probs"] * q).sum(axis=(0, 2)) for x, layer in zip(g, layers)])
            self.out_norm_sums[name] = self.out_norm_sums.get(name, 0.0) + np.stack([(o * q).sum(axis=(0, 2))
                                                                                      for o in outs])
        rest = first.copy()
        rest[:, 0] = False
        real_B = np.asarray(segment_ids_BxT)[:, 0] != 0  # padding rows (segment 0) have no first token
        for i, layer in enumerate(layers):
            h_BxTxD = layer["block_out"].reshape(b, t, -1)
            v_BxHxK = layer["sdpa_out"].reshape(b, t, *layer["sdpa_out"].shape[1:])[:, 0]
            self.value_norm[i] += np.linalg.norm(v_BxHxK[real_B], axis=-1).sum(axis=0)
            out_BxHxK = head_output(layer).reshape(b, t, *layer["sdpa_out"].shape[1:])[:, 0]
            self.value_norm_gated[i] += np.linalg.norm(out_BxHxK[real_B], axis=-1).sum(axis=0)
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
            row["value_norm_first_gated_per_head"] = [float(x) for x in self.value_norm_gated[i] / max(self.rows, 1)]
            row["value_norm_first_gated"] = float(np.mean(row["value_norm_first_gated_per_head"]))
            for k, a in alphas.items():
                suffix = "" if k == "all" else f"_{k}"
                row[f"alpha_1{suffix}_per_head"] = [float(x) for x in a[i]]
                row[f"sink_share{suffix}"] = float(np.mean(a[i] > self.eps))
                for key, value in self._per_query(k).items():
                    row[f"{key}{suffix}_per_head"] = [float(x) for x in value[i]]
            per_layer.append(row)
        overall = {"uniform_alpha_1": uniform_level(window), "window": window, "eps": self.eps,
                   "windows": self.rows}
        for k, a in alphas.items():
            suffix = "" if k == "all" else f"_{k}"
            overall[f"sink_share{suffix}"] = float(np.mean(a > self.eps))
            overall[f"alpha_1{suffix}_mean"] = float(a.mean())
            overall[f"alpha_1{suffix}_max"] = float(a.max())
            for key, value in self._per_query(k).items():
                overall[f"{key}{suffix}_mean"] = float(value.mean())
        overall["value_norm_first_gated"] = float(self.value_norm_gated.mean() / max(self.rows, 1))
        overall["residual_norm_first"] = float(self.residual_first.mean() / max(self.rows, 1))
        return {"overall": overall, "per_layer": per_layer}

    def _per_query(self, name: str) -> dict[str, np.ndarray]:
        """[layers, heads] means over the query set `name`: alpha_1 weighted by the head's gate
        score (alpha_1 itself when ungated), |head output| after the gate and, gated, the gate score."""
        n = max(self.counts[name], 1.0)
        out = {"alpha_1_gated": self.gated_alpha_sums[name] / n, "head_out_norm": self.out_norm_sums[name] / n}
        if self.gated:
            out["gate_score"] = self.gate_sums[name] / n
        return out


def head_gate_BxHxT(layer: dict, b: int, t: int) -> np.ndarray | None:
    """Each query head's gate score (the mean over its width) as [B, H, T], for a gate on the SDPA
    output; None otherwise."""
    if "gated" not in layer or layer["gated"].shape != layer["sdpa_out"].shape:
        return None
    g_NxHxW = layer["gate_scores"]
    g_NxH = np.broadcast_to(g_NxHxW.mean(axis=-1), layer["sdpa_out"].shape[:2])  # (a head-shared gate: 1 head)
    return g_NxH.reshape(b, t, -1).transpose(0, 2, 1)


def head_output(layer: dict) -> np.ndarray:
    """What each head passes to the output projection, [N, H, K]: the SDPA output after a gate on
    it (the gate's output), else the SDPA output."""
    if "gated" in layer and layer["gated"].shape == layer["sdpa_out"].shape:
        return layer["gated"]
    return layer["sdpa_out"]


def query_masks(cfg, tokens_BxT) -> dict[str, np.ndarray]:
    """Extra query sets of the run's data: Bigram-Backcopy's non-trigger queries."""
    if cfg.data.source != BACKCOPY:
        return {}
    from gattn.data import backcopy  # noqa: PLC0415

    trigger = backcopy.trigger_mask(backcopy.task(cfg.data.backcopy), tokens_BxT)
    rest = np.ones(trigger.shape, bool)
    rest[:, 0] = False  # (query 0 sees only token 0: A = 1 whatever the model)
    return {"non_trigger": ~trigger, "non_trigger_rest": ~trigger & rest, "trigger": trigger}


def measure(model, cfg, batches: list[dict], *, window: int = WINDOW, eps: float = EPS,
            rows: int = 64) -> dict:
    """Sink_1^eps and the first token's norms on the first `window` tokens of each row of the
    pipeline `batches`, `rows` windows per forward pass, and the cost of hiding the first token
    (`ablation`, on the whole rows): {"overall": {...}, "per_layer": [...], "ablation": {...}}."""
    w = windows(batches, window)
    window = w["tokens"].shape[1]
    attention = model.cfg.full_attention_layers  # a hybrid's Gated DeltaNet layers have no attention
    stats = SinkStats(len(attention), model.cfg.q_heads, eps)
    model = analysis.for_analysis(model)
    on_sdpa = model.cfg.gate is not None and model.cfg.gate.position == "sdpa"
    for r in range(0, len(w["tokens"]), rows):
        part = {k: v[r:r + rows] for k, v in w.items()}
        layers = analysis.collect(model, part["tokens"], part["segment_ids"], part["positions"])
        layers = [layers[i] for i in attention]
        if not on_sdpa:  # (the head output and the gate score per head are those of a gate on the SDPA output)
            layers = [{k: v for k, v in layer.items() if k not in ("gated", "gate_scores")} for layer in layers]
        stats.add(layers, part["segment_ids"], query_masks(cfg, part["tokens"]))
    out = stats.result(window)
    if len(attention) < model.cfg.num_layers:  # rows are the attention layers: name them by the model's index
        for row, i in zip(out["per_layer"], attention):
            row["layer"] = i
        out["overall"]["attention_layers"] = list(attention)
        out["overall"]["not_measured"] = ("Sink_1^eps, alpha_1 and the first token's norms are measured on the "
                                          "full-attention layers: a Gated DeltaNet layer has no attention weights")
    out["overall"]["uniform_f_attn"] = uniform_f_attn(batches)
    out["ablation"] = ablation(model, cfg, batches, rows=rows)
    out["overall"]["ablation_cost"] = out["ablation"]["cost"]
    return out


@nnx.jit
def _token_losses(model, tokens_BxS, positions_BxS, segment_ids_BxS, targets_BxS):
    return token_nll(model(tokens_BxS, positions_BxS, segment_ids_BxS), targets_BxS)


def hide_first_BxS(segment_ids_BxS) -> np.ndarray:
    """Segment ids under which every document's first token is a document of its own: it still
    sees itself, and no later query of its document sees it (padding, id 0, stays padding)."""
    seg = np.asarray(segment_ids_BxS)
    start = np.asarray(analysis.document_starts(seg)) == np.arange(seg.shape[1])
    return np.where(seg == 0, 0, 2 * seg + start).astype(seg.dtype)


def ablation(model, cfg, batches: list[dict], *, rows: int = 64) -> dict:
    """The cost of hiding the first token (`<s>`) from every query after it: the mean next-token
    loss with it hidden (`hide_first_BxS`) minus the plain loss, on the targets that are no copy
    (Bigram-Backcopy; all targets otherwise) of the queries after each document's first, within
    their document. A sink the model relies on costs loss when hidden; a cosmetic one does not."""
    model = analysis.for_analysis(model)
    plain, hidden, count = 0.0, 0.0, 0
    for b in batches:
        full = np.asarray(b["tokens"])
        for r in range(0, len(full), rows):
            tokens = full[r:r + rows]
            seg, pos = (np.asarray(b[k])[r:r + rows] for k in ("segment_ids", "positions"))
            x, y, s = tokens[:, :-1], tokens[:, 1:], seg[:, :-1]
            keep = (s != 0) & (seg[:, 1:] == s) & (np.asarray(analysis.document_starts(s)) != np.arange(s.shape[1]))
            keep &= ~copy_targets(cfg, tokens)[:, 1:]
            args = [jnp.asarray(a) for a in (x, pos[:, :-1])]
            lp = np.asarray(_token_losses(model, *args, jnp.asarray(s), jnp.asarray(y)))
            lh = np.asarray(_token_losses(model, *args, jnp.asarray(hide_first_BxS(s)), jnp.asarray(y)))
            plain += float(lp[keep].astype(np.float64).sum())
            hidden += float(lh[keep].astype(np.float64).sum())
            count += int(keep.sum())
    n = max(count, 1)
    return {"cost": (hidden - plain) / n, "loss_plain": plain / n, "loss_hidden": hidden / n, "targets": count}


def copy_targets(cfg, tokens_BxL) -> np.ndarray:
    """[B, L] True where Bigram-Backcopy copied the token (none for other data)."""
    if cfg.data.source != BACKCOPY:
        return np.zeros(np.shape(tokens_BxL), bool)
    from gattn.data import backcopy  # noqa: PLC0415

    return backcopy.is_copy_target(backcopy.task(cfg.data.backcopy), tokens_BxL)


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
                     f"alpha_1 mean {o[f'alpha_1_{k}_mean']:.3f}, max {o[f'alpha_1_{k}_max']:.3f}"
                     + (f"; x gate score {o[f'alpha_1_gated_{k}_mean']:.3f}, gate score {o[f'gate_score_{k}_mean']:.3f}"
                        if f"gate_score_{k}_mean" in o else ""))
    if "ablation_cost" in o:
        a = sinks.get("ablation", {})
        lines.append(f"- hiding the first token from every later query costs {o['ablation_cost']:.4f} nats"
                     + (f" ({a['loss_plain']:.4f} -> {a['loss_hidden']:.4f} on {a['targets']} non-copy targets)"
                        if a else ""))
    head = ["layer", "alpha_1 per head"] + [f"alpha_1 {k.replace('_', '-')} per head" for k in extra] + [
        "first token value norm", "first token residual norm (others)"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sinks["per_layer"]:
        cells = [str(r["layer"]), " ".join(f"{a:.2f}" for a in r["alpha_1_per_head"])]
        cells += [" ".join(f"{a:.2f}" for a in r[f"alpha_1_{k}_per_head"]) for k in extra]
        cells += [f"{r['value_norm_first']:.2f}", f"{r['residual_norm_first']:.2f} ({r['residual_norm_rest']:.2f})"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
