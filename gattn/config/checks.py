"""The names a config allows (the choice tuples), `ConfigError`, and the small validators every
config class uses. JAX-free, like the whole of gattn.config."""

from __future__ import annotations

import math
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
# exec.remat (gattn/model/transformer.py builds them; docs/performance.md, "Rematerialisation")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "qkv_proj", "save_attn_out", "minimal",
                  "qkv_proj_offloaded", "minimal_offloaded")
# plain jnp reference / fused Pallas flash kernel (TPU) / its GPU (Triton) twin / cuDNN + gate /
# per backend (gattn/kernels/__init__.py, docs/gpu.md)
ATTENTION_IMPLS = ("xla", "pallas", "pallas_gpu", "cudnn", "auto")
# the Gated DeltaNet rule: jnp chunked scan / Pallas TPU kernel / per backend (gattn/kernels/gdn.py)
GDN_IMPLS = ("xla", "pallas", "auto")
MOE_IMPLS = ("partitioned", "all_to_all", "ragged")
GROUPED_MATMULS = ("ragged_dot", "megablox")  # exec.grouped_matmul of the ragged MoE path
ACCUMULATE = ("sharded", "gathered")  # exec.accumulate: FSDP's gradient accumulation (ZeRO-3 or ZeRO-2)
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
