"""The schema of a run: typed, frozen dataclasses for the gate design space, the architecture,
the execution settings, training, data and the mesh.

Every value is checked when the object is built, before any JAX work, and a bad value raises
`ConfigError` naming the field, the value and what is allowed. This package imports nothing from
the rest of gattn and no JAX, so checking a config is instant; reading config files and
command-line overrides is `gattn.cli`'s job.

Where each part lives (every name is importable from `gattn.config` itself):
    checks.py     ConfigError, the choice tuples (POSITIONS ... DECODE_ERRORS), the validators
    model.py      the architecture: ModelConfig, GateSpec, MoESpec, SwitchHeadsSpec, YarnSpec,
                  LinearAttentionSpec, LAYER_TYPES, hybrid_layer_types, POSITION_FIELDS
    execution.py  how and where it is computed: ExecConfig, MOVED_TO_EXEC, MeshConfig
    train.py      TrainConfig, LR_PRESETS, EXTEND
    data.py       DataConfig, BackcopySpec, BACKCOPY, SHARDS, TFDS
    __init__.py   Config (the run: all of the above) and its dicts: from_dict, to_dict,
                  flat_fields, differences (a run's config.json)
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from gattn.config.checks import (ACCUMULATE, ATTENTION_IMPLS, DECODE_ERRORS, DTYPES, FFN_ACTIVATIONS, FORMS,
                                 GATE_ACTIVATIONS, GDN_IMPLS,
                                 GRANULARITIES, GROUPED_MATMULS, LBL_SCOPES, MOE_IMPLS, POSITIONS, REMAT_POLICIES,
                                 SDPA_NONLINEARITIES, SHARINGS, SWITCH_TARGETS, ConfigError)
from gattn.config.data import BACKCOPY, BACKGROUNDS, SHARDS, TFDS, BackcopySpec, DataConfig
from gattn.config.execution import BATCH_AXES, MESH_AXES, MOVED_TO_EXEC, ExecConfig, MeshConfig
from gattn.config.model import (LAYER_TYPES, POSITION_FIELDS, GateSpec, LinearAttentionSpec, ModelConfig, MoESpec,
                                SwitchHeadsSpec, YarnSpec, hybrid_layer_types)
from gattn.config.train import EXTEND, LR_PRESETS, TrainConfig

__all__ = [
    "ACCUMULATE", "ATTENTION_IMPLS", "BACKCOPY", "BACKGROUNDS", "DECODE_ERRORS", "DTYPES", "EXTEND", "FFN_ACTIVATIONS", "FORMS", "GATE_ACTIVATIONS",
    "GDN_IMPLS", "GRANULARITIES", "GROUPED_MATMULS", "LAYER_TYPES", "LBL_SCOPES", "LR_PRESETS", "MOE_IMPLS", "MOVED_TO_EXEC", "POSITIONS", "POSITION_FIELDS",
    "REMAT_POLICIES", "SDPA_NONLINEARITIES", "SHARDS", "SHARINGS", "SWITCH_TARGETS", "TFDS",
    "BATCH_AXES", "BackcopySpec", "Config", "ConfigError", "DataConfig", "ExecConfig", "GateSpec", "LinearAttentionSpec", "MESH_AXES", "MeshConfig", "ModelConfig",
    "MoESpec", "SwitchHeadsSpec", "TrainConfig", "YarnSpec",
    "differences", "flat_fields", "from_dict", "hybrid_layer_types", "to_dict",
]


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
        moe = self.model.moe
        if moe is not None and moe.lbl_scope == "micro" and self.train.batch_size % moe.micro_batches:
            # each micro-batch is whole rows (on a data mesh, micro_batches a multiple of the shard
            # count keeps each group on one shard); validation batches may be any size (aux unused)
            raise ConfigError("train.batch_size", self.train.batch_size,
                              f"a multiple of model.moe.micro_batches ({moe.micro_batches}): the per-micro-batch "
                              "LBL (lbl_scope='micro') splits the batch into groups of whole rows")
        if moe is not None and moe.lbl_scope == "micro" and (self.train.batch_size // self.train.microbatches) \
                % moe.micro_batches:
            raise ConfigError("train.microbatches", self.train.microbatches,
                              f"a count that leaves each microbatch ({self.train.batch_size} / microbatches rows) a "
                              f"multiple of model.moe.micro_batches ({moe.micro_batches})")
        if moe is not None and self.exec.accumulate == "gathered":
            raise ConfigError("exec.accumulate", self.exec.accumulate,
                              "'sharded' for a MoE: 'gathered' sums each fsdp shard's own rows, and the MoE's "
                              "global-batch LBL counts every shard's tokens")
        ctx = self.mesh.context
        if ctx > 1 and self.train.seq_len % (2 * ctx):
            raise ConfigError("mesh.context", ctx, f"a context axis whose 2 x {ctx} chunks divide train.seq_len "
                              f"({self.train.seq_len}): each device holds an early and a late chunk of every row")
        if ctx > 1 and self.model.hybrid and self.train.seq_len // (2 * ctx) < self.model.linear_attention.conv_kernel - 1:
            raise ConfigError("mesh.context", ctx, f"chunks of at least conv_kernel - 1 = "
                              f"{self.model.linear_attention.conv_kernel - 1} tokens (train.seq_len / (2 x context) "
                              f"= {self.train.seq_len // (2 * ctx)}): the conv's left context comes from one chunk")
        if ctx > 1 and self.exec.attention_impl in ("pallas_gpu", "cudnn"):
            raise ConfigError("exec.attention_impl", self.exec.attention_impl, "xla, pallas or auto on TPU with "
                              f"mesh.context > 1 (now {ctx}): its chunk pairs need a kernel that takes the keys' "
                              "own segment ids and returns its log-sum-exp")
        if ctx > 1 and moe is not None and moe.capacity_factor is not None:
            raise ConfigError("mesh.context", ctx, "1 for a MoE with model.moe.capacity_factor set "
                              f"({moe.capacity_factor}): an expert keeps its first tokens in token order, which "
                              "the context layout reorders (another run's tokens would be dropped); a dropless "
                              "MoE (capacity_factor None) runs under context parallelism")
        if self.train.mtp_loss_weight and not self.model.mtp_layers:
            raise ConfigError("train.mtp_loss_weight", self.train.mtp_loss_weight,
                              "0 unless model.mtp_layers = 1 (there is no MTP layer to train)")
        impl = self.exec.moe_impl
        if impl in ("all_to_all", "ragged"):
            if impl == "all_to_all" and (moe is None or moe.capacity_factor is None):
                raise ConfigError("exec.moe_impl", impl, "the explicit all-to-all needs a MoE model with "
                                  "model.moe.capacity_factor set (fixed-size buffers); use 'partitioned'")
            if impl == "ragged" and (moe is None or moe.capacity_factor is not None):
                raise ConfigError("exec.moe_impl", impl, "dropless expert parallelism needs a MoE model "
                                  "with model.moe.capacity_factor None; use 'all_to_all' with a capacity")
            if (self.mesh.expert < 2 and not (impl == "ragged" and self.mesh.expert == 1)) or \
                    moe.num_experts % max(self.mesh.expert, 1):
                raise ConfigError("exec.moe_impl", impl, f"it splits the {moe.num_experts} experts over "
                                  f"mesh.expert (now {self.mesh.expert}): set mesh.expert dividing them (> 1 for "
                                  "all_to_all; 1 runs ragged with every expert on every device, gathered by "
                                  "FSDP), or exec.moe_impl='partitioned' (runs on any mesh)")


# --------------------------------------------------------------------------- dicts (config.json)


def from_dict(cls: type, tree: dict, prefix: str = "") -> Any:
    """The dataclass `cls` from a JSON-like dict (`dataclasses.asdict` of one, e.g. a run's
    config.json); nested configs are rebuilt, every value is checked as usual. A `Config` written
    before the architecture / execution split has its execution fields under "model": they are
    read as `exec`."""
    if not isinstance(tree, dict):  # (a hand-edited config.json: [1, 2], "model": 5)
        raise ConfigError(prefix or "config.json", tree, f"a JSON object of {cls.__name__}'s fields")
    if cls is Config and isinstance(tree.get("model"), dict) and any(k in MOVED_TO_EXEC for k in tree["model"]):
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
        if sub is not None and isinstance(value, dict):
            value = from_dict(sub, value, path)
        elif sub is not None and value is not None and hints[name] in (sub, sub | None):  # (a hand-edited "model": 5)
            raise ConfigError(path, value, f"a JSON object of {sub.__name__}'s fields")
        kwargs[name] = value
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
