"""A run directory keeps its history: a resumed run with another config keeps the earlier
config.json, metrics rows past the resumed step are set aside (not dropped), a Hugging Face folder
is named as one, and a loss blow-up in the first steps counts as a spike."""

import json
from pathlib import Path

import numpy as np
import pytest

from gattn import cli
from gattn.config import Config, ConfigError, ExecConfig, MeshConfig, ModelConfig, MoESpec, to_dict
from gattn.train import metrics, rundir

from conftest import entry_point

ROOT = Path(__file__).resolve().parents[1]


def test_a_changed_config_is_kept_in_the_history_and_an_unchanged_one_writes_nothing(tmp_path, capsys):
    cfg = cli.load("tiny")
    rundir.record_config(tmp_path, cfg, 0)
    written = (tmp_path / "config.json").read_text()
    assert json.loads(written) == to_dict(cfg) and not (tmp_path / rundir.HISTORY).exists()
    rundir.record_config(tmp_path, cli.load("tiny"), 6)  # a plain resume: nothing new
    assert (tmp_path / "config.json").read_text() == written and not (tmp_path / rundir.HISTORY).exists()
    assert capsys.readouterr().err == ""

    new = cli.apply_overrides(cfg, ["train.steps=900", "train.learning_rate=1e-3", "exec.remat=full"])
    rundir.record_config(tmp_path, new, 6)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "changed at step 6" in err and rundir.HISTORY in err
    assert f"train.steps {cfg.train.steps} -> 900" in err
    assert "train.learning_rate" in err and "exec.remat" in err
    assert json.loads((tmp_path / "config.json").read_text()) == to_dict(new)
    (entry,) = [json.loads(line) for line in (tmp_path / rundir.HISTORY).read_text().splitlines()]
    assert entry["replaced_at_step"] == 6 and entry["config"] == to_dict(cfg)
    assert entry["changed"] == {"exec.remat": {"was": cfg.exec.remat, "now": "full"},
                                "train.learning_rate": {"was": cfg.train.learning_rate, "now": 1e-3},
                                "train.steps": {"was": cfg.train.steps, "now": 900}}
    # A config.json that cannot be read as a config is kept as it was, word for word.
    (tmp_path / "config.json").write_text("{not json")
    rundir.record_config(tmp_path, cfg, 9)
    last = json.loads((tmp_path / rundir.HISTORY).read_text().splitlines()[-1])
    assert last == {"replaced_at_step": 9, "changed": None, "config": "{not json"}
    assert "could not be read" in capsys.readouterr().err


def test_metrics_rows_after_the_resumed_step_are_set_aside_not_dropped(tmp_path, capsys):
    rows = [{"step": s, "loss": 10.0 - s} for s in range(1, 8)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "lo')  # cut by a kill
    metrics.MetricsLog(tmp_path, 4).close()  # resumed from the step-4 checkpoint
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:4]
    aside = tmp_path / metrics.SET_ASIDE
    assert [json.loads(line) for line in aside.read_text().splitlines()] == \
        [{**r, "resumed_from": 4} for r in rows[4:]]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "from step 4" in err and "3 metrics row(s)" in err and str(aside) in err
    # A second resume (an earlier --resume-step) appends, and nothing to set aside says nothing.
    metrics.MetricsLog(tmp_path, 2).close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert [(r["step"], r["resumed_from"]) for r in map(json.loads, aside.read_text().splitlines())] == \
        [(5, 4), (6, 4), (7, 4), (3, 2), (4, 2)]
    capsys.readouterr()
    metrics.MetricsLog(tmp_path, 2).close()
    assert capsys.readouterr().err == "" and len(aside.read_text().splitlines()) == 5


@pytest.mark.parametrize("impl, capacity", [("ragged", None), ("all_to_all", 1.25)])
def test_an_expert_parallel_run_loads_on_fewer_devices_with_the_partitioned_moe(impl, capacity, capsys):
    """The run's mesh (expert=2) does not fit one device: every device goes on the data axis, and
    the MoE, which needed the expert axis, runs as the partitioned one (this used to raise, asking
    for mesh.expert > 1). The note says what changed."""
    cfg = Config(model=ModelConfig(moe=MoESpec(num_experts=4, top_k=2, expert_width=8, capacity_factor=capacity)),
                 mesh=MeshConfig(data=1, expert=2),
                 exec=ExecConfig(moe_impl=impl, grouped_matmul="megablox" if impl == "ragged" else "ragged_dot"))
    got = rundir.portable(cfg)
    assert got.mesh == MeshConfig() and got.exec.moe_impl == "partitioned" and got.exec.grouped_matmul == "ragged_dot"
    assert got.model == cfg.model
    note = capsys.readouterr().err
    assert note.count("\n") == 1 and f"exec.moe_impl '{impl}' -> 'partitioned'" in note


def test_a_hugging_face_folder_is_named_as_one(tmp_path, capsys):
    hf = tmp_path / "Qwen3-0.6B"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                                "hidden_size": 1024}))
    with pytest.raises(ConfigError) as e:
        rundir.read_config(hf)
    assert e.value.field == "--workdir" and "Hugging Face model folder" in e.value.allowed
    assert f"python -m gattn.convert from-hf {hf} --workdir OUT" in e.value.allowed
    assert cli.run_cli(entry_point("eval").main, ["--workdir", str(hf), "--no-figures"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Hugging Face model folder, not a gattn run" in err
    assert "from-hf" in err and "unknown field" not in err
    # train.py refuses it too, before writing anything into the folder.
    assert cli.run_cli(entry_point("train").main, ["--config", "tiny", "--workdir", str(hf), "--quiet"]) == 2
    assert "Hugging Face model folder" in capsys.readouterr().err
    assert sorted(p.name for p in hf.iterdir()) == ["config.json"]


def falling_curve(steps=80, seed=0):
    """An ordinary early-training curve: a fast fall from ln(4096) with step-to-step noise."""
    noise = np.random.default_rng(seed).normal(0, 0.15, steps)
    return [float(4.0 + 4.3 * np.exp(-s / 12) + n) for s, n in enumerate(noise)]


def count(losses, window=50, margin=0.5):
    counter = metrics.SpikeCounter(window, margin)
    return [s for s, loss in enumerate(losses) if counter(loss)], counter.count


def test_an_early_blow_up_is_a_spike_and_a_falling_noisy_curve_is_not():
    for seed in range(5):
        assert count(falling_curve(seed=seed)) == ([], 0), seed
    blown = falling_curve()
    blown[12] += 3.0  # step 12: far less than the 50-loss window the counter once waited for
    assert count(blown) == ([12], 1)
    # Fewer than MIN_PRIOR earlier losses: not judged (too few for a median).
    early = falling_curve()
    early[metrics.MIN_PRIOR - 1] += 5.0
    assert count(early) == ([], 0)
    # A window smaller than MIN_PRIOR is judged once it is full.
    assert count([5.0, 5.0, 5.0, 9.0], window=3) == ([3], 1)
