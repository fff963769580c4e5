"""Qwen3.5 (transformers' qwen3_5 and qwen3_5_moe) <-> gattn: the language model of a
Qwen3_5ForCausalLM or Qwen3_5MoeForCausalLM folder, or of a Qwen3_5ForConditionalGeneration or
Qwen3_5MoeForConditionalGeneration one (its text config under `text_config`, its tensors under
`model.language_model.` beside the vision tower `model.visual.`, which is skipped). Every field of
config.json is mapped to gattn's, known to change nothing gattn computes on text, or refused in
one line naming it.

To gattn, Qwen3.5 is Qwen3-Next's hybrid (Gated DeltaNet layers and gated attention: the
elementwise G1 gate packed [query | gate] per head in q_proj, QK-norm, (1 + w) norms, partial
RoPE), with three differences:
- the GDN projections are one per role (gattn/model/gdn.py's qwen3_5 packing);
- a dense SwiGLU in every layer (Qwen3_5), or an MoE with a shared expert in every layer whose
  router always renormalises its top-k (Qwen3_5Moe); the released MoE files store each layer's
  experts fused, which is read as well (the export writes them per expert, as save_pretrained does);
- the multimodal RoPE: each rotary frequency turns with the temporal, height or width position
  (`mrope_section`, interleaved). On text the three are the token's position, so it is plain RoPE,
  which is what gattn computes (tests/test_convert_qwen35.py checks it with the shipped section).
The tensors are Qwen3-Next's (gattn/interop/qwen3_next.py) with this GDN packing.
"""

from __future__ import annotations

import math
import sys

from gattn.config import ConfigError, GateSpec, LinearAttentionSpec, ModelConfig, MoESpec
from gattn.interop import qwen3_next
from gattn.interop.fields import (ACTIVATIONS, BOOKKEEPING, GDN_ACT, ROPE_FIELDS, ROPE_KEYS, fixed, kept, layer_kinds,
                                  rope, rope_spec, strict)

LAYOUTS = ("qwen3_5",)
TEXT_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
MULTIMODAL_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
ARCHITECTURES = {name: "qwen3_5" for name in TEXT_ARCHITECTURES + MULTIMODAL_ARCHITECTURES}
MODEL_TYPES = {name: "qwen3_5" for name in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")}
GDN_PACKING = "qwen3_5"  # the GDN projections one per role (gattn/model/gdn.py)
PACKING = qwen3_next.PACKING  # (q_proj rows [query | gate] per head, (1 + w) norms)
LM_PREFIX, VISION_PREFIX = "model.language_model.", "model.visual."

# transformers' defaults (Qwen3_5TextConfig; Qwen3_5MoeTextConfig changes the MoE's) for absent fields
DENSE_DEFAULTS = dict(
    vocab_size=248_320, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=32, num_attention_heads=16,
    num_key_value_heads=4, head_dim=256, hidden_act="silu", max_position_embeddings=32_768, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4)
MOE_DEFAULTS = {**{k: v for k, v in DENSE_DEFAULTS.items() if k != "intermediate_size"},
                "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2, "num_experts": 256,
                "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                "router_aux_loss_coef": 1e-3}
TEXT_NO_EFFECT = BOOKKEEPING + (
    "mamba_ssm_dtype",  # (the dtype other engines keep the GDN state in: execution)
    "output_router_logits",
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")  # (the MTP layer: read from its mtp.* tensors and
#                                                               checked by gattn/interop/mtp.py)
# Fields with one value transformers' Qwen3.5 can compute: value, and why.
FIXED = {
    "attn_output_gate": (True, "Qwen3.5's attention always gates its output"),
    "attention_dropout": (0.0, "gattn has no attention dropout"),
    "hidden_act": ("silu", GDN_ACT),
    "mlp_bias": (False, "gattn's SwiGLU has no biases"),
    "use_sliding_window": (False, "gattn has no sliding-window attention"),
    "decoder_sparse_step": (1, "transformers' Qwen3.5 ignores it: an MoE FFN in every layer"),
    "mlp_only_layers": ([], "transformers' Qwen3.5 ignores it: an MoE FFN in every layer"),
    "norm_topk_prob": (True, "Qwen3.5-MoE's router always renormalises its top-k; transformers ignores the field"),
}
QWEN3_5_ROPE_KEYS = ROPE_KEYS + ("mrope_section", "mrope_interleaved")
# Fields of a multimodal config.json beside text_config: the vision tower's (skipped with it).
OUTER = BOOKKEEPING + ("text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                       "vision_end_token_id", "language_model_only", "tie_word_embeddings")


def is_multimodal(hf: dict) -> bool:
    return "text_config" in hf or any(a in MULTIMODAL_ARCHITECTURES for a in hf.get("architectures") or [])


def text_config(hf: dict) -> tuple[dict, str]:
    """(the language model's config fields, how an error names them): a multimodal config's
    text_config with the outer tie_word_embeddings, or config.json itself. transformers'
    ConditionalGeneration model ties its head as the outer field says, whatever text_config says
    (its save_pretrained of a tied model writes true outside and the text config's default, false,
    inside), so gattn does too."""
    if not is_multimodal(hf):
        return hf, "config.json "
    strict(hf, OUTER, "config.json ", "Qwen3.5's multimodal config.json (beside text_config)")
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("config.json text_config", text, "the language model's config (an object)")
    return {**text, "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False))}, "config.json text_config."


def is_moe(hf: dict) -> bool:
    """Whether config.json describes Qwen3.5-MoE (by its architecture or model type)."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    names = list(hf.get("architectures") or []) + [hf.get("model_type"), text.get("model_type")]
    return any(n in ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe",
                     "qwen3_5_moe_text") for n in names)


def model_config(hf: dict, layout: str = "qwen3_5") -> ModelConfig:
    """The gattn model of a Qwen3.5 config.json (text or multimodal, dense or MoE): each field
    mapped, or known to change nothing on text, or refused (module docstring)."""
    text, where = text_config(hf)
    moe_model = is_moe(hf)
    defaults = MOE_DEFAULTS if moe_model else DENSE_DEFAULTS
    strict(text, tuple(defaults) + ROPE_FIELDS + TEXT_NO_EFFECT + tuple(FIXED) + ("layer_types",), where,
          f"{'Qwen3.5-MoE' if moe_model else 'Qwen3.5'}'s text config")
    fixed(text, FIXED, where)

    def get(key):
        return text[key] if text.get(key) is not None else defaults[key]

    spec = rope_spec(text, where, QWEN3_5_ROPE_KEYS)
    if spec.get("mrope_interleaved", True) is not True:
        raise ConfigError(f"{where}rope_parameters.mrope_interleaved", spec["mrope_interleaved"],
                          "True or absent (transformers' Qwen3.5 interleaves the multimodal RoPE)")
    section = spec.get("mrope_section", [11, 11, 10])
    if not _is_section(section):
        raise ConfigError(f"{where}rope_parameters.mrope_section", section, "3 integers >= 0 (temporal, "
                          "height, width)")
    base, yarn, partial = rope(text, 0.25, where)
    layers, head_dim = int(get("num_hidden_layers")), int(get("head_dim"))
    rope_dim = int(head_dim * partial)
    kinds = layer_kinds(text, layers, where)
    linear = None
    if "linear_attention" in kinds:
        linear = LinearAttentionSpec(
            num_k_heads=int(get("linear_num_key_heads")), num_v_heads=int(get("linear_num_value_heads")),
            head_k_dim=int(get("linear_key_head_dim")), head_v_dim=int(get("linear_value_head_dim")),
            conv_kernel=int(get("linear_conv_kernel_dim")))
    moe = None
    if moe_model:
        moe = MoESpec(num_experts=int(get("num_experts")), top_k=int(get("num_experts_per_tok")),
                      expert_width=int(get("moe_intermediate_size")), renormalize=True,
                      lbl_coef=float(get("router_aux_loss_coef")),
                      shared_expert_width=int(get("shared_expert_intermediate_size")))
        if moe.shared_expert_width < 1:
            raise ConfigError(f"{where}shared_expert_intermediate_size", moe.shared_expert_width,
                              "an integer >= 1 (Qwen3.5-MoE's MoE always runs its shared expert)")
    heads = int(get("num_attention_heads"))
    return ModelConfig(
        vocab_size=int(get("vocab_size")), d_model=int(get("hidden_size")), num_layers=layers, q_heads=heads,
        kv_heads=int(get("num_key_value_heads")), head_dim=head_dim,
        d_ff=moe.expert_width if moe else int(get("intermediate_size")),  # (unused beside an MoE)
        ffn_activation=ACTIVATIONS["silu"], tie_embeddings=bool(get("tie_word_embeddings")), rope_base=base,
        yarn=yarn, rope_dim=None if rope_dim == head_dim else rope_dim, qk_norm=True,
        attention_bias=bool(get("attention_bias")), norm_eps=float(get("rms_norm_eps")),
        gate=GateSpec(granularity="elementwise"), moe=moe, zero_centered_norm=True,
        layer_types=kinds if linear is not None else None, linear_attention=linear)


def mrope_section(rope_dim: int) -> list[int]:
    """A multimodal RoPE section for `rope_dim` rotating dims (rope_dim / 2 frequencies: temporal,
    height, width), Qwen3.5's [11, 11, 10] for its 64. gattn computes text positions, where every
    section gives plain RoPE, so the export writes this one for a gattn-native run (a converted
    folder's own section goes back as it was: `kept_fields`)."""
    n = rope_dim // 2
    return [n - math.ceil(n / 3) - n // 3, math.ceil(n / 3), n // 3]


def _is_section(section) -> bool:
    return isinstance(section, list) and len(section) == 3 and all(isinstance(n, int) and n >= 0 for n in section)


def kept_fields(hf: dict) -> dict:
    """What to-hf writes back as it was of a (checked) Qwen3.5 config.json: max_position_embeddings,
    and its mrope_section, which changes nothing on text."""
    text, where = text_config(hf)
    spec = rope_spec(text, where, QWEN3_5_ROPE_KEYS)
    return {**kept(text), **({"mrope_section": list(spec["mrope_section"])} if "mrope_section" in spec else {})}


def hf_config(cfg: ModelConfig, layout: str, max_len: int, kept_fields: dict) -> dict:
    """The config.json of gattn model `cfg` as a Qwen3.5 text model, from its Qwen3-Next one:
    Qwen3_5ForCausalLM, or Qwen3_5MoeForCausalLM with an MoE. The multimodal RoPE section is a
    converted folder's (`kept_fields`), else `mrope_section`'s."""
    next_config = qwen3_next.hf_config(cfg, "qwen3_next", max_len, kept_fields)
    section = kept_fields.get("mrope_section")
    dropped = {"decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "rope_theta", "rope_scaling",
               "partial_rotary_factor"} | ({"intermediate_size"} if cfg.moe is not None else {"num_experts"})
    out = {k: v for k, v in next_config.items() if k not in dropped}
    out.update(architectures=[TEXT_ARCHITECTURES[cfg.moe is not None]],
               model_type="qwen3_5_moe_text" if cfg.moe is not None else "qwen3_5_text")
    if cfg.layer_types is None:
        out["layer_types"] = ["full_attention"] * cfg.num_layers
    if not _is_section(section):
        section = mrope_section(cfg.rope_dim or cfg.head_dim)
    out["rope_parameters"] = {**out["rope_parameters"], "mrope_section": list(section), "mrope_interleaved": True}
    return out


def hf_shapes(cfg: ModelConfig, layout: str = "qwen3_5") -> dict[str, tuple[int, ...]]:
    return qwen3_next.shapes(cfg, GDN_PACKING)


def to_gattn(tensors, cfg: ModelConfig, layout: str = "qwen3_5"):
    return qwen3_next.tensors_to_gattn(tensors, cfg, PACKING, GDN_PACKING)


def from_gattn(params, cfg: ModelConfig, layout: str = "qwen3_5"):
    return qwen3_next.tensors_from_gattn(params, cfg, PACKING, GDN_PACKING)


def read_files(files, hf: dict, cfg: ModelConfig) -> None:
    """Sets up `files` (a files.TensorFiles) to read the language model as a text model: a
    multimodal folder's model.language_model.* as model.*, its vision tower dropped with one line;
    fused experts as per-expert tensors."""
    if is_multimodal(hf):
        vision = files.drop(VISION_PREFIX)
        if vision:
            name = next(iter(hf.get("architectures") or []), hf.get("model_type"))
            print(f"note: skipping the vision tower of {name} ({VISION_PREFIX}*, {len(vision)} tensors): gattn "
                  "converts the language model only", file=sys.stderr)
        files.rename(LM_PREFIX, "model.")
    if cfg.moe is not None:
        unfuse_experts(files, cfg.moe.num_experts, cfg.moe.expert_width, cfg.d_model)


def unfuse_experts(files, num_experts: int, width: int, d_model: int) -> None:
    """Reads each layer's experts stored fused, as Qwen3.5-MoE's released files store them
    (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]), under the
    per-expert names transformers' save_pretrained writes (`mlp.experts.{j}.gate_proj.weight`, ...).
    The names match any prefix (the MTP layer's too)."""
    for fused in [n for n in files.names() if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
        base = fused.rsplit(".", 1)[0]
        if fused.endswith("gate_up_proj"):
            parts = {f"{base}.{j}.{name}.weight": (j, rows) for j in range(num_experts)
                     for name, rows in (("gate_proj", slice(0, width)), ("up_proj", slice(width, None)))}
            files.derive(fused, (num_experts, 2 * width, d_model), parts)
        else:
            files.derive(fused, (num_experts, d_model, width), {f"{base}.{j}.down_proj.weight": j
                                                                 for j in range(num_experts)})
