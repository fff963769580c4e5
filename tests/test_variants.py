"""`variants.applicable` lists exactly the variants that build on a baseline, so
`python -m gattn.demo --variants all` runs on every shipped config (configs only, no JAX); a
run's label names the model it trains (`variants.label`), through train.py and eval.py --compare."""

from pathlib import Path

import pytest

from gattn import cli, variants
from gattn.config import ConfigError, GateSpec

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.py"))


def test_every_shipped_config_is_covered():
    assert {"configs/gpu_125m.py", "configs/moe_15a2b.py", "configs/peer.py"} <= set(SHIPPED)


@pytest.mark.parametrize("path", SHIPPED)
def test_applicable_variants_build_on_every_shipped_config_and_the_others_do_not(path):
    cfg = cli.load(ROOT / path)
    base = variants.baseline_of(cfg.model, cfg.variant)  # (a gated preset's model without its gate)
    names = variants.applicable(base)
    assert "baseline" in names
    for name in names:  # as the demo builds them: the run's whole config, validated
        try:
            built = cli.load(ROOT / path, variant=name)
        except ConfigError as e:  # the model builds, the preset's expert-parallel path may not split it:
            assert "exec.moe_impl" in str(e) and "mesh.expert" in str(e), e  # named, with the way out
            built = cli.load(ROOT / path, ["exec.moe_impl=partitioned", "exec.grouped_matmul=ragged_dot",
                                           "exec.moe_buffer=None"], variant=name)
        assert built.model == variants.apply(name, base) and built.variant == name
    for name in set(variants.REGISTRY) - set(names):
        with pytest.raises(ConfigError):
            variants.apply(name, base)


def test_head_count_and_ffn_matched_variants_are_left_out_where_they_cannot_build():
    gpu = cli.load(ROOT / "configs/gpu_125m.py").model  # q=12, kv=4: 18 % 4, 12 % 8
    assert not {"more_q_heads", "more_kv_heads"} & set(variants.applicable(gpu))
    moe = cli.load(ROOT / "configs/moe_15a2b.py").model  # no dense FFN to narrow
    assert not {"sdpa_elementwise_ffn_matched", "more_experts"} - set(variants.REGISTRY)
    assert "more_experts" in variants.applicable(moe)
    assert not {"sdpa_elementwise_ffn_matched", "sdpa_headwise_ffn_matched"} & set(variants.applicable(moe))


# --------------------------------------------------------------------------- the recorded label

@pytest.mark.parametrize("variant, overrides, label", [
    # An override that gives the baseline a gate, with --variant baseline or without --variant.
    ("baseline", ["model.gate.granularity=headwise"], 'baseline+gate.granularity="headwise"'),
    (None, ["model.gate.granularity=headwise"], 'baseline+gate.granularity="headwise"'),
    (None, ["model.gate=default"], "baseline+gate=default"),
    # A gate on a variant that has none; another position on a gated one; the gate taken away.
    ("sdpa_rmsnorm", ["model.gate.position=value"], 'sdpa_rmsnorm+gate.position="value"'),
    ("sdpa_elementwise", ["model.gate.position=value"], 'sdpa_elementwise+gate.position="value"'),
    ("sdpa_elementwise", ["model.gate=none"], "sdpa_elementwise+gate=null"),
    ("baseline", ["model.sandwich_norm=true", "model.output_clip=50"],
     "baseline+sandwich_norm=true,output_clip=50.0"),
    # A variant's own relative field (kv heads) set to something else.
    ("more_kv_heads", ["model.kv_heads=1"], "more_kv_heads+kv_heads=1"),
    # Sizes, training, execution and data keep the label.
    ("sdpa_headwise", ["model.num_layers=2", "model.d_model=64", "train.steps=300", "exec.remat=full",
                       "data.eval_batches=1"], "sdpa_headwise"),
    ("more_kv_heads", ["model.num_layers=2"], "more_kv_heads"),
    (None, ["model.kv_heads=4"], "baseline"),
])
def test_the_recorded_label_names_the_model_the_overrides_made(variant, overrides, label):
    cfg = cli.load("tiny", overrides, variant=variant)
    assert cfg.variant == label


def test_a_variant_of_a_gated_preset_is_built_on_its_baseline():
    """hybrid_tiny's model is sdpa_elementwise: --variant baseline is the hybrid without a gate,
    --variant sdpa_rmsnorm has the RMSNorm and no gate, each labelled as what it is."""
    assert cli.load("hybrid_tiny").variant == "sdpa_elementwise"
    base = cli.load("hybrid_tiny", variant="baseline")
    assert base.model.gate is None and base.variant == "baseline"
    norm = cli.load("hybrid_tiny", variant="sdpa_rmsnorm")
    assert norm.model.gate is None and norm.model.sdpa_nonlinearity == "rmsnorm" and norm.variant == "sdpa_rmsnorm"
    assert cli.load("hybrid_tiny", variant="sdpa_headwise").model.gate == GateSpec(granularity="headwise")


def test_a_config_whose_baseline_is_unknown_refuses_another_variant(tmp_path):
    """A run's config.json of a relative variant (more_kv_heads: the baseline's kv heads are not
    known) continues as itself; another variant on it is refused in one line."""
    import json

    from gattn.config import to_dict

    path = tmp_path / "config.json"
    path.write_text(json.dumps(to_dict(cli.load("tiny", variant="more_kv_heads"))))
    again = cli.load(path)
    assert again.variant == "more_kv_heads" and again.model.kv_heads == 4
    assert cli.load(path, variant="more_kv_heads").model.kv_heads == 4
    with pytest.raises(ConfigError) as e:
        cli.load(path, variant="sdpa_elementwise")
    assert e.value.field == "variant" and "more_kv_heads" in str(e.value) and "\n" not in str(e.value)


def test_every_variant_changes_only_the_label_fields_or_head_and_expert_counts():
    """`variants.AXES` are the fields a variant sets outright; the others only scale heads or
    experts (their baseline is then not recoverable from the model: `baseline_of` says None)."""
    from conftest import tiny_model
    from gattn.config import MoESpec, flat_fields

    dense, moe = tiny_model(), tiny_model(moe=MoESpec(num_experts=4, top_k=2, expert_width=32))
    for name, v in variants.REGISTRY.items():
        base = moe if v.needs_moe else dense
        was, now = flat_fields(base), flat_fields(v.change(base))
        changed = {k.partition(".")[0] for k in set(was) | set(now) if was.get(k) != now.get(k)}
        assert changed <= set(variants.AXES) | {"kv_heads", "q_heads", "moe"}, name
        assert (variants.baseline_of(v.change(base), name) is None) == bool(changed - set(variants.AXES)), name


def test_compare_lists_a_run_by_what_its_model_is(tmp_path, capsys):
    """Through train.py (one step) and eval.py --compare: a baseline given a gate by an override
    is recorded and listed as such, and so is an older run whose config.json says 'baseline'."""
    import json
    import shutil
    import subprocess
    import sys

    from conftest import entry_point, run_config_file

    (tmp_path / "small.py").write_text(run_config_file(steps=1, warmup_steps=0, eval_every=1, checkpoint_every=1))
    run = tmp_path / "gated"
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(tmp_path / "small.py"),
                          "--workdir", str(run), "--quiet", "--variant", "baseline",
                          "--config.model.gate.granularity=headwise"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    label = 'baseline+gate.granularity="headwise"'
    assert json.loads((run / "config.json").read_text())["variant"] == label
    compare = entry_point("eval").main
    assert cli.run_cli(compare, ["--compare", str(run), "--out", str(tmp_path / "cmp"), "--no-figures"]) == 0
    old = tmp_path / "old"  # as recorded before: the same run labelled "baseline" (its results.json too)
    shutil.copytree(run, old)
    for path in (old / "config.json", old / "eval" / "results.json"):
        path.write_text(json.dumps(json.loads(path.read_text()) | {"variant": "baseline"}))
    capsys.readouterr()
    assert cli.run_cli(compare, ["--compare", str(run), str(old), "--out", str(tmp_path / "cmp"), "--no-figures"]) == 0
    out = capsys.readouterr()
    assert "reusing old" in out.err  # (measured once: the copy's results.json is reused)
    rows = [line.split("|")[1:3] for line in out.out.splitlines()[2:]]
    assert [(r.strip(), v.strip()) for r, v in rows] == [("gated", label), ("old", label)]
    saved = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert {r["variant"] for r in saved.values()} == {label}


def test_a_study_builds_each_cell_on_the_baseline_and_refuses_overrides_that_change_a_variant():
    """The main job / demo / a study name their rows for their variants: an override that gives
    the baseline cell a gate is refused in one line before anything trains; sizes are fine; on a
    gated preset the baseline cell has no gate."""
    from gattn.experiments import study

    with pytest.raises(ConfigError) as e:
        study.comparison("tiny", ["baseline", "sdpa_elementwise"], ["--config.model.gate.granularity=headwise"])
    assert e.value.field == "overrides" and 'baseline+gate.granularity="headwise"' in str(e.value)
    assert "\n" not in str(e.value)
    small = study.comparison("tiny", ["baseline", "sdpa_headwise"], ["--config.model.num_layers=2"])
    assert [(c.variant, study.cell_config(small, c).model.num_layers) for c in study.cells(small)] == [
        ("baseline", 2), ("sdpa_headwise", 2)]
    hybrid = study.comparison("hybrid_tiny", ["baseline", "sdpa_elementwise"])
    built = {c.variant: study.cell_config(hybrid, c) for c in study.cells(hybrid)}
    assert built["baseline"].model.gate is None and built["sdpa_elementwise"].model.gate == GateSpec()
