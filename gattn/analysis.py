"""The paper's measurements, read from the model's own forward pass (never a second model).

`collect` runs the model with intermediates switched on and returns, per layer, what the blocks
sowed: attention probabilities, the SDPA output, gate scores and the block's output hidden state.
`Measurements` accumulates them over any number of batches into Table 4's and Figures 2, 3, 5
and 6's quantities, per layer and overall:

    m_act        max |hidden state| output by the layer (Table 4 "M-Act", Fig. 6)
    f_attn       attention on the first token of the query's document, mean over heads and
                 queries (Table 4 "F-Attn", Fig. 2 left); per head too, and the share of heads
                 above `sink_threshold` (the sink metric of Gu et al. 2024)
    gate_score   mean gate score and its histogram (Table 4 "Gate Score", Fig. 3); absent for
                 ungated models
    sparsity     share of SDPA-output values below each threshold, before the gate, after it, and
                 after scaling by the layer's mean gate score instead (Fig. 5); the last two only
                 for gates on the SDPA output
    attn_map     per-head mean attention map over the first `map_len` positions (Fig. 2 right)

Tokens with segment id 0 (padding) are left out of every statistic. The first query of each
document (which can only attend to itself) is left out of F-Attn.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

# Histogram range of each gate activation's scores (values outside land in the edge bins).
GATE_RANGES = {"sigmoid": (0.0, 1.0), "ns_sigmoid": (0.5, 1.0), "silu": (-0.5, 3.0), "identity": (-3.0, 3.0)}


@nnx.jit
def _forward_collecting(model, tokens_BxS, positions_BxS, segment_ids_BxS):
    model(tokens_BxS, positions_BxS, segment_ids_BxS)
    return nnx.pop(model, nnx.Intermediate)


def collect(model, tokens_BxS, segment_ids_BxS=None, positions_BxS=None) -> list[dict[str, np.ndarray]]:
    """One dict per layer with 'attn_probs' [B, Hq, S, S], 'sdpa_out' [N, Hq, K], 'block_out'
    [N, D] and, for gated variants only, 'gate_scores' [N, heads, width] (N = B * S)."""
    if model.cfg.scan_layers:
        raise ValueError("collecting intermediates needs a model with scan_layers=False: convert it "
                         "with gattn.model.unscanned(model)")
    tokens_BxS = jnp.asarray(tokens_BxS)
    if segment_ids_BxS is None:
        segment_ids_BxS = jnp.ones_like(tokens_BxS)
    if positions_BxS is None:
        positions_BxS = jnp.broadcast_to(jnp.arange(tokens_BxS.shape[1]), tokens_BxS.shape)
    model.set_attributes(collect_intermediates=True, raise_if_not_found=False)
    try:
        inter = _forward_collecting(model, tokens_BxS, jnp.asarray(positions_BxS), jnp.asarray(segment_ids_BxS))
    finally:
        model.set_attributes(collect_intermediates=False, raise_if_not_found=False)
    layers = []
    for i in range(len(model.blocks)):
        blk = inter["blocks"][i]
        layer = {"block_out": blk["block_out"][0], "attn_probs": blk["attn"]["attn_probs"][0],
                 "sdpa_out": blk["attn"]["sdpa_out"][0]}
        if "gate" in blk["attn"]:
            layer["gate_scores"] = blk["attn"]["gate"]["gate_scores"][0]
        layers.append({k: np.asarray(v, np.float32) for k, v in layer.items()})
    return layers


def first_token_attention(probs_BxHxSxS: np.ndarray, segment_ids_BxS: np.ndarray | None = None):
    """(sum over queries of the attention on their document's first token [H], number of queries).
    Each query's first token is the first position with its segment id; padding queries and each
    document's first query are left out. Without segment ids a row is one document."""
    b, h, s, _ = probs_BxHxSxS.shape
    seg = np.ones((b, s), np.int64) if segment_ids_BxS is None else np.asarray(segment_ids_BxS)
    pos = np.arange(s)
    starts = np.concatenate([np.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    first_BxS = np.maximum.accumulate(np.where(starts, pos, 0), axis=1)  # start of each token's document
    keep_BxS = (seg != 0) & (pos[None] != first_BxS)
    bi, qi = np.nonzero(keep_BxS)
    picked_QxH = probs_BxHxSxS[bi, :, qi, first_BxS[bi, qi]]
    return picked_QxH.sum(axis=0), len(bi)


@dataclasses.dataclass
class Options:
    sink_threshold: float = 0.3          # a head with F-Attn above this is a sink head
    sparsity_thresholds: tuple[float, ...] = (1e-2, 1e-3)
    gate_bins: int = 50
    map_layers: tuple[int, ...] | None = None  # None: first, middle and last layer
    map_len: int = 64                    # attention maps cover positions [0, map_len)


class Measurements:
    """Accumulates `collect`'s per-layer tensors over batches; `result()` gives the statistics."""

    def __init__(self, model_cfg, options: Options | None = None):
        self.cfg, self.opts = model_cfg, options or Options()
        n, gate = model_cfg.num_layers, model_cfg.gate
        self.gated = gate is not None
        self.gate_on_sdpa = self.gated and gate.position == "sdpa"
        self.gate_range = GATE_RANGES[gate.activation] if self.gated else None
        self.map_layers = (self.opts.map_layers if self.opts.map_layers is not None
                           else tuple(sorted({0, n // 2, n - 1})))
        for i in self.map_layers:
            if not 0 <= i < n:
                raise ValueError(f"map_layers: layer {i} does not exist (the model has {n} layers)")
        t = len(self.opts.sparsity_thresholds)
        self.m_act = np.zeros(n)
        self.f_attn_sum, self.f_attn_count = np.zeros((n, model_cfg.q_heads)), 0
        self.gate_sum, self.gate_count = np.zeros(n), 0
        self.gate_hist = np.zeros((n, self.opts.gate_bins), np.int64)
        self.below = {k: np.zeros((n, t), np.int64) for k in ("sdpa_out", "gated", "mean_gate_scaled")}
        self.values = 0  # SDPA-output values counted per layer
        self.map_sum = {i: None for i in self.map_layers}
        self.map_queries = None  # per query position, how many rows' first document reach it

    def add(self, layers: list[dict[str, np.ndarray]], segment_ids_BxS=None) -> None:
        b, _, s, _ = layers[0]["attn_probs"].shape
        seg = np.ones((b, s), np.int64) if segment_ids_BxS is None else np.asarray(segment_ids_BxS)
        valid_N = seg.reshape(-1) != 0
        thresholds = np.asarray(self.opts.sparsity_thresholds)
        # Attention maps: only queries in each row's first document (later ones start elsewhere).
        l_ = min(self.opts.map_len, s)
        in_first_BxL = (np.cumsum(seg[:, :l_] != seg[:, :1], axis=1) == 0) & (seg[:, :1] != 0)
        f_count = 0
        for i, layer in enumerate(layers):
            self.m_act[i] = max(self.m_act[i], float(np.abs(layer["block_out"][valid_N]).max(initial=0.0)))
            f_sum, f_count = first_token_attention(layer["attn_probs"], seg)
            self.f_attn_sum[i] += f_sum
            y = layer["sdpa_out"][valid_N]
            self._count_below("sdpa_out", i, y, thresholds)
            if self.gated:
                scores = layer["gate_scores"][valid_N]
                self.gate_sum[i] += scores.sum() / scores[0].size
                lo, hi = self.gate_range
                self.gate_hist[i] += np.histogram(np.clip(scores, lo, hi), self.opts.gate_bins, (lo, hi))[0]
                if self.gate_on_sdpa:
                    s_ = scores.reshape(len(y), scores.shape[1], -1)
                    s_ = np.broadcast_to(s_, y.shape) if s_.shape[1] == y.shape[1] else np.broadcast_to(
                        s_.mean(axis=1, keepdims=True), y.shape)
                    gated = y * s_ if self.cfg.gate.form == "multiplicative" else y + s_
                    mean_scaled = y * scores.mean() if self.cfg.gate.form == "multiplicative" else y + scores.mean()
                    self._count_below("gated", i, gated, thresholds)
                    self._count_below("mean_gate_scaled", i, mean_scaled, thresholds)
            if i in self.map_sum:
                m = (layer["attn_probs"][:, :, :l_, :l_] * in_first_BxL[:, None, :, None]).sum(axis=0)
                self.map_sum[i] = m if self.map_sum[i] is None else self.map_sum[i][:, :l_, :l_] + m
        self.f_attn_count += f_count
        self.gate_count += int(valid_N.sum())
        self.values += int(valid_N.sum()) * layers[0]["sdpa_out"][0].size
        count = in_first_BxL.sum(axis=0)
        self.map_queries = count if self.map_queries is None else self.map_queries[:l_] + count

    def _count_below(self, key, layer, values, thresholds):
        self.below[key][layer] += (np.abs(values).reshape(-1, 1) < thresholds).sum(axis=0)

    def result(self) -> dict:
        """{"per_layer": [...], "overall": {...}, "gate_histogram": ..., "attn_maps": ...} with
        plain floats and lists (JSON-ready). Gate fields are absent for ungated models."""
        n, names = self.cfg.num_layers, [f"{t:g}" for t in self.opts.sparsity_thresholds]
        f_head = self.f_attn_sum / max(self.f_attn_count, 1)
        per_layer = []
        for i in range(n):
            row = {"layer": i, "m_act": float(self.m_act[i]), "f_attn": float(f_head[i].mean()),
                   "f_attn_per_head": [float(x) for x in f_head[i]],
                   "sink_head_share": float(np.mean(f_head[i] > self.opts.sink_threshold)),
                   "sparsity": {"sdpa_out": self._shares("sdpa_out", i, names)}}
            if self.gated:
                row["gate_score"] = float(self.gate_sum[i] / max(self.gate_count, 1))
                if self.gate_on_sdpa:
                    row["sparsity"]["gated"] = self._shares("gated", i, names)
                    row["sparsity"]["mean_gate_scaled"] = self._shares("mean_gate_scaled", i, names)
            per_layer.append(row)
        overall = {"m_act": float(self.m_act.max()), "m_act_mean_over_layers": float(self.m_act.mean()),
                   "f_attn": float(f_head.mean()),
                   "sink_head_share": float(np.mean(f_head > self.opts.sink_threshold)),
                   "sparsity": {k: {t: float(np.mean([r["sparsity"][k][t] for r in per_layer])) for t in names}
                                for k in per_layer[0]["sparsity"]}}
        out = {"per_layer": per_layer, "overall": overall,
               "counts": {"queries_for_f_attn": self.f_attn_count, "tokens": self.gate_count,
                          "attn_map_rows": int(self.map_queries[0]) if self.map_queries is not None else 0},
               "sink_threshold": self.opts.sink_threshold}
        if self.gated:
            overall["gate_score"] = float(np.mean([r["gate_score"] for r in per_layer]))
            lo, hi = self.gate_range
            out["gate_histogram"] = {"range": [lo, hi], "per_layer": self.gate_hist.tolist(),
                                     "all_layers": self.gate_hist.sum(axis=0).tolist()}
        if self.map_queries is not None:  # [heads, query, key], each query row averaged over its rows
            q = np.maximum(self.map_queries, 1)[None, :, None]
            out["attn_maps"] = {str(i): (m / q).tolist() for i, m in self.map_sum.items() if m is not None}
        return out

    def _shares(self, key, layer, names):
        return {t: float(c / max(self.values, 1)) for t, c in zip(names, self.below[key][layer])}


def measure(model, batches, options: Options | None = None) -> dict:
    """Runs `Measurements` over packed batches ({"tokens", "segment_ids", "positions"} with
    rows of S + 1 tokens, as the data pipeline makes them; the last token is dropped)."""
    acc = Measurements(model.cfg, options)
    for batch in batches:
        tokens, seg, pos = (np.asarray(batch[k])[:, :-1] for k in ("tokens", "segment_ids", "positions"))
        acc.add(collect(model, tokens, seg, pos), seg)
    return acc.result()


def summarize(model, tokens_BxS, segment_ids_BxS=None, positions_BxS=None,
              options: Options | None = None) -> dict:
    """The statistics of one batch of model inputs ([B, S] tokens), per layer and overall."""
    acc = Measurements(model.cfg, options)
    acc.add(collect(model, tokens_BxS, segment_ids_BxS, positions_BxS), segment_ids_BxS)
    return acc.result()
