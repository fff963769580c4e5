"""The Pallas Gated DeltaNet kernel (gattn/kernels/gdn.py) in interpret mode: values and gradients
equal a float64 recurrence and the jnp chunked rule (packed resets mid-chunk, on a chunk boundary
and documents crossing chunks, a length that pads, 2 value heads per key head, K != V, initial and
final states), with the chunk states saved or recomputed; bf16 inputs keep a float32 state; the
model with exec.gdn_impl=pallas runs the kernel and equals xla; under a mesh it runs in shard_map;
the kernels compile through Mosaic for TPU (ahead of time, libtpu on this CPU machine)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gattn.config import ConfigError, ExecConfig, LinearAttentionSpec, hybrid_layer_types
from gattn.kernels import gdn as kernel
from gattn.kernels.standin import ENV as STANDIN_ENV
from gattn.model import gdn
from gattn.model.transformer import Transformer, with_exec

import multidevice
from conftest import tiny_model

B, S, G, H, K, V, CHUNK = 2, 37, 2, 4, 8, 6, 16  # 3 chunks, the last padded; H / G = 2
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def inputs(seed=0, b=B, s=S, g_=G, h=H, dk=K, dv=V, resets_at=((0, (5, 16, 20)), (1, (30,)))):
    """q, k unit vectors, beta in (0, 1), g <= 0 (A from 0.02 to 4, so some heads remember across
    chunks), a random initial state; by default resets in row 0 mid-chunk (5, 20) and on a chunk
    boundary (16), in row 1 one document over two chunk boundaries (0..29) and one in the padded
    chunk."""
    r = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = unit(r.normal(size=(b, s, g_, dk))), unit(r.normal(size=(b, s, g_, dk)))
    v = r.normal(size=(b, s, h, dv))
    g = -np.geomspace(0.02, 4, h) * np.log1p(np.exp(r.normal(size=(b, s, h)) - 1.0))
    beta = 1 / (1 + np.exp(-r.normal(size=(b, s, h))))
    state = 0.5 * r.normal(size=(b, h, dk, dv))
    resets = np.zeros((b, s), bool)
    for row, at in resets_at:
        resets[row, list(at)] = True
    return [x.astype(np.float32) for x in (q, k, v, g, beta)] + [resets, state.astype(np.float32)]


def recurrence64(q, k, v, g, beta, resets, state):
    """The rule one token at a time in float64 (jnp, for its gradients): q scaled by 1/sqrt(K)."""
    ratio, dk = v.shape[2] // q.shape[2], q.shape[3]
    q, k = (jnp.repeat(x, ratio, axis=2) for x in (q * dk ** -0.5, k))

    def token(s, xs):
        q_t, k_t, v_t, g_t, b_t, reset = xs
        s = s * jnp.where(reset[:, None], 0.0, jnp.exp(g_t))[..., None, None]
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)) * b_t[..., None]
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    state, o = jax.lax.scan(token, state, [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, resets)])
    return jnp.moveaxis(o, 0, 1), state


def loss_of(rule, resets, w_o, w_s):
    def loss(q, k, v, g, beta, state):
        o, final = rule(q, k, v, g, beta, resets, state)
        return jnp.sum(o.astype(w_o.dtype) * w_o) + jnp.sum(final * w_s)
    return loss


def values_and_grads(rule, args, dtype=jnp.float32):
    """(o, final state, grads of a random linear loss w.r.t. q, k, v, g, beta, state)."""
    *diff, resets, state = args
    r = np.random.default_rng(7)
    w_o, w_s = (jnp.asarray(r.normal(size=x.shape), dtype) for x in (diff[2], state))
    loss = loss_of(rule, jnp.asarray(resets), w_o, w_s)
    arrays = [jnp.asarray(x, dtype) for x in diff] + [jnp.asarray(state, dtype)]

    def run(*a):
        return rule(*a[:5], jnp.asarray(resets), a[5]), jax.grad(loss, argnums=range(6))(*a)

    (o, final), grads = jax.jit(run).lower(*arrays).compile(FAST_COMPILE if dtype != jnp.float64 else None)(*arrays)
    return o, final, grads


@pytest.fixture(scope="module")
def case():
    args = inputs()
    with jax.enable_x64(True):
        want64 = jax.tree.map(np.asarray, values_and_grads(recurrence64, args, jnp.float64))
    pallas = values_and_grads(lambda *a: kernel.gated_delta_rule(*a, chunk_size=CHUNK, interpret=True), args)
    jnp_path = values_and_grads(lambda *a: gdn.chunk_gated_delta_rule(*a, chunk_size=CHUNK), args)
    return args, want64, pallas, jnp_path


def close(got, want, tol):
    """|got - want| <= tol, relative once |want| exceeds 1."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want))) <= tol * max(1.0, float(np.max(np.abs(want))))


def test_values_equal_the_float64_recurrence_and_the_jnp_path(case):
    _, (o64, s64, _), (o, final, _), (o_jnp, s_jnp, _) = case
    assert o.shape == (B, S, H, V) and final.shape == (B, H, K, V) and final.dtype == jnp.float32
    assert close(o, o64, 2e-6) and close(final, s64, 2e-6)
    assert close(o, o_jnp, 2e-6) and close(final, s_jnp, 2e-6)


@pytest.mark.parametrize("name, i", [("q", 0), ("k", 1), ("v", 2), ("g", 3), ("beta", 4), ("state", 5)])
def test_gradients_equal_the_float64_recurrence_and_the_jnp_path(case, name, i):
    _, (_, _, want64), (_, _, got), (_, _, got_jnp) = case
    assert np.max(np.abs(want64[i])) > 0.1, name  # (the loss reaches it)
    assert close(got[i], want64[i], 1e-5), name
    assert close(got[i], got_jnp[i], 1e-5), name


def test_a_reset_cuts_the_state_and_its_gradient(case):
    """The reference agrees only because resets are honoured: without them the values differ, and
    g at a reset (a decay of a state that is zeroed anyway) gets no gradient."""
    args, (o64, _, _), (_, _, grads), _ = case
    no_resets = list(args)
    no_resets[5] = np.zeros_like(args[5])
    with jax.enable_x64(True):
        o_leak, _ = recurrence64(*[jnp.asarray(x) for x in no_resets])
    assert not close(o_leak, o64, 1e-2)
    assert np.all(np.asarray(grads[3])[args[5]] == 0.0)


def test_recomputed_chunk_states_give_the_same_gradients(case):
    """save_states=False keeps only the inputs and recomputes every chunk's state in the backward
    (the gdn_states kernel): the same gradients as the saved states."""
    args, _, (_, _, saved), _ = case
    _, _, recomputed = values_and_grads(
        lambda *a: kernel.gated_delta_rule(*a, chunk_size=CHUNK, interpret=True, save_states=False), args)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "state"), recomputed, saved):
        assert close(got, want, 1e-6), name


def test_bf16_inputs_keep_a_float32_state():
    """bf16 q, k, v: the state is carried in float32, so the final state equals the float32 rule on
    the same (bf16-valued) inputs to float32 rounding; o and the gradients of q, k, v are that
    rule's rounded to bf16."""
    q, k, v, g, beta, resets, state = inputs(1)
    w_o = jnp.asarray(np.random.default_rng(3).normal(size=v.shape), jnp.float32)

    def loss(rule, q, k, v):
        o, final = rule(q, k, v, g, beta, resets, state, chunk_size=CHUNK)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(final), (o, final)

    def run(rule, *args):
        f = jax.value_and_grad(functools.partial(loss, rule), argnums=(0, 1, 2), has_aux=True)
        (_, out), grads = jax.jit(f).lower(*args).compile(FAST_COMPILE)(*args)
        return out, grads

    as_bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    (o, final), grads = run(functools.partial(kernel.gated_delta_rule, interpret=True), *as_bf16)
    (want_o, want_final), want_grads = run(gdn.chunk_gated_delta_rule, *[x.astype(jnp.float32) for x in as_bf16])
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert close(final, want_final, 2e-6)
    assert close(o, want_o, 1e-2)  # (rounded to bf16, nothing more)
    for got, want in zip(grads, want_grads):
        assert got.dtype == jnp.bfloat16 and close(got, want, 1e-2)


@pytest.mark.slow  # ~40 CPU-s; the small case above is its fast cousin
def test_a_longer_case_with_64_token_chunks_and_4_value_heads_per_key_head():
    """The model's chunk (64), H / G = 4 and 3 documents crossing the 64-token chunks over 200
    tokens (4 chunks, the last padded): values and gradients equal the float64 recurrence."""
    args = inputs(2, b=1, s=200, g_=2, h=8, dk=16, dv=24, resets_at=((0, (50, 64, 131)),))
    with jax.enable_x64(True):
        o64, s64, want = jax.tree.map(np.asarray, values_and_grads(recurrence64, args, jnp.float64))
    o, final, grads = values_and_grads(lambda *a: kernel.gated_delta_rule(*a, chunk_size=64, interpret=True), args)
    assert close(o, o64, 1e-5) and close(final, s64, 1e-5)
    for name, got, want_i in zip(("q", "k", "v", "g", "beta", "state"), grads, want):
        assert close(got, want_i, 2e-5), name


def _tiny_hybrid(layers=2):
    """Layers: 1 GDN (+ 1 gated attention with 2)."""
    cfg = tiny_model(num_layers=layers, layer_types=hybrid_layer_types(layers, 2),
                     linear_attention=LinearAttentionSpec(num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8))
    tokens = jax.random.randint(jax.random.key(1), (2, 21), 0, cfg.vocab_size)
    ids = jnp.asarray([[1] * 11 + [2] * 10, [1] * 3 + [2] * 15 + [0] * 3])
    model = Transformer(cfg, ExecConfig(gdn_chunk=8), rngs=nnx.Rngs(0))

    def loss_fn(m):
        graphdef, state = nnx.split(m)

        def loss(s):
            logits = nnx.merge(graphdef, s)(tokens, None, ids)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])
        return loss, state
    return model, loss_fn


def test_the_model_runs_the_kernel_where_asked(monkeypatch):
    """exec.gdn_impl=pallas puts the kernels (forward and backward) in the hybrid's training step;
    xla and auto (off TPU) do not, nor does pallas under GATTN_PALLAS_STANDIN (the rehearsals' jnp
    stand-in, kernels/standin.py). (Traced, not compiled: the next test computes.)"""
    model, loss_fn = _tiny_hybrid(layers=1)

    def kernels(impl):
        loss, state = loss_fn(with_exec(model, ExecConfig(gdn_chunk=8, gdn_impl=impl)))
        return sorted(set(re.findall(r"name=(gdn_\w+)", str(jax.make_jaxpr(jax.grad(loss))(state)))))

    assert kernels("pallas") == ["gdn_bwd", "gdn_fwd"]
    assert kernels("xla") == kernels("auto") == []
    monkeypatch.setenv(STANDIN_ENV, "1")
    assert kernels("pallas") == []


@pytest.mark.slow  # ~20-30 CPU-s of compiles; test_the_model_runs_the_kernel_where_asked and the rule's tests
def test_the_hybrid_model_with_the_kernel_equals_the_xla_path():
    """A 1 GDN + 1 gated attention model on packed rows (documents crossing the 8-token chunks,
    padding): loss and every parameter's gradient, exec.gdn_impl pallas against xla."""
    model, loss_fn = _tiny_hybrid()
    pallas = with_exec(model, ExecConfig(gdn_chunk=8, gdn_impl="pallas"))
    assert pallas.blocks[0].linear_attn.impl == "pallas"

    def loss_and_grads(m):
        loss, state = loss_fn(m)
        return jax.jit(jax.value_and_grad(loss)).lower(state).compile(FAST_COMPILE)(state)

    (loss, grads), (want, want_grads) = loss_and_grads(pallas), loss_and_grads(model)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    flat, want_flat = dict(nnx.to_flat_state(grads)), dict(nnx.to_flat_state(want_grads))
    assert any("linear_attn" in str(path) for path in want_flat)
    for path, g in want_flat.items():
        np.testing.assert_allclose(flat[path][...], g[...], rtol=1e-5, atol=1e-7, err_msg=str(path))


@pytest.mark.slow  # ~45 s: a fresh interpreter on 8 devices; the AOT compile below covers the shard_map's shapes
def test_the_kernel_runs_sharded_over_rows_and_heads():
    """8 simulated devices, mesh (data 2, model 4): gated_delta_rule_on_mesh equals the jnp rule
    on one device in values, final state and gradients (tests/multidevice/sharded_gdn.py)."""
    assert "ok 8" in multidevice.run("sharded_gdn", "--mesh", "2,4")


def test_gdn_impl_is_checked_and_auto_is_the_xla_path_off_tpu():
    with pytest.raises(ConfigError, match="'gdn_impl' = 'triton'.*'xla', 'pallas', 'auto'"):
        ExecConfig(gdn_impl="triton")
    with pytest.raises(ConfigError, match="'gdn_chunk' = 12.*multiple of 8"):
        ExecConfig(gdn_impl="pallas", gdn_chunk=12)
    assert ExecConfig(gdn_impl="xla", gdn_chunk=12).gdn_chunk == 12
    spec = gdn.GDNSpec(d_model=16, num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8)
    with pytest.raises(ConfigError, match="'impl' = 'fla'"):
        gdn.GatedDeltaNet(spec, rngs=nnx.Rngs(0), impl="fla")
    assert kernel.resolve("auto") == "xla" and kernel.resolve("pallas") == "pallas"
    with pytest.raises(ValueError, match="chunk_size = 12 must be a multiple of 8"):
        kernel.gated_delta_rule(*[jnp.asarray(x) for x in inputs()[:5]], chunk_size=12)
    q, k, v, g, beta = (jnp.asarray(x) for x in inputs()[:5])
    with pytest.raises(ValueError, match=r"H a multiple of G"):
        kernel.gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match=r"beta \(2, 37, 3\) must be \[B, S, H\]"):
        kernel.gated_delta_rule(q, k, v, g, beta[:, :, :3])


def _compile_for_tpu(topology, what):
    """Compiled for 4 chips of `topology` under a 2 x 2 mesh (rows over data, heads over model: a
    chip runs 1 key head and its 2 value heads), bf16 q, k, v with K = V = 128, 5 chunks of 64,
    resets and an initial state. `what`: "grad" (saved chunk states), "grad_recompute"
    (recomputed), "forward" (prefill: outputs and the final state)."""
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    mesh = Mesh(np.asarray(devices[:4]).reshape(2, 2), ("data", "model"))
    b, s, g, h = 4, 320, 2, 4
    spec = {4: P("data", None, "model", None), 3: P("data", None, "model"), 2: P("data", None)}

    def arg(shape, dtype, sharding=None):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, sharding or spec[len(shape)]))

    args = [arg((b, s, g, 128), jnp.bfloat16), arg((b, s, g, 128), jnp.bfloat16), arg((b, s, h, 128), jnp.bfloat16),
            arg((b, s, h), jnp.float32), arg((b, s, h), jnp.float32), arg((b, s), jnp.bool_),
            arg((b, h, 128, 128), jnp.float32, P("data", "model", None, None))]

    def rule(*a):
        return kernel.gated_delta_rule_on_mesh(*a, interpret=False, save_states=what != "grad_recompute")

    def loss(q, k, v, g_, beta, resets, state):
        o, final = rule(q, k, v, g_, beta, resets, state)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    f = rule if what == "forward" else jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 6))
    with jax.set_mesh(mesh):
        return jax.jit(f).lower(*args).compile()


def _kernels(compiled):
    text = compiled.as_text()
    return sorted(name for name in ("gdn_fwd", "gdn_states", "gdn_bwd") if name in text), text.count("tpu_custom_call")


@pytest.mark.parametrize("topology", ["v5p:2x2x1", pytest.param("v6e:2x2", marks=pytest.mark.slow)])
def test_forward_and_backward_compile_through_mosaic(topology):
    kernels, calls = _kernels(_compile_for_tpu(topology, "grad"))
    assert kernels == ["gdn_bwd", "gdn_fwd"] and calls >= 2


@pytest.mark.slow  # ~15 CPU-s: two more compiles of the same kernel code; the grad compile above
@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2"])
def test_prefill_and_the_recomputing_backward_compile_through_mosaic(topology):
    assert _kernels(_compile_for_tpu(topology, "forward"))[0] == ["gdn_fwd"]
    kernels, calls = _kernels(_compile_for_tpu(topology, "grad_recompute"))
    assert kernels == ["gdn_bwd", "gdn_fwd", "gdn_states"] and calls >= 3
