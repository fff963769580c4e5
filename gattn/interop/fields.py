"""The config.json core every family reads with: each field is mapped, known to change nothing gattn
computes on text, or refused in one line naming it, its value and what is allowed
(gattn.config.ConfigError); the fields every decoder family shares (sizes, norms, RoPE, activation)
read and written one way. `where` prefixes each field's name as the error shows it ("config.json ",
or "config.json text_config." for a multimodal Qwen3.5)."""

from __future__ import annotations

from gattn.config import LAYER_TYPES, ConfigError, ModelConfig, YarnSpec, hybrid_layer_types

# Fields any transformers config.json may carry that change nothing gattn computes: names, dtypes,
# the tokenizer's ids (the tokenizer files carry them), generation and output switches, init.
BOOKKEEPING = ("architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
               "use_cache", "initializer_range", "output_hidden_states", "output_attentions", "return_dict",
               "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
               "tokenizer_class", "bos_token_id", "eos_token_id", "pad_token_id")
# The attention decoder's fields every family maps (ModelConfig's sizes, norms, head, activation).
DECODER = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
           "tie_word_embeddings", "attention_bias")
# Fields with the one value gattn computes: value, and why.
DECODER_FIXED = {"attention_dropout": (0.0, "gattn has no attention dropout"),
                 "mlp_bias": (False, "gattn's SwiGLU has no biases"),
                 "use_sliding_window": (False, "gattn has no sliding-window attention")}
# Read only when use_sliding_window is true (which DECODER_FIXED refuses).
SLIDING = ("sliding_window", "max_window_layers")
# Hugging Face hidden_act -> gattn ffn_activation (jax.nn.gelu is the tanh approximation), and back.
ACTIVATIONS = {"silu": "silu", "relu": "relu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}
EXPORT_ACTIVATIONS = {"silu": "silu", "relu": "relu", "gelu": "gelu_pytorch_tanh"}
# Where transformers reads the rotary embedding (v5's rope_parameters; v4's others).
ROPE_FIELDS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
               "original_max_position_embeddings")
# The keys of rope_parameters that `rope` reads or refuses.
ROPE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
             "beta_fast", "beta_slow", "attention_factor", "truncate", "mscale", "mscale_all_dim")
# The GDN's causal conv runs transformers' hidden_act; gattn's conv is SiLU (gattn/model/gdn.py).
GDN_ACT = "transformers applies hidden_act to the Gated DeltaNet's causal conv too, and gattn's conv is SiLU"


def strict(fields: dict, allowed: tuple[str, ...], where: str, what: str) -> None:
    """Refuses a quantized checkpoint, then the first field not in `allowed` (the fields of `what`)."""
    if "quantization_config" in fields:
        q = fields["quantization_config"]
        raise ConfigError(f"{where}quantization_config", q.get("quant_method", q) if isinstance(q, dict) else q,
                          "absent: gattn reads float weights (float32, bfloat16, float16) only; dequantize the "
                          "checkpoint first (e.g. load it in transformers and save_pretrained it in bfloat16)")
    known(fields, allowed, where, what)


def known(fields: dict, allowed: tuple[str, ...], where: str, what: str) -> None:
    """Refuses the first field of `fields` not in `allowed` (the fields of `what`)."""
    for key, value in fields.items():
        if key not in allowed:
            raise ConfigError(f"{where}{key}", value, f"absent: it is not one of the fields of {what} that gattn "
                              "maps or knows to change nothing on text")


def fixed(fields: dict, table: dict[str, tuple[object, str]], where: str) -> None:
    """Refuses a field of `table` ({field: (the one value gattn computes, why)}) set to another value."""
    for key, (value, why) in table.items():
        if key in fields and fields[key] != value:
            raise ConfigError(f"{where}{key}", fields[key], f"{value!r} or absent ({why})")


def rope_spec(fields: dict, where: str, keys: tuple[str, ...] = ROPE_KEYS) -> dict:
    """The rope parameters as transformers 5 reads them (v4's rope_scaling, when present, replaces
    rope_parameters whole; one dict, or one per layer type of which only full attention has
    RoPE), every key one of `keys`."""
    spec = dict(fields.get("rope_scaling") or fields.get("rope_parameters") or {})
    name = f"{where}{'rope_scaling' if fields.get('rope_scaling') else 'rope_parameters'}"
    if isinstance(spec.get("full_attention"), dict):
        for kind in spec:
            if kind not in LAYER_TYPES:
                raise ConfigError(f"{name}.{kind}", spec[kind], f"one of {', '.join(LAYER_TYPES)} (rope "
                                  "parameters per layer type)")
        spec, name = dict(spec["full_attention"]), f"{name}.full_attention"
    for key in spec:
        if key not in keys:
            raise ConfigError(f"{name}.{key}", spec[key], f"one of {', '.join(keys)}")
    return spec


def layer_kinds(fields: dict, layers: int, where: str) -> tuple[str, ...]:
    """Each layer's type: config.json's layer_types, else transformers' pattern from
    full_attention_interval (default 4: every 4th layer full attention, the others Gated DeltaNet)."""
    kinds = fields.get("layer_types")
    if not kinds:
        interval = fields.get("full_attention_interval")
        interval = 4 if interval is None else interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ConfigError(f"{where}full_attention_interval", interval, "an integer >= 1 (every interval-th "
                              "layer full attention, the others Gated DeltaNet), or absent (4), or a layer_types list")
        kinds = hybrid_layer_types(layers, interval)
    for kind in kinds:
        if kind not in LAYER_TYPES:
            raise ConfigError(f"{where}layer_types", kind, f"one of {', '.join(LAYER_TYPES)} per layer")
    return tuple(kinds)


def check_gdn_act(act: str, kinds: tuple[str, ...], where: str) -> None:
    """Refuses a hidden_act other than SiLU in a model with Gated DeltaNet layers (`GDN_ACT`)."""
    if act != "silu" and "linear_attention" in kinds:
        raise ConfigError(f"{where}hidden_act", act, f"'silu' for a model with linear_attention layers ({GDN_ACT})")


def required(fields: dict, key: str, where: str = "config.json "):
    if fields.get(key) is None:
        raise ConfigError(f"{where}{key}", None, "a required field is missing")
    return fields[key]


def activation(fields: dict, where: str = "config.json ") -> str:
    """gattn's ffn_activation for config.json's hidden_act (default silu)."""
    act = fields.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"{where}hidden_act", act, f"expected one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act]


def full_attention_only(fields: dict, layers: int, where: str = "config.json ") -> None:
    """Refuses layer_types other than full attention (sliding windows, linear attention)."""
    for kind in fields.get("layer_types") or ():
        if kind != "full_attention":
            raise ConfigError(f"{where}layer_types", kind, "'full_attention' per layer (gattn has no sliding-window "
                              "attention; linear attention is Qwen3-Next's and Qwen3.5's)")


def rope(fields: dict, default_partial: float, where: str = "config.json ") -> tuple[float, YarnSpec | None, float]:
    """(base, yarn, partial rotary factor) as transformers 5 reads them: v4's rope_scaling, when
    present, replaces rope_parameters whole; rope_theta and partial_rotary_factor at the top
    level fill what the dict lacks; a top-level original_max_position_embeddings wins."""
    spec = dict(fields.get("rope_scaling") or fields.get("rope_parameters") or {})
    if isinstance(spec.get("full_attention"), dict):  # nested per layer type (only full attention here)
        spec = dict(spec["full_attention"])
    if any(isinstance(v, dict) for v in spec.values()):
        raise ConfigError(f"{where}rope_parameters", sorted(spec), "one dict, or one per layer type "
                          "with only 'full_attention'")
    base = spec.get("rope_theta", fields.get("rope_theta", 10_000.0))
    partial = spec.get("partial_rotary_factor", fields.get("partial_rotary_factor", default_partial))
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind == "default":
        return float(base), None, float(partial)
    if kind != "yarn":
        raise ConfigError(f"{where}rope_type", kind, "expected 'default' or 'yarn'")
    for unsupported in ("mscale", "mscale_all_dim"):
        if spec.get(unsupported):
            raise ConfigError(f"{where}rope_scaling.{unsupported}", spec[unsupported],
                              "not supported (plain YaRN only)")
    if spec.get("truncate") is False:
        raise ConfigError(f"{where}rope_scaling.truncate", False, "gattn's YaRN truncates (True)")
    original = (fields.get("original_max_position_embeddings") or spec.get("original_max_position_embeddings")
                or fields.get("max_position_embeddings"))
    factor = spec.get("factor") or required(fields, "max_position_embeddings", where) / original
    yarn = YarnSpec(factor=float(factor), original_len=int(original),
                    beta_fast=float(spec.get("beta_fast") or 32), beta_slow=float(spec.get("beta_slow") or 1),
                    attention_factor=spec.get("attention_factor"))
    return float(base), yarn, float(partial)


def decoder(fields: dict, *, head_dim: int | None, partial: float, where: str = "config.json ") -> dict:
    """The ModelConfig fields every decoder family reads alike (sizes, head, RoPE, norms, embeddings),
    with the family's defaults for an absent head_dim (None: hidden_size // heads) and partial
    rotary factor; the rest is the family's."""
    d, heads = int(required(fields, "hidden_size", where)), int(required(fields, "num_attention_heads", where))
    head_dim = int(fields.get("head_dim") or head_dim or d // heads)
    base, yarn, partial = rope(fields, partial, where)
    rope_spec(fields, where)  # (no key rope() would pass over)
    rope_dim = int(head_dim * partial)
    return dict(vocab_size=int(required(fields, "vocab_size", where)), d_model=d,
                num_layers=int(required(fields, "num_hidden_layers", where)), q_heads=heads,
                kv_heads=int(fields.get("num_key_value_heads") or heads), head_dim=head_dim,
                d_ff=int(required(fields, "intermediate_size", where)), ffn_activation=activation(fields, where),
                tie_embeddings=bool(fields.get("tie_word_embeddings", False)), rope_base=base, yarn=yarn,
                rope_dim=None if rope_dim == head_dim else rope_dim, norm_eps=float(fields.get("rms_norm_eps", 1e-6)),
                attention_bias=bool(fields.get("attention_bias", False)))


def full_rotary(common: dict, layout: str) -> None:
    """Refuses partial rotary embeddings in `common` (`decoder`'s fields): only Qwen3-Next's and
    Qwen3.5's attention has them."""
    if common["rope_dim"] is not None:
        raise ConfigError("config.json partial_rotary_factor", common["rope_dim"] / common["head_dim"],
                          f"1.0 for layout {layout}")


def kept(fields: dict) -> dict:
    """What to-hf writes back as it was of any checked config.json: max_position_embeddings."""
    n = fields.get("max_position_embeddings")
    return {} if n is None else {"max_position_embeddings": int(n)}


def decoder_config(cfg: ModelConfig, max_len: int, kept_fields: dict, *, partial: bool) -> dict:
    """The config.json fields every decoder family writes alike; `partial` writes
    partial_rotary_factor even for a full rotation (a family whose default is partial).
    max_position_embeddings is the longest of `max_len` (the length the run was trained at) and the
    converted folder's (`kept_fields`)."""
    rope_ = {"rope_theta": cfg.rope_base, "rope_type": "default"}
    if cfg.yarn is not None:
        y = cfg.yarn
        rope_.update(rope_type="yarn", factor=y.factor, original_max_position_embeddings=y.original_len,
                     beta_fast=y.beta_fast, beta_slow=y.beta_slow)
        if y.attention_factor is not None:
            rope_["attention_factor"] = y.attention_factor
    if cfg.rope_dim is not None or partial:
        rope_["partial_rotary_factor"] = (cfg.rope_dim or cfg.head_dim) / cfg.head_dim
    out = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.ffn_width,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.q_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": EXPORT_ACTIVATIONS[cfg.ffn_activation],
        "max_position_embeddings": max(max_len, int(kept_fields.get("max_position_embeddings") or 0)),
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0, "use_cache": True, "torch_dtype": "float32",
        # v5 reads rope_parameters; v4 reads rope_theta / rope_scaling / partial_rotary_factor.
        "rope_parameters": rope_, "rope_theta": cfg.rope_base,
        "rope_scaling": None if cfg.yarn is None else {k: v for k, v in rope_.items() if k != "rope_theta"},
    }
    if "partial_rotary_factor" in rope_:
        out["partial_rotary_factor"] = rope_["partial_rotary_factor"]
    return out
