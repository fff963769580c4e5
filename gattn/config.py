"""Typed, frozen configuration: the gate design space, the model, and command-line overrides.

Configs are plain frozen dataclasses. Every value is checked when the object is built, before any
JAX work, and a bad value raises `ConfigError` naming the field, the value and what is allowed.
This module imports no JAX so that checking a config is instant.
"""

from __future__ import annotations

import dataclasses
import json
import importlib.util
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The paper's gate positions (Fig. 1 left). Both the descriptive name and G1..G5 are accepted.
POSITIONS = {"sdpa": "G1", "value": "G2", "key": "G3", "query": "G4", "dense": "G5"}
GRANULARITIES = ("elementwise", "headwise")
SHARINGS = ("head_specific", "head_shared")
FORMS = ("multiplicative", "additive")
GATE_ACTIVATIONS = ("sigmoid", "silu", "ns_sigmoid", "identity")
SDPA_NONLINEARITIES = ("none", "rmsnorm", "silu")
SWITCH_TARGETS = ("v", "kv")
FFN_ACTIVATIONS = ("silu", "gelu", "relu")
DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
ATTENTION_IMPLS = ("xla", "pallas")  # plain jnp reference / fused Pallas flash kernel
LBL_SCOPES = ("global", "micro")


class ConfigError(ValueError):
    """A config value that is not allowed; names the field, the value and what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"config field {field!r} = {value!r} is not allowed: {allowed}")

    def under(self, prefix: str) -> "ConfigError":
        return ConfigError(f"{prefix}.{self.field}" if prefix else self.field, self.value, self.allowed)


def _choice(name: str, value: Any, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(name, value, f"expected one of {', '.join(map(repr, choices))}")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(name, value, "expected True or False")


def _positive(name: str, value: Any, *, zero_ok: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(name, value, "expected a number >= 0" if zero_ok else "expected a number > 0")


def _integer(name: str, value: Any, *, zero_ok: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(name, value, "expected an integer")
    _positive(name, value, zero_ok=zero_ok)


@dataclass(frozen=True)
class GateSpec:
    """One point of the paper's gate design space (Sec. 2.2; SPEC section 1).

    position:     where the gate acts: sdpa (G1), value (G2), key (G3), query (G4), dense (G5).
    granularity:  elementwise (a score per dimension) or headwise (one scalar per head).
    sharing:      head_specific, or head_shared (score averaged over the head axis).
    form:         multiplicative (Y * act(XW)) or additive (Y + act(XW)).
    activation:   sigmoid, silu, ns_sigmoid (0.5 + 0.5 * sigmoid), identity.
    input_dependent: True for act(X W_theta); False for a learnable, zero-initialised tensor.
    """

    position: str = "sdpa"
    granularity: str = "elementwise"
    sharing: str = "head_specific"
    form: str = "multiplicative"
    activation: str = "sigmoid"
    input_dependent: bool = True

    def __post_init__(self):
        by_g = {g: name for name, g in POSITIONS.items()}
        if self.position in by_g:
            object.__setattr__(self, "position", by_g[self.position])
        _choice("position", self.position, tuple(POSITIONS) + tuple(by_g))
        _choice("granularity", self.granularity, GRANULARITIES)
        _choice("sharing", self.sharing, SHARINGS)
        _choice("form", self.form, FORMS)
        _choice("activation", self.activation, GATE_ACTIVATIONS)
        _bool("input_dependent", self.input_dependent)
        if self.position == "dense" and self.granularity == "headwise":
            raise ConfigError("granularity", self.granularity,
                              "position 'dense' (G5) has no heads; use 'elementwise'")
        if self.position == "dense" and self.sharing == "head_shared":
            raise ConfigError("sharing", self.sharing,
                              "position 'dense' (G5) has no heads; use 'head_specific'")

    @property
    def g(self) -> str:
        """The paper's name of the position, G1..G5."""
        return POSITIONS[self.position]

    @property
    def fusable(self) -> bool:
        """Whether the attention kernel can apply this gate itself: sigmoid(X W_theta) multiplying
        each head's own SDPA output (the paper's best gate, and its headwise form)."""
        return (self.position == "sdpa" and self.form == "multiplicative"
                and self.activation == "sigmoid" and self.sharing == "head_specific"
                and self.input_dependent)

    def shape(self, cfg: "ModelConfig") -> tuple[int, int]:
        """(heads, width) of the score before any head sharing (see gattn/gates.py)."""
        if self.position == "dense":
            return 1, cfg.d_model
        heads = cfg.q_heads if self.position in ("sdpa", "query") else cfg.kv_heads
        return heads, cfg.head_dim if self.granularity == "elementwise" else 1

    def num_params(self, cfg: "ModelConfig") -> int:
        """Parameters this gate adds to one layer (Table 1's 'Added Param' / num_layers)."""
        heads, width = self.shape(cfg)
        if not self.input_dependent:
            return heads * width
        return heads * width * (cfg.d_model + cfg.attention_bias)


@dataclass(frozen=True)
class MoESpec:
    """A fine-grained mixture-of-experts FFN (the paper's MoE 15A2B: 128 experts, top-8).

    num_experts, top_k: softmax router over experts, keep the top-k per token.
    expert_width:       FFN width of one SwiGLU expert.
    renormalize:        rescale the kept top-k weights to sum to 1 (as Qwen3-MoE does).
    capacity_factor:    None: dropless (grouped matmul over exactly the routed tokens); a number c:
                        each expert takes at most ceil(c * tokens * top_k / num_experts) tokens (the
                        first in token order), the rest are dropped (expert output 0) and counted.
                        With experts split over a mesh, "tokens" are each data x expert shard's.
    lbl_coef, lbl_scope: load-balancing loss weight, and whether expert frequencies are counted
                        over the global batch ("global", Qiu et al. 2025b) or per micro-batch
                        ("micro": the batch split into `micro_batches` groups, averaged).
    z_loss_coef:        router z-loss weight (mean squared log-sum-exp of router logits).
    """

    num_experts: int = 128
    top_k: int = 8
    expert_width: int = 768
    renormalize: bool = True
    capacity_factor: float | None = None
    lbl_coef: float = 1e-3
    lbl_scope: str = "global"
    micro_batches: int = 1
    z_loss_coef: float = 0.0

    def __post_init__(self):
        for name in ("num_experts", "top_k", "expert_width", "micro_batches"):
            _integer(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ConfigError("top_k", self.top_k, f"expected 1..num_experts ({self.num_experts})")
        _bool("renormalize", self.renormalize)
        if self.capacity_factor is not None:
            _positive("capacity_factor", self.capacity_factor)
        _positive("lbl_coef", self.lbl_coef, zero_ok=True)
        _positive("z_loss_coef", self.z_loss_coef, zero_ok=True)
        _choice("lbl_scope", self.lbl_scope, LBL_SCOPES)

    def num_params(self, d_model: int) -> tuple[int, int]:
        """(total, activated) parameters of one MoE FFN: router plus experts (3 matrices each)."""
        expert = 3 * d_model * self.expert_width
        router = d_model * self.num_experts
        return router + self.num_experts * expert, router + self.top_k * expert


@dataclass(frozen=True)
class SwitchHeadsSpec:
    """Switch Heads (Csordas et al. 2024; the paper's Table 6): per kv head, `num_experts` value (or
    key and value) projections mixed by a sigmoid router that keeps the `top_k` best per token."""

    targets: str = "v"
    num_experts: int = 1
    top_k: int = 1

    def __post_init__(self):
        _choice("targets", self.targets, SWITCH_TARGETS)
        _integer("num_experts", self.num_experts)
        _integer("top_k", self.top_k)
        if self.top_k > self.num_experts:
            raise ConfigError("top_k", self.top_k, f"expected 1..num_experts ({self.num_experts})")


@dataclass(frozen=True)
class YarnSpec:
    """YaRN RoPE scaling (Peng et al. 2023, "NTK-by-parts" with attention temperature), applied at
    eval time to a trained checkpoint or for continued training; the paper's Table 5 extends 32k
    models to 128k with it (factor 4).

    factor:           s, how many times the context is stretched.
    original_len:     L, the context length the checkpoint was trained at.
    beta_fast, beta_slow: the ramp. A RoPE dimension pair that turns more than beta_fast times
                      within L keeps its frequency (extrapolated); one that turns fewer than
                      beta_slow times is divided by s (interpolated); between them, a linear blend.
    attention_factor: sqrt(1/t), multiplying q and k after RoPE (logits by 1/t);
                      None = the paper's 0.1 ln(s) + 1.
    """

    factor: float = 1.0
    original_len: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    def __post_init__(self):
        _positive("factor", self.factor)
        if self.factor < 1:
            raise ConfigError("factor", self.factor, "expected a number >= 1 (the context is stretched, not shrunk)")
        if not isinstance(self.original_len, int) or isinstance(self.original_len, bool) or self.original_len < 1:
            raise ConfigError("original_len", self.original_len,
                              "expected the context length the checkpoint was trained at (an integer > 0)")
        _positive("beta_fast", self.beta_fast)
        _positive("beta_slow", self.beta_slow)
        if self.beta_slow >= self.beta_fast:
            raise ConfigError("beta_slow", self.beta_slow, f"expected < beta_fast ({self.beta_fast})")
        if self.attention_factor is not None:
            _positive("attention_factor", self.attention_factor)

    @property
    def temperature_factor(self) -> float:
        """sqrt(1/t): the given attention_factor, or 0.1 ln(s) + 1."""
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only LM: pre-RMSNorm blocks of GQA attention (with an optional gate) and SwiGLU."""

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 352
    ffn_activation: str = "silu"
    tie_embeddings: bool = False
    rope_base: float = 10_000.0
    yarn: YarnSpec | None = None           # YaRN context extension (Table 5); None = plain RoPE.
    rope_dim: int | None = None            # dims of each head that rotate (the first rope_dim);
                                           # None = all of head_dim. Qwen3-Next rotates head_dim / 4.
    qk_norm: bool = False
    attention_bias: bool = False           # biases on W_Q, W_K, W_V, W_O and the gate's W_theta
                                           # (Qwen3's attention_bias, the authors' release's qkv_bias).
    norm_eps: float = 1e-6
    init_std: float = 0.02
    # The paper's variant space.
    gate: GateSpec | None = None
    sdpa_nonlinearity: str = "none"        # Table 3 rows 5-6: per-head RMSNorm or SiLU at G1.
    switch_heads: SwitchHeadsSpec | None = None  # Table 6.
    moe: MoESpec | None = None             # None: a dense SwiGLU FFN of width d_ff.
    sandwich_norm: bool = False            # Table 2 row 7: RMSNorm on attn/FFN outputs.
    output_clip: float | None = None       # Appendix A.5: clip attn/FFN outputs to (-c, c).
    match_ffn_params: bool = False         # Table 2: shrink d_ff so params equal the baseline's.
    # Numerics and compilation.
    param_dtype: str = "float32"
    dtype: str = "float32"
    scan_layers: bool = False
    remat: str = "none"
    attention_impl: str = "xla"
    attention_block_q: int = 128           # causal query block of the xla path (0 = no blocking).
    attention_query_chunk: int = 0         # > 0: xla path runs queries this many at a time in a loop
                                           # (memory O(chunk * S) per layer; long contexts on CPU).
    flash_block_q: int = 512               # query / key blocks of the pallas kernel (multiples of 8;
    flash_block_k: int = 512               # TPU wants multiples of 128).

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "q_heads", "kv_heads", "head_dim", "d_ff"):
            _integer(name, getattr(self, name))
        _integer("attention_block_q", self.attention_block_q, zero_ok=True)
        _integer("attention_query_chunk", self.attention_query_chunk, zero_ok=True)
        for name in ("flash_block_q", "flash_block_k"):
            _integer(name, getattr(self, name))
            if getattr(self, name) % 8:
                raise ConfigError(name, getattr(self, name), "expected a positive multiple of 8")
        _positive("rope_base", self.rope_base)
        _positive("norm_eps", self.norm_eps)
        _positive("init_std", self.init_std)
        if self.q_heads % self.kv_heads:
            raise ConfigError("q_heads", self.q_heads,
                              f"must be a multiple of kv_heads ({self.kv_heads}) for GQA")
        if self.rope_base <= 1:
            raise ConfigError("rope_base", self.rope_base, "expected a number > 1")
        if self.head_dim % 2:
            raise ConfigError("head_dim", self.head_dim, "RoPE needs an even head_dim")
        if self.rope_dim is not None:
            _integer("rope_dim", self.rope_dim)
            if self.rope_dim % 2 or self.rope_dim > self.head_dim:
                raise ConfigError("rope_dim", self.rope_dim,
                                  f"expected an even number of dims <= head_dim ({self.head_dim}), or None")
        _choice("ffn_activation", self.ffn_activation, FFN_ACTIVATIONS)
        _choice("sdpa_nonlinearity", self.sdpa_nonlinearity, SDPA_NONLINEARITIES)
        _choice("param_dtype", self.param_dtype, DTYPES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("remat", self.remat, REMAT_POLICIES)
        _choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        for name in ("tie_embeddings", "qk_norm", "attention_bias", "sandwich_norm", "match_ffn_params",
                     "scan_layers"):
            _bool(name, getattr(self, name))
        if self.output_clip is not None:
            _positive("output_clip", self.output_clip)
        if self.gate is not None and not isinstance(self.gate, GateSpec):
            raise ConfigError("gate", self.gate, "expected a GateSpec or None")
        if self.switch_heads is not None and not isinstance(self.switch_heads, SwitchHeadsSpec):
            raise ConfigError("switch_heads", self.switch_heads, "expected a SwitchHeadsSpec or None")
        if self.switch_heads is not None and self.attention_bias:
            raise ConfigError("attention_bias", True, "switch heads (switch_heads is set) have no biases")
        if self.yarn is not None and not isinstance(self.yarn, YarnSpec):
            raise ConfigError("yarn", self.yarn, "expected a YarnSpec or None")
        if self.moe is not None and not isinstance(self.moe, MoESpec):
            raise ConfigError("moe", self.moe, "expected a MoESpec or None")
        if self.moe is not None and self.match_ffn_params:
            raise ConfigError("match_ffn_params", True, "FFN matching is for dense models (moe is set)")
        if self.ffn_width <= 0:
            raise ConfigError("match_ffn_params", True,
                              f"the block adds {self.block_added_params} parameters, more than the "
                              f"FFN (d_ff={self.d_ff}) has; use a larger d_ff or match_ffn_params=False")

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.q_heads // self.kv_heads

    @property
    def attention_added_params(self) -> int:
        """Parameters one attention layer has beyond the baseline's W_Q, W_K, W_V, W_O, QK-norm."""
        n = self.gate.num_params(self) if self.gate is not None else 0
        if self.sdpa_nonlinearity == "rmsnorm":
            n += self.q_heads * self.head_dim  # one RMSNorm scale per head
        if (sw := self.switch_heads) is not None:
            per_expert = self.d_model * self.kv_heads * self.head_dim * (2 if sw.targets == "kv" else 1)
            n += self.d_model * self.kv_heads * sw.num_experts + (sw.num_experts - 1) * per_expert
        return n

    @property
    def block_added_params(self) -> int:
        """Parameters one block has beyond the baseline block (attention extras, sandwich norms)."""
        return self.attention_added_params + (2 * self.d_model if self.sandwich_norm else 0)

    @property
    def ffn_width(self) -> int:
        """d_ff, or with `match_ffn_params` the width that gives the block the baseline's parameter
        count: every extra parameter of the block is paid for by FFN columns (3 * d_model each)."""
        if not self.match_ffn_params:
            return self.d_ff
        return self.d_ff - round(self.block_added_params / (3 * self.d_model))


# The paper's learning-rate recipes (Sec. 3.2): name -> (max LR, final LR, warmup steps). The
# paper gives the floor only for the MoE recipe; the dense presets decay to 1% of their peak.
LR_PRESETS = {
    "moe_15a2b": (2e-3, 3e-5, 1000),          # Table 1: 1k warmup, 2e-3 -> 3e-5, bsz 1024
    "dense_400b": (4e-3, 4e-5, 1000),         # Table 2 rows 1-2, 5, 8-9 (bsz 1024)
    "dense_3.5t": (4.5e-3, 4.5e-5, 1000),     # Table 2 rows 3-4 (bsz 2048)
    "dense_1t": (5.3e-3, 5.3e-5, 1000),       # Table 2 rows 11, 13 (bsz 4096)
    "dense_high_lr": (8e-3, 8e-5, 1000),      # Table 2 rows 6-7, 10, 12, 14: the baseline diverges
}


@dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it becomes tokens (gattn/data)."""

    source: str = "embedded"        # "embedded" (CPython docs + stdlib sources) or a folder path
    code_max_bytes: int = 1_500_000  # how much stdlib source the embedded corpus takes
    tokenizer: str = ""             # a SentencePiece .model file; "" trains one of model.vocab_size
    shuffle_window: int = 256       # packed rows shuffled together (decorrelates batches)
    eval_batches: int = 4           # held-out batches per domain for validation
    eval_batch_size: int = 8

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source:
            raise ConfigError("source", self.source, "expected 'embedded' or a folder path")
        if not isinstance(self.tokenizer, str):
            raise ConfigError("tokenizer", self.tokenizer, "expected a path or ''")
        for name in ("code_max_bytes", "shuffle_window", "eval_batches", "eval_batch_size"):
            _integer(name, getattr(self, name))


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, checkpointing and logging of a run (gattn/optim.py, gattn/trainer.py)."""

    seed: int = 0
    batch_size: int = 8             # global batch (sequences)
    seq_len: int = 128
    steps: int = 200                # total training steps
    learning_rate: float = 3e-3     # max LR, after linear warmup
    min_learning_rate: float = 3e-5  # cosine floor at the last step
    warmup_steps: int = 20
    lr_preset: str = ""             # a key of LR_PRESETS; sets the three values above
    weight_decay: float = 0.01      # AdamW's defaults otherwise (the paper keeps them)
    grad_clip: float = 1.0          # global-norm clipping (0 = off)
    log_every: int = 10
    eval_every: int = 100
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    max_bad_steps: int = 10         # consecutive non-finite steps before the run stops
    spike_window: int = 50          # loss spike: loss > median of the last `window` + margin
    spike_margin: float = 0.5
    # Continued training (e.g. the paper's context extension: a new RoPE base and seq_len): a new
    # run starts from the parameters of run directory `init_from` (its latest checkpoint, or step
    # `init_step`) with a fresh optimizer and schedule. Ignored once this run has a checkpoint.
    init_from: str = ""
    init_step: int | None = None

    def __post_init__(self):
        _integer("seed", self.seed, zero_ok=True)
        for name in ("batch_size", "seq_len", "steps", "log_every", "eval_every", "checkpoint_every",
                     "keep_checkpoints", "max_bad_steps", "spike_window"):
            _integer(name, getattr(self, name))
        _integer("warmup_steps", self.warmup_steps, zero_ok=True)
        for name in ("learning_rate", "spike_margin"):
            _positive(name, getattr(self, name))
        for name in ("min_learning_rate", "weight_decay", "grad_clip"):
            _positive(name, getattr(self, name), zero_ok=True)
        if not isinstance(self.init_from, str):
            raise ConfigError("init_from", self.init_from, "expected a run directory or ''")
        if self.init_step is not None:
            _integer("init_step", self.init_step)
            if not self.init_from:
                raise ConfigError("init_step", self.init_step, "only with init_from (a run directory)")
        if self.lr_preset:
            _choice("lr_preset", self.lr_preset, tuple(LR_PRESETS))
        peak, floor, warmup = self.schedule
        if floor > peak:
            raise ConfigError("min_learning_rate", floor, f"expected <= the max LR ({peak})")
        if warmup >= self.steps:
            raise ConfigError("warmup_steps", warmup, f"expected fewer than steps ({self.steps})")

    @property
    def schedule(self) -> tuple[float, float, int]:
        """(max LR, final LR, warmup steps), from the preset when one is named."""
        if self.lr_preset:
            return LR_PRESETS[self.lr_preset]
        return self.learning_rate, self.min_learning_rate, self.warmup_steps


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh axes (gattn/sharding.py): data parallel, expert parallel, model (tensor)
    parallel. Their product is the device count; data = -1 takes what the others leave."""

    data: int = -1
    expert: int = 1
    model: int = 1

    def __post_init__(self):
        if not isinstance(self.data, int) or isinstance(self.data, bool) or (self.data < 1 and self.data != -1):
            raise ConfigError("data", self.data, "expected a positive integer or -1 (all remaining devices)")
        _integer("expert", self.expert)
        _integer("model", self.model)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    # The registered variant (gattn.variants) that `load` applied to the config file's model. It is
    # a record, not a switch: choose a variant with `--variant NAME` (or `--config.variant=NAME`).
    variant: str = "baseline"

    def __post_init__(self):
        from gattn.variants import REGISTRY  # noqa: PLC0415 (variants imports this module)

        _choice("variant", self.variant, tuple(REGISTRY))


# --------------------------------------------------------------------------- overrides


def _coerce(path: str, text: str, hint: Any) -> Any:
    """Turns the text of a command-line override into the field's declared type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if text.lower() in ("none", "null"):
            return None
        return _coerce(path, text, args[0])
    if hint is bool:
        low = text.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(path, text, "expected true or false")
    if hint in (int, float):
        try:
            number = float(text)
            return int(number) if hint is int and number.is_integer() else hint(text)
        except ValueError:
            raise ConfigError(path, text, f"expected {'an integer' if hint is int else 'a number'}") from None
    if dataclasses.is_dataclass(hint):
        if text.lower() == "default":
            return hint()
        raise ConfigError(path, text, f"set its fields ({path}.FIELD=VALUE) or 'default'")
    return text


def _build(cfg: Any, tree: dict, prefix: str) -> Any:
    """Returns `cfg` with every override in `tree` ({field: text or subtree}) applied at once, so
    that cross-field checks see the final values whatever the order on the command line. `cfg` may
    be a dataclass type: an absent sub-config is created from its defaults and the given fields."""
    cls = cfg if isinstance(cfg, type) else type(cfg)
    fields = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    changes = {}
    for name, value in tree.items():
        path = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            raise ConfigError(path, value if isinstance(value, str) else None,
                              f"unknown field; {cls.__name__} has {', '.join(sorted(fields))}")
        if isinstance(value, str):
            changes[name] = _coerce(path, value, hints[name])
            continue
        child = None if isinstance(cfg, type) else getattr(cfg, name)
        if child is None:  # a field of an absent sub-config: built from its defaults and these fields
            child = next((a for a in (hints[name], *typing.get_args(hints[name]))
                          if dataclasses.is_dataclass(a)), None)
        if not dataclasses.is_dataclass(child):
            raise ConfigError(path, None, f"{path} is a value, not a nested config")
        changes[name] = _build(child, value, path)
    try:
        return cls(**changes) if isinstance(cfg, type) else dataclasses.replace(cfg, **changes)
    except ConfigError as e:
        raise e.under(prefix) from None


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Applies overrides like `model.num_layers=2` (a leading `--config.` is accepted too)."""
    tree: dict = {}
    for item in overrides:
        item = item.removeprefix("--").removeprefix("config.")
        if "=" not in item:
            raise ConfigError(item, None, "expected FIELD=VALUE, e.g. --config.model.num_layers=2")
        path, _, text = item.partition("=")
        *parents, leaf = path.strip().split(".")
        node = tree
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if isinstance(node, str):
                raise ConfigError(".".join(parents[:i + 1]), node, "set either the value or its fields, not both")
        if isinstance(node.get(leaf), dict):
            raise ConfigError(path.strip(), text.strip(), "set either the value or its fields, not both")
        node[leaf] = text.strip()
    return _build(cfg, tree, "")


def call_file(path: Path, function: str, field: str, returns: str) -> Any:
    """`function()` of the Python file `path` (a config or study file); errors name `field`."""
    spec = importlib.util.spec_from_file_location(f"gattn_{function}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, function):
        raise ConfigError(field, str(path), f"the file must define {function}() -> {returns}")
    return getattr(module, function)()


def load(path: str | Path, overrides: list[str] = (), variant: str | None = None) -> Config:
    """Loads `get_config()` from a Python config file (or a run's config.json, e.g. a model
    converted from Hugging Face, to continue training it), applies a variant, then the overrides."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("--config", str(path), "expected the path of a Python file under configs/ "
                          "or of a run's config.json")
    if path.suffix == ".json":
        cfg = from_dict(Config, json.loads(path.read_text()))
    else:
        cfg = call_file(path, "get_config", "--config", "Config")
    # `--config.variant=NAME` is the same as `--variant NAME`: the variant is applied, not relabelled.
    named = [o for o in overrides if o.removeprefix("--").removeprefix("config.").startswith("variant=")]
    overrides = [o for o in overrides if o not in named]
    variant = named[-1].partition("=")[2].strip() if named else variant
    if variant is not None:
        from gattn import variants  # noqa: PLC0415 (variants imports this module)

        cfg = dataclasses.replace(cfg, model=variants.apply(variant, cfg.model), variant=variant)
    return apply_overrides(cfg, list(overrides))


def from_dict(cls: type, tree: dict, prefix: str = "") -> Any:
    """The dataclass `cls` from a JSON-like dict (`dataclasses.asdict` of one, e.g. a run's
    config.json); nested configs are rebuilt, every value is checked as usual."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in tree.items():
        path = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            raise ConfigError(path, None, f"unknown field; {cls.__name__} has {', '.join(sorted(fields))}")
        sub = next((a for a in (hints[name], *typing.get_args(hints[name])) if dataclasses.is_dataclass(a)), None)
        kwargs[name] = from_dict(sub, value, path) if sub is not None and isinstance(value, dict) else value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.under(prefix) from None


def flat_fields(tree: Any) -> dict:
    """{"model.gate.position": value, ...}: a config (or its JSON dict, as in config.json) as
    dotted field paths, values as JSON would hold them (for comparing two configs field by field)."""
    if dataclasses.is_dataclass(tree):
        tree = json.loads(json.dumps(dataclasses.asdict(tree)))
    out = {}
    for k, v in tree.items():
        out.update({f"{k}.{kk}": vv for kk, vv in flat_fields(v).items()} if isinstance(v, dict) else {k: v})
    return out


def load_run(workdir: str | Path, overrides: list[str] = ()) -> Config:
    """The config a run in `workdir` was trained with (its config.json), with `overrides` applied
    (e.g. `model.attention_impl=xla` or a mesh for the devices present now)."""
    path = Path(workdir) / "config.json"
    if not path.is_file():
        raise ConfigError("--workdir", str(workdir), "expected a run directory holding config.json "
                          "(written by train.py)")
    cfg = from_dict(Config, json.loads(path.read_text()))
    overrides = list(overrides)
    names = [o.removeprefix("--").removeprefix("config.").partition("=")[0].strip() for o in overrides]
    if (any(n.startswith("model.yarn.") for n in names) and "model.yarn.original_len" not in names
            and cfg.model.yarn is None):
        # YaRN on a trained checkpoint: the context it was trained at is the run's own seq_len.
        overrides.append(f"model.yarn.original_len={cfg.train.seq_len}")
    return apply_overrides(cfg, overrides)


def parse_args(parser, argv=None, *, steps_set_train_steps: bool = False):
    """(args, overrides): the parser's own arguments and the `--config.FIELD=VALUE` overrides;
    anything else is an error. With `steps_set_train_steps`, `--steps N` becomes train.steps=N."""
    args, rest = parser.parse_known_args(argv)
    rest, overrides = split_argv(rest)
    if rest:
        parser.error(f"unrecognised arguments: {' '.join(rest)}")
    if steps_set_train_steps and args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    return args, overrides


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separates `--config.FIELD=VALUE` overrides from the other command-line arguments."""
    overrides = [a for a in argv if a.startswith("--config.")]
    return [a for a in argv if not a.startswith("--config.")], overrides


def run_cli(main, argv=None) -> int:
    """Runs an entry point's `main`, turning a ConfigError into one line on stderr and exit 2."""
    try:
        return main(argv) or 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
