"""exec.remat: every policy computes the same loss and gradients as no rematerialisation, scanned
or not, and keeps for the backward pass what it says (gattn/model/transformer.py, SAVED_NAMES)."""

import contextlib
import dataclasses
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from gattn import cli, variants
from gattn import config as C
from gattn.config import ExecConfig, LinearAttentionSpec, MoESpec, hybrid_layer_types
from gattn.model.transformer import QKV_NAMES, REMAT_POLICIES, SAVED_NAMES, Transformer, relayout, with_exec

from conftest import tiny_model

GATED = variants.apply("sdpa_elementwise", tiny_model())  # G1 gate: X W_theta is one more projection
TOKENS = jax.random.randint(jax.random.key(0), (2, 12), 0, GATED.vocab_size)


def loss_and_grads(model, tokens=TOKENS):
    graphdef, state = nnx.split(model)

    def loss(s):
        logits, aux = nnx.merge(graphdef, s).forward(tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0]) + sum(jnp.sum(aux[k]) for k in aux
                                                                            if k in ("lbl", "z_loss"))
    return jax.jit(jax.value_and_grad(loss)).lower(state).compile(FAST_COMPILE)(state)


FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}  # (CPU: 2x)


@pytest.fixture(scope="module")
def reference():
    model = Transformer(GATED, ExecConfig(), rngs=nnx.Rngs(0))
    return model, loss_and_grads(model)


def assert_same(got, want, like):
    """Loss and every gradient of `got` equal `want`'s; `got`'s gradients relaid out as `like`'s."""
    (loss, grads), (want_loss, want_grads) = got, want
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    flat = dict(nnx.to_flat_state(relayout(grads.filter(nnx.Param), nnx.state(like, nnx.Param))))
    want_flat = dict(nnx.to_flat_state(want_grads.filter(nnx.Param)))
    assert flat.keys() == want_flat.keys()
    for path, g in want_flat.items():
        np.testing.assert_allclose(flat[path][...], g[...], rtol=1e-5, atol=1e-6, err_msg=str(path))


@pytest.mark.parametrize("policy", sorted(REMAT_POLICIES))
def test_every_policy_computes_what_no_remat_computes(reference, policy):
    model, want = reference
    for scan in (False, True):
        other = with_exec(model, dataclasses.replace(model.ex, remat=policy, scan_layers=scan))
        assert_same(loss_and_grads(other), want, model)


def saved(model, tokens=TOKENS) -> list[str]:
    """The residuals the backward pass of `model`'s loss reads (print_saved_residuals's lines),
    the parameters and constants left out."""
    graphdef, state = nnx.split(model)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda s: jnp.mean(nnx.merge(graphdef, s)(tokens)), state)
    return [line for line in out.getvalue().splitlines() if "from the argument" not in line
            and "from a constant" not in line]


def named(lines: list[str]) -> list[str]:
    return [m.group(1) for line in lines if (m := re.search(r"named '(\w+)'", line))]


def build(remat: str, cfg=GATED, **changes):
    return Transformer(cfg, ExecConfig(remat=remat, **changes), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("policy, keeps", [
    ("full", ()),
    ("qkv_proj", QKV_NAMES),
    ("save_attn_out", ("attn_in", "attn_out", "out_proj", "mlp_in")),
    # mlpwo is never read back in a pre-norm block: the residual stream adds it and moves on
    ("minimal", QKV_NAMES + ("attn_out", "out_proj", "mlp_in")),
])
def test_a_named_policy_saves_its_names_per_layer_and_recomputes_the_rest(policy, keeps):
    got = named(saved(build(policy)))
    assert sorted(got) == sorted(keeps * GATED.num_layers)
    assert set(keeps) <= set(SAVED_NAMES.get(policy, ()))
    assert not {"mlpwi_0", "mlpwi_1"} & set(got)  # the FFN's hidden is recomputed by every named policy


def test_dots_save_every_projection_and_none_of_the_names():
    lines = saved(build("dots_no_batch"))
    assert not named(lines)
    dots = [line.split()[0] for line in lines if "dot_general" in line]
    # per layer W_Q, W_K, W_V, W_theta, W_O, W1, W3 (W2's output is not read back)
    per_layer = ["f32[24,32]", "f32[24,16]", "f32[24,16]", "f32[24,32]", "f32[24,32]", "f32[24,64]", "f32[24,64]"]
    assert sorted(dots) == sorted(per_layer * GATED.num_layers)


@pytest.mark.parametrize("policy", ["qkv_proj", "minimal"])
def test_an_offloaded_policy_keeps_the_same_activations_in_host_memory(policy):
    on_device = [line.split()[0] for line in saved(build(policy)) if "named '" in line]
    offloaded = saved(build(f"{policy}_offloaded"))
    assert not named(offloaded)
    host = [line.split()[0] for line in offloaded if "<host>" in line]
    assert sorted(host) == sorted(s.replace("f32", "f32<host>") for s in on_device)


def test_minimal_in_a_hybrid_moe_names_the_gdn_and_expert_activations():
    """Gated DeltaNet layers name their projections as attention does; a MoE's experts name their
    routed rows' activations (mlpwo per routed row: the router's weights read it back). Names only:
    the gradients are the dense test's business (a hybrid's compile would cost ~10 s)."""
    cfg = tiny_model(num_layers=2, layer_types=hybrid_layer_types(2, 2),
                     linear_attention=LinearAttentionSpec(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8),
                     moe=MoESpec(num_experts=4, top_k=2, expert_width=16))
    got = named(saved(build("minimal", cfg, gdn_chunk=4), TOKENS % cfg.vocab_size))
    per_layer = ("query_proj", "key_proj", "value_proj", "attn_out", "out_proj", "mlp_in", "mlpwo")
    assert sorted(got) == sorted(per_layer * 2 + ("gate_proj",))  # the GDN layer's output gate X W_z


def test_a_policy_that_does_not_exist_is_one_line_naming_exec_remat_and_the_choices():
    with pytest.raises(C.ConfigError) as err:
        cli.apply_overrides(C.Config(), ["exec.remat=save_everything"])
    message = str(err.value)
    assert "\n" not in message and "'exec.remat' = 'save_everything'" in message
    assert all(repr(name) in message for name in C.REMAT_POLICIES)
    assert set(C.REMAT_POLICIES) == set(REMAT_POLICIES) | {"none"}


def test_an_offloaded_policy_moves_its_activations_to_host_memory_in_a_tpu_compile():
    """jax 0.10.2 with libtpu lowers host offload ahead of time: a scanned bf16 model's gradient
    compiled for v5p-8 keeps minimal_offloaded's activations in pinned host memory
    (memory_analysis's host temp, at least their stacked bytes) and less in HBM than minimal."""
    from jax.experimental import topologies  # noqa: PLC0415

    from gattn.config import MeshConfig  # noqa: PLC0415
    from gattn.model import sharding  # noqa: PLC0415

    mesh = sharding.make_mesh(MeshConfig(data=4), topologies.get_topology_desc("v5p:2x2x1", "tpu").devices)
    cfg = tiny_model(vocab_size=512, d_model=256, q_heads=4, kv_heads=2, head_dim=64, d_ff=512, num_layers=2)
    rows, seq = 16, 512  # (at 256 the compiler keeps too little in HBM for the offload to show)

    def memory(remat):
        ex = ExecConfig(dtype="bfloat16", scan_layers=True, remat=remat, attention_impl="pallas")
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, ex, rngs=nnx.Rngs(0))))
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.replicated(mesh)),
                             state)
        tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=sharding.batch_sharding(mesh))

        def loss(s, t):
            return jnp.mean(jax.nn.logsumexp(nnx.merge(graphdef, s)(t), -1))
        with jax.set_mesh(mesh):
            return jax.jit(jax.grad(loss)).lower(state, tokens).compile().memory_analysis()

    kept, offloaded = memory("minimal"), memory("minimal_offloaded")
    # per token and layer: q 256, k 128, v 128, attn_out 256, out_proj 256, mlp_in 256 (bf16)
    stacked = cfg.num_layers * (rows // 4) * seq * 1280 * 2
    assert kept.host_temp_size_in_bytes == 0 and offloaded.host_temp_size_in_bytes >= stacked
    assert offloaded.temp_size_in_bytes < kept.temp_size_in_bytes - stacked / 2
