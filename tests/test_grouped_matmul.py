"""The grouped matmul kernels (gattn/kernels/grouped_matmul.py, exec.grouped_matmul): megablox (in
interpret mode on CPU) equals jax.lax.ragged_dot and a dense per-group reference, values and
gradients, with an empty group and padding rows; inside the dropless expert-parallel layer it
gives one device's loss and gradients on 8 simulated devices (mesh 2,2,2 by default, the others
slow), and for a TPU mesh the layer compiles with megablox's gmm and tgmm Mosaic kernels in place
of ragged-dot."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import multidevice
from gattn.config import ConfigError, ExecConfig, MoESpec
from gattn.kernels.grouped_matmul import grouped_dot, megablox_dot, padded_rows, scanned_dot, tiles
from gattn.model import dropless_ep


def dense_reference(x_BxK, w_LxKxN, sizes):
    """Each group's rows times its weights, one numpy matmul per group; padding rows zero."""
    out, start = np.zeros((x_BxK.shape[0], w_LxKxN.shape[2]), np.float32), 0
    for g, size in enumerate(sizes):
        out[start:start + size] = x_BxK[start:start + size] @ w_LxKxN[g]
        start += size
    return out


def test_megablox_equals_ragged_dot_and_a_dense_reference_with_gradients():
    b, k, n, sizes = 48, 32, 16, [10, 0, 21]  # an empty group; rows 31.. are padding
    x = jax.random.normal(jax.random.key(0), (b, k))
    w = jax.random.normal(jax.random.key(1), (len(sizes), k, n))
    ct = jax.random.normal(jax.random.key(2), (b, n))
    sizes_L = jnp.array(sizes, jnp.int32)

    def out_and_grads(dot):  # one compile each: forward and backward together
        def run(x, w, sizes_L, ct):
            out, vjp = jax.vjp(lambda x, w: dot(x, w, sizes_L), x, w)
            return out, vjp(ct)
        return jax.jit(run)(x, w, sizes_L, ct)

    got, want = out_and_grads(grouped_dot("megablox", "cpu")), out_and_grads(jax.lax.ragged_dot)
    np.testing.assert_allclose(got[0], dense_reference(np.asarray(x), np.asarray(w), sizes), rtol=1e-5, atol=1e-4)
    assert not np.any(np.asarray(got[0])[sum(sizes):]), "padding rows are zero"
    for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(r))))


def test_the_rehearsals_stand_in_equals_ragged_dot_without_its_per_group_buffers(monkeypatch):
    """GATTN_PALLAS_STANDIN=1 (the dress rehearsal) runs megablox as `scanned_dot`. Before, it was
    XLA's CPU ragged_dot, which holds every group's product at once: moe_15a2b's rehearsal (8
    experts) outgrew the 24 GiB machine at its resume (4 processes x 8 devices, 6.5-6.8 GiB each)."""
    monkeypatch.setenv("GATTN_PALLAS_STANDIN", "1")
    assert grouped_dot("megablox", "cpu") is scanned_dot
    b, k, n, sizes = 48, 32, 16, [10, 0, 21, 5]
    x = jax.random.normal(jax.random.key(0), (b, k))
    w = jax.random.normal(jax.random.key(1), (len(sizes), k, n))
    sizes_L = jnp.array(sizes, jnp.int32)

    def loss(dot):
        return lambda x, w: jnp.sum(jnp.sin(dot(x, w, sizes_L)))
    got = jax.jit(jax.value_and_grad(loss(scanned_dot), argnums=(0, 1)))(x, w)
    want = jax.jit(jax.value_and_grad(loss(jax.lax.ragged_dot), argnums=(0, 1)))(x, w)
    for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(scanned_dot(x, w, sizes_L), dense_reference(np.asarray(x), np.asarray(w), sizes),
                               rtol=1e-5, atol=1e-4)

    def temp_bytes(dot):  # the step's temporaries at the rehearsal's shape: 8 groups, rows x 64
        x, w = jax.ShapeDtypeStruct((16384, 64), jnp.float32), jax.ShapeDtypeStruct((8, 64, 64), jnp.float32)
        sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
        step = jax.jit(jax.grad(lambda x, w, s: jnp.sum(dot(x, w, s) ** 2), argnums=(0, 1)))
        return step.lower(x, w, sizes).compile().memory_analysis().temp_size_in_bytes
    scanned, ragged = temp_bytes(scanned_dot), temp_bytes(jax.lax.ragged_dot)
    assert scanned < ragged / 3, (scanned, ragged)


def test_megablox_rows_are_whole_tiles():
    assert [padded_rows(r) for r in (1, 16, 40, 128, 129, 513, 40960)] == [16, 16, 48, 128, 144, 1024, 40960]
    with pytest.raises(ValueError, match="padded_rows"):
        megablox_dot(jnp.zeros((40, 8)), jnp.zeros((2, 8, 8)), jnp.array([3, 4], jnp.int32))


def test_megablox_takes_maxtexts_tiles_not_128():
    """(At 128 x 128 x 128, moe_15a2b's step read its routed rows 6x and each expert's weights once
    per 128 rows: 13.7 of its 27.8 TB of HBM traffic, docs/presets.md.) Rows by 512, K and N whole
    up to 1024, else the largest multiple of 128 that divides them."""
    assert tiles(1_048_576, 2048, 704) == (512, 1024, 704)  # moe_15a2b's gate and up projections
    assert tiles(1_048_576, 704, 2048) == (512, 704, 1024)  # its down projection (and the transposes)
    assert tiles(40, 1408, 96) == (48, 128, 96) and tiles(1024, 1152, 4352) == (512, 384, 256)


def test_megablox_over_several_tiles_of_each_dimension_equals_ragged_dot():
    """Rows over two 512-row tiles with groups crossing them, N over two 1024 tiles, K whole:
    forward and both backward kernels (each with tiles of its own shape)."""
    b, k, n, sizes = 1024, 128, 2048, [300, 0, 500, 100]
    x, w = jax.random.normal(jax.random.key(0), (b, k)), jax.random.normal(jax.random.key(1), (len(sizes), k, n))
    ct, sizes_L = jax.random.normal(jax.random.key(2), (b, n)), jnp.array(sizes, jnp.int32)

    def out_and_grads(dot):
        out, vjp = jax.vjp(lambda x, w: dot(x, w, sizes_L), x, w)
        return out, vjp(ct)
    got, want = jax.jit(lambda: out_and_grads(grouped_dot("megablox", "cpu")))(), out_and_grads(jax.lax.ragged_dot)
    for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(r))))


def test_grouped_matmul_is_a_checked_execution_choice():
    assert ExecConfig().grouped_matmul == "ragged_dot"
    ExecConfig(moe_impl="ragged", grouped_matmul="megablox")
    with pytest.raises(ConfigError, match="grouped_matmul.*expected one of 'ragged_dot', 'megablox'"):
        ExecConfig(moe_impl="ragged", grouped_matmul="gmm")
    with pytest.raises(ConfigError, match="moe_impl='ragged'"):
        ExecConfig(grouped_matmul="megablox")
    with pytest.raises(ValueError, match="TPU kernel .* for gpu"):  # not ~100x-slow interpret mode there
        grouped_dot("megablox", "gpu")


@pytest.mark.parametrize("meshes", [pytest.param(["2,2,2"], id="2,2,2"),
                                    pytest.param(["1,4,2", "1,8,1"], id="1,4,2+1,8,1", marks=pytest.mark.slow)])
def test_megablox_in_the_dropless_layer_equals_one_device(meshes):
    """tests/multidevice/dropless_ep_step.py with megablox (check_vma off): loss, aux values and
    every gradient equal one device's. Mesh (2,2,2) has every axis > 1, so it runs by default."""
    out = multidevice.run("dropless_ep_step", "--meshes", *meshes, "--grouped-matmul", "megablox")
    assert out.count("ok") == len(meshes), out


def compile_for_tpu(grouped_matmul: str):
    """The dropless layer's forward and backward compiled by libtpu for v5p:2x2x1 (expert 2 x
    model 2), bf16, a buffer of 1.25 x the mean load; returns the executable."""
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh, NamedSharding

    devices = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices
    mesh = Mesh(np.asarray(devices).reshape(1, 2, 2), ("data", "expert", "model"),
                axis_types=(AxisType.Auto,) * 3)
    spec, d, n = MoESpec(num_experts=4, top_k=2, expert_width=256), 128, 256  # width 128 per model shard

    def loss(w, x):
        out, aux = dropless_ep.moe_forward(w, spec, jax.nn.silu, jnp.bfloat16, x, mesh, 1.25, grouped_matmul)
        return jnp.sum(out.astype(jnp.float32) ** 2) + aux["lbl"]

    def arg(shape, spec_, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec_))
    w13 = arg((4, d, 256), P("expert", None, "model"))
    w = {"router": arg((d, 4), P(), jnp.float32), "w1": w13, "w3": w13,
         "w2": arg((4, 256, d), P("expert", "model"))}
    with jax.set_mesh(mesh):
        return jax.jit(jax.grad(loss)).lower(w, arg((n, d), P(("data", "expert")))).compile()


def mosaic_kernels(text: str) -> list[str]:
    """The jax function each Mosaic (tpu_custom_call) kernel of an executable came from."""
    return [re.search(r'op_name="[^"]*?(\w+)\)?/pallas_call', line).group(1) if "pallas_call" in line else "other"
            for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]


def test_megablox_compiles_for_tpu_inside_the_layer():
    """Forward gmm x3 (w1, w3, w2), backward tgmm x3 (weight gradients) and gmm (the input
    gradient of w2; the others are unused here), all Mosaic custom calls; no ragged-dot left."""
    text = compile_for_tpu("megablox").as_text()
    kernels = mosaic_kernels(text)
    assert kernels.count("tgmm") == 3 and kernels.count("gmm") >= 4, kernels
    assert "ragged-dot" not in text and text.count("ragged-all-to-all(") >= 3


@pytest.mark.slow
def test_xla_counts_megablox_below_ragged_dot():
    """XLA's FLOP count of the same layer (per device): megablox's is its kernels' own estimate,
    2 B K N for each of its 7 calls (B = padded_rows(1.25 x 256 routed rows) = 384, K = N = 128),
    plus the little else the layer does; ragged_dot's count is higher."""
    flops = {g: compile_for_tpu(g).cost_analysis()["flops"] for g in ("megablox", "ragged_dot")}
    kernels = 7 * 2 * padded_rows(320) * 128 * 128
    assert kernels <= flops["megablox"] < 1.1 * kernels, flops
    assert flops["ragged_dot"] - flops["megablox"] > 0.1 * kernels, flops
