"""Hugging Face config.json <-> gattn ModelConfig, whichever the family: which layout a config.json
is in, the gattn model it describes and the config.json of a gattn model (each family's module
reads and writes its own: gattn/interop/families.py), and the layout a gattn model is exported in,
chosen across the families. The layouts are described in gattn/interop/convert.py."""

from __future__ import annotations

from gattn.config import ConfigError, ModelConfig
from gattn.interop import families, release
from gattn.interop.families import LAYOUTS, family
from gattn.interop.fields import GDN_ACT

NATIVE = ("qwen3", "llama", "qwen3_next", "qwen3_moe", "qwen3_5")  # the layouts transformers loads as they are
NEXT_FAMILY = ("qwen3_next", "qwen3_5")  # Qwen3-Next's attention, norms, GDN layers and shared-expert MoE
RELEASE_CAVEAT = ("--layout release writes the paper's released layout, which transformers loads only with "
                  "the release's own modeling code (its modeling_qwen3.py, trust_remote_code=True), which "
                  "gattn does not ship")
ARCHITECTURES = {name: layout for f in families.FAMILIES for name, layout in f.ARCHITECTURES.items()}
MODEL_TYPES = {name: layout for f in families.FAMILIES for name, layout in f.MODEL_TYPES.items()}
RELEASE_FLAGS = release.FLAGS


def detect_layout(hf: dict) -> str:
    """The layout of a Hugging Face config.json (see gattn/interop/convert.py's docstring)."""
    if release.is_release(hf):
        return "release"  # the authors' files say model_type "qwen2" or "qwen3": the flags decide
    names = list(hf.get("architectures") or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not names and hf.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf["model_type"]]
    raise ConfigError("config.json architectures", names or hf.get("model_type"),
                      f"expected one of {', '.join(ARCHITECTURES)} (or the authors' release, whose "
                      f"config has {', '.join(RELEASE_FLAGS)})")


def text_fields(hf: dict) -> dict:
    """The language model's fields of a config.json: a multimodal Qwen3.5's text_config, else itself."""
    return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def model_config(hf: dict, layout: str) -> ModelConfig:
    """The gattn model of a Hugging Face config.json in `layout`; each family maps every field,
    knows it changes nothing, or refuses it in one line."""
    return family(layout).model_config(hf, layout)


def kept_fields(hf: dict, layout: str) -> dict:
    """The values of a (checked) config.json that change nothing gattn computes and that to-hf
    writes back as they were (from-hf keeps them in converted.json): max_position_embeddings, and
    Qwen3.5's mrope_section."""
    return family(layout).kept_fields(hf)


def hf_config(cfg: ModelConfig, layout: str, max_len: int, kept: dict | None = None) -> dict:
    """The Hugging Face config.json of gattn model `cfg` in `layout` (see `export_layout`).
    max_position_embeddings is the longest of `max_len` (the length the run was trained at) and
    the converted folder's (`kept`, from `kept_fields`), which also gives Qwen3.5's mrope_section
    back; a gattn-native run has the default section (qwen3_5.mrope_section)."""
    return family(layout).hf_config(cfg, layout, max_len, kept or {})


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
    if cfg.gate is not None and cfg.gate.granularity in ("elementwise", "headwise") and not cfg.qk_norm:
        ways.append("for a folder transformers loads as is, train the run with --config.model.qk_norm=true (the "
                    "tiny preset has no QK-norm; Qwen3-Next's attention, transformers' one with a G1 gate, "
                    "always normalises q and k) and export that run with --layout qwen3_next")
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
              ("qkv_bias", cfg.qkv_bias, not cfg.qkv_bias,
               "False to export to Hugging Face: no layout gattn writes has biases on q, k and v alone "
               "(Qwen2.5's attention); the layouts' attention biases (attention_bias, the release's qkv_bias) "
               "are model.attention_bias's, on q, k, v and o"),
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
