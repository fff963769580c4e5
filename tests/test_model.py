"""Whole-model behaviour: equivalences the paper relies on, scan/remat/dtypes, and learning."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gattn import variants
from gattn.config import ExecConfig, GateSpec
from gattn.eval import analysis
from gattn.model.capture import EVERYTHING, Capture
from gattn.model.transformer import Transformer, with_exec
from gattn.train.loss import lm_loss

from conftest import tiny_model

TINY = tiny_model()
EX = ExecConfig(attention_block_q=4)  # 12-token rows run through 3 causal query blocks
B, S = 2, 12


def tokens(seed=0, b=B, s=S, vocab=TINY.vocab_size):
    return jax.random.randint(jax.random.key(seed), (b, s), 0, vocab)


def copy_params(src, dst):
    """Copies every parameter of `src` into the same path of `dst` (dst may have more)."""
    nnx.update(dst, nnx.state(src, nnx.Param))
    return dst


def build(cfg, seed=0, **exec_changes):
    return Transformer(cfg, dataclasses.replace(EX, **exec_changes), rngs=nnx.Rngs(seed))


@functools.cache
def baseline_and_its_logits():
    """build(TINY) and its logits on tokens(), once for the cases below (which only read them)."""
    base = build(TINY)
    return base, np.asarray(base(tokens()))


@pytest.mark.parametrize("position", ["sdpa", "value", "key", "query", "dense"])
@pytest.mark.parametrize("activation, theta", [("identity", 1.0), ("sigmoid", 40.0)])
def test_multiplicative_gate_forced_to_one_equals_baseline(position, activation, theta):
    base, base_logits = baseline_and_its_logits()
    gate = GateSpec(position=position, activation=activation, input_dependent=False)
    gated = copy_params(base, build(dataclasses.replace(TINY, gate=gate), seed=1))
    for block in gated.blocks:
        block.attn.gate.theta[...] = jnp.full_like(block.attn.gate.theta[...], theta)
    x = tokens()
    np.testing.assert_allclose(gated(x), base_logits, rtol=1e-6, atol=1e-6)


def test_gate_changes_the_output():
    """The converse of the test above: an active gate is not a no-op."""
    base = build(TINY)
    gated = copy_params(base, build(variants.apply("sdpa_elementwise", TINY), seed=1))
    assert not np.allclose(gated(tokens()), base(tokens()), atol=1e-4)


def test_gqa_equals_mha_with_repeated_kv_weights():
    """GQA (q=4, k=2) is MHA (q=k=4) whose key/value heads are the group's shared head, repeated."""
    gqa = build(TINY)
    mha = build(dataclasses.replace(TINY, kv_heads=4), seed=3)
    copy_params_but_kv = {k: v for k, v in nnx.to_flat_state(nnx.state(gqa, nnx.Param))
                          if k[-1] not in ("wk", "wv")}
    nnx.update(mha, nnx.from_flat_state(copy_params_but_kv))
    k = TINY.head_dim
    for g_blk, m_blk in zip(gqa.blocks, mha.blocks):
        for name in ("wk", "wv"):
            w = getattr(g_blk.attn, name)[...].reshape(TINY.d_model, TINY.kv_heads, k)
            rep = jnp.repeat(w, TINY.group_size, axis=1).reshape(TINY.d_model, -1)
            getattr(m_blk.attn, name)[...] = rep
    np.testing.assert_allclose(gqa(tokens()), mha(tokens()), rtol=1e-5, atol=1e-5)


def test_switch_v_1top1_equals_v_headwise_gate():
    """Table 6: 'Switch v, 1top1' is the v headwise gate (Table 1 row 11) under matching weights."""
    headwise = build(variants.apply("v_headwise", TINY))
    switch = build(variants.apply("switch_v_1top1", TINY), seed=5)
    flat = {k: v for k, v in nnx.to_flat_state(nnx.state(headwise, nnx.Param)) if "gate" not in k
            and k[-1] != "wv"}
    nnx.update(switch, nnx.from_flat_state(flat))
    for h_blk, s_blk in zip(headwise.blocks, switch.blocks):
        s_blk.attn.router[...] = h_blk.attn.gate.w[...]
        s_blk.attn.v_experts.w[...] = h_blk.attn.wv[...][None]
    np.testing.assert_allclose(switch(tokens()), headwise(tokens()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_scan_over_layers_equals_the_layer_loop(remat):
    loop = build(variants.apply("sdpa_elementwise", TINY))
    scan = build(variants.apply("sdpa_elementwise", TINY), seed=7, scan_layers=True, remat=remat)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b, nnx.Param) for b in loop.blocks])
    nnx.update(scan.blocks, stacked)
    rest = {k: v for k, v in nnx.to_flat_state(nnx.state(loop, nnx.Param)) if k[0] != "blocks"}
    nnx.update(scan, nnx.from_flat_state(rest))
    # with_exec restacks the same way: the same parameters, the same execution settings.
    converted = with_exec(loop, scan.ex)
    assert converted.ex == scan.ex and converted.cfg == scan.cfg
    want = dict(nnx.to_flat_state(nnx.state(scan, nnx.Param)))
    got = dict(nnx.to_flat_state(nnx.state(converted, nnx.Param)))
    assert got.keys() == want.keys()
    for path, var in got.items():
        np.testing.assert_array_equal(var[...], want[path][...], err_msg=str(path))
    x = tokens()
    forward, grad = nnx.jit(lambda m, x: m(x)), nnx.jit(nnx.grad(lm_loss))
    np.testing.assert_allclose(forward(scan, x), forward(loop, x), rtol=1e-5, atol=1e-5)
    g_loop = grad(loop, x)
    g_scan = grad(scan, x)
    np.testing.assert_allclose(g_scan["blocks"]["attn"]["gate"]["w"][...][1],
                               g_loop["blocks"][1]["attn"]["gate"]["w"][...], rtol=1e-4, atol=1e-6)


def last_block_out(model, x):
    """h: the last block's output, captured from the forward pass (op by op, as the other tests
    here run the model: no program of its own to compile)."""
    model.forward(x, capture=Capture(block_out=True))
    return nnx.pop(model, nnx.Intermediate)["blocks"][len(model.blocks) - 1]["block_out"][0]


def test_tied_embeddings_share_the_table():
    """With tied embeddings the head is the embedding table: logits = final_norm(h) @ E^T."""
    tied = build(dataclasses.replace(TINY, tie_embeddings=True))
    assert not hasattr(tied, "lm_head")
    x = tokens()
    h_NxD = last_block_out(tied, x)
    expected = tied.final_norm(jnp.asarray(h_NxD)) @ tied.embed[...].T
    np.testing.assert_allclose(tied(x).reshape(-1, TINY.vocab_size), expected, rtol=1e-5, atol=1e-6)
    untied = build(TINY)
    assert hasattr(untied, "lm_head")
    h_NxD = last_block_out(untied, x)
    wrong = untied.final_norm(jnp.asarray(h_NxD)) @ untied.embed[...].T
    assert not np.allclose(untied(x).reshape(-1, TINY.vocab_size), wrong, atol=1e-3)


def test_bf16_compute_with_fp32_params_tracks_fp32():
    cfg = variants.apply("sdpa_elementwise", TINY)
    f32 = build(cfg)
    bf16 = copy_params(f32, build(cfg, dtype="bfloat16"))
    assert bf16.blocks[0].attn.wq[...].dtype == jnp.float32
    out, ref = bf16(tokens()), f32(tokens())
    assert out.dtype == jnp.float32
    # bf16 keeps ~3 significant digits; measured error here is ~0.5% of the logits' spread.
    spread = float(jnp.max(jnp.abs(ref - ref.mean())))
    assert float(jnp.max(jnp.abs(out - ref))) < 0.03 * spread
    assert abs(float(lm_loss(bf16, tokens())) - float(lm_loss(f32, tokens()))) < 1e-3
    pure = build(dataclasses.replace(cfg, param_dtype="bfloat16"), dtype="bfloat16")
    assert pure.blocks[0].attn.gate.w[...].dtype == jnp.bfloat16


def test_causal_model_ignores_future_tokens():
    model = build(variants.apply("sdpa_elementwise", TINY))
    x = tokens()
    y = x.at[:, 7:].set((x[:, 7:] + 1) % TINY.vocab_size)
    np.testing.assert_allclose(model(x)[:, :7], model(y)[:, :7], rtol=1e-5, atol=1e-6)
    assert not np.allclose(model(x)[:, 7:], model(y)[:, 7:])


def test_intermediates_are_collected_from_the_forward_pass():
    model = build(variants.apply("sdpa_elementwise", TINY))
    logits, _ = model.forward(tokens(), capture=EVERYTHING)
    inter = nnx.pop(model, nnx.Intermediate)
    blk = inter["blocks"][0]
    probs = blk["attn"]["attn_probs"][0]
    assert probs.shape == (B, TINY.q_heads, S, S)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    scores = blk["attn"]["gate"]["gate_scores"][0]
    assert scores.shape == (B * S, TINY.q_heads, TINY.head_dim)
    assert float(scores.min()) > 0 and float(scores.max()) < 1
    assert blk["block_out"][0].shape == (B * S, TINY.d_model)
    np.testing.assert_allclose(model(tokens()), logits, rtol=1e-6)
    assert not nnx.state(model, nnx.Intermediate)  # a plain call captures nothing


def test_capturing_the_attention_matrix_needs_the_xla_attention():
    """A pallas model refuses to capture attention probabilities (the kernel never forms them)
    rather than switching kernels; a scanned model refuses any capture. `analysis.collect` runs
    such a model as `for_analysis` makes it (xla, unscanned) with the same parameters."""
    cfg = variants.apply("sdpa_elementwise", TINY)
    # (restacked from an unscanned model: initialising a scanned one compiles its vmapped
    # initialisers, seconds; with_exec's own checks are in test_scan_over_layers_equals_the_layer_loop)
    pallas = with_exec(build(cfg), dataclasses.replace(EX, attention_impl="pallas", scan_layers=True))
    unscanned_pallas = with_exec(pallas, dataclasses.replace(pallas.ex, scan_layers=False))
    with pytest.raises(ValueError, match="attention_impl='xla'"):
        unscanned_pallas.forward(tokens(), capture=Capture(attn_probs=True))
    with pytest.raises(ValueError, match="scan_layers"):
        pallas.forward(tokens(), capture=Capture(block_out=True))
    xla = with_exec(pallas, EX)
    assert analysis.for_analysis(pallas).ex == EX  # xla and unscanned; block_q kept
    got, want = analysis.collect(pallas, tokens()), analysis.collect(xla, tokens())
    for a, b in zip(got, want, strict=True):
        for name in b:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", ["baseline", "sdpa_elementwise"])
def test_tiny_model_loss_decreases_on_a_fixed_batch(name):
    """20 AdamW steps on one batch must cut the loss well below its start (memorisation)."""
    model = build(variants.apply(name, TINY))
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    batch = tokens(seed=11, b=4, s=16)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, batch)) for _ in range(20)]
    assert all(np.isfinite(losses))
    assert losses[0] > np.log(TINY.vocab_size) - 0.5       # starts near uniform
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("name", variants.applicable(TINY))
def test_every_variant_builds_runs_and_has_finite_gradients(name):
    model = build(variants.apply(name, TINY))
    loss, grads = nnx.value_and_grad(lm_loss)(model, tokens())
    assert np.isfinite(float(loss))
    leaves = jax.tree.leaves(grads)
    assert leaves and all(np.isfinite(np.asarray(g)).all() for g in leaves)  # (numpy: no program per shape)


def test_packed_loss_equals_the_loss_of_each_document_alone():
    """With segment ids, no target is predicted across a document boundary or from padding."""
    model = build(TINY)
    doc_a, doc_b = tokens(seed=3, b=1, s=7), tokens(seed=4, b=1, s=5)
    packed = jnp.concatenate([doc_a, doc_b, jnp.zeros((1, 4), doc_a.dtype)], axis=1)  # 16 tokens
    seg = jnp.array([[1] * 7 + [2] * 5 + [0] * 4])
    pos = jnp.array([list(range(7)) + list(range(5)) + [0] * 4])
    packed_loss = lm_loss(model, packed, seg, pos)
    nll_a = lm_loss(model, doc_a) * 6   # 6 targets in a 7-token document
    nll_b = lm_loss(model, doc_b) * 4
    np.testing.assert_allclose(packed_loss, (nll_a + nll_b) / 10, rtol=1e-5)
    # Counting the boundary target (first token of b from last of a) would change the loss.
    unmasked = lm_loss(model, packed, jnp.where(seg > 0, 1, 0), pos)
    assert abs(float(unmasked) - float(packed_loss)) > 1e-4


def test_config_name_lists_match_the_implementations():
    """gattn.config (JAX-free) lists the names; the modules hold the functions: they must agree."""
    from gattn import config, kernels
    from gattn.model import layers
    from gattn.model import transformer as model_lib
    assert set(config.DTYPES) == set(layers.DTYPES)
    assert set(config.FFN_ACTIVATIONS) == set(layers.FFN_ACTIVATIONS)
    assert set(config.REMAT_POLICIES) == set(model_lib.REMAT_POLICIES) | {"none"}
    assert set(config.ATTENTION_IMPLS) == set(kernels.IMPLS)
    from gattn.model import gates
    assert set(config.GATE_ACTIVATIONS) == set(gates.ACTIVATIONS)


# The default run keeps the fused headwise gate with attention biases; the kernel's elementwise
# gate is checked against the reference in tests/test_flash.py. The others: -m slow.
@pytest.mark.parametrize("variant", [pytest.param("sdpa_elementwise", marks=pytest.mark.slow), "sdpa_headwise",
                                     pytest.param("v_elementwise", marks=pytest.mark.slow),
                                     pytest.param("sdpa_rmsnorm_gate", marks=pytest.mark.slow)])
def test_pallas_attention_matches_xla_in_loss_and_gradients(variant):
    """exec.attention_impl='pallas' (interpret mode here) trains the same model: the fused sigmoid
    SDPA gate (first two; headwise with attention biases, whose gate bias the kernel's gate logits
    carry), a gate the kernel does not fuse (G2), and a gate behind a non-linearity."""
    if variant == "sdpa_rmsnorm_gate":
        cfg = dataclasses.replace(variants.apply("sdpa_elementwise", TINY), sdpa_nonlinearity="rmsnorm")
    else:
        cfg = variants.apply(variant, TINY)
    if variant == "sdpa_headwise":
        cfg = dataclasses.replace(cfg, attention_bias=True)
    xla = build(cfg)
    pallas = copy_params(xla, build(cfg, attention_impl="pallas", flash_block_q=8, flash_block_k=8))
    x = tokens(b=2, s=20)
    seg = jnp.asarray([[1] * 12 + [2] * 6 + [0] * 2, [1] * 20])
    pos = jnp.asarray([list(range(12)) + list(range(6)) + [0, 0], list(range(20))])

    def loss_and_grads(model):
        return nnx.value_and_grad(lambda m: lm_loss(m, x, seg, pos))(model)

    graphdef, state = nnx.split(pallas)
    jaxpr = str(jax.make_jaxpr(lambda st: nnx.merge(graphdef, st)(x, pos, seg))(state))
    fused = variant in ("sdpa_elementwise", "sdpa_headwise")
    assert ("gated_flash_fwd" in jaxpr) == fused and "flash_fwd" in jaxpr

    (l_x, g_x), (l_p, g_p) = loss_and_grads(xla), loss_and_grads(pallas)
    np.testing.assert_allclose(l_p, l_x, rtol=1e-5)
    flat_x, flat_p = dict(nnx.to_flat_state(g_x)), dict(nnx.to_flat_state(g_p))
    assert flat_x.keys() == flat_p.keys()
    for path in flat_x:
        a, b = np.asarray(flat_p[path][...]), np.asarray(flat_x[path][...])
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, np.abs(b).max()), err_msg=str(path))
