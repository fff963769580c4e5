"""The reservation planner (`python -m gattn.params --preset P --plan SLICE --days D`,
gattn/experiments/plan.py): tokens/s, steps and tokens in D days from the fit's modelled step,
and the train.steps and schedule of a run that fits them; refusals naming what to pass."""

import json
import math

import pytest

from gattn import cli, params
from gattn.config import ConfigError
from gattn.experiments import plan

MOE_FIT = json.loads((plan.FITS / "moe_15a2b.json").read_text())


@pytest.mark.parametrize("text, generation, chips", [
    ("v5p-64", "v5p", 32), ("v5p-128", "v5p", 64), ("v4-32", "v4", 16), ("v5litepod-16", "v5e", 16),
    ("v6e-32", "v6e", 32), ("v5p:4x4x2", "v5p", 32), ("v5e:2x4", "v5e", 8)])
def test_slices_as_gcloud_names_them_or_as_topologies(text, generation, chips):
    where = plan.parse_slice(text)
    assert (where.generation, where.chips) == (generation, chips)


@pytest.mark.parametrize("text", ["v5p-63", "v5p", "tpu-64", "v5p:4x4x"])
def test_a_slice_that_is_neither_is_refused_naming_the_forms(text):
    with pytest.raises(ConfigError, match=r"'--plan' = .* gcloud names it"):
        plan.parse_slice(text)


def fit_of(step_s=10.0, batch=8, seq=16, chips=4, model_tflops=100.0):
    return {"preset": "tiny", "topology": "v5p:2x2x1", "chips": chips, "mesh": {"data": 4}, "global_batch": batch,
            "seq_len": seq, "model_tflops_per_chip": model_tflops,
            "train": {"roofline": {"chip": "v5p", "step_s": step_s, "bound": "compute", "mfu": 0.5,
                                   "no_overlap_step_s": 2 * step_s, "no_overlap_mfu": 0.25}}}


def test_the_numbers_of_a_reservation_by_hand():
    cfg = cli.load("tiny", ["train.steps=100000", "train.checkpoint_every=100", "train.warmup_steps=10"])
    p = plan.plan(cfg, fit_of(), days=1.0, margin=0.05)
    assert p["tokens_per_step"] == 128 and p["tokens_per_s"] == round(128 / 10)
    assert p["steps_in_days"] == 8640 and p["tokens_in_days"] == 8640 * 128
    usable = math.floor(86_400 * 0.95 / 10)  # 8208: rounded down to the checkpoint cadence
    assert p["train_steps"] == usable - usable % 100 == 8200
    assert p["overrides"] == ["--config.train.steps=8200"]
    assert p["schedule"]["decay_until_step"] == 8200 and p["schedule"]["warmup_steps"] == 10
    assert p["preset_days"] == round(100_000 * 10 / 86_400, 3)
    assert p["mfu"] == round(100 / (10 * plan.CHIPS["v5p"]["bf16_tflops"]), 4)


def test_a_preset_that_fits_its_days_keeps_its_steps():
    cfg = cli.load("tiny", ["train.steps=500"])
    p = plan.plan(cfg, fit_of(), days=1.0)
    assert p["train_steps"] == 500 and p["overrides"] == []


def test_a_measured_rate_replaces_the_modelled_step():
    cfg = cli.load("tiny", ["train.steps=100000"])
    p = plan.plan(cfg, fit_of(), days=1.0, tokens_per_sec=6.4)  # 128 tokens a step: 20 s
    assert p["step"] == "measured" and p["step_s"] == 20.0 and p["modelled_step_s"] == 10.0
    assert p["steps_in_days"] == 4320 and p["mfu"] == round(100 / (20 * plan.CHIPS["v5p"]["bf16_tflops"]), 4)


def test_days_shorter_than_the_warmup_are_refused():
    cfg = cli.load("tiny", ["train.steps=100000", "train.warmup_steps=1000"])
    with pytest.raises(ConfigError, match=r"'--days' = 0.01 .* not more than the warmup \(1000 steps\)"):
        plan.plan(cfg, fit_of(), days=0.01)


def test_moe_15a2b_on_v5p_64_for_7_days_from_its_fit(capsys):
    params.main(["--preset", "moe_15a2b", "--plan", "v5p-64", "--days", "7", "--json"])
    p = json.loads(capsys.readouterr().out)
    step = MOE_FIT["train"]["roofline"]["step_s"]
    tokens = MOE_FIT["global_batch"] * MOE_FIT["seq_len"]
    assert p["fit"] == "docs/fits/moe_15a2b.json" and p["chips"] == 32 and p["notes"] == []
    assert p["step_s"] == round(step, 4) and p["tokens_per_s"] == round(tokens / step)
    assert p["steps_in_days"] == math.floor(7 * 86_400 / step)
    assert p["train_steps"] < cli.load("moe_15a2b").train.steps  # 100k steps do not fit 7 days
    assert p["overrides"] == [f"--config.train.steps={p['train_steps']}"] and p["train_steps"] % 1000 == 0


def test_the_text_says_the_step_is_modelled_and_what_to_set(capsys):
    params.main(["--preset", "moe_15a2b", "--plan", "v5p-64", "--days", "7"])
    out = capsys.readouterr().out
    assert "MODELLED, not measured" in out and "to fit 7 days: --config.train.steps=" in out
    assert "from docs/fits/moe_15a2b.json (the preset as configured)" in out


def test_without_plan_params_prints_the_counts(capsys):
    params.main(["--preset", "tiny"])
    assert "plan" not in capsys.readouterr().out.lower()


def test_params_help_names_the_planner(capsys):
    """(Before: `python -m gattn.params --help` never mentioned --plan, --days or --tokens-per-sec.)"""
    with pytest.raises(SystemExit):
        params.main(["--help"])
    text = capsys.readouterr().out
    assert all(flag in text for flag in ("--plan SLICE", "--days", "--tokens-per-sec", "--plan --help")), text


def test_a_slice_without_a_fit_names_the_command_that_writes_one():
    with pytest.raises(ConfigError, match=r"v5p:4x4x4 > DIR/moe_15a2b.json and pass --fits DIR"):
        plan.main(["--preset", "moe_15a2b", "--plan", "v5p-128", "--days", "7"])
    with pytest.raises(ConfigError, match=r"nothing\.json does not exist; write it with python bench/fit_presets.py "
                                          r"--preset nothing"):
        plan.find_fit("nothing", plan.parse_slice("v5p-64"))


def write_fit(tmp_path, **changes):
    (tmp_path / "moe_15a2b.json").write_text(json.dumps({**MOE_FIT, **changes}))
    return tmp_path


def test_a_stale_fit_is_named_field_by_field(tmp_path, capsys):
    fits = write_fit(tmp_path, microbatches=2, overrides=["--config.exec.remat=none"])
    plan.main(["--preset", "moe_15a2b", "--plan", "v5p-64", "--days", "7", "--fits", str(fits), "--json"])
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert notes == ["train.microbatches: the fit has 2, the preset 1",
                     "the fit was compiled with --config.exec.remat=none; the preset has exec.remat='full'"]


def test_a_fit_at_another_batch_is_refused(tmp_path):
    fits = write_fit(tmp_path, global_batch=512)
    with pytest.raises(ConfigError, match=r"'--preset' = 'moe_15a2b' .* a batch of 512 x 4096, the preset runs 1024"):
        plan.main(["--preset", "moe_15a2b", "--plan", "v5p-64", "--days", "7", "--fits", str(fits)])


@pytest.mark.parametrize("preset", ["qwen3_5_2b", "qwen3_next_80b"])
def test_a_preset_whose_own_variant_is_gated_finds_its_fit(preset, capsys):
    """(The planner looked for a fit of the baseline; bench/fit_presets.py compiles a preset with its
    own variant, sdpa_elementwise for these two, so their fits were never found.)"""
    fit = json.loads((plan.FITS / f"{preset}.json").read_text())
    chips = {"v5p:2x2x4": "v5p-32", "v5p:4x4x4": "v5p-128"}[fit["topology"]]
    params.main(["--preset", preset, "--plan", chips, "--days", "7", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["variant"] == fit["variant"] == "sdpa_elementwise" and out["fit"].endswith(f"{preset}.json")
