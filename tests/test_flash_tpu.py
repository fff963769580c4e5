"""The Pallas kernel compiled ahead of time for real TPU topologies, on this CPU machine.

`libtpu` (installed with the test extra, `jax[tpu]`) carries the Mosaic compiler, so lowering
and compiling for a TPU topology description checks block shapes, layouts and VMEM use that
interpret mode accepts blindly. Nothing runs on a TPU here; the test asserts that the executable
exists and contains the kernels as Mosaic custom calls.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gattn.kernels import attention_pallas, shard_attention


def _mesh(topology, shape, names):
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    return Mesh(np.asarray(devices).reshape(shape), names)


def _abstract(mesh, shape, spec, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _compile_grad(mesh, *, batch, seq, q_heads, kv_heads, head_dim, gate, segments, batch_axes):
    heads = P(batch_axes or None, None, "model", None)
    attn = shard_attention(attention_pallas, mesh, batch_axes=batch_axes, head_axis="model")
    gate_spec = heads if gate == "elementwise" else P(batch_axes or None, None, "model")
    gate_shape = (batch, seq, q_heads) + ((head_dim,) if gate == "elementwise" else ())

    def loss(q, k, v, g, seg):
        y = attn(q, k, v, g, segment_ids=seg if segments else None, interpret=False)
        return jnp.sum(y.astype(jnp.float32))

    args = (_abstract(mesh, (batch, seq, q_heads, head_dim), heads),
            _abstract(mesh, (batch, seq, kv_heads, head_dim), heads),
            _abstract(mesh, (batch, seq, kv_heads, head_dim), heads),
            _abstract(mesh, gate_shape, gate_spec),
            _abstract(mesh, (batch, seq), P(batch_axes or None, None), jnp.int32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args).compile()


@pytest.mark.parametrize("topology, mesh_shape, gate, head_dim, segments", [
    ("v5e:2x2", (1, 4), "elementwise", 128, True),   # heads over 4 chips, packed sequences
    ("v5e:2x2", (2, 2), "headwise", 128, False),     # batch and heads
    ("v5p:2x2x1", (1, 4), "elementwise", 128, False),
    ("v6e:2x2", (2, 2), "elementwise", 64, True),    # head_dim 64: the transposed layout
])
def test_forward_and_gradient_compile_for_tpu(topology, mesh_shape, gate, head_dim, segments):
    mesh = _mesh(topology, mesh_shape, ("data", "model"))
    compiled = _compile_grad(mesh, batch=2 * mesh_shape[0], seq=1024, q_heads=8, kv_heads=4,
                             head_dim=head_dim, gate=gate, segments=segments,
                             batch_axes=("data",))
    text = compiled.as_text()
    assert text.count("tpu_custom_call") >= 3
    for kernel in ("gated_flash_fwd", "flash_bwd_dkv", "flash_bwd_dq"):
        assert kernel in text, kernel
    assert compiled.memory_analysis() is not None


def test_forward_alone_compiles_without_gate_at_default_blocks():
    mesh = _mesh("v5e:2x2", (4,), ("model",))
    attn = shard_attention(attention_pallas, mesh, batch_axes=(), head_axis="model")
    spec = P(None, None, "model", None)
    args = [_abstract(mesh, (1, 2048, 32, 128), spec)] + [_abstract(mesh, (1, 2048, 4, 128), spec)] * 2
    compiled = jax.jit(lambda q, k, v: attn(q, k, v, interpret=False)).lower(*args).compile()
    text = compiled.as_text()
    assert "flash_fwd" in text and "flash_bwd" not in text


def test_a_length_the_default_blocks_do_not_tile_compiles():
    """S = 2560 with the default 512 / 512 blocks: no padding, and the dK/dV key block (2048 asked)
    shrinks to 1280, which tiles it; segment ids padded per side."""
    mesh = _mesh("v5e:2x2", (1, 4), ("data", "model"))
    compiled = _compile_grad(mesh, batch=2, seq=2560, q_heads=8, kv_heads=4, head_dim=64,
                             gate="elementwise", segments=True, batch_axes=("data",))
    assert compiled.as_text().count("tpu_custom_call") >= 3
