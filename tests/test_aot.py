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
    pytest.param("dense_1p7b", ["model.num_layers=1", "model.vocab_size=32768", "train.seq_len=2048"],
                 "v5e:2x2", (1, 1, 4), marks=pytest.mark.slow),  # the fit test below compiles it at batch 1024
    pytest.param("moe_15a2b", ["model.num_layers=1", "model.vocab_size=32768",
                               "model.moe.num_experts=16", "train.seq_len=1024", "exec.moe_impl=partitioned",
                               "exec.grouped_matmul=ragged_dot"],
                 "v5p:2x2x1", (1, 2, 2), marks=pytest.mark.slow),  # ~60 s of compiling: `pytest -m slow`
    # (the partitioned path named: the preset's own is the dropless one since issue 58)
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


_fit_spec = importlib.util.spec_from_file_location(
    "fit_presets", Path(__file__).resolve().parents[1] / "bench" / "fit_presets.py")
fit = importlib.util.module_from_spec(_fit_spec)
_fit_spec.loader.exec_module(fit)


def test_fit_compiles_train_and_eval_steps_at_the_real_global_batch():
    """bench/fit_presets.py on one small case: the preset's real batch of 1024 rows (not one per
    device), with microbatches and the chunked loss, and the eval step as validation runs it.
    ~100 s of compiling on 2 CPU cores (8 rows per shard per microbatch: 256 took twice that)."""
    out = fit.run_row("dense_1p7b", "v5p:2x2x1", (2, 1, 2),
                      ["model.num_layers=1", "model.vocab_size=4096", "train.seq_len=128",
                       "train.microbatches=64", "exec.loss_chunk=64", "data.eval_batch_size=3"])
    assert out["global_batch"] == 1024 and out["seq_len"] == 128 and out["chips"] == 4
    assert (out["microbatches"], out["loss_chunk"], out["rows_per_shard_per_microbatch"]) == (64, 64, 8)
    assert out["train"]["fits"] and out["eval"]["fits"] and out["fits"], out
    assert out["train"]["arguments_gib"] > 0 and out["train"]["xla_tflops_per_chip"] > 0
    assert out["eval"]["rows"] == 4  # 3 held-out rows padded to the 2 data shards, as trainer.validate pads
    assert out["eval"]["resident_gib"] > out["eval"]["total_gib"]  # the AdamW moments stay in HBM


def test_fit_refuses_a_batch_the_shards_and_microbatches_do_not_divide():
    with pytest.raises(fit.ConfigError, match="microbatches"):
        fit.run_row("dense_1p7b", "v5p:2x2x1", (4, 1, 1), ["model.num_layers=1", "train.microbatches=512"])


@pytest.mark.slow  # full depth at the real batch: minutes of compiling each
@pytest.mark.parametrize("part, preset, topology, mesh, overrides",
                         # (not ROWS["candidates"]: the meshes and microbatches a fit chose among,
                         # some of them beyond HBM by design, e.g. dense_1p7b in one pass)
                         [(part, *row) for part, rows in fit.ROWS.items() if part != "candidates" for row in rows])
def test_preset_fits_its_slice_at_the_real_batch(part, preset, topology, mesh, overrides):
    out = fit.run_row(preset, topology, mesh, overrides)
    assert out["global_batch"] == cli.load(preset).train.batch_size
    assert out["train"]["fits"] and out["eval"]["fits"], out


_TINY_QWEN3_5 = '''
import dataclasses

from gattn.config import LinearAttentionSpec, hybrid_layer_types
from gattn.configs.qwen3_5_2b import get_config as preset


def get_config():  # qwen3_5_2b (3 Gated DeltaNet layers to 1 gated attention, the MTP layer), shrunk
    c = preset()
    m = dataclasses.replace(c.model, vocab_size=4096, d_model=256, num_layers=4, layer_types=hybrid_layer_types(4, 4),
                            q_heads=4, kv_heads=2, head_dim=64, rope_dim=16, d_ff=512,
                            linear_attention=LinearAttentionSpec(num_k_heads=4, num_v_heads=4, head_k_dim=64,
                                                                 head_v_dim=64, conv_kernel=4))
    # one pass: the preset's 4 microbatches would gather the weights 4 times (FSDP regathers per microbatch)
    return dataclasses.replace(c, model=m, train=dataclasses.replace(c.train, batch_size=16, seq_len=128, microbatches=1))
'''


def test_fsdp_sends_weights_not_the_full_batchs_activations(tmp_path):
    """The hybrid qwen3_5_2b on FSDP (its layers a Python loop, not a scan): XLA laid the residual
    stream out as the embedding table is split (d_model over fsdp) and all-reduced every layer's
    full-batch activations, 9,018 GiB per chip per step at the preset's size on v5p-32. The stream
    is now pinned to rows over the batch axes (sharding.rows), so a step sends what FSDP must: the
    bf16 weights gathered for the forward and again for the recompute, and the float32 gradients
    reduce-scattered, ~1.3x the float32 parameter bytes. Before: 5.9x on this shrunk model (15x at
    256 tokens a row, whose TPU compile took 3x as long)."""
    path = tmp_path / "qwen3_5_tiny.py"
    path.write_text(_TINY_QWEN3_5)
    out = fit.run_row(str(path), "v5p:2x2x1", (1, 4, 1, 1), eval_step=False)
    sent = out["train"]["network"]["total_gib"] * 2**30
    assert out["mesh"]["fsdp"] == 4 and out["params"] > 4e6
    assert 0.5 * 4 * out["params"] < sent < 2.5 * 4 * out["params"], (sent, out["train"]["network"])
