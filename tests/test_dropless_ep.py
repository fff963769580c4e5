"""Dropless expert parallelism (gattn/model/dropless_ep.py, exec.moe_impl="ragged"): on meshes
(data, expert, model) = (1,4,2), (2,2,2), (1,8,1) of 8 simulated CPU devices its loss, load, LBL,
z-loss and gradients equal the single-device dropless model's, with a skewed router too, and a
buffer smaller than the worst case counts its overflow (tests/multidevice/dropless_ep_step.py,
one subprocess for all meshes). On CPU the exchange is the all_gather emulation of
ragged_all_to_all, tested here against the collective's documented example; the real collective
compiles for TPU in tests/test_aot.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import multidevice
from gattn.config import Config, ConfigError, ExecConfig, MeshConfig, MoESpec
from gattn.model import dropless_ep
from gattn.model.dropless_ep import buffer_rows, emulated_ragged_all_to_all

from conftest import tiny_model

# (data, expert, model); 1,8,1,1 is (data, fsdp, expert, model): pure FSDP, the experts gathered
MESHES = ["1,4,2", "2,2,2", "1,8,1", "1,8,1,1"]


def test_dropless_expert_parallel_moe_equals_one_device():
    out = multidevice.run("dropless_ep_step", "--meshes", *MESHES)
    assert out.count("ok") == len(MESHES), out


def test_emulation_follows_the_collectives_example():
    """The example in jax.lax.ragged_all_to_all's docstring (axis of size 2), on a 1-device mesh
    with the axis vmapped (the emulation's all_gather works under vmap with an axis name)."""
    operand = jnp.array([[1, 2, 2], [3, 4, 0]])
    output = jnp.zeros((2, 4), jnp.int32)
    tables = [jnp.array(t) for t in ([[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])]
    got = jax.vmap(lambda *a: emulated_ragged_all_to_all(*a, axis_name="x"), axis_name="x")(
        operand, output, *tables)
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_buffer_is_the_worst_case_unless_bounded():
    assert buffer_rows(64, 4, None) == 256
    assert buffer_rows(64, 4, 1.25) == 80
    assert buffer_rows(64, 4, 9.0) == 256


def test_ragged_needs_a_dropless_moe_and_an_expert_axis():
    dropless = tiny_model(moe=MoESpec(num_experts=8, top_k=2, expert_width=16))
    Config(model=dropless, mesh=MeshConfig(1, 4, 2), exec=ExecConfig(moe_impl="ragged"))
    capped = tiny_model(moe=MoESpec(num_experts=8, top_k=2, expert_width=16, capacity_factor=1.25))
    with pytest.raises(ConfigError, match="capacity_factor None"):
        Config(model=capped, mesh=MeshConfig(1, 4, 2), exec=ExecConfig(moe_impl="ragged"))
    with pytest.raises(ConfigError, match="mesh.expert"):
        Config(model=dropless, mesh=MeshConfig(1, 3, 1), exec=ExecConfig(moe_impl="ragged"))
    # expert 1 (pure FSDP, as MaxText runs its FSDP MoE configs): every expert on every device
    Config(model=dropless, mesh=MeshConfig(1, 1, 1, fsdp=8), exec=ExecConfig(moe_impl="ragged"))
    with pytest.raises(ConfigError, match="moe_buffer"):
        ExecConfig(moe_impl="ragged", moe_buffer=0.5)


def test_the_real_collective_compiles_for_tpu():
    """On a TPU mesh the layer holds jax.lax.ragged_all_to_all itself, not the emulation: its
    forward and backward compile (libtpu, ahead of time) with ragged-all-to-all and ragged-dot."""
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh, NamedSharding

    devices = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices
    mesh = Mesh(np.asarray(devices).reshape(1, 2, 2), ("data", "expert", "model"),
                axis_types=(AxisType.Auto,) * 3)
    spec, d, n = MoESpec(num_experts=4, top_k=2, expert_width=128), 128, 256

    def loss(w, x):
        out, aux = dropless_ep.moe_forward(w, spec, jax.nn.silu, jnp.bfloat16, x, mesh)
        return jnp.sum(out.astype(jnp.float32) ** 2) + aux["lbl"]

    def arg(shape, spec_, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec_))
    w13 = arg((4, d, 128), P("expert", None, "model"))
    w = {"router": arg((d, 4), P(), jnp.float32), "w1": w13, "w3": w13, "w2": arg((4, 128, d), P("expert", "model"))}
    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss)).lower(w, arg((n, d), P(("data", "expert")))).compile().as_text()
    assert text.count("ragged-all-to-all(") >= 3, "forward, backward: the collective itself"
    assert "ragged-dot" in text and "all-gather(" not in text, "no emulation on TPU"
