"""The architecture: `ModelConfig` and the gate, MoE, Switch Heads and YaRN specs it holds.
Everything here is what a checkpoint *is*."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gattn.config.checks import (DTYPES, FFN_ACTIVATIONS, FORMS, GATE_ACTIVATIONS, GRANULARITIES, LBL_SCOPES,
                                 POSITIONS, SDPA_NONLINEARITIES, SHARINGS, SWITCH_TARGETS, ConfigError, _bool,
                                 _choice, _integer, _positive)


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
                        Cached decoding ignores it (dropless: a row never competes with the others).
    lbl_coef, lbl_scope: load-balancing loss weight, and whether expert frequencies are counted
                        over the global batch ("global", Qiu et al. 2025b) or per micro-batch
                        ("micro": the batch's rows split into `micro_batches` groups of whole
                        rows, averaged; train.batch_size must be a multiple of it).
    z_loss_coef:        router z-loss weight (mean squared log-sum-exp of router logits).
    shared_expert_width: > 0: a shared SwiGLU expert of this width that every token also runs,
                        its output scaled by sigmoid(x w_g) (w_g [D, 1]) and added to the routed
                        experts' (Qwen3-Next's shared_expert and shared_expert_gate); 0 = none.
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
    shared_expert_width: int = 0

    def __post_init__(self):
        for name in ("num_experts", "top_k", "expert_width", "micro_batches"):
            _integer(name, getattr(self, name))
        _integer("shared_expert_width", self.shared_expert_width, zero_ok=True)
        if self.top_k > self.num_experts:
            raise ConfigError("top_k", self.top_k, f"expected 1..num_experts ({self.num_experts})")
        _bool("renormalize", self.renormalize)
        if self.capacity_factor is not None:
            _positive("capacity_factor", self.capacity_factor)
        _positive("lbl_coef", self.lbl_coef, zero_ok=True)
        _positive("z_loss_coef", self.z_loss_coef, zero_ok=True)
        _choice("lbl_scope", self.lbl_scope, LBL_SCOPES)

    def num_params(self, d_model: int) -> tuple[int, int]:
        """(total, activated) parameters of one MoE FFN: router plus experts (3 matrices each),
        plus the shared expert and its gate, which every token uses."""
        expert = 3 * d_model * self.expert_width
        router = d_model * self.num_experts
        if self.shared_expert_width:
            router += 3 * d_model * self.shared_expert_width + d_model
        return router + self.num_experts * expert, router + self.top_k * expert


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The Gated DeltaNet layers of a hybrid model (Qwen3-Next's `linear_*` fields; the layer is
    gattn/model/gdn.py, docs/hybrid.md). Qwen3-Next-80B-A3B: 16 key heads and 32 value heads of
    128, a conv of width 4.

    num_k_heads, head_k_dim: the G key (and query) heads of the rule's state and their width K.
    num_v_heads, head_v_dim: the H value heads (a multiple of G; each key head serves H/G
                      consecutive value heads) and their width V.
    conv_kernel:      width W of the depthwise causal conv over q, k and v.
    """

    num_k_heads: int = 2
    num_v_heads: int = 4
    head_k_dim: int = 32
    head_v_dim: int = 32
    conv_kernel: int = 4

    def __post_init__(self):
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel"):
            _integer(name, getattr(self, name))
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError("num_v_heads", self.num_v_heads,
                              f"expected a multiple of num_k_heads = {self.num_k_heads} (each key head "
                              "serves num_v_heads / num_k_heads value heads)")


LAYER_TYPES = ("full_attention", "linear_attention")  # transformers' names (Qwen3NextConfig.layer_types)


def hybrid_layer_types(num_layers: int, full_attention_interval: int = 4) -> tuple[str, ...]:
    """Qwen3-Next's pattern: every `full_attention_interval`-th layer full attention (layers
    interval-1, 2*interval-1, ...), the others Gated DeltaNet: 3 GDN : 1 full for 4."""
    return tuple("full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
                 for i in range(num_layers))


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
    zero_centered_norm: bool = False       # every RMSNorm but GDN's stores w and scales by 1 + w
                                           # (initialised 0; Qwen3-Next's), instead of a scale
                                           # initialised 1.
    attention_bias: bool = False           # biases on W_Q, W_K, W_V, W_O and the gate's W_theta
                                           # (Qwen3's attention_bias, the authors' release's qkv_bias).
    qkv_bias: bool = False                 # biases on W_Q, W_K, W_V only (Qwen2.5's attention).
    norm_eps: float = 1e-6
    init_std: float = 0.02
    # The paper's variant space.
    gate: GateSpec | None = None
    sdpa_nonlinearity: str = "none"        # Table 3 rows 5-6: per-head RMSNorm or SiLU at G1.
    switch_heads: SwitchHeadsSpec | None = None  # Table 6.
    moe: MoESpec | None = None             # None: a dense SwiGLU FFN of width d_ff.
    # Hybrid models (Qwen3-Next): each layer's token mixer, "full_attention" (the attention above,
    # gate and all) or "linear_attention" (Gated DeltaNet, `linear_attention`); None = all full.
    layer_types: tuple[str, ...] | None = None
    linear_attention: LinearAttentionSpec | None = None
    sandwich_norm: bool = False            # Table 2 row 7: RMSNorm on attn/FFN outputs.
    output_clip: float | None = None       # Appendix A.5: clip attn/FFN outputs to (-c, c).
    match_ffn_params: bool = False         # Table 2: shrink d_ff so params equal the baseline's.
    param_dtype: str = "float32"           # the dtype parameters are stored (and checkpointed) in
    # Qwen3-Next's / Qwen3.5's multi-token-prediction layer (gattn/model/mtp.py, docs/mtp.md): 1 = one
    # full-attention block that predicts token t+2 at position t, sharing the embedding and LM head
    # (trained with train.mtp_loss_weight, drafting for speculative decoding); 0 = none.
    mtp_layers: int = 0

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
        for name in ("tie_embeddings", "qk_norm", "zero_centered_norm", "attention_bias", "qkv_bias",
                     "sandwich_norm", "match_ffn_params"):
            _bool(name, getattr(self, name))
        if self.output_clip is not None:
            _positive("output_clip", self.output_clip)
        if self.gate is not None and not isinstance(self.gate, GateSpec):
            raise ConfigError("gate", self.gate, "expected a GateSpec or None")
        if self.switch_heads is not None and not isinstance(self.switch_heads, SwitchHeadsSpec):
            raise ConfigError("switch_heads", self.switch_heads, "expected a SwitchHeadsSpec or None")
        if self.switch_heads is not None and self.attention_bias:
            raise ConfigError("attention_bias", True, "switch heads (switch_heads is set) have no biases")
        if self.qkv_bias and (self.attention_bias or self.switch_heads is not None):
            raise ConfigError("qkv_bias", True, "False with attention_bias (it biases q, k and v already) "
                              "or switch_heads (they have no biases)")
        if self.yarn is not None and not isinstance(self.yarn, YarnSpec):
            raise ConfigError("yarn", self.yarn, "expected a YarnSpec or None")
        if self.moe is not None and not isinstance(self.moe, MoESpec):
            raise ConfigError("moe", self.moe, "expected a MoESpec or None")
        if self.moe is not None and self.match_ffn_params:
            raise ConfigError("match_ffn_params", True, "FFN matching is for dense models (moe is set)")
        self._check_layer_types()
        if not isinstance(self.mtp_layers, int) or isinstance(self.mtp_layers, bool) or self.mtp_layers not in (0, 1):
            raise ConfigError("mtp_layers", self.mtp_layers, "0 (no multi-token prediction) or 1 (Qwen3-Next's "
                              "and Qwen3.5's one MTP layer; deeper MTP stacks are not built)")
        if self.ffn_width <= 0:
            raise ConfigError("match_ffn_params", True,
                              f"the block adds {self.block_added_params} parameters, more than the "
                              f"FFN (d_ff={self.d_ff}) has; use a larger d_ff or match_ffn_params=False")

    def _check_layer_types(self):
        if self.layer_types is not None:
            if isinstance(self.layer_types, list):
                object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers:
                raise ConfigError("layer_types", self.layer_types,
                                  f"a tuple of num_layers ({self.num_layers}) layer types, or None (all full "
                                  "attention); e.g. gattn.config.hybrid_layer_types(num_layers, 4)")
            for kind in self.layer_types:
                _choice("layer_types", kind, LAYER_TYPES)
        if self.linear_attention is not None and not isinstance(self.linear_attention, LinearAttentionSpec):
            raise ConfigError("linear_attention", self.linear_attention, "expected a LinearAttentionSpec or None")
        if self.hybrid and self.linear_attention is None:
            raise ConfigError("linear_attention", None, "a LinearAttentionSpec: layer_types has "
                              "'linear_attention' layers")

    @property
    def hybrid(self) -> bool:
        """Whether some layers are Gated DeltaNet (linear attention) layers."""
        return self.layer_types is not None and "linear_attention" in self.layer_types

    def layer_type(self, i: int) -> str:
        """Layer i's token mixer: "full_attention" or "linear_attention"."""
        return "full_attention" if self.layer_types is None else self.layer_types[i]

    @property
    def layer_period(self) -> int:
        """The length of the shortest pattern that layer_types repeats (1 without layer_types;
        Qwen3-Next's 3 Gated DeltaNet + 1 attention: 4). A scanned hybrid stacks its layers in
        groups of this many (gattn/model/transformer.py)."""
        types = self.layer_types or ("full_attention",)
        return next(p for p in range(1, len(types) + 1)
                    if len(types) % p == 0 and types == types[:p] * (len(types) // p))

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """The layers with (gated) softmax attention, where the attention measures apply."""
        return tuple(i for i in range(self.num_layers) if self.layer_type(i) == "full_attention")

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
