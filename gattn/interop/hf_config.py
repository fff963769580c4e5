"""Hugging Face config.json <-> gattn ModelConfig, both ways: which layout a config.json is in,
the gattn model it describes (refusing what gattn cannot represent), the config.json of a gattn
model, and the layout a gattn model is exported in. The layouts are described in
gattn/interop/convert.py; Qwen3.5's config is gattn/interop/qwen3_5.py."""

from __future__ import annotations

from gattn.config import ConfigError, GateSpec, LinearAttentionSpec, ModelConfig, MoESpec, YarnSpec
from gattn.interop import qwen3_5
from gattn.interop.fields import (BOOKKEEPING, GDN_ACT, ROPE_FIELDS, check_gdn_act, fixed, known, layer_kinds,
                                  rope_spec)

LAYOUTS = ("qwen3", "llama", "release", "qwen3_next", "qwen3_moe", "qwen3_5")
NATIVE = ("qwen3", "llama", "qwen3_next", "qwen3_moe", "qwen3_5")  # the layouts transformers loads as they are
NEXT_FAMILY = ("qwen3_next", "qwen3_5")  # Qwen3-Next's attention, norms, GDN layers and shared-expert MoE
RELEASE_CAVEAT = ("--layout release writes the paper's released layout, which transformers loads only with "
                  "the release's own modeling code (its modeling_qwen3.py, trust_remote_code=True), which "
                  "gattn does not ship")
ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama", "Qwen3NextForCausalLM": "qwen3_next",
                 "Qwen3MoeForCausalLM": "qwen3_moe",
                 **{name: "qwen3_5" for name in qwen3_5.TEXT_ARCHITECTURES + qwen3_5.MULTIMODAL_ARCHITECTURES}}
RELEASE_FLAGS = ("headwise_attn_output_gate", "elementwise_attn_output_gate", "use_qk_norm", "qkv_bias")
# Hugging Face hidden_act -> gattn ffn_activation (jax.nn.gelu is the tanh approximation).
ACTIVATIONS = {"silu": "silu", "relu": "relu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}
EXPORT_ACTIVATIONS = {"silu": "silu", "relu": "relu", "gelu": "gelu_pytorch_tanh"}
# Qwen3-Next's config.json (transformers' Qwen3NextConfig), read as strictly as Qwen3.5's: the fields
# mapped, those that change nothing on text, and those with one value gattn computes.
NEXT_MAPPED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
               "tie_word_embeddings", "attention_bias", "layer_types", "full_attention_interval",
               "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
               "linear_num_value_heads", "decoder_sparse_step", "mlp_only_layers", "num_experts",
               "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
               "router_aux_loss_coef")
NEXT_NO_EFFECT = BOOKKEEPING + (
    "output_router_logits", "mamba_ssm_dtype",
    "sliding_window", "max_window_layers",  # (read only with use_sliding_window, which must be false)
    "num_nextn_predict_layers", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")  # (gattn/interop/mtp.py)
NEXT_FIXED = {"attention_dropout": (0.0, "gattn has no attention dropout"),
              "mlp_bias": (False, "gattn's SwiGLU has no biases"),
              "use_sliding_window": (False, "gattn has no sliding-window attention")}


def detect_layout(hf: dict) -> str:
    """The layout of a Hugging Face config.json (see gattn/interop/convert.py's docstring)."""
    if any(flag in hf for flag in RELEASE_FLAGS):
        return "release"  # the authors' files say model_type "qwen2" or "qwen3": the flags decide
    names = list(hf.get("architectures") or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    by_type = {"qwen3": "qwen3", "llama": "llama", "qwen3_next": "qwen3_next", "qwen3_moe": "qwen3_moe",
               **{name: "qwen3_5" for name in qwen3_5.MODEL_TYPES}}
    if not names and hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    raise ConfigError("config.json architectures", names or hf.get("model_type"),
                      f"expected one of {', '.join(ARCHITECTURES)} (or the authors' release, whose "
                      f"config has {', '.join(RELEASE_FLAGS)})")


def _field(hf: dict, key: str, default=None):
    if key not in hf and default is None:
        raise ConfigError(f"config.json {key}", None, "a required field is missing")
    return hf.get(key, default)


def _rope(hf: dict, default_partial: float) -> tuple[float, YarnSpec | None, float]:
    """(base, yarn, partial rotary factor) as transformers 5 reads them: v4's rope_scaling, when
    present, replaces rope_parameters whole; rope_theta and partial_rotary_factor at the top
    level fill what the dict lacks; a top-level original_max_position_embeddings wins."""
    spec = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if isinstance(spec.get("full_attention"), dict):  # nested per layer type (only full attention here)
        spec = dict(spec["full_attention"])
    if any(isinstance(v, dict) for v in spec.values()):
        raise ConfigError("config.json rope_parameters", sorted(spec), "one dict, or one per layer type "
                          "with only 'full_attention'")
    base = spec.get("rope_theta", hf.get("rope_theta", 10_000.0))
    partial = spec.get("partial_rotary_factor", hf.get("partial_rotary_factor", default_partial))
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind == "default":
        return float(base), None, float(partial)
    if kind != "yarn":
        raise ConfigError("config.json rope_type", kind, "expected 'default' or 'yarn'")
    for unsupported in ("mscale", "mscale_all_dim"):
        if spec.get(unsupported):
            raise ConfigError(f"config.json rope_scaling.{unsupported}", spec[unsupported],
                              "not supported (plain YaRN only)")
    if spec.get("truncate") is False:
        raise ConfigError("config.json rope_scaling.truncate", False, "gattn's YaRN truncates (True)")
    original = (hf.get("original_max_position_embeddings") or spec.get("original_max_position_embeddings")
                or hf.get("max_position_embeddings"))
    factor = spec.get("factor") or _field(hf, "max_position_embeddings") / original
    yarn = YarnSpec(factor=float(factor), original_len=int(original),
                    beta_fast=float(spec.get("beta_fast") or 32), beta_slow=float(spec.get("beta_slow") or 1),
                    attention_factor=spec.get("attention_factor"))
    return float(base), yarn, float(partial)


def text_fields(hf: dict) -> dict:
    """The language model's fields of a config.json: a multimodal Qwen3.5's text_config, else itself."""
    return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def model_config(hf: dict, layout: str) -> ModelConfig:
    """The gattn model of a Hugging Face config.json in `layout`; fields gattn cannot represent
    (sliding windows, linear-attention or MoE layers, exact GELU, MLP biases) are refused."""
    if layout == "qwen3_5":
        return qwen3_5.model_config(hf)
    if layout == "qwen3_next":
        known(hf, NEXT_MAPPED + NEXT_NO_EFFECT + ROPE_FIELDS + tuple(NEXT_FIXED), "config.json ",
              "Qwen3-Next's config")
        fixed(hf, NEXT_FIXED, "config.json ")
        rope_spec(hf, "config.json ")
    d, heads = int(_field(hf, "hidden_size")), int(_field(hf, "num_attention_heads"))
    layers = int(_field(hf, "num_hidden_layers"))
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
        raise ConfigError("config.json use_sliding_window", True, "gattn has no sliding-window attention")
    if hf.get("mlp_bias"):
        raise ConfigError("config.json mlp_bias", True, "gattn's SwiGLU has no biases")
    act = hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ConfigError("config.json hidden_act", act, f"expected one of {', '.join(ACTIVATIONS)}")
    # transformers' defaults when config.json has no head_dim (the release's config: 128 too).
    default_head_dim = {"qwen3": 128, "release": 128, "qwen3_next": 256}.get(layout, d // heads)  # (qwen3_moe: d // heads)
    head_dim = int(hf.get("head_dim") or default_head_dim)
    base, yarn, partial = _rope(hf, 0.25 if layout == "qwen3_next" else 1.0)  # (Qwen3NextConfig's default)
    rope_dim = None if partial == 1.0 else int(head_dim * partial)
    if rope_dim is not None and layout != "qwen3_next":
        raise ConfigError("config.json partial_rotary_factor", partial, f"1.0 for layout {layout}")
    gate, qk_norm, bias = None, layout in ("qwen3", "qwen3_next", "qwen3_moe"), bool(hf.get("attention_bias", False))
    if layout == "release":
        qk_norm, bias = bool(hf.get("use_qk_norm", False)), bool(hf.get("qkv_bias", False))
        if hf.get("headwise_attn_output_gate") and hf.get("elementwise_attn_output_gate"):
            raise ConfigError("config.json headwise_attn_output_gate", True,
                              "at most one of headwise / elementwise_attn_output_gate")
        if hf.get("headwise_attn_output_gate"):
            gate = GateSpec(granularity="headwise")
        elif hf.get("elementwise_attn_output_gate"):
            gate = GateSpec(granularity="elementwise")
    layer_types, linear, moe = None, None, None
    if layout == "qwen3_next":
        gate = GateSpec(granularity="elementwise")
        layer_types, linear, moe = _qwen3_next(hf, layers, act)
    if layout == "qwen3_moe":
        moe = _moe(hf, layers)
    return ModelConfig(
        vocab_size=int(_field(hf, "vocab_size")), d_model=d, num_layers=layers, q_heads=heads,
        kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=head_dim,
        d_ff=int(_field(hf, "intermediate_size")), ffn_activation=ACTIVATIONS[act],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_base=base, yarn=yarn,
        rope_dim=rope_dim, qk_norm=qk_norm, attention_bias=bias, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        gate=gate, moe=moe, zero_centered_norm=layout == "qwen3_next", layer_types=layer_types,
        linear_attention=linear)


def _qwen3_next(hf: dict, layers: int, act: str) -> tuple[tuple[str, ...] | None, LinearAttentionSpec | None,
                                                         MoESpec | None]:
    """(layer_types, linear_attention, moe) of a Qwen3-Next config.json, with Qwen3NextConfig's
    defaults for absent fields (the 3:1 pattern from full_attention_interval, 512 experts): MoE
    layers with a shared expert everywhere or nowhere (gattn has no dense layers between MoE
    layers); Gated DeltaNet layers only with hidden_act `act` SiLU (their conv's)."""
    kinds = layer_kinds(hf, layers, "config.json ")
    check_gdn_act(act, kinds, "config.json ")
    linear = None
    if "linear_attention" in kinds:
        linear = LinearAttentionSpec(
            num_k_heads=int(hf.get("linear_num_key_heads", 16)), num_v_heads=int(hf.get("linear_num_value_heads", 32)),
            head_k_dim=int(hf.get("linear_key_head_dim", 128)), head_v_dim=int(hf.get("linear_value_head_dim", 128)),
            conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)))
    experts, step = int(hf.get("num_experts", 512)), int(hf.get("decoder_sparse_step", 1))
    dense_only = set(hf.get("mlp_only_layers") or [])
    sparse = [i for i in range(layers) if i not in dense_only and experts > 0 and (i + 1) % step == 0]
    moe = None
    if sparse and len(sparse) != layers:
        raise ConfigError("config.json mlp_only_layers", sorted(dense_only), f"all layers or none (layers {sparse} "
                          "would be MoE and the others dense; gattn's MoE models have an MoE FFN in every layer)")
    if sparse:
        shared = int(hf.get("shared_expert_intermediate_size", 512))
        if shared < 1:
            raise ConfigError("config.json shared_expert_intermediate_size", shared, "an integer >= 1 (Qwen3-Next's "
                              "MoE always runs its shared expert)")
        moe = MoESpec(num_experts=experts, top_k=int(hf.get("num_experts_per_tok", 10)),
                      expert_width=int(hf.get("moe_intermediate_size", 512)),
                      renormalize=bool(hf.get("norm_topk_prob", True)),
                      lbl_coef=float(hf.get("router_aux_loss_coef", 1e-3)), shared_expert_width=shared)
    return (kinds if linear is not None else None), linear, moe


def _moe(hf: dict, layers: int) -> MoESpec:
    """The MoE of a Qwen3-MoE config.json: every layer sparse (gattn has no dense layers between
    MoE layers), softmax top-k routing, renormalised as norm_topk_prob says (transformers' default:
    not), dropless as transformers computes it."""
    dense = sorted(set(hf.get("mlp_only_layers") or []))
    if dense:
        raise ConfigError("config.json mlp_only_layers", dense, "[] (gattn's MoE models have an MoE FFN in every "
                          "layer, and no dense layers between)")
    if int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ConfigError("config.json decoder_sparse_step", hf["decoder_sparse_step"], "1 (an MoE FFN in every layer)")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise ConfigError("config.json num_experts", None, "a required field is missing")
    return MoESpec(num_experts=int(experts), top_k=int(hf.get("num_experts_per_tok", 8)),
                   expert_width=int(_field(hf, "moe_intermediate_size")), renormalize=bool(hf.get("norm_topk_prob", False)),
                   lbl_coef=float(hf.get("router_aux_loss_coef", 1e-3)))


def kept_fields(hf: dict, layout: str) -> dict:
    """The values of a (checked) config.json that change nothing gattn computes and that to-hf
    writes back as they were (from-hf keeps them in converted.json): max_position_embeddings, and
    Qwen3.5's mrope_section."""
    text = text_fields(hf)
    kept = {} if text.get("max_position_embeddings") is None else \
        {"max_position_embeddings": int(text["max_position_embeddings"])}
    return {**kept, **(qwen3_5.kept_fields(hf) if layout == "qwen3_5" else {})}


def hf_config(cfg: ModelConfig, layout: str, max_len: int, kept: dict | None = None) -> dict:
    """The Hugging Face config.json of gattn model `cfg` in `layout` (see `export_layout`).
    max_position_embeddings is the longest of `max_len` (the length the run was trained at) and
    the converted folder's (`kept`, from `kept_fields`), which also gives Qwen3.5's mrope_section
    back; a gattn-native run has the default section (qwen3_5.mrope_section)."""
    kept = kept or {}
    if layout == "qwen3_5":
        return qwen3_5.hf_config(cfg, hf_config(cfg, "qwen3_next", max_len, kept), kept.get("mrope_section"))
    max_len = max(max_len, int(kept.get("max_position_embeddings") or 0))
    rope = {"rope_theta": cfg.rope_base, "rope_type": "default"}
    if cfg.yarn is not None:
        y = cfg.yarn
        rope.update(rope_type="yarn", factor=y.factor, original_max_position_embeddings=y.original_len,
                    beta_fast=y.beta_fast, beta_slow=y.beta_slow)
        if y.attention_factor is not None:
            rope["attention_factor"] = y.attention_factor
    if cfg.rope_dim is not None or layout == "qwen3_next":  # (Qwen3-Next's default is 0.25)
        rope["partial_rotary_factor"] = (cfg.rope_dim or cfg.head_dim) / cfg.head_dim
    out = {
        "architectures": [{v: k for k, v in ARCHITECTURES.items()}.get(layout, "Qwen3ForCausalLM")],
        "model_type": {"llama": "llama", "qwen3_next": "qwen3_next", "qwen3_moe": "qwen3_moe"}.get(layout, "qwen3"),
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_width,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.q_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": EXPORT_ACTIVATIONS[cfg.ffn_activation],
        "max_position_embeddings": max_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0, "use_cache": True, "torch_dtype": "float32",
        # v5 reads rope_parameters; v4 reads rope_theta / rope_scaling / partial_rotary_factor.
        "rope_parameters": rope, "rope_theta": cfg.rope_base,
        "rope_scaling": None if cfg.yarn is None else {k: v for k, v in rope.items() if k != "rope_theta"},
    }
    if "partial_rotary_factor" in rope:
        out["partial_rotary_factor"] = rope["partial_rotary_factor"]
    if layout == "qwen3_moe":
        m = cfg.moe
        out.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.expert_width,
                   norm_topk_prob=m.renormalize, decoder_sparse_step=1, mlp_only_layers=[],
                   router_aux_loss_coef=m.lbl_coef, output_router_logits=False, intermediate_size=cfg.d_ff)
    if layout in ("qwen3", "release", "qwen3_moe"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers,
                   layer_types=["full_attention"] * cfg.num_layers)
    if layout == "llama":
        out["mlp_bias"] = False
    if layout == "release":
        # Loads with the authors' modeling_qwen3.py / configuration_qwen3.py next to it
        # (trust_remote_code). A model type transformers does not know keeps its own Qwen3 code
        # from loading these weights without their gate, biases or norms.
        out.update(model_type="qwen3_gated_attention",
                   auto_map={"AutoConfig": "configuration_qwen3.Qwen3Config",
                             "AutoModelForCausalLM": "modeling_qwen3.Qwen3ForCausalLM"})
        out.update(headwise_attn_output_gate=cfg.gate is not None and cfg.gate.granularity == "headwise",
                   elementwise_attn_output_gate=cfg.gate is not None and cfg.gate.granularity == "elementwise",
                   use_qk_norm=cfg.qk_norm, qkv_bias=cfg.attention_bias, attention_bias=False)
    if layout == "qwen3_next":
        out.update(layer_types=[cfg.layer_type(i) for i in range(cfg.num_layers)], decoder_sparse_step=1)
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


def native_layout(cfg: ModelConfig) -> str | None:
    """The layout transformers loads as is that holds gattn model `cfg` unchanged (what
    `--layout auto` picks), or None: a headwise gate, an elementwise gate without QK-norm, or
    partial rotary embeddings without an elementwise gate and QK-norm."""
    g, full_rope = cfg.gate, cfg.rope_dim in (None, cfg.head_dim)
    if _next_only(cfg):
        return "qwen3_next" if g is not None and g.granularity == "elementwise" and cfg.qk_norm else None
    if cfg.moe is not None:
        return "qwen3_moe" if g is None and cfg.qk_norm and full_rope else None
    if g is not None and g.granularity == "elementwise" and cfg.qk_norm:
        return "qwen3_next"
    if g is None and full_rope:
        return "qwen3" if cfg.qk_norm else "llama"
    return None


def _next_only(cfg: ModelConfig) -> str | None:
    """What only the qwen3_next layout holds in `cfg` (Gated DeltaNet layers, a shared expert), or None."""
    if cfg.hybrid:
        return "Gated DeltaNet layers (model.layer_types)"
    if cfg.moe is not None and cfg.moe.shared_expert_width:
        return "a shared expert (model.moe.shared_expert_width)"
    return None


def _why_not_native(cfg: ModelConfig) -> str:
    g = cfg.gate
    if _next_only(cfg):
        return (f"only qwen3_next holds {_next_only(cfg)}, and it needs an elementwise G1 gate and "
                "model.qk_norm=True (Qwen3-Next's attention)")
    if cfg.moe is not None:
        return ("qwen3_moe, the one MoE layout, has no attention gate" if g is not None else
                "qwen3_moe needs model.qk_norm=True and full rotary embeddings (Qwen3-MoE's attention)")
    if g is not None and g.granularity == "headwise":
        return "qwen3_next holds an elementwise gate; this run's is headwise"
    if g is not None:
        return "qwen3_next needs model.qk_norm=True (Qwen3-Next normalises q and k); this run has no QK-norm"
    return "of them only qwen3_next, which holds a G1 gate, has partial rotary embeddings (model.rope_dim)"


def _instead(cfg: ModelConfig) -> str:
    """What the user can write instead, for a refusal: the native layout, else the ways out."""
    native = native_layout(cfg)
    if native is not None:
        return f"--layout {native} (what auto picks) holds this run"
    if cfg.moe is not None and not _next_only(cfg):
        return ("no Hugging Face layout holds this MoE run: Qwen3-MoE's has no attention gate, and Qwen3-Next's, "
                "which has one, pairs its MoE with a shared expert that this run lacks "
                "(model.moe.shared_expert_width = 0)") if cfg.gate is not None \
            else "no Hugging Face layout holds it (train it with model.qk_norm=True to export as qwen3_moe)"
    ways = []
    if cfg.gate is not None and cfg.gate.granularity == "headwise" and cfg.qk_norm:
        ways.append("--layout qwen3_next writes it loadable as is, with each head's gate repeated over its "
                    "head_dim rows (the same logits; from-hf reads it back as an elementwise gate)")
    if cfg.rope_dim in (None, cfg.head_dim) and cfg.moe is None and not cfg.hybrid:
        ways.append(RELEASE_CAVEAT)
    return "; or ".join(ways) if ways else "no Hugging Face layout holds this run"


def export_layout(cfg: ModelConfig, layout: str = "auto", source: str | None = None) -> str:
    """The Hugging Face layout gattn model `cfg` is written in. auto: the layout transformers
    loads as is that holds the model unchanged (`native_layout`), and a refusal that names the
    explicit ways out where there is none (`--layout release` never comes silently: transformers
    cannot load it without the release's code); a run converted from Qwen3.5 (`source`, the
    layout it was read in) goes back to Qwen3.5, which holds what qwen3_next holds but for an MoE
    router that does not renormalise. Models no layout holds are refused, naming the field."""
    g = cfg.gate
    checks = [("sdpa_nonlinearity", cfg.sdpa_nonlinearity, cfg.sdpa_nonlinearity == "none",
               "'none' to export to Hugging Face (no layout transforms the SDPA output but by a G1 gate)"),
              ("switch_heads", cfg.switch_heads, cfg.switch_heads is None,
               "None to export to Hugging Face (no layout has switch-head attention)"),

              ("sandwich_norm", cfg.sandwich_norm, not cfg.sandwich_norm,
               "False to export to Hugging Face (no layout normalises the attention and FFN outputs)"),
              ("output_clip", cfg.output_clip, cfg.output_clip is None,
               "None to export to Hugging Face (no layout clips the branch outputs)"),
              ("gate", g, g is None or (g.fusable and g.granularity in ("elementwise", "headwise")),
               "None or a head-specific, input-dependent sigmoid gate on the SDPA output (G1: the "
               "sdpa_elementwise and sdpa_headwise variants) to export to Hugging Face")]
    for name, value, ok, allowed in checks:
        if not ok:
            raise ConfigError(f"model.{name}", value, allowed)
    if layout == "auto":
        if native_layout(cfg) is None:
            raise ConfigError("--layout", "auto", "auto picks only a layout transformers loads as is "
                              f"({', '.join(NATIVE)}), and none holds this run unchanged ({_why_not_native(cfg)}): "
                              f"{_instead(cfg)}")
        layout = native_layout(cfg)
        if layout == "qwen3_next" and source == "qwen3_5" and (cfg.moe is None or cfg.moe.renormalize):
            layout = "qwen3_5"
    if layout not in LAYOUTS:
        raise ConfigError("--layout", layout, f"expected auto or one of {', '.join(LAYOUTS)}")
    if cfg.ffn_activation != "silu" and (layout == "qwen3_5" or (layout == "qwen3_next" and cfg.hybrid)):
        instead = ("no Hugging Face layout holds this run" if cfg.hybrid else
                   "from-hf reads Qwen3.5 with hidden_act 'silu' only; --layout qwen3_next holds this run")
        raise ConfigError("model.ffn_activation", cfg.ffn_activation, f"'silu' for layout {layout}"
                          f"{' with Gated DeltaNet layers' if cfg.hybrid else ''}: its one hidden_act is the FFN's "
                          f"activation and the conv's ({GDN_ACT}); {instead}")
    if _next_only(cfg) and layout not in NEXT_FAMILY:
        field = "model.layer_types" if cfg.hybrid else "model.moe.shared_expert_width"
        raise ConfigError(field, cfg.layer_types if cfg.hybrid else cfg.moe.shared_expert_width,
                          f"layout {layout} has no {_next_only(cfg)}: only qwen3_next and qwen3_5 do; {_instead(cfg)}")
    moe_ok = {"qwen3_moe": cfg.moe is not None, "qwen3_next": True, "qwen3_5": True}.get(layout, cfg.moe is None)
    if not moe_ok or (layout == "qwen3_moe" and cfg.moe.shared_expert_width):
        raise ConfigError("model.moe", cfg.moe, (f"None for layout {layout} (a dense FFN); " if cfg.moe is not None
                                                  else "an MoE for layout qwen3_moe; ") + _instead(cfg))
    if layout in NEXT_FAMILY and cfg.moe is not None and not cfg.moe.shared_expert_width:
        raise ConfigError("model.moe.shared_expert_width", 0, f"> 0 for layout {layout} (its MoE always runs a "
                          f"shared expert); {_instead(cfg)}")
    if layout == "qwen3_5" and cfg.moe is not None and not cfg.moe.renormalize:
        raise ConfigError("model.moe.renormalize", False, "True for layout qwen3_5 (Qwen3.5-MoE's router always "
                          "renormalises its top-k); --layout qwen3_next (norm_topk_prob false) holds this run")
    holds_gate = {"qwen3": g is None, "llama": g is None, "qwen3_next": g is not None, "release": True,
                  "qwen3_moe": g is None, "qwen3_5": g is not None}[layout]
    if not holds_gate:
        what = "no gate" if layout in ("qwen3", "llama", "qwen3_moe") else "a G1 gate (elementwise, or headwise repeated)"
        raise ConfigError("model.gate", g, f"layout {layout} holds {what}; {_instead(cfg)}")
    qk = {"qwen3": (True, "Qwen3 normalises q and k"), "llama": (False, "Llama has no QK-norm"),
          "qwen3_next": (True, "Qwen3-Next normalises q and k"), "qwen3_5": (True, "Qwen3.5 normalises q and k"),
          "qwen3_moe": (True, "Qwen3-MoE normalises q and k")}.get(layout)
    if qk is not None and cfg.qk_norm != qk[0]:
        raise ConfigError("model.qk_norm", cfg.qk_norm, f"{qk[0]} for layout {layout} ({qk[1]}); {_instead(cfg)}")
    if cfg.rope_dim not in (None, cfg.head_dim) and layout not in NEXT_FAMILY:
        raise ConfigError("model.rope_dim", cfg.rope_dim, f"None (all of head_dim) for layout {layout}: of the "
                          "layouts only qwen3_next and qwen3_5 (a G1 gate with QK-norm) have partial rotary embeddings")
    if cfg.rope_dim is not None and int(cfg.head_dim * (cfg.rope_dim / cfg.head_dim)) != cfg.rope_dim:
        raise ConfigError("model.rope_dim", cfg.rope_dim, f"a value transformers recovers from "
                          f"partial_rotary_factor = rope_dim / head_dim ({cfg.head_dim}) without rounding")
    return layout
