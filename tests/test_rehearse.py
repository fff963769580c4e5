"""The dress rehearsal (python -m gattn.rehearse): a preset as configured, shrunk only in width,
depth, vocabulary, experts, sequence length and step counts, on local processes with the preset's
chip count; one line per stage."""

import pytest

from gattn import cli
from gattn.experiments import rehearse


@pytest.mark.parametrize("preset", ["dense_1p7b", "dense_1p7b_48l", "moe_15a2b", "extend_1p7b_32k"])
def test_shrink_keeps_batch_mesh_microbatches_and_exec_and_says_what_it_changed(preset):
    small, lines = rehearse.shrink(preset, "sdpa_elementwise", [], chips=64)
    full, cfg = cli.load(preset, variant="sdpa_elementwise"), cli.load(preset, small, variant="sdpa_elementwise")
    assert (cfg.mesh, cfg.exec, cfg.data) == (full.mesh, full.exec, full.data)
    assert (cfg.train.batch_size, cfg.train.microbatches) == (full.train.batch_size, full.train.microbatches)
    assert cfg.model.gate == full.model.gate and cfg.model.q_heads == full.model.q_heads
    assert cfg.train.seq_len == 64 and cfg.model.num_layers == 2 and cfg.train.steps == rehearse.STEPS
    assert len(lines) == len(small) and all("->" in line for line in lines)
    if full.model.moe is not None:  # experts: 2 per device of the expert axis, top-k kept
        experts = max(2 * full.mesh.expert, full.model.moe.top_k)
        experts += -experts % full.mesh.expert
        assert cfg.model.moe.num_experts == experts and cfg.model.moe.top_k == full.model.moe.top_k
    if full.train.lr_preset:  # the preset's schedule spelled out, its warmup scaled
        peak, floor, warmup = full.train.schedule
        assert cfg.train.schedule == (peak, floor, rehearse.WARMUP)
        assert f"train.warmup_steps: {warmup} -> {rehearse.WARMUP}" in lines


def test_a_small_rehearsal_passes_every_stage(tmp_path, capsys):
    """2 processes x 2 devices; the Pallas kernel's shard_map and 3 held-out rows over 4 data shards
    (which crashed the first validation before the eval batch was padded to the shards)."""
    results = rehearse.rehearse("tiny", 2, 2, overrides=["exec.attention_impl=pallas", "data.eval_batch_size=3"],
                                workdir=tmp_path, timeout=600)
    out = capsys.readouterr().out
    assert all(v.startswith("ok") for v in results.values()), out
    assert [line.split(":")[0] for line in out.splitlines()[-len(rehearse.STAGES):]] == list(rehearse.STAGES)
    assert "resume: ok (1 x 4" in out


def test_the_config_stage_refuses_a_batch_the_chips_do_not_divide(tmp_path, capsys):
    """extend_1p7b_32k's 64 rows in 2 microbatches fill its v5p-64 (32 chips, fsdp 32); on 64
    chips fsdp 64 x 2 does not divide them. Before: "config: ok", then every process of the
    training stage failed on it and the later stages reported what that left missing."""
    results = rehearse.rehearse("extend_1p7b_32k", 8, 8, variant="sdpa_elementwise", workdir=tmp_path)
    assert results["config"].startswith("error") and "'train.batch_size' = 64" in results["config"], results
    assert "fsdp" in results["config"] and "train.microbatches (2)" in results["config"], results
    assert all(v.startswith("not run") for k, v in results.items() if k != "config"), results
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("preset, processes, devices", [
    ("dense_1p7b", 8, 8),       # 64 chips: fsdp 64 (the batch of 1,024 in 16 microbatches divides)
    ("dense_1p7b_48l", 8, 8),
    ("moe_15a2b", 8, 4),        # its v5p-64: 8 hosts x 4 chips, fsdp 32
    ("extend_1p7b_32k", 8, 4),  # its v5p-64 (at 64 chips its 64 rows in 2 microbatches do not divide)
])
def test_every_paper_preset_rehearses_on_16_batch_shards(preset, processes, devices, tmp_path, capsys):
    """At 16 or more batch shards the presets' eval batch of 8 is not a multiple of the shards (the
    first validation crashed there). Each takes many minutes on 2 cores."""
    results = rehearse.rehearse(preset, processes, devices, variant="sdpa_elementwise", workdir=tmp_path,
                                timeout=3600)
    out = capsys.readouterr().out
    assert all(v.startswith("ok") for v in results.values()), out
