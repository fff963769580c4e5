"""Qwen3-Next's and Qwen3.5's multi-token-prediction tensors (`mtp.*`) <-> gattn's MTP layer
(gattn/model/mtp.py, model.mtp_layers = 1), both ways, every tensor kept.

    mtp.pre_fc_norm_embedding.weight [D]     ("mtp", "pre_fc_norm_embedding", "scale")
    mtp.pre_fc_norm_hidden.weight [D]        ("mtp", "pre_fc_norm_hidden", "scale")
    mtp.fc.weight [D, 2D]                    ("mtp", "fc") [2D, D], transposed (input [embedding | hidden])
    mtp.layers.0.<decoder layer>             ("mtp", "block", ...): one full-attention layer, named and
                                             packed as model.layers.<i>.* of the same layout
    mtp.norm.weight [D]                      ("mtp", "norm", "scale")

The four norms are the model's (1 + w) RMSNorms and are recentred as the family recentres the main
model's (copied bit for bit when model.zero_centered_norm). The layer goes through the family's
own mapping of a one-layer model (gattn/interop/weights.py), so its attention (the gate in
q_proj), MoE (router, experts, shared expert) or dense MLP are read and written exactly as the
main layers are. The embedding and LM head are the main model's: the checkpoints store no copy
(Qwen3.5's `mtp_use_dedicated_embeddings: false`; a folder with `mtp.embed_tokens` is refused).
Qwen3.5-MoE files that store the MTP layer's experts fused are unfused like the main layers'
(gattn/interop/qwen3_5.py's unfuse_experts matches any prefix).

Wiring into gattn/interop/convert.py: from-hf sets model.mtp_layers = `mtp_layers(config, names)`,
checks `hf_shapes(cfg, layout)` with the main model's shapes and adds `to_gattn(tensors, cfg,
layout)` to the parameters; to-hf adds `from_gattn(params, cfg, layout)` to the tensors and
`hf_config_fields(cfg, layout)` to config.json.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gattn.config import ModelConfig
from gattn.interop import weights
from gattn.interop.families import family
from gattn.interop.files import ConversionError

PREFIX = "mtp."
LAYER = PREFIX + "layers.0."
_NORMS = (("pre_fc_norm_embedding", "pre_fc_norm_embedding"), ("pre_fc_norm_hidden", "pre_fc_norm_hidden"),
          ("norm", "norm"))  # (HF name under mtp., gattn module under mtp)
_MAIN_LAYER = "model.layers.0."  # how the family names the one layer of `_layer_config`


def _layer_config(cfg: ModelConfig) -> ModelConfig:
    """A one-layer, full-attention model of `cfg`'s kind: weights.py maps its layer as the MTP block."""
    return dataclasses.replace(cfg, num_layers=1, layer_types=None, mtp_layers=0, tie_embeddings=True)


def _norm_offset(cfg: ModelConfig, layout: str) -> float:
    """What to add to a Hugging Face norm weight to get gattn's (as the family does for the main model)."""
    return family(layout).PACKING.norm_offset(cfg)


def _recentred(w: np.ndarray, offset: float) -> np.ndarray:
    return (w.astype(np.float32) + np.float32(offset)).astype(np.float32) if offset else w


def mtp_layers(hf_config: dict, names) -> int:
    """model.mtp_layers of a Hugging Face folder: 1 if it stores MTP tensors. A config that
    declares more than one layer (num_nextn_predict_layers / mtp_num_hidden_layers), or
    dedicated MTP embeddings, is refused naming the field."""
    present = any(n.startswith(PREFIX) for n in names)
    for field in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        n = hf_config.get(field)
        if n is not None and n not in (0, 1) and present:
            raise ConversionError(f"config field {field} = {n}: gattn builds one MTP layer (model.mtp_layers 0 or 1)")
    if hf_config.get("mtp_use_dedicated_embeddings") or any(n.startswith(PREFIX + "embed_tokens") for n in names):
        raise ConversionError("config field mtp_use_dedicated_embeddings = true (or a tensor mtp.embed_tokens.*): "
                              "gattn's MTP layer shares the main model's embedding")
    return int(present)


def absent_layer(hf_config: dict, names) -> str | None:
    """What to tell the user of a folder whose config declares an MTP layer but which holds no
    mtp.* tensors (transformers neither loads nor saves them: its save of a released model writes
    such a folder), or None. The main model converts exactly; only the MTP layer is missing."""
    if any(n.startswith(PREFIX) for n in names):
        return None
    for field in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        n = hf_config.get(field)
        if n:
            return (f"declares an MTP layer ({field} = {n}) but the folder holds no mtp.* tensors (transformers "
                    "neither loads nor saves them): the run has no MTP layer (model.mtp_layers = 0); the main "
                    "model converts exactly, and MTP training or speculative decoding need a folder with the "
                    "released mtp.* tensors")
    return None


def hf_shapes(cfg: ModelConfig, layout: str = "qwen3_next") -> dict[str, tuple[int, ...]]:
    """Every mtp.* tensor name of `cfg` (model.mtp_layers = 1) in `layout`, with its shape."""
    if not cfg.mtp_layers:
        return {}
    d = cfg.d_model
    out = {PREFIX + name + ".weight": (d,) for name, _ in _NORMS}
    out[PREFIX + "fc.weight"] = (d, 2 * d)
    for name, shape in weights.hf_shapes(_layer_config(cfg), layout).items():
        if name.startswith(_MAIN_LAYER):
            out[LAYER + name[len(_MAIN_LAYER):]] = shape
    return out


def to_gattn(tensors: dict[str, np.ndarray], cfg: ModelConfig, layout: str) -> dict[tuple, np.ndarray]:
    """The mtp.* tensors (others in `tensors` are ignored) -> gattn parameters {("mtp", ...): array};
    {} for a model without an MTP layer."""
    if not cfg.mtp_layers:
        return {}
    missing = sorted(set(hf_shapes(cfg, layout)) - set(tensors))
    if missing:
        raise ConversionError(f"tensor {missing[0]} is missing ({len(missing)} MTP tensors are) for model.mtp_layers = 1")
    one = {_MAIN_LAYER + n[len(LAYER):]: v for n, v in tensors.items() if n.startswith(LAYER)}
    one["model.embed_tokens.weight"] = np.zeros((1, 1), np.float32)  # (read by weights.py, not kept)
    one["model.norm.weight"] = np.zeros(cfg.d_model, np.float32)
    layer = weights.to_gattn(one, _layer_config(cfg), layout)
    out = {("mtp", "block") + path[2:]: v for path, v in layer.items() if path[:2] == ("blocks", 0)}
    offset = _norm_offset(cfg, layout)
    out.update({("mtp", ours, "scale"): _recentred(tensors[PREFIX + theirs + ".weight"], offset)
                for theirs, ours in _NORMS})
    out[("mtp", "fc")] = np.ascontiguousarray(tensors[PREFIX + "fc.weight"].T)
    return out


def from_gattn(params: dict[tuple, np.ndarray], cfg: ModelConfig, layout: str) -> dict[str, np.ndarray]:
    """gattn's ("mtp", ...) parameters (others in `params` are ignored) -> the mtp.* tensors."""
    if not cfg.mtp_layers:
        return {}
    one = {("blocks", 0) + path[2:]: v for path, v in params.items() if path[:2] == ("mtp", "block")}
    one[("embed",)] = np.zeros((1, 1), np.float32)
    one[("final_norm", "scale")] = np.zeros(cfg.d_model, np.float32)
    layer = weights.from_gattn(one, _layer_config(cfg), layout)
    out = {LAYER + n[len(_MAIN_LAYER):]: v for n, v in layer.items() if n.startswith(_MAIN_LAYER)}
    offset = _norm_offset(cfg, layout)
    out.update({PREFIX + theirs + ".weight": _recentred(params[("mtp", ours, "scale")], -offset)
                for theirs, ours in _NORMS})
    out[PREFIX + "fc.weight"] = np.ascontiguousarray(params[("mtp", "fc")].T)
    return out


def hf_config_fields(cfg: ModelConfig, layout: str) -> dict:
    """The config.json fields that declare the MTP layer: Qwen3.5's mtp_num_hidden_layers (and
    mtp_use_dedicated_embeddings false); for Qwen3-Next num_nextn_predict_layers, the field vLLM
    and SGLang read (transformers keeps it as an extra attribute); {} without one."""
    if not cfg.mtp_layers:
        return {}
    if layout == "qwen3_5":
        return {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}
    return {"num_nextn_predict_layers": 1}
