"""The paper's measurements, read from the model's own forward pass (never a second model).

`collect` runs the model with intermediates switched on (one jitted call) and returns, per layer,
what the blocks sowed, reduced on the device so that no [S, S] attention matrix leaves it: each
query's attention on its document's first token, the attention map corner of the chosen layers,
the SDPA output, the block's output hidden state and, for gated variants, the gate scores and
the gate's input and output. `Measurements` accumulates them over any number of batches into
Table 4's and Figures 2, 3, 5 and 6's quantities, per layer and overall:

    m_act        max |hidden state| output by the layer, a running maximum over every evaluated
                 token (so it grows with the size of the eval set); overall, the mean of the
                 layers' maxima (Table 4 "M-Act", Sec. 4.3) and their max (Fig. 6)
    m_act_per_token  the mean over tokens of each token's max |hidden state| output by the
                 layer: the typical token's largest activation, which does not grow with the eval
                 set; overall, the mean over layers
    ffn_act      max |FFN output| of the layer (what the FFN adds to the residual stream), a
                 running maximum like m_act (Fig. 6, Appendix A.3: the baseline's massive
                 activations start in one layer's FFN); overall, the mean and the max over layers
    mean_abs_y   mean |Y| of the SDPA output per layer, before any G1 gate (the ungated model's Y),
                 and for gates on the SDPA output `mean_abs_y_gated`, mean |Y'| of what the gate
                 returns (Fig. 4, Appendix A.2); overall, the means over layers
    f_attn       attention on the first token of the query's document, mean over heads and
                 queries (Table 4 "F-Attn", Fig. 2 left); per head too, and `sink_head_share`,
                 the "F-Attn sink heads": the share of heads whose F-Attn exceeds
                 `sink_threshold` (gattn's count; the paper gives F-Attn, not a share). It is
                 not Gu et al.'s Sink_1^eps share (gattn/eval/sinks.py), which averages other
                 queries and can disagree (docs/sinks.md, "Two sink-head shares")
    gate_score   mean gate score and its histogram (Table 4 "Gate Score", Fig. 3); absent for
                 ungated models
    sparsity     share of values below each threshold (Fig. 5): `sdpa_out` (the SDPA output),
                 and for gates on the SDPA output `gated` (what the gate returns) and, for a
                 multiplicative gate, `mean_gate_scaled` (the gate's input times the layer's mean
                 gate score over all the data instead)
    attn_map     per-head mean attention map over the first `map_len` positions (Fig. 2 right)

Tokens with segment id 0 (padding) are left out of every statistic. The first query of each
document (which can only attend to itself) is left out of F-Attn.

No mesh is set here: an expert-parallel MoE runs as the partitioned one (`for_analysis`), an
all_to_all one on one data x expert shard's rows per forward pass (`moe_shards`), which drops
exactly the tokens the run's mesh drops (docs/moe-and-mesh.md, "Without the mesh").

`window_perplexity` is the long-context measure of eval.py --ruler: held-out perplexity of
windows of a given length, overall and in the window's second half.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gattn.config import ConfigError
from gattn.model.capture import EVERYTHING
from gattn.model import sharding
from gattn.model.transformer import Transformer, off_mesh, with_exec
from gattn.train.loss import token_nll

# Histogram range of each gate activation's scores (values outside land in the edge bins).
GATE_RANGES = {"sigmoid": (0.0, 1.0), "ns_sigmoid": (0.5, 1.0), "silu": (-0.5, 3.0), "identity": (-3.0, 3.0)}
# |gate input| histogram for `mean_gate_scaled`: 100 log bins per decade over [1e-12, 1e4), so a
# threshold divided by the final mean gate score is placed to within 2.3%.
ABS_EDGES = 10.0 ** np.linspace(-12, 4, 1601)


def document_starts(segment_ids_BxS):
    """The position where each token's document starts (a row is split at every change of id)."""
    s = segment_ids_BxS.shape[1]
    pos = jnp.arange(s)
    starts = jnp.concatenate([jnp.ones_like(segment_ids_BxS[:, :1], bool),
                              segment_ids_BxS[:, 1:] != segment_ids_BxS[:, :-1]], axis=1)
    return jax.lax.cummax(jnp.where(starts, pos, 0), axis=1)


def first_token_probs(probs_BxHxSxS, segment_ids_BxS):
    """[B, H, S]: each query's attention on the first token of its own document."""
    first_BxS = document_starts(segment_ids_BxS)
    return jnp.take_along_axis(probs_BxHxSxS, first_BxS[:, None, :, None], axis=-1)[..., 0]


def f_attn_mask(segment_ids_BxS):
    """[B, S] True for the queries F-Attn counts: real tokens that do not start their document."""
    return (segment_ids_BxS != 0) & (jnp.arange(segment_ids_BxS.shape[1]) != document_starts(segment_ids_BxS))


@nnx.jit(static_argnames=("map_layers", "map_len"))
def _collect(model, tokens_BxS, positions_BxS, segment_ids_BxS, map_layers, map_len):
    model.forward(tokens_BxS, positions_BxS, segment_ids_BxS, capture=EVERYTHING)
    inter = nnx.pop(model, nnx.Intermediate)
    layers = []
    for i in range(len(model.blocks)):
        blk = inter["blocks"][i]
        if "attn" not in blk:  # a Gated DeltaNet layer (hybrid models): no attention matrix, SDPA output or gate
            layers.append({"block_out": blk["block_out"][0], "ffn_out": blk["ffn_out"][0]})
            continue
        attn = blk["attn"]
        probs = attn["attn_probs"][0]
        layer = {"block_out": blk["block_out"][0], "ffn_out": blk["ffn_out"][0], "sdpa_out": attn["sdpa_out"][0],
                 "first_probs": first_token_probs(probs, segment_ids_BxS)}
        if i in map_layers:
            layer["attn_map"] = probs[:, :, :map_len, :map_len]
        for name in ("gate_scores", "gate_input", "gated"):
            if "gate" in attn and name in attn["gate"]:
                layer[name] = attn["gate"][name][0]
        layers.append(layer)
    return layers


def for_analysis(model: Transformer) -> Transformer:
    """The same parameters as the measurements compute them: the xla attention (they need the
    attention matrix, which the Pallas kernel never forms; both compute the same outputs),
    unscanned blocks (each layer's values are sown separately) and the partitioned MoE, which
    runs without the run's mesh (`off_mesh`: for all_to_all, see `Options.moe_shards`). Other
    settings are kept."""
    ex = off_mesh(model.ex)
    return with_exec(model, dataclasses.replace(ex, attention_impl="xla", scan_layers=False))


def moe_shards(cfg) -> int:
    """The data x fsdp x expert shards of `cfg`'s mesh if its MoE is exec.moe_impl=all_to_all, whose
    capacity is counted per shard (so the measurements run one shard's rows at a time); else 1."""
    if cfg.exec.moe_impl != "all_to_all":
        return 1
    mesh = sharding.make_mesh(cfg.mesh)
    return sharding.batch_shards(mesh)


def collect(model, tokens_BxS, segment_ids_BxS=None, positions_BxS=None, *,
            map_layers: tuple[int, ...] = (), map_len: int = 64) -> list[dict[str, np.ndarray]]:
    """One dict per layer (N = B * S): 'block_out' [N, D], 'ffn_out' [N, D] (the FFN's addition to
    the residual stream) and, for attention layers (a hybrid's Gated DeltaNet layers have only those
    two), 'sdpa_out' [N, Hq, K], 'first_probs'
    [B, Hq, S] (see `first_token_probs`), 'attn_map' [B, Hq, L, L] for `map_layers` (L = min(map_len,
    S)) and, for gated variants, 'gate_scores' [N, heads, width] and, at the gate's position,
    'gate_input' / 'gated' (what the gate multiplies and what it returns). Runs `for_analysis(model)`."""
    model = for_analysis(model)
    tokens_BxS = jnp.asarray(tokens_BxS)
    if segment_ids_BxS is None:
        segment_ids_BxS = jnp.ones_like(tokens_BxS)
    if positions_BxS is None:
        positions_BxS = jnp.broadcast_to(jnp.arange(tokens_BxS.shape[1]), tokens_BxS.shape)
    layers = _collect(model, tokens_BxS, jnp.asarray(positions_BxS), jnp.asarray(segment_ids_BxS),
                      tuple(map_layers), map_len)
    return [{k: np.asarray(v, np.float32) for k, v in layer.items()} for layer in layers]


def sink_heads_label(threshold: float) -> str:
    """The name of `sink_head_share` wherever it is shown, apart from Gu et al.'s Sink_1^eps
    share (`sinks.share_label`): the share of heads whose F-Attn exceeds `threshold`."""
    return f"F-Attn sink heads (F-Attn > {threshold:g})"


SINK_HEADS_DEFINITION = ("the share of (layer, head) pairs whose F-Attn (the paper's Table 4 first-token "
                         "attention: each query's attention on its document's first token, averaged over "
                         "every query of the held-out rows but each document's first) exceeds the threshold")


# Per-layer fields that only attention layers have; a hybrid's Gated DeltaNet rows hold None there.
ATTENTION_ONLY = ("mean_abs_y", "f_attn", "sink_head_share", "sparsity", "gate_score", "mean_abs_y_gated")
HYBRID_NOTE = ("F-Attn, the sink-head share, the gate score, mean |Y| and the sparsity are attention measures: "
               "they are averaged over the full-attention layers (attention_layers) and are None for the Gated "
               "DeltaNet layers, which have no softmax attention, SDPA output or gate; M-Act and the FFN "
               "activations cover every layer")


def check_map_layers(map_layers, num_layers: int, field: str = "map_layers", *,
                     attention_layers: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """`map_layers` as a tuple, or ConfigError (naming `field`) for a layer the model lacks or,
    in a hybrid, a Gated DeltaNet layer (`attention_layers`: the layers with an attention map)."""
    for i in map_layers:
        if not 0 <= i < num_layers:
            raise ConfigError(field, i, f"layers 0..{num_layers - 1} of this model")
        if attention_layers is not None and i not in attention_layers:
            raise ConfigError(field, i, f"an attention layer ({', '.join(map(str, attention_layers))}): layer "
                              f"{i} is a Gated DeltaNet layer, which has no attention map")
    return tuple(map_layers)


@dataclasses.dataclass
class Options:
    sink_threshold: float = 0.3          # a head with F-Attn above this is an F-Attn sink head
    sparsity_thresholds: tuple[float, ...] = (1e-2, 1e-3)
    gate_bins: int = 50
    map_layers: tuple[int, ...] | None = None  # None: first, middle and last layer
    map_len: int = 64                    # attention maps cover positions [0, map_len)
    batch_rows: int | None = None        # rows per forward pass (None: each batch as it comes)
    # > 1 (`moe_shards(cfg)` for an all_to_all MoE): each forward pass holds 1/moe_shards of a
    # batch's rows, one data x expert shard's (batch_rows is then unused), so the capacity drops
    # what the run's mesh drops.
    moe_shards: int = 1


class Measurements:
    """Accumulates `collect`'s per-layer tensors over batches; `result()` gives the statistics."""

    def __init__(self, model_cfg, options: Options | None = None):
        self.cfg, self.opts = model_cfg, options or Options()
        n, gate = model_cfg.num_layers, model_cfg.gate
        self.gated = gate is not None
        self.gate_on_sdpa = self.gated and gate.position == "sdpa"
        self.gate_range = GATE_RANGES[gate.activation] if self.gated else None
        full = model_cfg.full_attention_layers  # where the attention measures apply (all layers but a hybrid's GDN)
        self.attention_layers = full
        self.map_layers = (check_map_layers(self.opts.map_layers, n, attention_layers=full)
                           if self.opts.map_layers is not None
                           else tuple(sorted({full[0], full[len(full) // 2], full[-1]})))
        t, l_ = len(self.opts.sparsity_thresholds), self.opts.map_len
        self.m_act = np.zeros(n)
        self.m_act_token_sum, self.ffn_act = np.zeros(n), np.zeros(n)  # sum of per-token maxima; max |FFN out|
        self.abs_sum = {k: np.zeros(n) for k in ("sdpa_out", "gated")}  # sum of |Y| and |Y'| (Fig. 4)
        self.f_attn_sum, self.f_attn_count = np.zeros((n, model_cfg.q_heads)), 0
        self.gate_sum, self.gate_count = np.zeros(n), 0
        self.gate_hist = np.zeros((n, self.opts.gate_bins), np.int64)
        self.below = {k: np.zeros((n, t), np.int64) for k in ("sdpa_out", "gated")}
        self.abs_hist = np.zeros((n, len(ABS_EDGES) + 1), np.int64)  # |gate input|, for mean_gate_scaled
        self.values = 0  # SDPA-output values counted per layer
        self.map_sum = {i: np.zeros((model_cfg.q_heads, l_, l_)) for i in self.map_layers}
        self.map_queries = np.zeros(l_, np.int64)  # per query position: rows whose first document reaches it

    def add(self, layers: list[dict[str, np.ndarray]], segment_ids_BxS=None) -> None:
        first_attention = layers[self.attention_layers[0]]
        b, _, s = first_attention["first_probs"].shape
        seg = np.ones((b, s), np.int64) if segment_ids_BxS is None else np.asarray(segment_ids_BxS)
        valid_N = seg.reshape(-1) != 0
        keep_BxS = np.asarray(f_attn_mask(jnp.asarray(seg)))
        thresholds = np.asarray(self.opts.sparsity_thresholds)
        # Attention maps: only queries in each row's first document (later ones start elsewhere).
        l_ = min(self.opts.map_len, s)
        in_first_BxL = (np.asarray(document_starts(jnp.asarray(seg[:, :l_]))) == 0) & (seg[:, :l_] != 0)
        for i, layer in enumerate(layers):
            token_max_T = np.abs(layer["block_out"][valid_N]).max(axis=-1, initial=0.0)
            self.m_act[i] = max(self.m_act[i], float(token_max_T.max(initial=0.0)))
            self.m_act_token_sum[i] += float(token_max_T.astype(np.float64).sum())
            self.ffn_act[i] = max(self.ffn_act[i], float(np.abs(layer["ffn_out"][valid_N]).max(initial=0.0)))
            if "first_probs" not in layer:  # a Gated DeltaNet layer: M-Act and the FFN only
                continue
            self.abs_sum["sdpa_out"][i] += float(np.abs(layer["sdpa_out"][valid_N]).astype(np.float64).sum())
            self.f_attn_sum[i] += (layer["first_probs"] * keep_BxS[:, None, :]).sum(axis=(0, 2))
            self._count_below("sdpa_out", i, layer["sdpa_out"][valid_N], thresholds)
            if self.gated:
                scores = layer["gate_scores"][valid_N]
                self.gate_sum[i] += scores.sum() / scores[0].size
                lo, hi = self.gate_range
                self.gate_hist[i] += np.histogram(np.clip(scores, lo, hi), self.opts.gate_bins, (lo, hi))[0]
                if self.gate_on_sdpa:
                    self._count_below("gated", i, layer["gated"][valid_N], thresholds)
                    self.abs_sum["gated"][i] += float(np.abs(layer["gated"][valid_N]).astype(np.float64).sum())
                    idx = np.searchsorted(ABS_EDGES, np.abs(layer["gate_input"][valid_N]).ravel(), side="right")
                    self.abs_hist[i] += np.bincount(idx, minlength=len(ABS_EDGES) + 1)
            if i in self.map_sum:
                m = (layer["attn_map"] * in_first_BxL[:, None, :, None]).sum(axis=0)
                self.map_sum[i][:, :l_, :l_] += m
        self.f_attn_count += int(keep_BxS.sum())
        self.gate_count += int(valid_N.sum())
        self.values += int(valid_N.sum()) * first_attention["sdpa_out"][0].size
        self.map_queries[:l_] += in_first_BxL.sum(axis=0)

    def add_batch(self, model, tokens_BxS, segment_ids_BxS=None, positions_BxS=None) -> None:
        """Runs `collect` on model inputs with this accumulator's map options and adds the result."""
        self.add(collect(model, tokens_BxS, segment_ids_BxS, positions_BxS, map_layers=self.map_layers,
                         map_len=self.opts.map_len), segment_ids_BxS)

    def _count_below(self, key, layer, values, thresholds):
        self.below[key][layer] += (np.abs(values).reshape(-1, 1) < thresholds).sum(axis=0)

    def result(self) -> dict:
        """{"per_layer": [...], "overall": {...}, "gate_histogram": ..., "attn_maps": ...} with
        plain floats and lists (JSON-ready). Gate fields are absent for ungated models."""
        n, names = self.cfg.num_layers, [f"{t:g}" for t in self.opts.sparsity_thresholds]
        f_head = self.f_attn_sum / max(self.f_attn_count, 1)
        per_layer = []
        for i in range(n):
            row = {"layer": i, "mixer": self.cfg.layer_type(i), "m_act": float(self.m_act[i]),
                   "m_act_per_token": float(self.m_act_token_sum[i] / max(self.gate_count, 1)),
                   "ffn_act": float(self.ffn_act[i])}
            if i not in self.attention_layers:  # no softmax attention, SDPA output or gate: no number
                row.update({k: None for k in ATTENTION_ONLY}, f_attn_per_head=[None] * self.cfg.q_heads)
                per_layer.append(row)
                continue
            row.update({
                   "mean_abs_y": float(self.abs_sum["sdpa_out"][i] / max(self.values, 1)),
                   "f_attn": float(f_head[i].mean()),
                   "f_attn_per_head": [float(x) for x in f_head[i]],
                   "sink_head_share": float(np.mean(f_head[i] > self.opts.sink_threshold)),
                   "sparsity": {"sdpa_out": self._shares(self.below["sdpa_out"][i], names)}})
            if self.gated:
                row["gate_score"] = float(self.gate_sum[i] / max(self.gate_count, 1))
                if self.gate_on_sdpa:
                    row["sparsity"]["gated"] = self._shares(self.below["gated"][i], names)
                    row["mean_abs_y_gated"] = float(self.abs_sum["gated"][i] / max(self.values, 1))
                    if self.cfg.gate.form == "multiplicative":
                        row["sparsity"]["mean_gate_scaled"] = self._mean_scaled(i, row["gate_score"], names)
            per_layer.append(row)
        att = [per_layer[i] for i in self.attention_layers]  # the attention measures average these
        f_att = f_head[list(self.attention_layers)]
        overall = {"m_act": float(self.m_act.mean()), "m_act_max": float(self.m_act.max()),
                   "m_act_per_token": float(np.mean([r["m_act_per_token"] for r in per_layer])),
                   "ffn_act": float(self.ffn_act.mean()), "ffn_act_max": float(self.ffn_act.max()),
                   **{k: float(np.mean([r[k] for r in att])) for k in ("mean_abs_y", "mean_abs_y_gated")
                      if k in att[0]},
                   "f_attn": float(f_att.mean()),
                   "sink_head_share": float(np.mean(f_att > self.opts.sink_threshold)),
                   "sparsity": {k: {t: float(np.mean([r["sparsity"][k][t] for r in att])) for t in names}
                                for k in att[0]["sparsity"]}}
        if len(att) < n:
            overall["attention_layers"] = list(self.attention_layers)
            overall["not_measured"] = HYBRID_NOTE
        out = {"per_layer": per_layer, "overall": overall,
               "counts": {"queries_for_f_attn": self.f_attn_count, "tokens": self.gate_count,
                          "attn_map_rows": int(self.map_queries[0])},
               "sink_threshold": self.opts.sink_threshold}
        if self.gated:
            overall["gate_score"] = float(np.mean([r["gate_score"] for r in att]))
            lo, hi = self.gate_range
            out["gate_histogram"] = {"range": [lo, hi], "per_layer": self.gate_hist.tolist(),
                                     "all_layers": self.gate_hist.sum(axis=0).tolist()}
        q = np.maximum(self.map_queries, 1)[None, :, None]  # [heads, query, key], rows averaged per query
        out["attn_maps"] = {str(i): (m / q).tolist() for i, m in self.map_sum.items()}
        return out

    def _shares(self, counts, names):
        return {t: float(c / max(self.values, 1)) for t, c in zip(names, counts)}

    def _mean_scaled(self, layer, mean_gate, names):
        """Share of |gate input * mean gate| below each threshold, from the |gate input| histogram:
        the values in the bins that lie below threshold / |mean gate|."""
        out = {}
        for t, name in zip(self.opts.sparsity_thresholds, names):
            limit = t / max(abs(mean_gate), 1e-30)
            bins = np.searchsorted(ABS_EDGES, limit, side="right")  # bins [0, bins) hold values < edge[bins-1] <= limit
            out[name] = float(self.abs_hist[layer][:bins].sum() / max(self.values, 1))
        return out


def measure(model, batches, options: Options | None = None) -> dict:
    """Runs `Measurements` over packed batches ({"tokens", "segment_ids", "positions"} with
    rows of S + 1 tokens, as the data pipeline makes them; the last token is dropped), in chunks
    of `options.batch_rows` rows (with `options.moe_shards` > 1: of one shard's rows)."""
    acc = Measurements(model.cfg, options)
    rows, shards = acc.opts.batch_rows, acc.opts.moe_shards
    model = for_analysis(model)  # once, not per batch (collect's own call is then a no-op)
    for batch in batches:
        tokens, seg, pos = (np.asarray(batch[k])[:, :-1] for k in ("tokens", "segment_ids", "positions"))
        if shards > 1 and len(tokens) % shards:
            raise ConfigError("data.eval_batch_size", len(tokens), f"a multiple of the {shards} data x expert "
                              "shards over which exec.moe_impl='all_to_all' counts the MoE's capacity")
        step = len(tokens) // shards if shards > 1 else rows or len(tokens)
        for r in range(0, len(tokens), step):
            sl = slice(r, r + step)
            acc.add_batch(model, tokens[sl], seg[sl], pos[sl])
    return acc.result()


def summarize(model, tokens_BxS, segment_ids_BxS=None, positions_BxS=None,
              options: Options | None = None) -> dict:
    """The statistics of one batch of model inputs ([B, S] tokens), per layer and overall."""
    acc = Measurements(model.cfg, options)
    acc.add_batch(model, tokens_BxS, segment_ids_BxS, positions_BxS)
    return acc.result()


@functools.partial(jax.jit, static_argnums=0)
def _token_nll(graphdef, state, tokens_BxL1):
    """Next-token loss of every position of rows of L + 1 tokens (one sequence each): [B, L]."""
    return token_nll(nnx.merge(graphdef, state)(tokens_BxL1[:, :-1]), tokens_BxL1[:, 1:])


def window_perplexity(model, stream, length: int) -> dict | None:
    """Long-context perplexity: the model on `stream` (held-out documents concatenated with eos
    between them) cut into consecutive windows of `length` + 1 tokens, each read as one sequence at
    positions 0..length-1 (training instead restarts positions at each document and masks attention
    across documents: this measures positions and context length, not document boundaries); over
    the whole windows and over their second halves, where a model trained at length/2 meets
    positions it never saw. Give every length the same stream to compare lengths on the same
    text. None if the stream is shorter than one window. Windows run one at a time; set
    exec.attention_query_chunk to bound a long window's memory."""
    n = (len(stream) - 1) // length
    if n < 1:
        return None
    graphdef, state = nnx.split(with_exec(model, off_mesh(model.ex)))  # no mesh is set here
    nll = np.concatenate([np.asarray(_token_nll(graphdef, state, jnp.asarray(
        stream[i * length:(i + 1) * length + 1][None], jnp.int32))) for i in range(n)])  # [n, L]

    def ppl(x):
        return float(np.exp(min(float(x.mean()), 50.0)))

    return {"ppl": ppl(nll), "ppl_second_half": ppl(nll[:, length // 2:]), "windows": n}
