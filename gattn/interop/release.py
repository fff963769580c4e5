"""The paper authors' released models <-> gattn: Qwen3's modeling code with
headwise_attn_output_gate / elementwise_attn_output_gate, use_qk_norm and qkv_bias (their files say
model_type "qwen2" or "qwen3": the flags decide). No gate, or a headwise or elementwise G1 gate,
packed into a widened q_proj per kv group: each group's rows are the queries of its G heads, then
their gates (G rows headwise, G * head_dim elementwise). transformers loads the layout only with the
release's own modeling code (trust_remote_code), which gattn does not ship, so it is written only
on request. Every field of config.json is mapped, known to change nothing gattn computes, or
refused in one line."""

from __future__ import annotations

import numpy as np

from gattn.config import ConfigError, GateSpec, ModelConfig
from gattn.interop import decoder, fields

LAYOUTS = ("release",)
ARCHITECTURES: dict[str, str] = {}  # (its architectures are Qwen3's: detected by FLAGS)
MODEL_TYPES = {"qwen3_gated_attention": "release"}  # (what to-hf writes)
FLAGS = ("headwise_attn_output_gate", "elementwise_attn_output_gate", "use_qk_norm", "qkv_bias")
# (attention_bias, a field of DECODER, changes nothing: the release's code biases q, k, v and o as qkv_bias says)
NO_EFFECT = fields.SLIDING + ("layer_types", "auto_map")  # (layer_types: checked all full attention)


def is_release(hf: dict) -> bool:
    return any(flag in hf for flag in FLAGS)


def _split_q(w: np.ndarray, cfg: ModelConfig):
    """q_proj rows per kv group [queries of the group's G heads | their gates] -> (W_Q rows, gate rows)."""
    rest = w.shape[1:]
    per_group = w.reshape(cfg.kv_heads, -1, *rest)
    q_rows = cfg.group_size * cfg.head_dim
    return per_group[:, :q_rows].reshape(cfg.q_heads * cfg.head_dim, *rest), per_group[:, q_rows:].reshape(-1, *rest)


def _join_q(q: np.ndarray, gate: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    rest = q.shape[1:]
    both = np.concatenate([q.reshape(cfg.kv_heads, -1, *rest), gate.reshape(cfg.kv_heads, -1, *rest)], axis=1)
    return both.reshape(-1, *rest)


PACKING = decoder.Packing("release", _split_q, _join_q)


def model_config(hf: dict, layout: str = "release") -> ModelConfig:
    """The gattn model of a release config.json."""
    fields.strict(hf, fields.DECODER + tuple(fields.DECODER_FIXED) + fields.ROPE_FIELDS + fields.BOOKKEEPING + FLAGS
                  + NO_EFFECT, "config.json ", "the release's config")
    fields.fixed(hf, fields.DECODER_FIXED, "config.json ")
    common = fields.decoder(hf, head_dim=128, partial=1.0)  # (the release's config: head_dim 128, as Qwen3's)
    fields.full_attention_only(hf, common["num_layers"])
    fields.full_rotary(common, "release")
    if hf.get("headwise_attn_output_gate") and hf.get("elementwise_attn_output_gate"):
        raise ConfigError("config.json headwise_attn_output_gate", True,
                          "at most one of headwise / elementwise_attn_output_gate")
    gate = None
    if hf.get("headwise_attn_output_gate"):
        gate = GateSpec(granularity="headwise")
    elif hf.get("elementwise_attn_output_gate"):
        gate = GateSpec(granularity="elementwise")
    return ModelConfig(**{**common, "attention_bias": bool(hf.get("qkv_bias", False))},
                       qk_norm=bool(hf.get("use_qk_norm", False)), gate=gate)


def hf_config(cfg: ModelConfig, layout: str, max_len: int, kept: dict) -> dict:
    """Loads with the authors' modeling_qwen3.py / configuration_qwen3.py next to it
    (trust_remote_code). A model type transformers does not know keeps its own Qwen3 code from
    loading these weights without their gate, biases or norms."""
    g = cfg.gate
    return {"architectures": ["Qwen3ForCausalLM"], **fields.decoder_config(cfg, max_len, kept, partial=False),
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers,
            "layer_types": ["full_attention"] * cfg.num_layers, "model_type": "qwen3_gated_attention",
            "auto_map": {"AutoConfig": "configuration_qwen3.Qwen3Config",
                         "AutoModelForCausalLM": "modeling_qwen3.Qwen3ForCausalLM"},
            "headwise_attn_output_gate": g is not None and g.granularity == "headwise",
            "elementwise_attn_output_gate": g is not None and g.granularity == "elementwise",
            "use_qk_norm": cfg.qk_norm, "qkv_bias": cfg.attention_bias, "attention_bias": False}


kept_fields = fields.kept  # the config.json fields kept as they are
hf_shapes, to_gattn, from_gattn, read_files = PACKING.family_tensors()
