"""The paper-scale presets' full training step (forward, backward, AdamW), compiled ahead of time
for TPU topologies by libtpu on this CPU machine, at reduced depth so the suite stays fast
(`bench/aot_train_step.py` compiles the full presets)."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from gattn import cli
from gattn.model import params

_spec = importlib.util.spec_from_file_location(
    "aot_train_step", Path(__file__).resolve().parents[1] / "bench" / "aot_train_step.py")
aot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(aot)


@pytest.mark.parametrize("preset, overrides, topology, mesh", [
    ("dense_1p7b", ["model.num_layers=1", "model.vocab_size=32768", "train.seq_len=2048"],
     "v5e:2x2", (1, 1, 4)),
    pytest.param("moe_15a2b", ["model.num_layers=1", "model.vocab_size=32768",
                               "model.moe.num_experts=16", "train.seq_len=1024"], "v5p:2x2x1", (1, 2, 2),
                 marks=pytest.mark.slow),  # ~60 s of compiling: `pytest -m slow`
    pytest.param("moe_15a2b", ["model.num_layers=1", "model.vocab_size=32768", "model.moe.num_experts=16",
                               "train.seq_len=1024", "exec.moe_impl=ragged"], "v5p:2x2x1", (1, 2, 2),
                 marks=pytest.mark.slow, id="moe_15a2b-ragged"),  # dropless EP (ragged_all_to_all): ~80 s
    pytest.param("extend_1p7b_32k", ["model.num_layers=1", "model.vocab_size=32768"], "v5e:2x2", (1, 1, 4),
                 marks=pytest.mark.slow),  # a 32k row through the Pallas kernel: ~40 s
])
def test_preset_train_step_compiles_for_tpu_and_fits(preset, overrides, topology, mesh):
    cfg = cli.load(preset, overrides, variant="sdpa_elementwise")
    compiled, kind, rows, _, hosts = aot.compile_step(cfg, topology, mesh, batch_per_device=1)
    out = aot.report(compiled, kind)
    assert out["fits"] is True, out
    assert out["per_device_bytes"]["arguments"] > 0 and out["flops_per_device"] > 0
    assert out["mosaic_kernels"] >= 4, "the fused attention kernels must be in the executable"
    assert rows == mesh[0] * mesh[1]
    assert ("exec.moe_impl=ragged" in overrides) == (out["ragged_all_to_all"] > 0)
    # the rows each host feeds: contiguous, together the whole batch (one host on these topologies)
    assert sorted(r for span in hosts.values() for r in range(*span)) == list(range(rows))


def test_presets_have_the_papers_sizes():
    moe = cli.load("moe_15a2b").model
    assert 14.5e9 < params.count_params(moe) < 15.5e9
    assert 2.4e9 < params.activated_params(moe) < 2.7e9
    for name in ("dense_1p7b", "dense_1p7b_48l"):
        dense = cli.load(name).model
        assert 1.65e9 < params.count_params(dense) == params.activated_params(dense) < 1.8e9
    assert cli.load("dense_1p7b_48l").model.num_layers == 48
    dense, ext = (cli.load(n) for n in ("dense_1p7b", "extend_1p7b_32k"))
    assert (dense.model.rope_base, ext.model.rope_base) == (10_000.0, 1_000_000.0)  # Sec. 4.4
    assert dataclasses.replace(ext.model, rope_base=dense.model.rope_base) == dense.model  # init_from accepts it
    assert ext.train.seq_len == 32_768
    assert 75e9 < ext.train.batch_size * ext.train.seq_len * ext.train.steps < 85e9  # ~80B tokens
