"""Qwen3-MoE (transformers' Qwen3MoeForCausalLM) <-> gattn: Qwen3's attention (QK-norm, no gate)
with an MoE FFN in every layer: the router mlp.gate [E, d] is gattn's router transposed, and
expert j's gate_proj / up_proj / down_proj are slices j of gattn's stacked w1 / w3 / w2, transposed
(the shared decoder's names, gattn/interop/decoder.py); softmax top-k routing, renormalised as
norm_topk_prob says (transformers' default: not), computed dropless as transformers computes it.
Every field of config.json is mapped, known to change nothing gattn computes, or refused in one line."""

from __future__ import annotations

from gattn.config import ConfigError, ModelConfig, MoESpec
from gattn.interop import decoder, fields

LAYOUTS = ("qwen3_moe",)
ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe"}
MODEL_TYPES = {"qwen3_moe": "qwen3_moe"}
PACKING = decoder.Packing("qwen3_moe")
MOE = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
       "router_aux_loss_coef", "decoder_sparse_step", "mlp_only_layers")
NO_EFFECT = fields.SLIDING + ("layer_types", "output_router_logits")  # (layer_types: checked all full attention)


def model_config(hf: dict, layout: str = "qwen3_moe") -> ModelConfig:
    """The gattn model of a Qwen3-MoE config.json: every layer sparse (gattn has no dense layers
    between MoE layers)."""
    fields.strict(hf, fields.DECODER + tuple(fields.DECODER_FIXED) + fields.ROPE_FIELDS + fields.BOOKKEEPING + MOE
                  + NO_EFFECT, "config.json ", "Qwen3-MoE's config")
    fields.fixed(hf, fields.DECODER_FIXED, "config.json ")
    common = fields.decoder(hf, head_dim=None, partial=1.0)
    fields.full_attention_only(hf, common["num_layers"])
    fields.full_rotary(common, layout)
    dense = sorted(set(hf.get("mlp_only_layers") or []))
    if dense:
        raise ConfigError("config.json mlp_only_layers", dense, "[] (gattn's MoE models have an MoE FFN in every "
                          "layer, and no dense layers between)")
    if int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ConfigError("config.json decoder_sparse_step", hf["decoder_sparse_step"], "1 (an MoE FFN in every layer)")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise ConfigError("config.json num_experts", None, "a required field is missing")
    moe = MoESpec(num_experts=int(experts), top_k=int(hf.get("num_experts_per_tok", 8)),
                  expert_width=int(fields.required(hf, "moe_intermediate_size")),
                  renormalize=bool(hf.get("norm_topk_prob", False)),
                  lbl_coef=float(hf.get("router_aux_loss_coef", 1e-3)))
    return ModelConfig(**common, qk_norm=True, moe=moe)


def hf_config(cfg: ModelConfig, layout: str, max_len: int, kept: dict) -> dict:
    m = cfg.moe
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            **fields.decoder_config(cfg, max_len, kept, partial=False),
            "num_experts": m.num_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.expert_width,
            "norm_topk_prob": m.renormalize, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "router_aux_loss_coef": m.lbl_coef, "output_router_logits": False, "intermediate_size": cfg.d_ff,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers,
            "layer_types": ["full_attention"] * cfg.num_layers}


kept_fields = fields.kept  # the config.json fields kept as they are
hf_shapes, to_gattn, from_gattn, read_files = PACKING.family_tensors()
