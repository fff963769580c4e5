"""Qwen3-Next (transformers' Qwen3NextForCausalLM) <-> gattn: full-attention layers with the
elementwise G1 gate and Gated DeltaNet layers in any pattern (layer_types; linear_attn.* through
gattn/model/gdn.py's from_hf / to_hf), dense MLPs or an MoE with a shared expert in every layer
(mlp.shared_expert.*, mlp.shared_expert_gate [1, d]).
- q_proj rows per head: [query | gate]; a headwise gate is written with each head's row repeated
  head_dim times (the same gate values, so the same logits; it reads back elementwise).
- Every RMSNorm but the GDN's scales by (1 + w): gattn reads it as model.zero_centered_norm and
  copies w as it is (a model without it is written with w = scale - 1).
- Partial rotary embeddings (rope_dim; Qwen3NextConfig's default is a quarter of head_dim 256).
- transformers applies hidden_act to the GDN's causal conv as well as to the FFN, and gattn's conv
  is SiLU: a model with GDN layers is read and written with hidden_act silu only.
Every field of config.json is mapped, known to change nothing gattn computes on text, or refused
in one line. Qwen3.5 (gattn/interop/qwen3_5.py) is this model with other GDN projections."""

from __future__ import annotations

import numpy as np

from gattn.config import ConfigError, GateSpec, LinearAttentionSpec, ModelConfig, MoESpec
from gattn.interop import decoder, fields

LAYOUTS = ("qwen3_next",)
ARCHITECTURES = {"Qwen3NextForCausalLM": "qwen3_next"}
MODEL_TYPES = {"qwen3_next": "qwen3_next"}
GDN_PACKING = "qwen3_next"  # how the GDN projections are packed (gattn/model/gdn.py)
MAPPED = fields.DECODER + (
    "layer_types", "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "decoder_sparse_step", "mlp_only_layers", "num_experts",
    "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
    "router_aux_loss_coef")
NO_EFFECT = fields.BOOKKEEPING + fields.SLIDING + (
    "output_router_logits", "mamba_ssm_dtype",
    "num_nextn_predict_layers", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")  # (gattn/interop/mtp.py)


def _split_q(w: np.ndarray, cfg: ModelConfig):
    """q_proj rows per head [query | gate] -> (W_Q rows, gate rows)."""
    rest, k = w.shape[1:], cfg.head_dim
    per_head = w.reshape(cfg.q_heads, 2 * k, *rest)
    return per_head[:, :k].reshape(cfg.q_heads * k, *rest), per_head[:, k:].reshape(cfg.q_heads * k, *rest)


def _join_q(q: np.ndarray, gate: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """The inverse of `_split_q`; a headwise gate's row repeated over its head's head_dim rows."""
    rest, k = q.shape[1:], cfg.head_dim
    per_head = gate.reshape(cfg.q_heads, -1, *rest)
    per_head = np.repeat(per_head, k // per_head.shape[1], axis=1)
    return np.concatenate([q.reshape(cfg.q_heads, k, *rest), per_head], axis=1).reshape(-1, *rest)


PACKING = decoder.Packing("qwen3_next", _split_q, _join_q, one_plus_w=True)


def model_config(hf: dict, layout: str = "qwen3_next") -> ModelConfig:
    """The gattn model of a Qwen3-Next config.json, with Qwen3NextConfig's defaults for absent
    fields (the 3:1 pattern from full_attention_interval, 512 experts)."""
    fields.strict(hf, MAPPED + NO_EFFECT + fields.ROPE_FIELDS + tuple(fields.DECODER_FIXED), "config.json ",
                  "Qwen3-Next's config")
    fields.fixed(hf, fields.DECODER_FIXED, "config.json ")
    common = fields.decoder(hf, head_dim=256, partial=0.25)
    kinds = fields.layer_kinds(hf, common["num_layers"], "config.json ")
    fields.check_gdn_act(hf.get("hidden_act", "silu"), kinds, "config.json ")
    linear = None
    if "linear_attention" in kinds:
        linear = LinearAttentionSpec(
            num_k_heads=int(hf.get("linear_num_key_heads", 16)), num_v_heads=int(hf.get("linear_num_value_heads", 32)),
            head_k_dim=int(hf.get("linear_key_head_dim", 128)), head_v_dim=int(hf.get("linear_value_head_dim", 128)),
            conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)))
    return ModelConfig(**common, qk_norm=True, gate=GateSpec(granularity="elementwise"),
                       moe=_moe(hf, common["num_layers"]), zero_centered_norm=True,
                       layer_types=kinds if linear is not None else None, linear_attention=linear)


def _moe(hf: dict, layers: int) -> MoESpec | None:
    """MoE layers with a shared expert everywhere or nowhere (gattn has no dense layers between MoE layers)."""
    experts, step = int(hf.get("num_experts", 512)), int(hf.get("decoder_sparse_step", 1))
    dense_only = set(hf.get("mlp_only_layers") or [])
    sparse = [i for i in range(layers) if i not in dense_only and experts > 0 and (i + 1) % step == 0]
    if not sparse:
        return None
    if len(sparse) != layers:
        raise ConfigError("config.json mlp_only_layers", sorted(dense_only), f"all layers or none (layers {sparse} "
                          "would be MoE and the others dense; gattn's MoE models have an MoE FFN in every layer)")
    shared = int(hf.get("shared_expert_intermediate_size", 512))
    if shared < 1:
        raise ConfigError("config.json shared_expert_intermediate_size", shared, "an integer >= 1 (Qwen3-Next's "
                          "MoE always runs its shared expert)")
    return MoESpec(num_experts=experts, top_k=int(hf.get("num_experts_per_tok", 10)),
                   expert_width=int(hf.get("moe_intermediate_size", 512)),
                   renormalize=bool(hf.get("norm_topk_prob", True)),
                   lbl_coef=float(hf.get("router_aux_loss_coef", 1e-3)), shared_expert_width=shared)


def hf_config(cfg: ModelConfig, layout: str, max_len: int, kept: dict) -> dict:
    out = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
           **fields.decoder_config(cfg, max_len, kept, partial=True),
           "layer_types": [cfg.layer_type(i) for i in range(cfg.num_layers)], "decoder_sparse_step": 1}
    if cfg.linear_attention is not None:
        la = cfg.linear_attention
        out.update(linear_num_key_heads=la.num_k_heads, linear_num_value_heads=la.num_v_heads,
                   linear_key_head_dim=la.head_k_dim, linear_value_head_dim=la.head_v_dim,
                   linear_conv_kernel_dim=la.conv_kernel)
    if cfg.moe is None:
        out.update(mlp_only_layers=list(range(cfg.num_layers)), num_experts=0)
    else:
        m = cfg.moe
        out.update(mlp_only_layers=[], num_experts=m.num_experts, num_experts_per_tok=m.top_k,
                   moe_intermediate_size=m.expert_width, shared_expert_intermediate_size=m.shared_expert_width,
                   norm_topk_prob=m.renormalize, router_aux_loss_coef=m.lbl_coef, output_router_logits=False,
                   intermediate_size=cfg.d_ff)
    return out


def kept_fields(hf: dict) -> dict:
    return fields.kept(hf)


# --------------------------------------------------------------------------- tensors: the shared decoder's,
# and the GDN layers and the shared expert (used by Qwen3.5 too, with its GDN packing)

def _shared_expert(cfg: ModelConfig) -> bool:
    return cfg.moe is not None and bool(cfg.moe.shared_expert_width)


def shapes(cfg: ModelConfig, gdn_packing: str) -> dict[str, tuple[int, ...]]:
    from gattn.model import gdn  # noqa: PLC0415 (jax; the interop modules stay numpy-only to import)

    out, d = decoder.hf_shapes(cfg), cfg.d_model
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.layer_type(i) == "linear_attention":
            out.update({f"{p}linear_attn.{n}": s for n, s in gdn.hf_shapes(gdn.GDNSpec.of(cfg), gdn_packing).items()})
        if _shared_expert(cfg):  # a shared SwiGLU, scaled by a sigmoid gate
            fs = cfg.moe.shared_expert_width
            s = f"{p}mlp.shared_expert"
            out.update({f"{s}.gate_proj.weight": (fs, d), f"{s}.up_proj.weight": (fs, d),
                        f"{s}.down_proj.weight": (d, fs), f"{s}_gate.weight": (1, d)})
    return out


def tensors_to_gattn(t: dict, cfg: ModelConfig, packing: decoder.Packing, gdn_packing: str) -> dict:
    from gattn.model import gdn  # noqa: PLC0415

    out = decoder.to_gattn(t, cfg, packing)
    for i in range(cfg.num_layers):
        p, b = f"model.layers.{i}.", ("blocks", i)
        if _shared_expert(cfg):
            out.update({b + ("ffn", "shared_expert", ours): t[f"{p}mlp.shared_expert.{theirs}.weight"].T
                        for ours, theirs in decoder.FFN_PROJ})
            out[b + ("ffn", "shared_gate")] = t[p + "mlp.shared_expert_gate.weight"].T
        if cfg.layer_type(i) == "linear_attention":
            layer = gdn.from_hf(t, p + "linear_attn.", gdn.GDNSpec.of(cfg), gdn_packing)
            out.update({b + ("linear_attn",) + path: value for path, value in layer.items()})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def tensors_from_gattn(P: dict, cfg: ModelConfig, packing: decoder.Packing, gdn_packing: str) -> dict:
    from gattn.model import gdn  # noqa: PLC0415

    out = decoder.from_gattn(P, cfg, packing)
    for i in range(cfg.num_layers):
        p, b = f"model.layers.{i}.", ("blocks", i)
        if _shared_expert(cfg):
            out.update({f"{p}mlp.shared_expert.{theirs}.weight": P[b + ("ffn", "shared_expert", ours)].T
                        for ours, theirs in decoder.FFN_PROJ})
            out[p + "mlp.shared_expert_gate.weight"] = P[b + ("ffn", "shared_gate")].T
        if cfg.layer_type(i) == "linear_attention":
            layer = {path[len(b) + 1:]: v for path, v in P.items() if path[:len(b) + 1] == b + ("linear_attn",)}
            out.update(gdn.to_hf(layer, p + "linear_attn.", gdn.GDNSpec.of(cfg), gdn_packing))
    return {k: np.ascontiguousarray(v) for k, v in decoder.by_layer(out).items()}


def hf_shapes(cfg: ModelConfig, layout: str = "qwen3_next") -> dict[str, tuple[int, ...]]:
    return shapes(cfg, GDN_PACKING)


def to_gattn(tensors, cfg: ModelConfig, layout: str = "qwen3_next"):
    return tensors_to_gattn(tensors, cfg, PACKING, GDN_PACKING)


def from_gattn(params, cfg: ModelConfig, layout: str = "qwen3_next"):
    return tensors_from_gattn(params, cfg, PACKING, GDN_PACKING)


def read_files(files, hf: dict, cfg: ModelConfig) -> None:
    """Nothing to set up: the tensors are stored under their own names."""
