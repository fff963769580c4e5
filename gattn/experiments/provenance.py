"""Where every setting of a paper-scale preset comes from: a section or table of the paper, or
"ours" with the reason. Each preset file carries a `PROVENANCE` dict (dotted field -> source)
beside its `get_config()`; this module joins it with the config's values and with `COMMON`, the
sources of the schema's defaults, into one table per preset:

    python -m gattn.params --provenance [PRESET ...] [--json]

docs/presets.md holds the same tables (tests/test_presets.py checks that they agree).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import ModuleType

from gattn import cli
from gattn.config import Config

PAPER_PRESETS = ("dense_1p7b", "dense_1p7b_48l", "moe_15a2b", "extend_1p7b_32k")

_VARIANT = "the baseline; a --variant sets it (python -m gattn.variants)"
# Sources of the schema's defaults, for fields a preset leaves at them. A preset that changes one
# must name the source of its own value in its PROVENANCE (tests/test_presets.py).
COMMON = {
    "model.ffn_activation": "Qwen-style SwiGLU (Sec. 3.2.2 follows Yang et al. 2024a, Qwen2)",
    "model.tie_embeddings": "ours: untied (the paper does not say)",
    "model.rope_base": "Sec. 4.4: pretraining uses base 10k",
    "model.yarn": "Sec. 4.4: YaRN only stretches the 32k-extended model to 128k, at eval",
    "model.rope_dim": "ours: every dim of a head rotates (the paper says only 'RoPE', Sec. 4.4)",
    "model.qk_norm": "off: the paper never mentions QK-norm",
    "model.attention_bias": "ours: no biases (the paper does not say; Qwen3 has none)",
    "model.qkv_bias": "ours: no biases (the paper does not say; Qwen2.5, which its dense models follow, "
                      "biases q, k and v: configs/instability_lab_noqk.py)",
    "model.norm_eps": "ours: Qwen's RMSNorm epsilon 1e-6 (the paper gives none)",
    "model.init_std": "ours: every weight, the gate's W_theta included, truncated normal (+-2 std) "
                      "with std 0.02; the paper gives no initialisation",
    "model.gate": _VARIANT,
    "model.sdpa_nonlinearity": _VARIANT,
    "model.switch_heads": _VARIANT,
    "model.sandwich_norm": _VARIANT,
    "model.output_clip": _VARIANT,
    "model.match_ffn_params": _VARIANT + " (Table 2: gated dense models narrow the FFN)",
    "model.moe": "a dense model (Sec. 3.2.2)",
    "model.moe.shared_expert_width": "none: the paper's MoE has routed experts only (Sec. 3.1); Qwen3-Next "
                                     "adds a shared one (docs/hybrid.md)",
    "model.zero_centered_norm": "ours: RMSNorm scales start at 1 (Qwen3-Next stores w of 1 + w; docs/hybrid.md)",
    "model.layer_types": "every layer softmax attention, as in the paper (Qwen3-Next's hybrid: docs/hybrid.md)",
    "model.linear_attention": "none: no Gated DeltaNet layers (the paper's models are attention only)",
    "model.param_dtype": "ours: float32 weights and optimizer state (the paper does not say)",
    "model.mtp_layers": "none: no multi-token-prediction layer (the paper has none; Qwen3.5's: docs/mtp.md)",
    "train.seed": "ours: any seed",
    "train.weight_decay": "Sec. 3.1 (AdamW's defaults): PyTorch's weight decay 0.01, with its betas "
                          "(0.9, 0.999) and epsilon 1e-8; ours: only weight matrices decay, not norm "
                          "scales, biases or the input-independent gate (docs/training.md)",
    "train.lr_preset": "none: learning_rate, min_learning_rate and warmup_steps are the schedule",
    "train.init_from": "none: a new run (pretraining)",
    "train.init_step": "the source run's latest checkpoint",
    "train.extend": "ours: a resume with more steps refits the cosine to them (docs/training.md)",
    "train.continue_step": "none: the schedule as trained (a continuation starts here; docs/training.md)",
    "train.continue_lr": "none: the schedule as trained (a continuation's LR; docs/training.md)",
    "train.mtp_loss_weight": "none: next-token loss only (the paper trains no MTP layer; docs/mtp.md)",
}
# Settings that change neither the trained model nor its training: how often to log, evaluate and
# save, and when a run stops on non-finite losses.
BOOKKEEPING = ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "max_bad_steps",
               "spike_window", "spike_margin")
_BOOKKEEPING = "ours: bookkeeping (changes neither the model nor its training)"
_EXECUTION = "ours: how it runs on a TPU slice (execution, not the model; free to change on resume)"
_SCHEDULE = ("learning_rate", "min_learning_rate", "warmup_steps")


def preset_module(name: str) -> ModuleType:
    """The preset file `name` as a module (its PROVENANCE, CONTINUES, get_config)."""
    path = cli.resolve(name, "--preset")
    spec = importlib.util.spec_from_file_location(f"gattn_preset_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaves(obj, prefix: str, always: bool):
    """(dotted field, value, default) for each field of dataclass `obj`; a set nested spec of
    the model (moe) is opened, the others (gate, yarn, ...) are one value."""
    for f in dataclasses.fields(obj):
        value, default = getattr(obj, f.name), f.default
        if default is dataclasses.MISSING:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        path = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value) and f.name == "moe":
            yield from _leaves(value, path, always)
        elif always or value != default:
            yield path, value, default


def fields(cfg: Config) -> list[tuple[str, object, object]]:
    """(field, value, default): every model and train field, and the execution, mesh and data
    fields that differ from their defaults. With `train.lr_preset` the schedule fields show the
    preset's values (the ones training uses)."""
    out = [*_leaves(cfg.model, "model", True), *_leaves(cfg.train, "train", True)]
    for part in ("exec", "mesh", "data"):
        out += list(_leaves(getattr(cfg, part), part, False))
    if cfg.train.lr_preset:
        used = dict(zip(_SCHEDULE, cfg.train.schedule))
        out = [(p, used.get(p.split(".")[-1], v) if p.startswith("train.") else v, d) for p, v, d in out]
    return out


def source(path: str, value, default, provenance: dict) -> str | None:
    """The preset's own source, else the default's (only while the value is the default), else
    the automatic one of bookkeeping and execution fields; None when there is none."""
    if path in provenance:
        return provenance[path]
    part, name = path.split(".")[0], path.split(".")[-1]
    if part in ("exec", "mesh") or path == "train.microbatches":  # (accumulation: the same update)
        return _EXECUTION
    if part == "train" and name in BOOKKEEPING:
        return _BOOKKEEPING
    if value == default and path in COMMON:
        return COMMON[path]
    return None


def table(name: str) -> list[dict]:
    """One row per field of preset `name`: field, value, source (None where the preset owes one)."""
    module = preset_module(name)
    provenance = getattr(module, "PROVENANCE", {})
    return [{"field": p, "value": fmt(v), "source": source(p, v, d, provenance)}
            for p, v, d in fields(cli.load(cli.resolve(name, "--preset")))]


def fmt(value) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "none"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.0f}" if value >= 1000 and value == int(value) else f"{value:g}"
    if isinstance(value, str):
        return value or '""'
    return repr(value)


def markdown(names=PAPER_PRESETS) -> str:
    """docs/presets.md's tables: one section per preset."""
    out = []
    for name in names:
        doc = (preset_module(name).__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        out += [f"### `{name}`", "", doc, "", "| field | value | source |", "|---|---|---|"]
        out += [f"| `{r['field']}` | {r['value']} | {r['source'] or 'MISSING'} |" for r in table(name)]
        out.append("")
    return "\n".join(out)
