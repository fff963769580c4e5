"""Configs are typed and frozen; bad values fail fast with the field, the value and what is allowed."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from gattn import cli
from gattn import config as C
from gattn.config import ConfigError, ExecConfig, GateSpec, ModelConfig, SwitchHeadsSpec

ROOT = Path(__file__).resolve().parents[1]


def _raises(fn, field, value, allowed_part):
    with pytest.raises(ConfigError) as e:
        fn()
    assert e.value.field == field
    if value is not None:  # None: NaN, which equals nothing
        assert e.value.value == value
    assert allowed_part in e.value.allowed
    assert field in str(e.value) and repr(e.value.value) in str(e.value)


@pytest.mark.parametrize("kwargs, field, value, allowed", [
    (dict(position="G7"), "position", "G7", "'sdpa'"),
    (dict(granularity="rowwise"), "granularity", "rowwise", "'headwise'"),
    (dict(sharing="all"), "sharing", "all", "'head_shared'"),
    (dict(form="subtractive"), "form", "subtractive", "'additive'"),
    (dict(activation="tanh"), "activation", "tanh", "'ns_sigmoid'"),
    (dict(position="dense", granularity="headwise"), "granularity", "headwise", "no heads"),
    (dict(position="G5", sharing="head_shared"), "sharing", "head_shared", "no heads"),
])
def test_bad_gate_spec_names_field_value_and_choices(kwargs, field, value, allowed):
    _raises(lambda: GateSpec(**kwargs), field, value, allowed)


def test_gate_positions_accept_paper_names():
    assert [GateSpec(position=g).position for g in ("G1", "G2", "G3", "G4", "G5")] == \
        ["sdpa", "value", "key", "query", "dense"]
    assert GateSpec(position="value").g == "G2"


@pytest.mark.parametrize("kwargs, field, value, allowed", [
    (dict(q_heads=6, kv_heads=4), "q_heads", 6, "multiple of kv_heads (4)"),
    (dict(num_layers=-2), "num_layers", -2, "> 0"),
    (dict(d_model=0), "d_model", 0, "> 0"),
    (dict(head_dim=2.5), "head_dim", 2.5, "integer"),
    (dict(head_dim=7), "head_dim", 7, "even"),
    (dict(ffn_activation="swish2"), "ffn_activation", "swish2", "'silu'"),
    (dict(sdpa_nonlinearity="layernorm"), "sdpa_nonlinearity", "layernorm", "'rmsnorm'"),
    (dict(rope_base=-1.0), "rope_base", -1.0, "> 0"),
    (dict(output_clip=-5.0), "output_clip", -5.0, "> 0"),
    (dict(gate="sdpa"), "gate", "sdpa", "GateSpec"),
    (dict(norm_eps=float("nan")), "norm_eps", None, "> 0"),
    (dict(rope_base=float("inf")), "rope_base", float("inf"), "> 0"),
    (dict(output_clip=float("inf")), "output_clip", float("inf"), "> 0"),
    (dict(qk_norm=1), "qk_norm", 1, "True or False"),
    (dict(d_ff=8, match_ffn_params=True, gate=GateSpec()), "match_ffn_params", True, "larger d_ff"),
])
def test_bad_model_config_names_field_value_and_choices(kwargs, field, value, allowed):
    _raises(lambda: ModelConfig(**kwargs), field, value, allowed)


@pytest.mark.parametrize("kwargs, field, value, allowed", [
    (dict(dtype="float16"), "dtype", "float16", "'bfloat16'"),
    (dict(remat="some"), "remat", "some", "'dots'"),
    (dict(attention_impl="cuda"), "attention_impl", "cuda", "'pallas'"),
    (dict(flash_block_k=100), "flash_block_k", 100, "multiple of 8"),
    (dict(flash_block_q=0), "flash_block_q", 0, "> 0"),
    (dict(scan_layers="yes"), "scan_layers", "yes", "True or False"),
])
def test_bad_exec_config_names_field_value_and_choices(kwargs, field, value, allowed):
    _raises(lambda: ExecConfig(**kwargs), field, value, allowed)


def test_execution_settings_are_apart_from_the_architecture():
    """ModelConfig holds what a checkpoint is; ExecConfig how it is computed. The old spelling
    `model.attention_impl` (overrides, an older run's config.json) is read as exec.*."""
    arch = {f.name for f in dataclasses.fields(ModelConfig)}
    assert not arch & {f.name for f in dataclasses.fields(ExecConfig)}
    cfg = cli.apply_overrides(C.Config(), ["model.attention_impl=pallas", "exec.remat=full"])
    assert (cfg.exec.attention_impl, cfg.exec.remat) == ("pallas", "full")
    old = C.to_dict(C.Config())
    old["model"].update(old.pop("exec"), scan_layers=True)
    assert C.from_dict(C.Config, old).exec.scan_layers is True
    # differences() compares configs field by field, and honours the allowed prefixes
    a, b = C.Config(), cli.apply_overrides(C.Config(), ["model.num_layers=3", "exec.remat=full"])
    assert C.differences(b, a, ("model",)) == [("model.num_layers", 3, 2)]
    assert C.differences(b, a, ("model", "exec"), may_differ=("exec",)) == [("model.num_layers", 3, 2)]


def test_a_field_given_twice_is_refused():
    with pytest.raises(ConfigError) as e:
        cli.apply_overrides(C.Config(), ["train.steps=5", "--config.train.steps=7"])
    assert e.value.field == "train.steps" and "given twice" in str(e.value) and "'5'" in str(e.value)


def test_presets_load_by_name_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.load("tiny") == cli.load(ROOT / "configs/tiny.py")
    assert cli.load("configs/moe_15a2b.py").model.moe is not None  # the repo's path, from elsewhere
    assert "table4_tiny" in cli.presets("study")
    with pytest.raises(ConfigError) as e:
        cli.load("no_such_preset")
    assert e.value.field == "--config" and "tiny" in str(e.value)


def test_bad_switch_heads():
    _raises(lambda: SwitchHeadsSpec(targets="q"), "targets", "q", "'kv'")
    _raises(lambda: SwitchHeadsSpec(num_experts=2, top_k=3), "top_k", 3, "1..num_experts (2)")
    _raises(lambda: GateSpec(input_dependent=0), "input_dependent", 0, "True or False")


def test_unknown_variant_label_is_rejected():
    _raises(lambda: cli.check_variant(C.Config(variant="sdpa_gate_typo")), "variant", "sdpa_gate_typo",
            "'sdpa_elementwise'")


def test_configs_are_frozen():
    cfg = ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3


def test_overrides_coerce_types_and_create_nested_gate():
    cfg = C.Config()
    cfg = cli.apply_overrides(cfg, ["--config.model.num_layers=3", "model.rope_base=1e6",
                                  "model.tie_embeddings=true", "model.gate.position=G2",
                                  "model.gate.granularity=headwise", "train.learning_rate=0.01"])
    assert cfg.model.num_layers == 3 and isinstance(cfg.model.num_layers, int)
    assert cfg.model.rope_base == 1e6 and cfg.model.tie_embeddings is True
    assert cfg.model.gate == GateSpec(position="value", granularity="headwise")
    assert cfg.train.learning_rate == 0.01
    assert cli.apply_overrides(cfg, ["model.gate=none"]).model.gate is None
    assert cli.apply_overrides(cfg, ["model.output_clip=100"]).model.output_clip == 100.0


def test_a_hybrid_layer_pattern_is_given_on_the_command_line():
    """model.layer_types (a tuple): a comma-separated list, NAME*K for K in a row, or the JSON
    list; what configs/hybrid_tiny.py tells a user to pass with model.num_layers=8."""
    pattern = C.hybrid_layer_types(8, 4)
    for text in ("linear_attention*3,full_attention,linear_attention*3,full_attention",
                 '["linear_attention", "linear_attention", "linear_attention", "full_attention", '
                 '"linear_attention", "linear_attention", "linear_attention", "full_attention"]'):
        cfg = cli.load("hybrid_tiny", ["model.num_layers=8", f"model.layer_types={text}"])
        assert cfg.model.layer_types == pattern and cfg.model.layer_period == 4
    for bad, value in (("linear_attention*three", "linear_attention*three"), ("mamba*8", "mamba")):
        with pytest.raises(ConfigError) as e:
            cli.load("hybrid_tiny", ["model.num_layers=8", f"model.layer_types={bad}"])
        assert e.value.field == "model.layer_types" and e.value.value == value


@pytest.mark.parametrize("override, field, value, allowed", [
    ("model.num_layers=two", "model.num_layers", "two", ""),
    ("model.q_heads=5", "model.q_heads", 5, ""),
    ("model.gate.position=G9", "model.gate.position", "G9", ""),
    ("model.nonexistent=1", "model.nonexistent", "1", ""),
    ("model.qk_norm=maybe", "model.qk_norm", "maybe", ""),
    ("model.num_layers", "model.num_layers", None, ""),
    ("model.num_layers.x=1", "model.num_layers", None, ""),
    ("model=none", "model", "none", "'default'"),
    ("train.learning_rate=nan", "train.learning_rate", None, ""),
])
def test_bad_overrides_name_the_full_path(override, field, value, allowed):
    with pytest.raises(ConfigError) as e:
        cli.apply_overrides(C.Config(), [override])
    assert e.value.field == field
    if value is not None:
        assert e.value.value == value
    assert allowed in e.value.allowed and "'none'" not in e.value.allowed


@pytest.mark.parametrize("order", [1, -1])
def test_overrides_do_not_depend_on_their_order(order):
    """Cross-field checks see all overrides at once (each order alone would be invalid midway)."""
    items = ["model.kv_heads=3", "model.q_heads=6",
             "model.switch_heads.num_experts=4", "model.switch_heads.top_k=3"]
    cfg = cli.apply_overrides(C.Config(), items[::order])
    assert (cfg.model.q_heads, cfg.model.kv_heads) == (6, 3)
    assert cfg.model.switch_heads == SwitchHeadsSpec(num_experts=4, top_k=3)


def test_value_and_fields_of_the_same_config_conflict():
    with pytest.raises(ConfigError) as e:
        cli.apply_overrides(C.Config(), ["model.gate=none", "model.gate.position=G2"])
    assert e.value.field == "model.gate" and "not both" in e.value.allowed


def test_config_variant_override_applies_the_variant():
    """--config.variant=NAME is --variant NAME: the model changes, not only the label."""
    cfg = cli.load(ROOT / "configs/tiny.py", ["--config.variant=v_headwise"])
    assert cfg.variant == "v_headwise"
    assert cfg.model.gate == GateSpec(position="value", granularity="headwise")


def test_load_config_file_with_variant_and_overrides():
    cfg = cli.load(ROOT / "configs/tiny.py", ["--config.model.num_layers=2"], variant="sdpa_headwise")
    assert cfg.variant == "sdpa_headwise"
    assert cfg.model.gate == GateSpec(granularity="headwise") and cfg.model.num_layers == 2
    with pytest.raises(ConfigError) as e:
        cli.load(ROOT / "configs/tiny.py", variant="no_such_variant")
    assert e.value.field == "variant"
    with pytest.raises(ConfigError) as e:
        cli.load(ROOT / "configs/missing.py")
    assert e.value.field == "--config"


def test_a_config_file_of_another_kind_or_shape_is_one_line(tmp_path):
    """(Before: config.yaml raised AttributeError ('NoneType' has no 'loader'), a config.json of a
    list AttributeError, one with "model": 5 TypeError: no field named, exit 1.)"""
    files = {"tiny.yaml": "model: {}", "list.json": "[1, 2]", "model5.json": '{"model": 5}',
             "gate.json": '{"model": {"gate": 3}}'}
    fields = {"tiny.yaml": "--config", "list.json": "config.json", "model5.json": "model", "gate.json": "model.gate"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as e:
            cli.load(tmp_path / name)
        assert e.value.field == fields[name], (name, e.value)
    with pytest.raises(ConfigError, match="a Python file"):
        cli.call_file(tmp_path / "tiny.yaml", "get_study", "--study", "Study")


def test_a_variant_loads_with_an_mtp_loss_weight_and_its_layer_in_either_order():
    """The variant's model and every override are built in one construction, so the cross-field
    check (an MTP loss weight needs model.mtp_layers) sees both, whatever their order; it used to
    apply the train overrides before the model ones and refuse this command line."""
    for overrides in (["--config.train.mtp_loss_weight=0.3", "--config.model.mtp_layers=1"],
                      ["--config.model.mtp_layers=1", "--config.train.mtp_loss_weight=0.3"]):
        cfg = cli.load(ROOT / "configs/tiny.py", overrides, variant="sdpa_elementwise")
        assert (cfg.model.mtp_layers, cfg.train.mtp_loss_weight) == (1, 0.3)
        assert cfg.variant == "sdpa_elementwise" and cfg.model.gate == GateSpec()
    with pytest.raises(ConfigError) as e:
        cli.load(ROOT / "configs/tiny.py", ["--config.train.mtp_loss_weight=0.3"], variant="sdpa_elementwise")
    assert e.value.field == "train.mtp_loss_weight"


def test_extension_preset_changes_only_what_no_parameter_depends_on():
    """configs/extend_tiny.py: the tiny model with RoPE base 1M at 4x the sequence length."""
    tiny, ext = cli.load(ROOT / "configs/tiny.py"), cli.load(ROOT / "configs/extend_tiny.py")
    assert (ext.model.rope_base, ext.train.seq_len) == (1e6, 4 * tiny.train.seq_len)
    assert dataclasses.replace(ext.model, rope_base=tiny.model.rope_base) == tiny.model
    cfg = cli.apply_overrides(C.Config(), ["train.init_from=runs/a", "train.init_step=400"])
    assert (cfg.train.init_from, cfg.train.init_step) == ("runs/a", 400)
    with pytest.raises(ConfigError) as e:
        cli.apply_overrides(C.Config(), ["train.init_step=400"])
    assert e.value.field == "train.init_step"


def test_bad_config_fails_before_any_jax_work():
    """Checking a config must not even import JAX (so errors come instantly)."""
    code = ("import sys\nfrom gattn import cli, config as C\n"
            "try:\n    cli.apply_overrides(C.Config(), ['model.kv_heads=3'])\n"
            "except C.ConfigError as e:\n    print(e)\n"
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert "'model.q_heads' = 4" in lines[0] and "multiple of kv_heads (3)" in lines[0], lines
    assert lines[-1] == "False"


def test_the_moe_path_is_chosen_by_the_config_and_checked_against_the_mesh():
    moe = cli.apply_overrides(C.Config(), ["model.moe.num_experts=8", "model.moe.top_k=2"])
    assert moe.exec.moe_impl == "partitioned"
    for extra, allowed in ((["exec.moe_impl=all_to_all"], "capacity_factor"),
                           (["exec.moe_impl=all_to_all", "model.moe.capacity_factor=1.25"], "mesh.expert"),
                           (["exec.moe_impl=all_to_all", "model.moe.capacity_factor=1.25", "mesh.expert=3"],
                            "dividing")):
        with pytest.raises(ConfigError) as e:
            cli.apply_overrides(moe, extra)
        assert e.value.field == "exec.moe_impl" and allowed in e.value.allowed, e.value
    ok = cli.apply_overrides(moe, ["exec.moe_impl=all_to_all", "model.moe.capacity_factor=1.25", "mesh.expert=4"])
    assert ok.exec.moe_impl == "all_to_all"


def test_every_name_of_the_config_package_is_importable_from_gattn_config():
    """gattn.config is a package (checks, model, execution, train, data); callers import every public
    name from the package itself, and every dataclass's type hints resolve in its own module (from_dict
    and the overrides read them)."""
    import importlib
    import pkgutil
    import typing
    for info in pkgutil.iter_modules(C.__path__):
        module = importlib.import_module(f"gattn.config.{info.name}")
        public = [n for n, v in vars(module).items() if not n.startswith("_") and getattr(v, "__module__",
                  module.__name__) == module.__name__ and (n.isupper() or isinstance(v, type))]
        assert public and set(public) <= set(C.__all__), (info.name, set(public) - set(C.__all__))
        for value in vars(module).values():
            if dataclasses.is_dataclass(value):
                typing.get_type_hints(value)
    assert all(getattr(C, n) is not None for n in C.__all__)
    cfg = cli.apply_overrides(C.Config(), ["model.gate.position=G2", "data.backcopy.chars=9", "mesh.model=2"])
    assert C.from_dict(C.Config, C.to_dict(cfg)) == cfg


def test_a_schedule_field_beside_an_lr_preset_is_refused():
    """lr_preset sets the schedule: an explicit learning_rate, min_learning_rate or warmup_steps
    beside it would be ignored, so it is refused (naming the preset); with lr_preset='' it is used."""
    for field, value in (("learning_rate", 8e-3), ("min_learning_rate", 1e-6), ("warmup_steps", 10)):
        _raises(lambda: C.TrainConfig(steps=2000, lr_preset="dense_400b", **{field: value}), field, value,
                "lr_preset='dense_400b'")
    dense = C.Config(train=C.TrainConfig(steps=2000, lr_preset="dense_400b"))
    _raises(lambda: cli.apply_overrides(dense, ["--config.train.learning_rate=8e-3"]), "train.learning_rate",
            8e-3, "lr_preset=''")
    own = cli.apply_overrides(dense, ["train.learning_rate=8e-3", "train.lr_preset="])
    assert own.train.schedule == (8e-3, 3e-5, 20)


def test_a_warmup_longer_than_the_run_names_the_flags_that_fix_it():
    """(It said only 'expected fewer than steps (5)'.)"""
    from gattn import cli

    with pytest.raises(ConfigError, match=r"fewer warmup steps than train.steps \(5\): --config.train.warmup_steps=N sets it, "
                                          r"or raise --steps"):
        cli.load("tiny", ["train.steps=5"])
    with pytest.raises(ConfigError, match=r"lr_preset sets it; choose your own with --config.train.lr_preset=''"):
        C.TrainConfig(steps=5, lr_preset="dense_400b")  # (its warmup: 1,000 steps)


def test_help_shows_every_real_default_including_zero_and_one():
    """--help (cli.HelpWithDefaults) shows defaults 0, 0.0 and 1.0 (which equal False and True in
    Python and were hidden as flags), and hides them only for flags and None."""
    import argparse

    ap = argparse.ArgumentParser(formatter_class=cli.HelpWithDefaults)
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus")
    ap.add_argument("--seed", type=int, default=0, help="seed")
    ap.add_argument("--json", action="store_true", help="JSON lines")
    ap.add_argument("--step", type=int, default=None, help="a step (default: the latest)")
    text = " ".join(ap.format_help().split())
    assert "sampling temperature (default: 0.0)" in text and "nucleus (default: 1.0)" in text
    assert "seed (default: 0)" in text
    assert "JSON lines (default" not in text and text.count("(default:") == 4
