"""Every variant of the paper as a named change to a baseline `ModelConfig`.

`python -m gattn.variants` lists them with their paper table and row. A variant is data: a
function from the baseline config to the variant's config; adding one is adding an entry here.

A run records a label (`label`): the variant's name when its model is that variant of its
baseline, else the name and the fields in which it is not (`baseline+gate.granularity="headwise"`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Callable

from gattn.config import ConfigError, GateSpec, ModelConfig, MoESpec, SwitchHeadsSpec, flat_fields


@dataclass(frozen=True)
class Variant:
    name: str
    rows: tuple[str, ...]      # the paper's rows, e.g. ("Table 1 (5)", "Table 3 (2)")
    description: str
    change: Callable[[ModelConfig], ModelConfig]
    needs_moe: bool = False    # applies to MoE models only (Table 1 row 4)


def _gate(**kw) -> Callable[[ModelConfig], ModelConfig]:
    return lambda m: dataclasses.replace(m, gate=GateSpec(**kw))


def _set(**kw) -> Callable[[ModelConfig], ModelConfig]:
    return lambda m: dataclasses.replace(m, **kw)


def _switch(targets: str, experts: int, top_k: int) -> Callable[[ModelConfig], ModelConfig]:
    return _set(switch_heads=SwitchHeadsSpec(targets=targets, num_experts=experts, top_k=top_k))


def _then(*changes):
    def change(m):
        for c in changes:
            m = c(m)
        return m
    return change


def _more_experts(m: ModelConfig) -> ModelConfig:
    """Table 1 row 4: 4 more experts in every MoE layer, and 4 more of them activated per token."""
    if m.moe is None:
        raise ConfigError("moe", None, "the more_experts variant (Table 1 row 4) needs a MoE model; "
                                       "set model.moe (e.g. configs/moe_15a2b.py)")
    return dataclasses.replace(m, moe=dataclasses.replace(
        m.moe, num_experts=m.moe.num_experts + 4, top_k=m.moe.top_k + 4))


_MATCHED = _set(match_ffn_params=True)

REGISTRY: dict[str, Variant] = {v.name: v for v in [
    # Table 1: the MoE 15A2B gating variants and parameter-matched baselines.
    Variant("baseline", ("Table 1 (1)", "Table 2 (1,3,5,6,11,12)", "Table 3 (1)", "Table 4 (1)",
                         "Table 6 (1)"), "no gate", lambda m: m),
    Variant("more_kv_heads", ("Table 1 (2)",), "twice the kv heads (k=4 -> 8)",
            lambda m: dataclasses.replace(m, kv_heads=2 * m.kv_heads)),
    Variant("more_q_heads", ("Table 1 (3)",), "1.5x the query heads (q=32 -> 48)",
            lambda m: dataclasses.replace(m, q_heads=m.q_heads * 3 // 2)),
    Variant("more_experts", ("Table 1 (4)",), "4 more experts, total and activated (MoE models)",
            _more_experts, needs_moe=True),
    Variant("sdpa_elementwise", ("Table 1 (5)", "Table 3 (2)", "Table 4 (2)"),
            "G1 elementwise sigmoid gate on the SDPA output", _gate()),
    Variant("v_elementwise", ("Table 1 (6)", "Table 3 (3)", "Table 4 (5)"),
            "G2 elementwise sigmoid gate on the value projection", _gate(position="value")),
    Variant("k_elementwise", ("Table 1 (7)",), "G3 elementwise sigmoid gate on the key projection",
            _gate(position="key")),
    Variant("q_elementwise", ("Table 1 (8)",), "G4 elementwise sigmoid gate on the query projection",
            _gate(position="query")),
    Variant("dense_output", ("Table 1 (9)",), "G5 elementwise sigmoid gate after W_O",
            _gate(position="dense")),
    Variant("sdpa_headwise", ("Table 1 (10)", "Table 4 (3)"), "G1 headwise sigmoid gate",
            _gate(granularity="headwise")),
    Variant("v_headwise", ("Table 1 (11)",), "G2 headwise sigmoid gate (one scalar per kv head)",
            _gate(position="value", granularity="headwise")),
    Variant("sdpa_head_shared", ("Table 1 (12)", "Table 4 (4)"),
            "G1 elementwise gate, score averaged over heads", _gate(sharing="head_shared")),
    Variant("v_head_shared", ("Table 1 (13)",), "G2 elementwise gate, score averaged over kv heads",
            _gate(position="value", sharing="head_shared")),
    Variant("sdpa_additive_silu", ("Table 1 (14)", "Table 3 (4)"), "G1 additive gate, Y + SiLU(XW)",
            _gate(form="additive", activation="silu")),
    Variant("sdpa_elementwise_silu", ("Table 1 (15)",), "G1 multiplicative gate, Y * SiLU(XW)",
            _gate(activation="silu")),
    # Table 3: non-linearity without (or with a linear) gate.
    Variant("sdpa_rmsnorm", ("Table 3 (5)",), "per-head RMSNorm on the SDPA output ('GroupNorm')",
            _set(sdpa_nonlinearity="rmsnorm")),
    Variant("sdpa_silu", ("Table 3 (6)",), "SiLU on the SDPA output, no parameters",
            _set(sdpa_nonlinearity="silu")),
    Variant("sdpa_additive_identity", ("Table 3 (7)",), "G1 additive gate, Y + XW",
            _gate(form="additive", activation="identity")),
    # Table 4: sparsity ablations.
    Variant("sdpa_input_independent", ("Table 4 (6)",),
            "G1 gate sigmoid(theta), theta a zero-initialised q x d_k tensor",
            _gate(input_dependent=False)),
    Variant("sdpa_ns_sigmoid", ("Table 4 (7)",), "G1 gate with NS-sigmoid = 0.5 + 0.5 sigmoid",
            _gate(activation="ns_sigmoid")),
    # Table 6 (Appendix A.1): Switch Heads.
    Variant("switch_kv_8top8", ("Table 6 (2)",), "8 key+value experts per kv head, top-8",
            _switch("kv", 8, 8)),
    Variant("switch_kv_4top4", ("Table 6 (3)",), "4 key+value experts per kv head, top-4",
            _switch("kv", 4, 4)),
    Variant("switch_v_4top4", ("Table 6 (4)",), "4 value experts per kv head, top-4", _switch("v", 4, 4)),
    Variant("switch_v_8top2", ("Table 6 (5)",), "8 value experts per kv head, top-2", _switch("v", 8, 2)),
    Variant("switch_v_1top1", ("Table 6 (6)",), "1 value expert, sigmoid-weighted (= v_headwise)",
            _switch("v", 1, 1)),
    # Table 2: dense 1.7B models; gated variants shrink the FFN to keep the parameter count.
    Variant("sdpa_elementwise_ffn_matched", ("Table 2 (2,4,8,10,13,14)",),
            "G1 elementwise gate, FFN narrowed to the baseline's parameter count",
            _then(_gate(), _MATCHED)),
    Variant("sdpa_headwise_ffn_matched", ("Table 2 (9)",),
            "G1 headwise gate, FFN narrowed to the baseline's parameter count",
            _then(_gate(granularity="headwise"), _MATCHED)),
    Variant("sandwich_norm", ("Table 2 (7)",), "RMSNorm on attention/FFN outputs before the residual",
            _set(sandwich_norm=True)),
    # Appendix A.5: clipping branch outputs.
    Variant("output_clip_100", ("Appendix A.5",), "attention/FFN outputs clipped to (-100, 100)",
            _set(output_clip=100.0)),
    Variant("output_clip_300", ("Appendix A.5",), "attention/FFN outputs clipped to (-300, 300)",
            _set(output_clip=300.0)),
]}


# The fields a variant sets outright; a baseline has each at its default (no gate, no Switch Heads,
# no SDPA non-linearity, no sandwich norm, no clipping, no FFN matching). The other variants scale
# head or expert counts of their baseline (more_kv_heads, more_q_heads, more_experts).
AXES = ("gate", "switch_heads", "sdpa_nonlinearity", "sandwich_norm", "output_clip", "match_ffn_params")
_BASELINE = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in AXES}
_PROBE = ModelConfig(vocab_size=64, d_model=32, num_layers=1, q_heads=4, kv_heads=2, head_dim=8, d_ff=64)


def apply(name: str, base: ModelConfig) -> ModelConfig:
    """The config of variant `name` built on `base` (a baseline: no gate, no switch heads)."""
    return _registered(name).change(base)


def _registered(name: str) -> Variant:
    if name not in REGISTRY:
        raise ConfigError("variant", name, f"expected one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def baseline_of(model: ModelConfig, label: str = "baseline") -> ModelConfig | None:
    """The baseline that `model`, recorded as `label`, is a variant of: `model` with the AXES at
    their defaults. None where the label's variant scales heads or experts: that baseline's
    counts are not in the model."""
    return None if _scales(label.partition("+")[0]) else dataclasses.replace(model, **_BASELINE)


def label(name: str, model: ModelConfig, base: ModelConfig | None = None) -> str:
    """What a run of `model` is called: `name` when `model` is variant `name` of `base`, else
    `name+field=value,...` listing where it is not, on the AXES and on the fields the variant
    itself changes (kv_heads for more_kv_heads). Sizes and the other fields are the config's, not
    the label's. `base` None (a recorded run, whose baseline is not known): the AXES only."""
    if base is None:  # (a variant that scales counts sets no AXES: the baseline's are expected)
        reset = dataclasses.replace(model, **_BASELINE)
        want = reset if _scales(name) else apply(name, reset)
    else:
        want = apply(name, base)
    own = [] if base is None else [k for k in _own(name, base) if k.partition(".")[0] not in AXES]
    changes = [c for f in AXES for c in _changed(f, getattr(want, f), getattr(model, f))]
    have, expected = flat_fields(model), flat_fields(want)
    changes += [f"{k}={json.dumps(have.get(k))}" for k in own if have.get(k) != expected.get(k)]
    return f"{name}+{','.join(changes)}" if changes else name


def checked(recorded: str, model: ModelConfig) -> str:
    """A recorded label checked against its model on the AXES: a bare variant name recorded for a
    model that is not that variant (a run recorded before labels named their overrides) becomes
    what `label` calls it; a label that names its changes is kept."""
    name = recorded.partition("+")[0]
    return label(name, model) if "+" not in recorded and name in REGISTRY else recorded


def _scales(name: str) -> bool:
    """Whether variant `name` changes fields beyond the AXES (head or expert counts), as it
    does on a small probe model (on a model it does not build on, it would raise)."""
    probe = dataclasses.replace(_PROBE, moe=MoESpec(num_experts=4, top_k=2, expert_width=16)) \
        if _registered(name).needs_moe else _PROBE
    return any(k.partition(".")[0] not in AXES for k in _own(name, probe))


def _own(name: str, base: ModelConfig) -> list[str]:
    """The dotted fields that variant `name` changes in `base` (`gate.position`, `kv_heads`, ...)."""
    was, now = flat_fields(base), flat_fields(apply(name, base))
    return sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))


def _changed(field: str, want, have) -> list[str]:
    """`field=value` items for a field whose value `have` is not the variant's `want`; a sub-config
    as the fields where it differs (from `want`'s, or from its defaults where `want` is None)."""
    if have == want:
        return []
    if not dataclasses.is_dataclass(have):
        return [f"{field}={json.dumps(have)}"]
    ref = flat_fields(want if dataclasses.is_dataclass(want) else type(have)())
    return [f"{field}.{k}={json.dumps(v)}" for k, v in flat_fields(have).items() if ref.get(k) != v] \
        or [f"{field}=default"]


def applicable(base: ModelConfig) -> list[str]:
    """The variants that apply to `base`: those whose change of `base` is a valid config. Some
    never build on some baselines: the MoE-only ones on a dense model, the FFN-matched ones on a
    MoE model (they narrow the dense FFN), more_q_heads / more_kv_heads where the changed q_heads
    is no longer a multiple of kv_heads (e.g. q_heads = kv_heads, or q_heads / kv_heads odd)."""
    return [n for n, v in REGISTRY.items() if _builds(v, base)]


def _builds(v: Variant, base: ModelConfig) -> bool:
    try:
        v.change(base)
    except ConfigError:
        return False
    return True


def table(name: str) -> dict:
    v = REGISTRY[name]
    return {"name": v.name, "rows": list(v.rows), "description": v.description,
            "moe_only": v.needs_moe}


def main(argv=None):
    ap = argparse.ArgumentParser(description="List the paper's variants with their table and row.")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    rows = [table(n) for n in REGISTRY]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    width = max(len(n) for n in REGISTRY)
    for r in rows:
        print(f"{r['name']:<{width}}  {', '.join(r['rows']):<34}  {r['description']}")


if __name__ == "__main__":
    main()
