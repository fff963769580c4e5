"""The Gated DeltaNet layer (gattn/model/gdn.py): its chunked and recurrent rules agree with each
other and with transformers' torch functions, the layer with Qwen3NextGatedDeltaNet; a packed row
computes what its documents compute alone; prefill + decode steps equal the full forward pass."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gattn.config import ConfigError
from gattn.model import gdn
from gattn.model.gdn import GatedDeltaNet, GDNSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402

# 2 key heads serving 4 value heads (the grouping Qwen3-Next uses: 16 over 32), K != V.
SPEC = GDNSpec(d_model=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel=4)


def rule_inputs(seed, b=2, s=37, spec=SPEC):
    """Random rule inputs as the layer makes them: q, k unit vectors, beta in (0, 1), g <= 0 with
    Qwen3-Next's spread (A up to 16), a random initial state."""
    r = np.random.default_rng(seed)
    g_, h, dk, dv = spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = unit(r.normal(size=(b, s, g_, dk))), unit(r.normal(size=(b, s, g_, dk)))
    v = r.normal(size=(b, s, h, dv))
    a_coef = r.uniform(0.01, 16, size=h)
    g = -a_coef * np.log1p(np.exp(r.normal(size=(b, s, h)) - 2.0))
    beta = 1 / (1 + np.exp(-r.normal(size=(b, s, h))))
    state = 0.5 * r.normal(size=(b, h, dk, dv))
    return [x.astype(np.float32) for x in (q, k, v, g, beta, state)]


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def close(ours, ref, tol=1e-5) -> bool:
    """Equal to float32 rounding: |ours - ref| <= tol, relative once |ref| exceeds 1."""
    return max_err(ours, ref) <= tol * max(1.0, float(np.max(np.abs(np.asarray(ref)))))


# One compiled program per function and shape: the tests share shapes so most calls hit the cache.
CHUNK = jax.jit(gdn.chunk_gated_delta_rule, static_argnames="chunk_size")
RECURRENT = jax.jit(gdn.recurrent_gated_delta_rule)
PREFILL = nnx.jit(GatedDeltaNet.prefill)
STEP = nnx.jit(GatedDeltaNet.step)


def prefill(model, x, ids=None, state=None):
    """The layer from `state` (default fresh) with segment ids (default: one document per row)."""
    ids = jnp.ones(x.shape[:2], jnp.int32) if ids is None else jnp.asarray(ids, jnp.int32)
    return PREFILL(model, jnp.asarray(x), ids, model.init_state(x.shape[0]) if state is None else state)


def resets_for(s):
    resets = np.zeros((2, s), bool)
    resets[1, [t for t in (5, 64, s - 3) if t < s]] = True  # documents start mid-chunk, at a chunk start, near the end
    return jnp.asarray(resets)


@pytest.mark.parametrize("s", [37, 130])
def test_chunked_rule_equals_recurrent_rule(s):
    q, k, v, g, beta, state = (jnp.asarray(x) for x in rule_inputs(0, s=s))
    o_c, s_c = CHUNK(q, k, v, g, beta, resets_for(s), state)
    o_r, s_r = RECURRENT(q, k, v, g, beta, resets_for(s), state)
    assert close(o_c, o_r) and close(s_c, s_r)
    assert float(jnp.abs(o_r).max()) > 0.1  # (not trivially small)


@pytest.mark.parametrize("s", [37, 130])
def test_rules_match_transformers(s):
    q, k, v, g, beta, state = rule_inputs(1, s=s)
    t = [torch.from_numpy(x) for x in (q, k, v, g, beta)]
    o_hc, s_hc = hf.torch_chunk_gated_delta_rule(*t, initial_state=torch.from_numpy(state), output_final_state=True)
    o_hr, s_hr = hf.torch_recurrent_gated_delta_rule(*t, initial_state=torch.from_numpy(state),
                                                     output_final_state=True)
    args = [jnp.asarray(x) for x in (q, k, v, g, beta)] + [jnp.zeros((2, s), bool), jnp.asarray(state)]
    o_c, s_c = CHUNK(*args)
    o_r, s_r = RECURRENT(*args)
    for ours, theirs in [(o_c, o_hc), (s_c, s_hc), (o_r, o_hr), (s_r, s_hr)]:
        assert close(ours, theirs.numpy())


def hf_layer(seed=0, spec=SPEC):
    """transformers' GDN layer (layer 0 of a tiny Qwen3-Next) with every weight random. The
    decay rates A span slow (a state that remembers across chunks) to fast forgetting."""
    cfg = transformers.Qwen3NextConfig(
        **spec.hf_config(), num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=50, intermediate_size=64,
        num_experts=0, mlp_only_layers=[0, 1])
    torch.manual_seed(seed)
    layer = hf.Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.tensor([0.02, 0.1, 0.5, 4.0]).log())
            elif name == "dt_bias":
                p.copy_(torch.randn_like(p) * 0.5 - 1.0)
            elif name == "norm.weight":
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_((0.5 if name == "conv1d.weight" else 0.2) * torch.randn_like(p))
    return layer


def ours_from(layer, spec=SPEC) -> GatedDeltaNet:
    """Our layer holding `layer`'s weights (built abstractly, then filled: nothing initialised)."""
    tensors = {f"linear_attn.{n}": p.detach().numpy() for n, p in layer.named_parameters()}
    assert tensors.keys() == {"linear_attn." + n for n in gdn.HF_NAMES}
    params = gdn.from_hf(tensors, "linear_attn.", spec)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: GatedDeltaNet(spec, rngs=nnx.Rngs(0))))
    flat = nnx.to_flat_state(abstract)
    assert {path for path, _ in flat} == set(params)
    for path, var in flat:
        assert var.shape == params[path].shape, path
    return nnx.merge(graphdef, nnx.from_flat_state([(p, v.replace(jnp.asarray(params[p]))) for p, v in flat]))


@pytest.fixture(scope="module")
def layers():
    layer = hf_layer()
    return layer, ours_from(layer)


def inputs(seed, b, s):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(b, s, SPEC.d_model)).astype(np.float32))


def test_layer_matches_transformers(layers):
    theirs, ours = layers
    x = inputs(2, 2, 75)
    with torch.no_grad():
        expected = theirs(torch.from_numpy(np.array(x))).numpy()
    y, _ = prefill(ours, x)
    assert np.abs(expected).max() > 0.05
    assert close(y, expected)


def test_weights_round_trip_to_transformers_exactly(layers):
    tensors = {f"model.layers.0.linear_attn.{n}": p.detach().numpy() for n, p in layers[0].named_parameters()}
    back = gdn.to_hf(gdn.from_hf(tensors, "model.layers.0.linear_attn.", SPEC), "model.layers.0.linear_attn.", SPEC)
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_packed_rows_equal_documents_run_alone(layers):
    """Three documents packed in two orders, then padding; in each a document crosses the chunk
    boundary at 64. Each document's outputs are those of the document alone (a row of its own,
    right-padded: causal, so the padding changes nothing before it)."""
    model = layers[1]
    lengths, pad, orders = [20, 30, 20], 5, [(0, 1, 2), (1, 2, 0)]
    s = sum(lengths) + pad
    docs = [inputs(5 + i, 1, n)[0] for i, n in enumerate(lengths)]
    padded = [jnp.pad(d, [(0, s - len(d)), (0, 0)]) for d in docs]
    alone = np.concatenate([prefill(model, jnp.stack(padded[:2]))[0], prefill(model, jnp.stack(padded[2:] * 2))[0]])
    rows = jnp.stack([jnp.concatenate([docs[i] for i in order] + [inputs(9, 1, pad)[0]]) for order in orders])
    ids = np.stack([np.concatenate([np.full(lengths[i], j + 1) for j, i in enumerate(order)] + [np.zeros(pad)])
                    for order in orders])
    packed = np.asarray(prefill(model, rows, ids)[0])
    for row, order in enumerate(orders):
        start = 0
        for i in order:
            assert close(packed[row, start:start + lengths[i]], alone[i, :lengths[i]])
            start += lengths[i]
        assert np.all(packed[row, start:] == 0)  # padding
    leaky = np.asarray(prefill(model, rows)[0])  # (one segment per row: documents leak)
    assert max_err(leaky[:, 60:70], packed[:, 60:70]) > 1e-3  # (past the conv's reach of 3)


def test_prefill_then_decode_steps_equal_the_full_forward_pass(layers):
    model = layers[1]
    x = inputs(2, 2, 75)
    full, _ = prefill(model, x)
    y1, state = prefill(model, x[:, :35])
    y2, state = prefill(model, x[:, 35:70], state=state)  # a prompt in two pieces continues the state
    steps = [y1, y2]
    for t in range(70, 75):
        y_t, state = STEP(model, x[:, t:t + 1], state)
        steps.append(y_t)
    assert state.conv_BxW1xM.shape == (2, SPEC.conv_kernel - 1, SPEC.conv_dim)
    assert state.recurrent_BxHxKxV.shape == (2, SPEC.num_v_heads, SPEC.head_k_dim, SPEC.head_v_dim)
    assert close(jnp.concatenate(steps, axis=1), full)


@pytest.mark.parametrize("prompt", [29, 2])
def test_prefill_state_is_the_last_documents_alone(layers, prompt):
    """The same prompt after padding (row 0, a left-padded prompt) and after another document
    (row 1): the state after it is the same, so decoding continues the prompt alone. A prompt of
    2 tokens is shorter than the conv's reach (W - 1 = 3)."""
    model, x = layers[1], inputs(3, 2, 35)
    x = x.at[1, -prompt:].set(x[0, -prompt:])
    ids = np.r_[[[0] * (35 - prompt) + [1] * prompt], [[1] * (35 - prompt) + [2] * prompt]]
    _, state = prefill(model, x, ids)
    assert close(state.conv_BxW1xM[0], state.conv_BxW1xM[1])
    assert close(state.recurrent_BxHxKxV[0], state.recurrent_BxHxKxV[1])
    _, leaky = prefill(model, x)  # (one segment per row: the tokens before the prompt leak in)
    assert max_err(leaky.recurrent_BxHxKxV[0], leaky.recurrent_BxHxKxV[1]) > 1e-3


def test_gradients_are_finite_and_match_the_recurrent_rule(layers):
    q, k, v, g, beta, state = (jnp.asarray(x) for x in rule_inputs(10, b=1, s=20))
    resets = jnp.zeros((1, 20), bool).at[0, 11].set(True)
    w = jnp.asarray(np.random.default_rng(11).normal(size=(1, 20, SPEC.num_v_heads, SPEC.head_v_dim)), jnp.float32)

    def loss(rule, q, k, v, g, beta, state):
        o, s = rule(q, k, v, g, beta, resets, state)
        return jnp.sum(o * w) + jnp.sum(s ** 2)

    chunked = functools.partial(gdn.chunk_gated_delta_rule, chunk_size=8)  # 3 chunks, a reset inside one
    grads_c = jax.jit(jax.grad(functools.partial(loss, chunked), argnums=range(6)))(q, k, v, g, beta, state)
    grads_r = jax.jit(jax.grad(functools.partial(loss, gdn.recurrent_gated_delta_rule), argnums=range(6)))(
        q, k, v, g, beta, state)
    for gc, gr in zip(grads_c, grads_r):
        assert np.all(np.isfinite(gc)) and close(gc, gr)

    model, x = layers[1], inputs(13, 1, 24)
    ids = jnp.asarray(np.r_[np.ones(10), 2 * np.ones(10), np.zeros(4)][None].astype(np.int32))
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, ids) ** 2)))(model)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(grads))
    assert all(float(jnp.abs(leaf).max()) > 0 for leaf in jax.tree.leaves(grads))


def test_parameters_carry_roles_and_logical_axes():
    model = nnx.eval_shape(lambda: GatedDeltaNet(SPEC, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16))
    meta = {path[0]: var.get_metadata() for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert meta["wq"]["out_sharding"] == ("embed", "kv_heads") and meta["wv"]["out_sharding"] == ("embed", "heads")
    assert meta["wo"]["out_sharding"] == ("heads", "embed")
    assert {n for n, m in meta.items() if m["role"] != "weight"} == {"dt_bias", "a_log", "norm"}
    assert meta["norm"]["role"] == "scale" and model.wq.dtype == jnp.bfloat16


@pytest.mark.parametrize("field, value, words", [
    ("num_v_heads", 3, "multiple of num_k_heads = 2"), ("head_k_dim", 0, "integer >= 1"),
    ("conv_kernel", 2.0, "integer >= 1"), ("norm_eps", 0.0, "number > 0")])
def test_spec_errors_name_the_field_and_what_is_allowed(field, value, words):
    with pytest.raises(ConfigError, match=f"'{field}' = {value!r} is not allowed: expected .*{words}"):
        dataclasses.replace(SPEC, **{field: value})


def test_spec_reads_and_writes_the_transformers_config():
    cfg = transformers.Qwen3NextConfig(**SPEC.hf_config())
    assert GDNSpec.from_hf_config(cfg.to_dict()) == SPEC
    with pytest.raises(ConfigError, match="'hidden_act' = 'gelu'"):
        GDNSpec.from_hf_config({**cfg.to_dict(), "hidden_act": "gelu"})
