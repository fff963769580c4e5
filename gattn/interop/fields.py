"""The config.json checks Qwen3-Next's and Qwen3.5's readers share: every field is mapped, known to
change nothing gattn computes on text, or refused in one line naming it, its value and what is
allowed (gattn.config.ConfigError). `where` prefixes each field's name as the error shows it
("config.json ", or "config.json text_config." for a multimodal Qwen3.5)."""

from __future__ import annotations

from gattn.config import LAYER_TYPES, ConfigError, hybrid_layer_types

# Fields any transformers config.json may carry that change nothing gattn computes: names, dtypes,
# the tokenizer's ids (the tokenizer files carry them), generation and output switches, init.
BOOKKEEPING = ("architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
               "use_cache", "initializer_range", "output_hidden_states", "output_attentions", "return_dict",
               "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
               "tokenizer_class", "bos_token_id", "eos_token_id", "pad_token_id")
# Where transformers reads the rotary embedding (v5's rope_parameters; v4's others).
ROPE_FIELDS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
               "original_max_position_embeddings")
# The keys of rope_parameters that gattn/interop/hf_config.py's _rope reads or refuses.
ROPE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor", "factor", "original_max_position_embeddings",
             "beta_fast", "beta_slow", "attention_factor", "truncate", "mscale", "mscale_all_dim")
# The GDN's causal conv runs transformers' hidden_act; gattn's conv is SiLU (gattn/model/gdn.py).
GDN_ACT = "transformers applies hidden_act to the Gated DeltaNet's causal conv too, and gattn's conv is SiLU"


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
