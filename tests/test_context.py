"""Context parallelism (mesh.context, gattn/model/context.py): the layout, the config's refusals,
and on 8 simulated CPU devices (tests/multidevice/context_step.py) the loss and gradients of a
dense gated model, a Qwen3.5-style hybrid with MTP and a hybrid MoE with the sequence split over
context 2, 4 and 8 (and context x fsdp, context x data) equal to one device's, on packed rows;
also through the Pallas kernels (interpret mode) and across a checkpoint moved between layouts."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import multidevice
from gattn import kernels
from gattn.config import (Config, ConfigError, ExecConfig, LinearAttentionSpec, MeshConfig, MoESpec, TrainConfig,
                          hybrid_layer_types)
from gattn.model import context, sharding
from gattn.model.transformer import Transformer

from conftest import tiny_model


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_order_is_a_balanced_permutation(n):
    length = 64
    idx = context.order(length, n)
    assert sorted(idx.tolist()) == list(range(length))
    c = length // (2 * n)
    per_device = idx.reshape(n, 2 * c)
    for r in range(n):  # an early chunk and a late one, each contiguous
        assert per_device[r, :c].tolist() == list(range(r * c, (r + 1) * c))
        assert per_device[r, c:].tolist() == list(range((2 * n - 1 - r) * c, (2 * n - r) * c))
    # equal causal work: the keys each device's queries see, summed, are the same on every device
    work = [(per_device[r] + 1).sum() for r in range(n)]
    assert len(set(work)) == 1


def test_arrange_and_restore_round_trip():
    x = np.arange(2 * 32).reshape(2, 32)
    (arranged,) = context.arrange(x, n=4)
    assert not np.array_equal(np.asarray(arranged), x)
    np.testing.assert_array_equal(np.asarray(context.restore(arranged, n=4)), x)
    assert context.arrange(x, None, n=1) == (x, None)


def test_order_refuses_a_length_the_chunks_do_not_divide():
    with pytest.raises(ValueError, match="multiple of 8"):
        context.order(30, 4)


def test_config_refuses_context_that_does_not_divide_the_sequence():
    with pytest.raises(ConfigError, match="mesh.context"):
        Config(mesh=MeshConfig(context=3), train=TrainConfig(seq_len=128))
    hybrid = tiny_model(num_layers=4, layer_types=hybrid_layer_types(4), linear_attention=LinearAttentionSpec())
    with pytest.raises(ConfigError, match="conv_kernel"):
        Config(model=hybrid, mesh=MeshConfig(context=16), train=TrainConfig(seq_len=32))
    Config(model=hybrid, mesh=MeshConfig(context=4), train=TrainConfig(seq_len=32))  # chunks of 4: fine
    with pytest.raises(ConfigError, match="context"):
        MeshConfig(context=0)


def test_config_refuses_what_context_parallelism_cannot_run():
    """The GPU kernels take neither the keys' own segment ids nor return the lse (before: a
    TypeError while tracing); a capacity MoE keeps each expert's first tokens in token order, which
    the context layout reorders (before: silently other tokens dropped than at context 1)."""
    for impl in ("pallas_gpu", "cudnn"):
        with pytest.raises(ConfigError, match="exec.attention_impl"):
            Config(mesh=MeshConfig(context=2), train=TrainConfig(seq_len=128),
                   exec=ExecConfig(attention_impl=impl))
    capacity = tiny_model(moe=MoESpec(num_experts=4, top_k=2, expert_width=16, capacity_factor=1.25))
    with pytest.raises(ConfigError, match="capacity_factor"):
        Config(model=capacity, mesh=MeshConfig(context=2), train=TrainConfig(seq_len=128))
    Config(model=capacity, train=TrainConfig(seq_len=128))  # (without context: fine)
    Config(model=dataclasses.replace(capacity, moe=dataclasses.replace(capacity.moe, capacity_factor=None)),
           mesh=MeshConfig(context=2), train=TrainConfig(seq_len=128))  # dropless: fine


def test_auto_attention_that_resolves_to_a_gpu_kernel_is_refused_under_context(monkeypatch):
    """`auto` on a GPU resolves to a kernel the context pairs cannot use: one line naming the field."""
    monkeypatch.setattr(context, "size", lambda: 2)
    monkeypatch.setattr(kernels, "resolve", lambda impl, platform=None: "pallas_gpu")
    model = Transformer(tiny_model(), ExecConfig(attention_impl="auto"), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((1, 16), jnp.int32)
    with pytest.raises(ConfigError, match="exec.attention_impl.*'pallas_gpu'"):
        model(tokens, jnp.broadcast_to(jnp.arange(16), (1, 16)))


def test_mesh_shape_has_the_context_axis():
    assert sharding.AXES == ("data", "fsdp", "context", "expert", "model")
    assert sharding.mesh_shape(MeshConfig(context=4), 8) == (2, 1, 4, 1, 1)
    assert sharding.mesh_shape(MeshConfig(data=1, fsdp=-1, context=2), 8) == (1, 4, 2, 1, 1)
    with pytest.raises(ConfigError, match="context=3"):
        sharding.mesh_shape(MeshConfig(data=1, context=3), 8)


def test_context_parallel_hybrid_step_equals_one_device():
    """The default set's cousin of the slow matrix below: the Qwen3.5-style hybrid (Gated DeltaNet,
    gated attention, MTP) on context 4 x fsdp 2; and exec.attention_query_chunk's bound on a
    device's attention memory under context (before: dropped there)."""
    out = multidevice.run("context_step", "--models", "hybrid", "--meshes", "1,2,4", "--query-chunk")
    oks = [line for line in out.splitlines() if line.startswith("ok ")]
    assert len(oks) == 2 and oks[0].startswith("ok query_chunk") and oks[1] == "ok hybrid (1, 2, 4)", out


@pytest.mark.slow
def test_context_parallel_step_equals_one_device_for_every_model_and_mesh(tmp_path):
    """Dense, hybrid, hybrid MoE and a hybrid whose conv has width 1 (before: an index error in the
    reset carried across chunks) on context 2 x data 4, context 4 x fsdp 2 and context 8; and a
    checkpoint saved without the context axis restores onto two layouts with it, whose next
    trainer step gives the same loss and gradient norm."""
    out = multidevice.run("context_step", "--checkpoint", tmp_path / "ckpt", timeout=1800)
    oks = [line for line in out.splitlines() if line.startswith("ok ")]
    assert len(oks) == 4 * 3 + 2, out
    assert sum(line.startswith("ok checkpoint") for line in oks) == 2, out


@pytest.mark.slow
def test_context_parallel_step_through_the_pallas_kernels_equals_one_device():
    """The fused flash kernel (its lse merging the chunk pairs) and the GDN rule's kernel, in
    interpret mode, for the dense model and the hybrid on context 4 x fsdp 2 (~1 min of CPU)."""
    out = multidevice.run("context_step", "--models", "dense_pallas", "hybrid_pallas", "--meshes", "1,2,4")
    assert [line for line in out.splitlines() if line.startswith("ok ")] == [
        "ok dense_pallas (1, 2, 4)", "ok hybrid_pallas (1, 2, 4)"], out


@pytest.mark.parametrize("preset, chips, seq_len", [("qwen3_5_2b_64k", 8, 64), ("qwen3_5_2b_256k", 16, 96)])
def test_the_rehearsal_shrinks_a_context_preset_to_chunks_the_conv_fits(preset, chips, seq_len):
    """The rehearsal's 64 tokens are 2 per device on a context axis of 16, fewer than the conv's 3
    of left context: it takes 96 there (the shrunk config must load)."""
    from gattn import cli
    from gattn.experiments.rehearse import shrink

    overrides, _ = shrink(preset, None, [], chips)
    cfg = cli.load(preset, overrides)
    assert cfg.train.seq_len == seq_len and cfg.mesh.context == cli.load(preset).mesh.context
    assert sharding.mesh_shape(cfg.mesh, chips)[2] == cfg.mesh.context
