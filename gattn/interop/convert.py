"""Hugging Face checkpoints <-> gattn runs, with numerical parity.

    python -m gattn.convert from-hf SRC_DIR --workdir DIR
    python -m gattn.convert to-hf WORKDIR --out DIR [--step N] [--layout auto|qwen3|llama|qwen3_next|release]

`from-hf` reads a local Hugging Face model folder (config.json, safetensors shards or
pytorch_model.bin files, tokenizer.json; nothing is downloaded) and writes a gattn run directory
that eval.py restores and `train.py --init-from` continues: config.json, an Orbax checkpoint of
the parameters (step 0) and the tokenizer under tokenizer/hf/. `to-hf` writes the reverse.

Layouts (all Linear weights are [out, in]; gattn stores [in, out], so each is transposed):

    qwen3        Qwen3ForCausalLM: QK-norm, no gate.
    llama        LlamaForCausalLM: no QK-norm, no gate.
    release      the paper's released models (Qwen3 modeling code with headwise_attn_output_gate /
                 elementwise_attn_output_gate, use_qk_norm, qkv_bias). The gate is packed into a
                 widened q_proj, per kv group g: rows [queries of the group's G heads | their gates],
                 G gates per group (headwise) or G * head_dim (elementwise).
    qwen3_next   Qwen3NextForCausalLM with full-attention layers and dense MLPs only. q_proj rows per
                 head: [query | gate] (elementwise). Every RMSNorm scales by (1 + w) with w
                 zero-initialised: gattn stores 1 + w. Partial rotary embedding (rope_dim).

gattn's GQA grouping (query head h reads kv head h // G) and its rotate-half RoPE are Hugging
Face's, so no head is permuted. Biases (attention_bias / qkv_bias) split as the weights do.
Everything is checked before anything is written: a missing shard, an absent, unexpected or
misshapen tensor, or a config field gattn cannot represent is refused with its name.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np

from gattn.config import Config, ConfigError, GateSpec, ModelConfig, TrainConfig, YarnSpec

LAYOUTS = ("qwen3", "llama", "release", "qwen3_next")
ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama", "Qwen3NextForCausalLM": "qwen3_next"}
RELEASE_FLAGS = ("headwise_attn_output_gate", "elementwise_attn_output_gate", "use_qk_norm", "qkv_bias")
# Hugging Face hidden_act -> gattn ffn_activation (jax.nn.gelu is the tanh approximation).
ACTIVATIONS = {"silu": "silu", "relu": "relu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}
EXPORT_ACTIVATIONS = {"silu": "silu", "relu": "relu", "gelu": "gelu_pytorch_tanh"}
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exports carry


class ConversionError(ValueError):
    """A Hugging Face folder or a gattn run that cannot be converted; names the file, tensor or field."""


def read_json(path: Path, text: str | bytes | None = None) -> dict:
    """The JSON object in file `path` (or in `text`, read from it): anything else is one line
    naming the file and where the JSON breaks."""
    try:
        data = json.loads(path.read_bytes() if text is None else text)
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON (not UTF-8 at byte offset {e.start})") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object, not a {type(data).__name__}")
    return data


# --------------------------------------------------------------------------- tensors on disk


class TensorFiles:
    """The tensors of a model folder: safetensors (one file or an index of shards) or
    pytorch_model.bin files (read with torch, if installed). Nothing is read until `get`."""

    def __init__(self, src: Path):
        self.src, self.where = src, {}
        index = next((src / n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                      if (src / n).is_file()), None)
        if index is not None:
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
        else:
            single = next((n for n in ("model.safetensors", "pytorch_model.bin") if (src / n).is_file()), None)
            if single is None:
                raise ConversionError(f"{src}: no model.safetensors, pytorch_model.bin or index of shards")
            weight_map = {name: single for name in self._names(src / single)}
        for name, shard in weight_map.items():
            if not (src / shard).is_file():
                raise ConversionError(f"shard {shard} (holding tensor {name}) is missing from {src}")
        self.where = weight_map
        self._open = {}

    @staticmethod
    def _names(path: Path) -> list[str]:
        if path.suffix == ".safetensors":
            from safetensors import safe_open  # noqa: PLC0415

            with safe_open(path, framework="flax") as f:
                return list(f.keys())
        return list(_torch_load(path))

    def _file(self, shard: str):
        if shard not in self._open:
            path = self.src / shard
            if path.suffix == ".safetensors":
                from safetensors import safe_open  # noqa: PLC0415

                self._open[shard] = safe_open(path, framework="flax")
            else:
                self._open[shard] = _torch_load(path)
        return self._open[shard]

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> np.ndarray:
        """The tensor in float32 (bf16 and fp16 widen exactly)."""
        f = self._file(self.where[name])
        if isinstance(f, dict):
            return f[name].float().numpy()
        return np.asarray(f.get_tensor(name), dtype=np.float32)


def _torch_load(path: Path) -> dict:
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise ConversionError(f"{path} is a PyTorch pickle: install torch to read it, or save the model "
                              "with safetensors (save_pretrained(..., safe_serialization=True))") from None
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


# --------------------------------------------------------------------------- configs


def detect_layout(hf: dict) -> str:
    """The layout of a Hugging Face config.json (see the module docstring)."""
    if any(flag in hf for flag in RELEASE_FLAGS):
        return "release"  # the authors' files say model_type "qwen2" or "qwen3": the flags decide
    names = list(hf.get("architectures") or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    by_type = {"qwen3": "qwen3", "llama": "llama", "qwen3_next": "qwen3_next"}
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


def model_config(hf: dict, layout: str) -> ModelConfig:
    """The gattn model of a Hugging Face config.json in `layout`; fields gattn cannot represent
    (sliding windows, linear-attention or MoE layers, exact GELU, MLP biases) are refused."""
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
    default_head_dim = {"qwen3": 128, "release": 128, "qwen3_next": 256}.get(layout, d // heads)
    head_dim = int(hf.get("head_dim") or default_head_dim)
    base, yarn, partial = _rope(hf, 0.25 if layout == "qwen3_next" else 1.0)  # (Qwen3NextConfig's default)
    rope_dim = None if partial == 1.0 else int(head_dim * partial)
    if rope_dim is not None and layout != "qwen3_next":
        raise ConfigError("config.json partial_rotary_factor", partial, f"1.0 for layout {layout}")
    gate, qk_norm, bias = None, layout in ("qwen3", "qwen3_next"), bool(hf.get("attention_bias", False))
    if layout == "release":
        qk_norm, bias = bool(hf.get("use_qk_norm", False)), bool(hf.get("qkv_bias", False))
        if hf.get("headwise_attn_output_gate") and hf.get("elementwise_attn_output_gate"):
            raise ConfigError("config.json headwise_attn_output_gate", True,
                              "at most one of headwise / elementwise_attn_output_gate")
        if hf.get("headwise_attn_output_gate"):
            gate = GateSpec(granularity="headwise")
        elif hf.get("elementwise_attn_output_gate"):
            gate = GateSpec(granularity="elementwise")
    if layout == "qwen3_next":
        gate = GateSpec(granularity="elementwise")
        kinds = hf.get("layer_types") or []
        if any(k != "full_attention" for k in kinds):
            raise ConfigError("config.json layer_types", sorted(set(kinds)),
                              "only 'full_attention' layers (gattn has no linear attention)")
        sparse = [i for i in range(layers) if i not in (hf.get("mlp_only_layers") or [])
                  and hf.get("num_experts", 0) > 0 and (i + 1) % hf.get("decoder_sparse_step", 1) == 0]
        if sparse:
            raise ConfigError("config.json num_experts", hf.get("num_experts"),
                              f"dense MLPs only (layers {sparse} would be MoE): set mlp_only_layers to all")
    return ModelConfig(
        vocab_size=int(_field(hf, "vocab_size")), d_model=d, num_layers=layers, q_heads=heads,
        kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=head_dim,
        d_ff=int(_field(hf, "intermediate_size")), ffn_activation=ACTIVATIONS[act],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_base=base, yarn=yarn,
        rope_dim=rope_dim, qk_norm=qk_norm, attention_bias=bias, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        gate=gate)


def hf_config(cfg: ModelConfig, layout: str, max_len: int) -> dict:
    """The Hugging Face config.json of gattn model `cfg` in `layout` (see `export_layout`)."""
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
        "model_type": {"llama": "llama", "qwen3_next": "qwen3_next"}.get(layout, "qwen3"),
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
    if layout in ("qwen3", "release"):
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
        out.update(layer_types=["full_attention"] * cfg.num_layers, mlp_only_layers=list(range(cfg.num_layers)),
                   num_experts=0, decoder_sparse_step=1)
    return out


def export_layout(cfg: ModelConfig, layout: str = "auto") -> str:
    """The Hugging Face layout gattn model `cfg` is written in. auto: a layout transformers loads
    natively where one exists (qwen3 / llama without a gate, qwen3_next for an elementwise gate
    with QK-norm), else the authors' release layout. Models no layout holds are refused, naming
    the field."""
    g = cfg.gate
    checks = [("sdpa_nonlinearity", cfg.sdpa_nonlinearity, cfg.sdpa_nonlinearity == "none", "'none'"),
              ("switch_heads", cfg.switch_heads, cfg.switch_heads is None, "None"),
              ("moe", cfg.moe, cfg.moe is None, "None (MoE checkpoints are not converted yet)"),
              ("sandwich_norm", cfg.sandwich_norm, not cfg.sandwich_norm, "False"),
              ("output_clip", cfg.output_clip, cfg.output_clip is None, "None"),
              ("gate", g, g is None or (g.fusable and g.granularity in ("elementwise", "headwise")),
               "None or a head-specific, input-dependent sigmoid gate on the SDPA output (G1)")]
    for name, value, ok, allowed in checks:
        if not ok:
            raise ConfigError(f"model.{name}", value, f"{allowed} to export to Hugging Face")
    if layout == "auto":
        if g is None:
            layout = "qwen3" if cfg.qk_norm else "llama"
        elif g.granularity == "elementwise" and cfg.qk_norm:
            layout = "qwen3_next"
        else:
            layout = "release"
    if layout not in LAYOUTS:
        raise ConfigError("--layout", layout, f"expected auto or one of {', '.join(LAYOUTS)}")
    need = {"qwen3": (g is None, cfg.qk_norm), "llama": (g is None, not cfg.qk_norm),
            "qwen3_next": (g is not None and g.granularity == "elementwise", cfg.qk_norm),
            "release": (True, True)}[layout]
    if not need[0]:
        raise ConfigError("model.gate", g, f"layout {layout} holds "
                          + ("no gate" if layout in ("qwen3", "llama") else "an elementwise gate"))
    if not need[1]:
        raise ConfigError("model.qk_norm", cfg.qk_norm, f"{not cfg.qk_norm} for layout {layout}")
    if cfg.rope_dim is not None and cfg.rope_dim != cfg.head_dim and layout != "qwen3_next":
        raise ConfigError("model.rope_dim", cfg.rope_dim, f"None (all of head_dim) for layout {layout}")
    if cfg.rope_dim is not None and int(cfg.head_dim * (cfg.rope_dim / cfg.head_dim)) != cfg.rope_dim:
        raise ConfigError("model.rope_dim", cfg.rope_dim, f"a value transformers recovers from "
                          f"partial_rotary_factor = rope_dim / head_dim ({cfg.head_dim}) without rounding")
    return layout


# --------------------------------------------------------------------------- tensor layouts


def _split_q(w: np.ndarray, cfg: ModelConfig, layout: str) -> tuple[np.ndarray, np.ndarray | None]:
    """q_proj rows ([out] + rest) -> (W_Q rows [H*K, ...], gate rows [H*width, ...] or None)."""
    g, hq, hk, k = cfg.gate, cfg.q_heads, cfg.kv_heads, cfg.head_dim
    if g is None:
        return w, None
    rest = w.shape[1:]
    if layout == "qwen3_next":
        per_head = w.reshape(hq, 2 * k, *rest)
        return per_head[:, :k].reshape(hq * k, *rest), per_head[:, k:].reshape(hq * k, *rest)
    per_group = w.reshape(hk, -1, *rest)  # release: [queries of the G heads | their gates]
    q_rows = cfg.group_size * k
    return per_group[:, :q_rows].reshape(hq * k, *rest), per_group[:, q_rows:].reshape(-1, *rest)


def _join_q(q: np.ndarray, gate: np.ndarray | None, cfg: ModelConfig, layout: str) -> np.ndarray:
    """The inverse of `_split_q`."""
    hq, hk, k = cfg.q_heads, cfg.kv_heads, cfg.head_dim
    if gate is None:
        return q
    rest = q.shape[1:]
    if layout == "qwen3_next":
        both = np.concatenate([q.reshape(hq, k, *rest), gate.reshape(hq, k, *rest)], axis=1)
    else:
        both = np.concatenate([q.reshape(hk, -1, *rest), gate.reshape(hk, -1, *rest)], axis=1)
    return both.reshape(-1, *rest)


def _q_rows(cfg: ModelConfig) -> int:
    heads, width = cfg.gate.shape(cfg) if cfg.gate is not None else (0, 0)
    return cfg.q_heads * cfg.head_dim + heads * width


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the Hugging Face model and its shape."""
    d, f, v = cfg.d_model, cfg.ffn_width, cfg.vocab_size
    kv = cfg.kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (v, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        attn = {"q_proj": (_q_rows(cfg), d), "k_proj": (kv, d), "v_proj": (kv, d),
                "o_proj": (d, cfg.q_heads * cfg.head_dim)}
        for name, shape in attn.items():
            out[f"{p}self_attn.{name}.weight"] = shape
            if cfg.attention_bias:
                out[f"{p}self_attn.{name}.bias"] = shape[:1]
        if cfg.qk_norm:
            out[f"{p}self_attn.q_norm.weight"] = out[f"{p}self_attn.k_norm.weight"] = (cfg.head_dim,)
        out.update({f"{p}input_layernorm.weight": (d,), f"{p}post_attention_layernorm.weight": (d,),
                    f"{p}mlp.gate_proj.weight": (f, d), f"{p}mlp.up_proj.weight": (f, d),
                    f"{p}mlp.down_proj.weight": (d, f)})
    return out


def _norm_names(cfg: ModelConfig) -> list[str]:
    names = ["model.norm.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
        if cfg.qk_norm:
            names += [f"{p}self_attn.q_norm.weight", f"{p}self_attn.k_norm.weight"]
    return names


def to_gattn(tensors: dict[str, np.ndarray], cfg: ModelConfig, layout: str) -> dict[tuple, np.ndarray]:
    """Hugging Face tensors -> gattn parameters {path: array} of the unscanned model."""
    t = dict(tensors)
    if layout == "qwen3_next":  # (1 + w) norms: gattn's scale is the whole factor
        for name in _norm_names(cfg):
            t[name] = (1.0 + t[name].astype(np.float32)).astype(np.float32)
    out = {("embed",): t["model.embed_tokens.weight"], ("final_norm", "scale"): t["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out[("lm_head",)] = t["lm_head.weight"].T
    for i in range(cfg.num_layers):
        p, b = f"model.layers.{i}.", ("blocks", i)
        a = p + "self_attn."
        q, gate = _split_q(t[a + "q_proj.weight"], cfg, layout)
        out.update({b + ("attn_norm", "scale"): t[p + "input_layernorm.weight"],
                    b + ("ffn_norm", "scale"): t[p + "post_attention_layernorm.weight"],
                    b + ("attn", "wq"): q.T, b + ("attn", "wk"): t[a + "k_proj.weight"].T,
                    b + ("attn", "wv"): t[a + "v_proj.weight"].T, b + ("attn", "wo"): t[a + "o_proj.weight"].T,
                    b + ("ffn", "w1"): t[p + "mlp.gate_proj.weight"].T,
                    b + ("ffn", "w3"): t[p + "mlp.up_proj.weight"].T,
                    b + ("ffn", "w2"): t[p + "mlp.down_proj.weight"].T})
        if gate is not None:
            out[b + ("attn", "gate", "w")] = gate.T
        if cfg.attention_bias:
            qb, gb = _split_q(t[a + "q_proj.bias"], cfg, layout)
            out.update({b + ("attn", "bq"): qb, b + ("attn", "bk"): t[a + "k_proj.bias"],
                        b + ("attn", "bv"): t[a + "v_proj.bias"], b + ("attn", "bo"): t[a + "o_proj.bias"]})
            if gb is not None:
                out[b + ("attn", "gate", "b")] = gb
        if cfg.qk_norm:
            out[b + ("attn", "q_norm")] = t[a + "q_norm.weight"]
            out[b + ("attn", "k_norm")] = t[a + "k_norm.weight"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def from_gattn(params: dict[tuple, np.ndarray], cfg: ModelConfig, layout: str) -> dict[str, np.ndarray]:
    """gattn parameters {path: array} of the unscanned model -> Hugging Face tensors."""
    P = params
    out = {"model.embed_tokens.weight": P[("embed",)], "model.norm.weight": P[("final_norm", "scale")]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = P[("lm_head",)].T
    for i in range(cfg.num_layers):
        p, b = f"model.layers.{i}.", ("blocks", i)
        a = p + "self_attn."
        gate = P[b + ("attn", "gate", "w")].T if cfg.gate is not None else None
        out.update({p + "input_layernorm.weight": P[b + ("attn_norm", "scale")],
                    p + "post_attention_layernorm.weight": P[b + ("ffn_norm", "scale")],
                    a + "q_proj.weight": _join_q(P[b + ("attn", "wq")].T, gate, cfg, layout),
                    a + "k_proj.weight": P[b + ("attn", "wk")].T, a + "v_proj.weight": P[b + ("attn", "wv")].T,
                    a + "o_proj.weight": P[b + ("attn", "wo")].T,
                    p + "mlp.gate_proj.weight": P[b + ("ffn", "w1")].T,
                    p + "mlp.up_proj.weight": P[b + ("ffn", "w3")].T,
                    p + "mlp.down_proj.weight": P[b + ("ffn", "w2")].T})
        if cfg.attention_bias:
            gb = P[b + ("attn", "gate", "b")] if cfg.gate is not None else None
            out.update({a + "q_proj.bias": _join_q(P[b + ("attn", "bq")], gb, cfg, layout),
                        a + "k_proj.bias": P[b + ("attn", "bk")], a + "v_proj.bias": P[b + ("attn", "bv")],
                        a + "o_proj.bias": P[b + ("attn", "bo")]})
        if cfg.qk_norm:
            out[a + "q_norm.weight"] = P[b + ("attn", "q_norm")]
            out[a + "k_norm.weight"] = P[b + ("attn", "k_norm")]
    if layout == "qwen3_next":
        for name in _norm_names(cfg):
            out[name] = out[name].astype(np.float32) - 1.0
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


# --------------------------------------------------------------------------- from-hf


def read_hf(src: str | Path) -> tuple[dict, str, ModelConfig, dict[str, np.ndarray]]:
    """(config.json, layout, gattn model config, tensors) of model folder `src`, all checked:
    every expected tensor present with its shape, none unexpected."""
    src = Path(src)
    if not (src / "config.json").is_file():
        raise ConversionError(f"{src}: no config.json (expected a Hugging Face model folder)")
    hf = read_json(src / "config.json")
    layout = detect_layout(hf)
    cfg = model_config(hf, layout)
    files = TensorFiles(src)
    present = [n for n in files.names() if not n.endswith(IGNORED_SUFFIXES)]
    if cfg.tie_embeddings and "lm_head.weight" in present and _head_differs(files, src):
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    elif cfg.tie_embeddings and "lm_head.weight" in present:
        present.remove("lm_head.weight")  # some exports write the tied head as well
    expected = hf_shapes(cfg)
    unexpected = sorted(n for n in present if n not in expected)
    if unexpected:
        raise ConversionError(f"tensor {unexpected[0]} is not part of the {layout} layout of this config "
                              f"({len(unexpected)} such tensors: a bias, an MoE or linear-attention weight "
                              "that config.json does not declare or gattn does not hold?)")
    tensors = {}
    for name, shape in expected.items():
        if name not in files.where:
            raise ConversionError(f"tensor {name} is missing from {src}")
        tensors[name] = files.get(name)
        if tuple(tensors[name].shape) != shape:
            raise ConversionError(f"tensor {name} has shape {tuple(tensors[name].shape)}; config.json "
                                  f"implies {shape} for layout {layout}")
    return hf, layout, cfg, tensors


def _head_differs(files: TensorFiles, src: Path) -> bool:
    """Whether a checkpoint that config.json calls tied stores an lm_head.weight unlike its
    embedding. transformers then keeps the stored head untied (with a warning), so gattn does
    too, and says so: dropping it would change every logit."""
    if "model.embed_tokens.weight" not in files.where:
        return False  # (reported as a missing tensor)
    head, embed = files.get("lm_head.weight"), files.get("model.embed_tokens.weight")
    if head.shape == embed.shape and np.array_equal(head, embed):
        return False
    diff = float(np.abs(head - embed).max()) if head.shape == embed.shape else float("nan")
    print(f"warning: {src / 'config.json'} says tie_word_embeddings: true, but tensor lm_head.weight "
          f"differs from model.embed_tokens.weight (max |difference| {diff:.3g}): keeping lm_head.weight "
          "as an untied head, as transformers does (the run's model.tie_embeddings is False)", file=sys.stderr)
    return True


def load_tokenizer_files(src: Path, hf: dict) -> dict[str, bytes]:
    """The tokenizer files to copy (tokenizer.json is required), with the eos token recorded in
    tokenizer_config.json when only config.json names it."""
    if not (src / "tokenizer.json").is_file():
        raise ConversionError(f"{src}: no tokenizer.json (eval.py reads text with the model's own "
                              "tokenizer; save it with tokenizer.save_pretrained)")
    files = {n: (src / n).read_bytes() for n in HF_TOKENIZER_FILES if (src / n).is_file()}
    tc = read_json(src / "tokenizer_config.json", files.get("tokenizer_config.json", b"{}"))
    if "eos_token" not in tc and hf.get("eos_token_id") is not None:
        eos = hf["eos_token_id"]
        tc["eos_token_id"] = eos[0] if isinstance(eos, list) else eos
        files["tokenizer_config.json"] = json.dumps(tc, indent=2).encode()
    return files


def from_hf(src: str | Path, workdir: str | Path) -> Path:
    """Converts Hugging Face model folder `src` into gattn run directory `workdir` (which must
    not hold a run). Returns the workdir."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from gattn.data.tokenizer import HF_TOKENIZER_DIR  # noqa: PLC0415
    from gattn.train import checkpoint, rundir  # noqa: PLC0415
    from gattn.model.transformer import Transformer  # noqa: PLC0415

    src, workdir = Path(src), Path(workdir)
    _check_new_folder(workdir, "--workdir")
    hf, layout, model_cfg, tensors = read_hf(src)
    tokenizer_files = load_tokenizer_files(src, hf)
    variant = "baseline" if model_cfg.gate is None else f"sdpa_{model_cfg.gate.granularity}"
    max_len = int(hf.get("max_position_embeddings") or 4096)
    cfg = Config(model=model_cfg, train=dataclasses.replace(TrainConfig(), seq_len=min(max_len, 4096)),
                 variant=variant)
    params = to_gattn(tensors, model_cfg, layout)
    del tensors  # (each parameter is moved into a jax array below: about two copies at the peak)
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract, nnx.Param)
    flat = []
    for path, var in nnx.to_flat_state(abstract_params):
        value = params.pop(path)  # every gattn parameter has its tensor (hf_shapes / to_gattn)
        if value.shape != var.shape:
            raise ConversionError(f"parameter {'.'.join(map(str, path))}: {value.shape} != {var.shape}")
        flat.append((path, var.replace(jax.numpy.asarray(value, var.dtype))))
    if params:
        raise ConversionError(f"tensors without a gattn parameter: {sorted(params)[:5]}")
    state = nnx.from_flat_state(flat)

    # Everything is read and checked: now write, into a sibling folder renamed at the end.
    with _written(workdir) as tmp:
        tok_dir = tmp / "tokenizer" / HF_TOKENIZER_DIR
        tok_dir.mkdir(parents=True)
        for name, data in tokenizer_files.items():
            (tok_dir / name).write_bytes(data)
        meta = rundir.meta(cfg, converted_from=str(src.absolute()), layout=layout)
        mngr = checkpoint.manager(tmp, 1, 1)
        try:
            checkpoint.save(mngr, 0, {"params": state}, {}, meta, force=True)
            mngr.wait_until_finished()
        finally:
            mngr.close()
        rundir.write_config(tmp, cfg)
        n = int(sum(math.prod(v.shape) for _, v in flat))
        (tmp / "converted.json").write_text(json.dumps({"from": str(src.absolute()), "layout": layout,
                                                        "params": n}, indent=2))
    return workdir


def _check_new_folder(path: Path, flag: str) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConversionError(f"{path} is not empty; choose a new {flag} folder")


@contextlib.contextmanager
def _written(path: Path):
    """A temporary sibling of `path` to write into, renamed to `path` when the block succeeds and
    removed when it fails: a conversion leaves either its whole output or nothing."""
    tmp = path.with_name(f".{path.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.exists():
            path.rmdir()  # (checked empty)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- to-hf


def to_hf(workdir: str | Path, out: str | Path, *, step: int | None = None, layout: str = "auto",
          max_shard_bytes: int = 5 * 2**30) -> Path:
    """Writes run `workdir`'s checkpoint `step` (default: the latest) as a Hugging Face model
    folder `out` (config.json, safetensors shards with an index when more than one, and the
    tokenizer: a Hugging Face run's tokenizer.json, or a SentencePiece run's model file as
    tokenizer.model). Returns `out`."""
    import safetensors.numpy  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from gattn.data.tokenizer import tokenizer_path  # noqa: PLC0415
    from gattn.train import rundir  # noqa: PLC0415

    workdir, out = Path(workdir), Path(out)
    _check_gattn_run(workdir)
    cfg = rundir.read_config(workdir)
    layout = export_layout(cfg.model, layout)
    _check_new_folder(out, "--out")
    tok = tokenizer_path(cfg, workdir)
    model = rundir.load(workdir, step, ["exec.scan_layers=false"]).model
    params = {path: np.asarray(var[...], np.float32) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    tensors = from_gattn(params, model.cfg, layout)
    max_len = cfg.train.seq_len if cfg.model.yarn is None else int(cfg.model.yarn.original_len * cfg.model.yarn.factor)
    config = hf_config(model.cfg, layout, max_len)

    shards, size = [[]], 0
    for name in tensors:
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    with _written(out) as tmp:
        weight_map = {}
        for i, names in enumerate(shards):
            fname = (f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1
                     else "model.safetensors")
            safetensors.numpy.save_file({n: tensors[n] for n in names}, tmp / fname, metadata={"format": "pt"})
            weight_map.update({n: fname for n in names})
        if len(shards) > 1:
            total = sum(t.nbytes for t in tensors.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        if tok.suffix == ".json":
            for name in HF_TOKENIZER_FILES:
                if (tok.parent / name).is_file():
                    shutil.copyfile(tok.parent / name, tmp / name)
        elif tok.is_file():
            shutil.copyfile(tok, tmp / "tokenizer.model")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _check_gattn_run(workdir: Path) -> None:
    """Refuses a folder that is not a gattn run, saying what it is instead."""
    what = "expected a gattn run directory (written by train.py or from-hf)"
    if not workdir.is_dir():
        raise ConversionError(f"{workdir}: no such folder; {what}")
    if not (workdir / "config.json").is_file():
        raise ConversionError(f"{workdir}: not a gattn run (no config.json); {what}")
    cfg = read_json(workdir / "config.json")
    if "model" not in cfg and ("architectures" in cfg or "model_type" in cfg):
        raise ConversionError(f"{workdir}: not a gattn run but a Hugging Face model folder (its config.json "
                              f"has 'architectures'/'model_type'); from-hf converts it into one")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gattn.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("from-hf", help="a Hugging Face model folder -> a gattn run directory")
    a.add_argument("src", help="local Hugging Face model folder (config.json + weights + tokenizer.json)")
    a.add_argument("--workdir", required=True, help="new run directory to write")
    b = sub.add_parser("to-hf", help="a gattn run directory -> a Hugging Face model folder")
    b.add_argument("workdir", help="gattn run directory")
    b.add_argument("--out", required=True, help="new folder to write")
    b.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    b.add_argument("--layout", default="auto", help=f"auto or one of {', '.join(LAYOUTS)}")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size")
    args = parser.parse_args(argv)
    try:
        if args.command == "from-hf":
            path = from_hf(args.src, args.workdir)
            print(json.dumps(json.loads((path / "converted.json").read_text())))
        else:
            path = to_hf(args.workdir, args.out, step=args.step, layout=args.layout,
                         max_shard_bytes=int(args.max_shard_gb * 2**30))
            print(json.dumps({"out": str(path), "files": sorted(p.name for p in path.iterdir())}))
    except (ConversionError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
