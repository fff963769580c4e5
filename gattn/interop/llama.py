"""Qwen3 and Llama (transformers' Qwen3ForCausalLM, LlamaForCausalLM) <-> gattn: the plain decoder
with no gate, Qwen3 with QK-norm and Llama without, full rotary embeddings, optional attention
biases. Their tensors are the shared decoder's (gattn/interop/decoder.py) as they are. Every field
of config.json is mapped, known to change nothing gattn computes, or refused in one line."""

from __future__ import annotations

from gattn.config import ModelConfig
from gattn.interop import decoder, fields

LAYOUTS = ("qwen3", "llama")
ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama"}
NAMES = {"qwen3": "Qwen3", "llama": "Llama"}
PACKING = decoder.Packing("qwen3")
# Fields beside the shared decoder's that change nothing gattn computes.
NO_EFFECT = {"qwen3": fields.SLIDING + ("layer_types",),  # (layer_types: checked all full attention)
             "llama": ("pretraining_tp",)}  # (v4's tensor-parallel slicing of the same products)
HEAD_DIM = {"qwen3": 128, "llama": None}  # transformers' default for an absent head_dim (None: d // heads)


def allowed(layout: str) -> tuple[str, ...]:
    """The config.json fields the family reads (used by the release family, a Qwen3 variant, too)."""
    return (fields.DECODER + tuple(fields.DECODER_FIXED) + fields.ROPE_FIELDS + fields.BOOKKEEPING
            + NO_EFFECT[layout])


def model_config(hf: dict, layout: str) -> ModelConfig:
    """The gattn model of a Qwen3 or Llama config.json."""
    fields.strict(hf, allowed(layout), "config.json ", f"{NAMES[layout]}'s config")
    fields.fixed(hf, fields.DECODER_FIXED, "config.json ")
    common = fields.decoder(hf, head_dim=HEAD_DIM[layout], partial=1.0)
    fields.full_attention_only(hf, common["num_layers"])
    fields.full_rotary(common, layout)
    return ModelConfig(**common, qk_norm=layout == "qwen3")


def hf_config(cfg: ModelConfig, layout: str, max_len: int, kept: dict) -> dict:
    out = {"architectures": [{v: k for k, v in ARCHITECTURES.items()}[layout]], "model_type": layout,
           **fields.decoder_config(cfg, max_len, kept, partial=False)}
    if layout == "qwen3":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers,
                   layer_types=["full_attention"] * cfg.num_layers)
    else:
        out["mlp_bias"] = False
    return out


kept_fields = fields.kept  # the config.json fields kept as they are
hf_shapes, to_gattn, from_gattn, read_files = PACKING.family_tensors()
