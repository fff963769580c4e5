"""The mesh and the logical-axis table: rules, divisibility fallback, and sharded training math
equal to one device's (8 simulated CPU devices, in a subprocess so the flag precedes jax:
tests/multidevice)."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from gattn.config import ConfigError, MeshConfig
from gattn.model import sharding

import multidevice


def test_mesh_shape_fills_data_and_rejects_a_wrong_product():
    assert sharding.AXES == ("data", "fsdp", "context", "expert", "model")
    assert sharding.mesh_shape(MeshConfig(), 8) == (8, 1, 1, 1, 1)
    assert sharding.mesh_shape(MeshConfig(expert=2, model=2), 8) == (2, 1, 1, 2, 2)
    assert sharding.mesh_shape(MeshConfig(data=1, fsdp=-1, model=2), 8) == (1, 4, 1, 1, 2)
    assert sharding.mesh_shape(MeshConfig(data=2, fsdp=4), 8) == (2, 4, 1, 1, 1)
    with pytest.raises(ConfigError, match="multiply to the 8 devices"):
        sharding.mesh_shape(MeshConfig(data=3), 8)
    with pytest.raises(ConfigError, match="'data' = 0"):
        MeshConfig(data=0)
    with pytest.raises(ConfigError, match="'fsdp' = -1"):
        MeshConfig(fsdp=-1)  # data is -1 too: one axis takes the rest


def test_logical_rules_and_divisibility_fallback():
    mesh = jax.sharding.AbstractMesh((2, 1, 1, 2, 4), sharding.AXES)
    assert sharding.spec(("embed", "heads"), (32, 16), mesh) == P(None, "model")
    assert sharding.spec(("expert", "embed", "mlp"), (8, 32, 64), mesh) == P("expert", None, "model")
    assert sharding.spec(("batch", None), (8, 16), mesh) == P(("data", "expert"), None)
    assert sharding.spec(("embed", "kv_heads"), (32, 2), mesh) == P(None, None)  # 2 kv heads, model 4
    one = jax.sharding.AbstractMesh((1, 1, 1, 1, 1), sharding.AXES)
    assert sharding.spec(("vocab", "embed"), (64, 32), one) == P(None, None)
    # FSDP: every weight's embed dimension over fsdp (experts stay on expert), rows over all three.
    fsdp = jax.sharding.AbstractMesh((2, 4, 1, 2, 2), sharding.AXES)
    assert sharding.spec(("embed", "heads"), (32, 16), fsdp) == P("fsdp", "model")
    assert sharding.spec(("heads", "embed"), (16, 32), fsdp) == P("model", "fsdp")
    assert sharding.spec(("expert", "embed", "mlp"), (8, 32, 64), fsdp) == P("expert", "fsdp", "model")
    assert sharding.spec(("vocab", "embed"), (64, 32), fsdp) == P("model", "fsdp")
    assert sharding.spec(("embed",), (32,), fsdp) == P("fsdp")
    assert sharding.spec(("embed", "mlp"), (30, 64), fsdp) == P(None, "model")  # 4 does not divide 30
    assert sharding.spec(("batch", None), (16, 16), fsdp) == P(("data", "fsdp", "expert"), None)
    assert sharding.batch_shards(fsdp) == 16 and sharding.batch_shards(mesh) == 4
    assert sharding.spec(("embed", "embed"), (32, 32), fsdp) == P("fsdp", None)  # an axis splits one dimension
    # Several axes on one dimension that together do not divide it: the leading ones that do (before:
    # none, so a d_model that fsdp 4 divides but fsdp 4 x context 4 does not was whole on every chip).
    ctx = jax.sharding.AbstractMesh((1, 4, 4, 1, 1), sharding.AXES)
    assert sharding.spec(("embed", None), (12, 8), ctx) == P("fsdp", None)
    assert sharding.spec(("embed", None), (32, 8), ctx) == P(("fsdp", "context"), None)
    assert sharding.spec(("embed", None), (6, 8), ctx) == P(None, None)
    assert sharding.spec(("batch", None), (4, 8), fsdp) == P("data", None) and \
        sharding.spec(("batch", None), (1, 8), fsdp) == P(None, None)


def test_sharded_loss_and_gradients_equal_one_device():
    """Dense and MoE models on meshes (data, expert, model) = (2,2,2), (1,4,2), (1,8,1), and with
    fsdp (data, expert, model, fsdp): FSDP alone (1,1,1,8), FSDP x model (1,1,2,4), FSDP x expert
    (1,2,1,4), data x FSDP (2,1,1,4): loss and every gradient equal the single-device values
    (float32, to 1e-5 relative), and with fsdp each device holds ~1/fsdp of the parameters
    (tests/multidevice/sharded_step.py)."""
    meshes = ["2,2,2", "1,4,2", "1,8,1", "1,1,1,8", "1,1,2,4", "1,2,1,4", "2,1,1,4"]
    out = multidevice.run("sharded_step", "--models", "dense", "moe", "--meshes", *meshes)
    assert out.count("ok") == 2 * len(meshes), out
    shares = {line.split(" ", 2)[1] + line.split(")")[0].split("(")[1]: float(line.split()[-1])
              for line in out.splitlines() if line.startswith("share ")}
    assert len(shares) == 8 and abs(shares["dense1, 1, 1, 8"] - 1 / 8) < 0.01, shares


def test_a_hybrid_shards_its_gdn_heads_and_equals_one_device():
    """Issue 31: the Qwen3-Next-shaped hybrid on a (2, 2, 2) mesh: the Gated DeltaNet heads split
    over the model axis, the experts over the expert axis; loss and gradients equal one device's.
    Also with FSDP x expert x model (1, 2, 2, 2): the GDN layers' weights over fsdp too."""
    assert multidevice.run("sharded_step", "--models", "hybrid", "--meshes", "2,2,2", "1,2,2,2").count("ok") == 2


def test_pallas_attention_runs_sharded_under_the_context_mesh():
    """exec.attention_impl='pallas' under jax.set_mesh((2, 2, 2)) runs the kernel in shard_map over
    batch and heads and equals the single-device xla model (loss and gradients)
    (tests/multidevice/sharded_pallas_step.py)."""
    assert "ok" in multidevice.run("sharded_pallas_step", "--mesh", "2,2,2")


def test_on_several_slices_the_data_axis_spans_them():
    """2 x v5p-8 (libtpu's topology, no TPU needed): the data axis is the slice axis (DCN), fsdp
    stays inside each slice; a data axis the slices do not divide is refused by name."""
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu", num_slices=2).devices
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=-1), devices)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "context": 1, "expert": 1, "model": 1}
    assert [{d.slice_index for d in row.flat} for row in mesh.devices] == [{0}, {1}]
    with pytest.raises(ConfigError, match="'mesh.data' = 1"):
        sharding.make_mesh(MeshConfig(data=1, fsdp=-1), devices)
