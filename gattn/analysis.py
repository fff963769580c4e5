"""The paper's measurements, read from the model's own forward pass (never a second model).

`collect` runs the model with intermediates switched on and returns, per layer, what the blocks
sowed: attention probabilities, SDPA output, gate scores and the block's output hidden state.
`summarize` turns them into Table 4's columns: gate score, M-Act and F-Attn.
"""

from __future__ import annotations

import numpy as np
from flax import nnx


def collect(model, tokens_BxS, segment_ids_BxS=None) -> list[dict[str, np.ndarray]]:
    """One dict per layer with 'attn_probs' [B, Hq, S, S], 'sdpa_out' [N, Hq, K], 'block_out'
    [N, D] and, for gated variants only, 'gate_scores' [N, heads, width]."""
    model.set_attributes(collect_intermediates=True, raise_if_not_found=False)
    try:
        model(tokens_BxS, segment_ids_BxS=segment_ids_BxS)
        inter = nnx.pop(model, nnx.Intermediate)
    finally:
        model.set_attributes(collect_intermediates=False, raise_if_not_found=False)
    layers = []
    for i in range(len(model.blocks)):
        blk = inter["blocks"][i]
        layer = {"block_out": blk["block_out"][0], "attn_probs": blk["attn"]["attn_probs"][0],
                 "sdpa_out": blk["attn"]["sdpa_out"][0]}
        if "gate" in blk["attn"]:
            layer["gate_scores"] = blk["attn"]["gate"]["gate_scores"][0]
        layers.append({k: np.asarray(v) for k, v in layer.items()})
    return layers


def first_token_attention(probs_BxHxSxS: np.ndarray) -> np.ndarray:
    """F-Attn per head: attention on the first token, averaged over batch and query positions
    (the first query, which can only attend to itself, is left out)."""
    return probs_BxHxSxS[:, :, 1:, 0].mean(axis=(0, 2))


def summarize(layers: list[dict[str, np.ndarray]]) -> dict:
    """Per layer and overall: gate score mean (absent for ungated models), M-Act (max |hidden|
    output by the layer) and F-Attn (first-token attention, mean over heads)."""
    per_layer = []
    for layer in layers:
        row = {"m_act": float(np.abs(layer["block_out"]).max()),
               "f_attn": float(first_token_attention(layer["attn_probs"]).mean())}
        if "gate_scores" in layer:
            row["gate_score"] = float(np.mean(layer["gate_scores"]))
        per_layer.append(row)
    overall = {k: float(np.mean([r[k] for r in per_layer])) for k in ("m_act", "f_attn")}
    if per_layer and "gate_score" in per_layer[0]:
        overall["gate_score"] = float(np.mean([r["gate_score"] for r in per_layer]))
    return {"overall": overall, "per_layer": per_layer}
