"""The schema of a run: typed, frozen dataclasses for the gate design space, the architecture,
the execution settings, training, data and the mesh.

Every value is checked when the object is built, before any JAX work, and a bad value raises
`ConfigError` naming the field, the value and what is allowed. This module imports nothing from
gattn and no JAX, so checking a config is instant; reading config files and command-line
overrides is `gattn.cli`'s job.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
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
# plain jnp reference / fused Pallas flash kernel (TPU) / its GPU (Triton) twin / cuDNN + gate /
# per backend (gattn/kernels/__init__.py, docs/gpu.md)
ATTENTION_IMPLS = ("xla", "pallas", "pallas_gpu", "cudnn", "auto")
MOE_IMPLS = ("partitioned", "all_to_all", "ragged")
LBL_SCOPES = ("global", "micro")
DECODE_ERRORS = ("strict", "replace")  # data.decode_errors (gattn/data/corpus.py)


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
    """One point of the paper's gate design space (Sec. 2.2, Fig. 1).

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
        """(heads, width) of the score before any head sharing (see gattn/model/gates.py)."""
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
    """The architecture of a decoder-only LM: pre-RMSNorm blocks of GQA attention (with an optional
    gate) and SwiGLU. Everything here is what a checkpoint *is*: a resumed run or an evaluation
    that changes a field is refused (only `POSITION_FIELDS` may change in eval and continued
    training). How the model is computed is `ExecConfig`."""

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
    param_dtype: str = "float32"           # the dtype parameters are stored (and checkpointed) in

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "q_heads", "kv_heads", "head_dim", "d_ff"):
            _integer(name, getattr(self, name))
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
        for name in ("tie_embeddings", "qk_norm", "attention_bias", "sandwich_norm", "match_ffn_params"):
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


# The model fields an evaluation (and a continued run, with `train.init_from`) may change: how
# positions are encoded, e.g. YaRN on a trained checkpoint (the paper's Sec. 4.4 and Table 5).
POSITION_FIELDS = ("rope_base", "yarn")


@dataclass(frozen=True)
class ExecConfig:
    """How the model is computed, not what it is: free to change on resume, in eval and when moving
    to another machine (the checkpoint's parameters do not depend on any of it).

    dtype:            compute dtype of activations and matmul inputs (parameters keep model.param_dtype).
    scan_layers:      one jax.lax.scan over stacked blocks (fast compiles for deep models) instead
                      of a Python loop; checkpoints convert between the two layouts on restore.
    remat:            rematerialisation of each block in the backward pass: none, full, dots,
                      dots_no_batch (which intermediates are saved).
    attention_impl:   xla (the plain jnp reference) or pallas (the fused flash kernel with the gate;
                      compiled by Mosaic on TPU, interpret mode elsewhere, ~100x slower);
                      pallas_gpu (the fused kernel for GPUs, Triton; interpret mode elsewhere);
                      cudnn (cuDNN attention, gate applied after it); auto (TPU -> pallas,
                      GPU -> kernels.GPU_DEFAULT, else xla). docs/gpu.md.
    attention_block_q: causal query block of the xla path (0 = no blocking).
    attention_query_chunk: > 0: the xla path runs queries this many at a time in a loop
                      (memory O(chunk * S) per layer; long contexts on CPU).
    flash_block_q, flash_block_k: query / key blocks of the pallas kernel (multiples of 8; TPU
                      wants multiples of 128).
    moe_impl:         partitioned: the MoE layer is one program that XLA's partitioner splits over
                      the mesh (dropless or with a capacity counted over the whole batch);
                      all_to_all: tokens exchanged explicitly over the mesh's expert axis inside
                      shard_map (needs model.moe.capacity_factor and mesh.expert > 1 dividing the
                      experts; capacity is counted per data x expert shard); ragged: dropless
                      expert parallelism, only the routed rows exchanged with ragged_all_to_all
                      and grouped matmuls (needs a dropless MoE, capacity_factor None, and
                      mesh.expert > 1 dividing the experts; gattn/model/dropless_ep.py). Chosen
                      here, never by whatever mesh happens to be set.
    moe_buffer:       ragged only: rows each device's experts can receive, as a multiple of the
                      rows one shard routes (N_local * k). None = the worst case, every row of
                      every shard of the expert group (mesh.expert x), so nothing can overflow; a
                      smaller value (>= 1) saves memory and compute, and rows past it are dropped
                      and counted (moe/dropped), never silently.
    """

    dtype: str = "float32"
    scan_layers: bool = False
    remat: str = "none"
    attention_impl: str = "xla"
    attention_block_q: int = 128
    attention_query_chunk: int = 0
    flash_block_q: int = 512
    flash_block_k: int = 512
    moe_impl: str = "partitioned"
    moe_buffer: float | None = None

    def __post_init__(self):
        _choice("dtype", self.dtype, DTYPES)
        _bool("scan_layers", self.scan_layers)
        _choice("remat", self.remat, REMAT_POLICIES)
        _choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _choice("moe_impl", self.moe_impl, MOE_IMPLS)
        if self.moe_buffer is not None and not (isinstance(self.moe_buffer, (int, float))
                                                and not isinstance(self.moe_buffer, bool)
                                                and self.moe_buffer >= 1):
            raise ConfigError("moe_buffer", self.moe_buffer, "expected None (the worst case) or a number >= 1")
        _integer("attention_block_q", self.attention_block_q, zero_ok=True)
        _integer("attention_query_chunk", self.attention_query_chunk, zero_ok=True)
        for name in ("flash_block_q", "flash_block_k"):
            _integer(name, getattr(self, name))
            if getattr(self, name) % 8:
                raise ConfigError(name, getattr(self, name), "expected a positive multiple of 8")


# Fields that lived in ModelConfig before the architecture / execution split: a run's older
# config.json and `--config.model.FIELD=...` overrides are read as `exec.FIELD`.
MOVED_TO_EXEC = tuple(f.name for f in dataclasses.fields(ExecConfig))


# The paper's learning-rate recipes (Sec. 3.2): name -> (max LR, final LR, warmup steps). The
# paper gives the floor only for the MoE recipe; the dense presets decay to 1% of their peak.
LR_PRESETS = {
    "moe_15a2b": (2e-3, 3e-5, 1000),          # Table 1: 1k warmup, 2e-3 -> 3e-5, bsz 1024
    "dense_400b": (4e-3, 4e-5, 1000),         # Table 2 rows 1-2, 5, 8-9 (bsz 1024)
    "dense_3.5t": (4.5e-3, 4.5e-5, 1000),     # Table 2 rows 3-4 (bsz 2048)
    "dense_1t": (5.3e-3, 5.3e-5, 1000),       # Table 2 rows 11, 13 (bsz 4096)
    "dense_high_lr": (8e-3, 8e-5, 1000),      # Table 2 rows 6-7, 10, 12, 14: the baseline diverges
}


BACKCOPY = "bigram_backcopy"  # data.source of the synthetic Bigram-Backcopy task (gattn/data/backcopy.py)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


@dataclass(frozen=True)
class BackcopySpec:
    """Bigram-Backcopy (Guo et al. 2024), the task that makes attention sinks form in small models
    (docs/sinks.md): each row is one sequence `<s> x1 x2 ...` over the `chars` most frequent
    characters of the embedded docs. After a trigger character of set j the next token copies the
    token offsets[j] places before the trigger; after any other character it is drawn from the
    docs' character bigrams.

    chars:    vocabulary size besides <s>.
    triggers: trigger sets as character frequency ranks (0 = the most frequent, a space), a set's
              ranks separated by ',' and sets by '|': "0,1,2" is Guo's one set of the top 3;
              "0|1|2|3" four one-character sets.
    offsets:  per trigger set, how far before the trigger the copied token is (1 = the token
              just before it, Guo's task), separated by ','.
    """

    chars: int = 63
    triggers: str = "0,1,2"
    offsets: str = "1"

    def __post_init__(self):
        _integer("chars", self.chars)
        if self.chars < 2:
            raise ConfigError("chars", self.chars, "expected at least 2 characters")
        try:
            sets = self.trigger_sets
        except (AttributeError, ValueError):
            raise ConfigError("triggers", self.triggers, "expected ranks like '0,1,2' or sets like '0|1|2'") from None
        ranks = [r for s in sets for r in s]
        if any(not 0 <= r < self.chars for r in ranks) or len(set(ranks)) != len(ranks):
            raise ConfigError("triggers", self.triggers,
                              f"expected distinct character ranks in 0..{self.chars - 1}, each in one set")
        if len(ranks) >= self.chars:
            raise ConfigError("triggers", self.triggers, f"expected fewer triggers than chars ({self.chars})")
        try:
            offsets = self.offset_list
        except (AttributeError, ValueError):
            offsets = []
        if len(offsets) != len(sets) or any(o < 1 for o in offsets):
            raise ConfigError("offsets", self.offsets,
                              f"expected one integer >= 1 per trigger set ({len(sets)}), separated by ','")

    @property
    def trigger_sets(self) -> list[list[int]]:
        return [_int_list(s) for s in self.triggers.split("|")]

    @property
    def offset_list(self) -> list[int]:
        return _int_list(self.offsets)


@dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it becomes tokens (gattn/data)."""

    source: str = "embedded"        # "embedded" (CPython docs + stdlib sources) or a folder path
    code_max_bytes: int = 1_500_000  # how much stdlib source the embedded corpus takes
    tokenizer: str = ""             # a SentencePiece .model file; "" trains one of model.vocab_size
    shuffle_window: int = 256       # packed rows shuffled together (decorrelates batches)
    eval_batches: int = 4           # held-out batches per domain for validation
    eval_batch_size: int = 8
    # A folder's text that is not valid UTF-8: "strict" refuses it, naming the file and the byte
    # offset; "replace" decodes it with U+FFFD and reports how many bytes were replaced.
    decode_errors: str = "strict"
    # Natural text: a fixed BOS token opens each document (a fixed first token, the literature's
    # strongest attention-sink recipe; docs/sinks.md). document_resets: positions restart and
    # attention stops at each document start (True), or each row is a plain window of
    # concatenated text read as one sequence (False; Gu et al.'s setup).
    bos: bool = False
    document_resets: bool = True
    backcopy: BackcopySpec = field(default_factory=BackcopySpec)  # used when source is 'bigram_backcopy'

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source:
            raise ConfigError("source", self.source, "expected 'embedded' or a folder path")
        _choice("decode_errors", self.decode_errors, DECODE_ERRORS)
        if not isinstance(self.tokenizer, str):
            raise ConfigError("tokenizer", self.tokenizer, "expected a path or ''")
        for name in ("code_max_bytes", "shuffle_window", "eval_batches", "eval_batch_size"):
            _integer(name, getattr(self, name))
        _bool("bos", self.bos)
        _bool("document_resets", self.document_resets)
        if not isinstance(self.backcopy, BackcopySpec):
            raise ConfigError("backcopy", self.backcopy, "expected a BackcopySpec")
        if self.source == BACKCOPY:
            for name, natural in (("bos", False), ("document_resets", True), ("tokenizer", "")):
                if getattr(self, name) != natural:
                    raise ConfigError(name, getattr(self, name), f"source {BACKCOPY!r} has its own <s> start "
                                      f"token, one sequence per row and its own vocabulary: leave it {natural!r}")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, checkpointing and logging of a run (gattn/train/optim.py, gattn/train/trainer.py)."""

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
        if self.seed > 2**32 - 1:  # the data pipeline's and NumPy's seeds are unsigned 32-bit
            raise ConfigError("seed", self.seed, f"expected an integer in 0..{2**32 - 1}")
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
    """Device mesh axes (gattn/model/sharding.py): data parallel, expert parallel, model (tensor)
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
    """A run: the architecture (`model`), how it trains (`train`) on what (`data`), and where and
    how it is computed (`mesh`, `exec`: free to change between runs of the same checkpoint)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    exec: ExecConfig = field(default_factory=ExecConfig)
    # The registered variant (gattn.variants) that `gattn.cli.load` applied to the config file's
    # model. It is a record, not a switch: choose a variant with `--variant NAME` (or
    # `--config.variant=NAME`); gattn.cli checks the name against the registry.
    variant: str = "baseline"

    def __post_init__(self):
        if not isinstance(self.variant, str) or not self.variant:
            raise ConfigError("variant", self.variant, "expected a registered variant's name "
                              "(python -m gattn.variants)")
        for name, kind in (("model", ModelConfig), ("train", TrainConfig), ("data", DataConfig),
                           ("mesh", MeshConfig), ("exec", ExecConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(name, type(getattr(self, name)).__name__, f"expected a {kind.__name__}")
        if self.exec.moe_impl == "all_to_all":
            moe = self.model.moe
            if moe is None or moe.capacity_factor is None:
                raise ConfigError("exec.moe_impl", "all_to_all", "the explicit all-to-all needs a MoE model with "
                                  "model.moe.capacity_factor set (fixed-size buffers); use 'partitioned'")
            if self.mesh.expert < 2 or moe.num_experts % self.mesh.expert:
                raise ConfigError("exec.moe_impl", "all_to_all", f"it splits the {moe.num_experts} experts over "
                                  f"mesh.expert (now {self.mesh.expert}): set mesh.expert > 1 dividing them")
        if self.exec.moe_impl == "ragged":
            moe = self.model.moe
            if moe is None or moe.capacity_factor is not None:
                raise ConfigError("exec.moe_impl", "ragged", "dropless expert parallelism needs a MoE model "
                                  "with model.moe.capacity_factor None; use 'all_to_all' with a capacity")
            if self.mesh.expert < 2 or moe.num_experts % self.mesh.expert:
                raise ConfigError("exec.moe_impl", "ragged", f"it splits the {moe.num_experts} experts over "
                                  f"mesh.expert (now {self.mesh.expert}): set mesh.expert > 1 dividing them")




# --------------------------------------------------------------------------- dicts (config.json)


def from_dict(cls: type, tree: dict, prefix: str = "") -> Any:
    """The dataclass `cls` from a JSON-like dict (`dataclasses.asdict` of one, e.g. a run's
    config.json); nested configs are rebuilt, every value is checked as usual. A `Config` written
    before the architecture / execution split has its execution fields under "model": they are
    read as `exec`."""
    if cls is Config and any(k in MOVED_TO_EXEC for k in tree.get("model", {})):
        tree = dict(tree, model=dict(tree["model"]), exec=dict(tree.get("exec", {})))
        for name in MOVED_TO_EXEC:
            if name in tree["model"]:
                tree["exec"].setdefault(name, tree["model"].pop(name))
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


def to_dict(cfg: Any) -> dict:
    """A config as JSON would hold it (what a run's config.json stores)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def flat_fields(tree: Any) -> dict:
    """{"model.gate.position": value, ...}: a config (or its JSON dict, as in config.json) as
    dotted field paths, values as JSON would hold them (for comparing two configs field by field)."""
    if dataclasses.is_dataclass(tree):
        tree = to_dict(tree)
    out = {}
    for k, v in tree.items():
        out.update({f"{k}.{kk}": vv for kk, vv in flat_fields(v).items()} if isinstance(v, dict) else {k: v})
    return out


def differences(now: Any, then: Any, under: tuple[str, ...], *, may_differ: tuple[str, ...] = ()) -> list[tuple]:
    """[(field, now, then), ...]: the dotted fields starting with one of `under` whose values
    differ between two configs (or their config.json dicts), except those starting with one of
    `may_differ`. A run written before the execution split is read with `from_dict` first."""
    now = flat_fields(from_dict(Config, now) if isinstance(now, dict) else now)
    then = flat_fields(from_dict(Config, then) if isinstance(then, dict) else then)
    return [(k, now.get(k), then.get(k)) for k in sorted(set(now) | set(then))
            if k.startswith(under) and not k.startswith(may_differ) and now.get(k) != then.get(k)]
