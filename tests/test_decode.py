"""Cached decoding computes what the full forward pass computes, for every kind of variant."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gattn import variants
from gattn.config import MoESpec, YarnSpec
from gattn.eval import decode
from gattn.model.transformer import Transformer, unscanned, with_exec

from conftest import tiny_model

TINY = tiny_model(vocab_size=96, head_dim=16, init_std=0.2)
MOE = dataclasses.replace(TINY, moe=MoESpec(num_experts=4, top_k=2, expert_width=32))
PROMPTS = [[5, 17, 3], [40, 2, 9, 71, 8, 8, 30], [12, 60, 1, 44, 7]]
ROWS = [PROMPTS[1] + [3, 50, 77], PROMPTS[2] + [88]]


def build(cfg, seed=0):
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def padded(rows, left=True):
    """(tokens, valid) [B, S]: the rows padded with 0 to the longest, on the left or the right."""
    s = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), s), np.int32)
    valid = np.zeros((len(rows), s), bool)
    for i, r in enumerate(rows):
        at = slice(s - len(r), s) if left else slice(0, len(r))
        tokens[i, at], valid[i, at] = r, True
    return jnp.asarray(tokens), jnp.asarray(valid)


def cached_logits(model, rows, chunk):
    """Logits of left-padded `rows`, run into the cache `chunk` slots at a time (a prefill, then
    decoding that reads what the earlier chunks wrote)."""
    tokens, valid = padded(rows)
    cache = decode.init_cache(model, len(rows), tokens.shape[1] + 3)
    outs = []
    for i in range(0, tokens.shape[1], chunk):
        out, cache = decode.prefill(model, tokens[:, i:i + chunk], valid[:, i:i + chunk], cache)
        outs.append(out)
    assert int(cache["index"]) == tokens.shape[1]
    return jnp.concatenate(outs, axis=1), valid


# (compiled without LLVM's optimisation passes, XLA's CPU backend at -O0: the same operations, and
# about a third less compile time for a program that runs once on a few tokens)
@functools.partial(jax.jit, static_argnums=0, compiler_options={"xla_backend_optimization_level": 0})
def full_forward(graphdef, state, tokens_BxS, segment_ids_BxS):
    return nnx.merge(graphdef, state)(tokens_BxS, None, segment_ids_BxS)


def assert_matches_full_forward(model, rows, chunk=5):
    """The cached logits of the left-padded rows equal the forward pass on the right-padded rows
    (each row's document at positions 0.., padding in segment 0)."""
    logits, valid = cached_logits(model, rows, chunk)
    tokens, valid_right = padded(rows, left=False)
    full = full_forward(*nnx.split(model), tokens, valid_right.astype(jnp.int32))
    for i, r in enumerate(rows):
        np.testing.assert_allclose(logits[i][valid[i]], full[i, :len(r)], rtol=1e-5, atol=1e-5,
                                   err_msg=f"row {i}")


def with_(name, **changes):
    return pytest.param(dataclasses.replace(variants.apply(name, TINY), **changes),
                        id="+".join([name, *changes]))


# Every gate position, granularity, sharing and input dependence, switch heads, the SDPA
# non-linearity, QK-norm, sandwich norm and a MoE FFN; orthogonal features share a model.
@pytest.mark.parametrize("cfg", [
    with_("baseline"),
    with_("sdpa_elementwise"),
    with_("sdpa_headwise"),
    with_("k_elementwise", qk_norm=True, sandwich_norm=True),
    with_("dense_output"),
    with_("v_head_shared", switch_heads=variants.apply("switch_kv_4top4", TINY).switch_heads),
    with_("sdpa_input_independent", sdpa_nonlinearity="rmsnorm"),
    with_("sdpa_headwise", rope_base=1e6, yarn=YarnSpec(4.0, 4), rope_dim=8),  # Table 5; partial rotary
    pytest.param(variants.apply("sdpa_elementwise", MOE), id="moe+sdpa_elementwise"),
])
def test_cached_logits_equal_the_full_forward(cfg):
    """Rows of 10 and 6 tokens (the second left-padded by 4), in two chunks of 5 slots. (One
    token at a time is what `generate` does; the tests below check it against the reference.)"""
    assert_matches_full_forward(build(cfg), ROWS)


def test_a_capacity_moe_decodes_dropless_and_each_row_as_it_would_alone():
    """Capacity pools a forward pass's tokens, so rows (and left padding) would compete for expert
    slots: decoding runs the MoE dropless. The cached logits equal the dropless forward's (the same
    parameters), a row decodes as it would alone, and a per-micro-batch LBL (lbl_scope="micro",
    its groups need whole rows) does not stop a 1-row, 5-token prefill."""
    spec = dataclasses.replace(MOE.moe, capacity_factor=1.0, lbl_scope="micro", micro_batches=2)
    model = build(dataclasses.replace(MOE, moe=spec))
    dropless = nnx.merge(nnx.split(nnx.eval_shape(lambda: build(MOE)))[0], nnx.state(model))
    tokens, valid_right = padded(ROWS, left=False)
    capped = full_forward(*nnx.split(model), tokens, valid_right.astype(jnp.int32))
    full = full_forward(*nnx.split(dropless), tokens, valid_right.astype(jnp.int32))
    assert float(jnp.abs(capped - full).max()) > 1e-2  # the training forward does drop here
    logits, valid = cached_logits(model, ROWS, 5)
    alone, _ = cached_logits(model, ROWS[1:], 5)
    for i, r in enumerate(ROWS):
        np.testing.assert_allclose(logits[i][valid[i]], full[i, :len(r)], rtol=1e-5, atol=1e-5, err_msg=f"row {i}")
    np.testing.assert_allclose(alone[0], logits[1][valid[1]], rtol=1e-5, atol=1e-5)


def test_cached_logits_equal_the_full_forward_with_attention_biases():
    """Random (non-zero) biases on W_Q, W_K, W_V, W_O and the gate, as converted checkpoints have."""
    model = build(dataclasses.replace(variants.apply("sdpa_elementwise", TINY), attention_bias=True, qk_norm=True))
    rng = np.random.default_rng(0)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] in ("bq", "bk", "bv", "bo", "b"):
            var[...] = jnp.asarray(rng.normal(0, 0.5, var.shape), var.dtype)
    assert_matches_full_forward(model, ROWS)


def scanned_twin(loop):
    """The scan_layers model with `loop`'s weights, stacked (by hand, not by `with_exec`)."""
    ex = dataclasses.replace(loop.ex, scan_layers=True)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(loop.cfg, ex, rngs=nnx.Rngs(0))))
    params = nnx.state(loop)
    layers = loop.cfg.num_layers
    params["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[params["blocks"][i] for i in range(layers)])
    return nnx.merge(graphdef, params)


def test_unscanned_slices_the_stacked_layers_and_the_scanned_model_decodes():
    loop = build(variants.apply("sdpa_elementwise", TINY))
    scanned = scanned_twin(loop)
    assert scanned.blocks.attn.wq[...].shape[0] == loop.cfg.num_layers

    back = unscanned(scanned)
    assert not back.ex.scan_layers and unscanned(back) is back and back.cfg == loop.cfg
    jax.tree.map(np.testing.assert_array_equal, nnx.state(back), nnx.state(loop))
    # with_exec(..., scan_layers=True) stacks as scanned_twin does.
    stacked = dict(nnx.to_flat_state(nnx.state(with_exec(loop, scanned.ex))))
    want = dict(nnx.to_flat_state(nnx.state(scanned)))
    assert stacked.keys() == want.keys()
    for path, var in stacked.items():
        np.testing.assert_array_equal(var[...], want[path][...], err_msg=str(path))
    tokens, valid = padded(ROWS, left=False)
    np.testing.assert_allclose(full_forward(*nnx.split(scanned), tokens, valid.astype(jnp.int32)),
                               full_forward(*nnx.split(back), tokens, valid.astype(jnp.int32)),
                               rtol=1e-5, atol=1e-5)
    assert_matches_full_forward(scanned, ROWS)


@pytest.fixture(scope="module")
def model():
    return build(variants.apply("sdpa_elementwise", TINY), seed=3)


def test_generate_equals_generation_without_cache(model):
    cached = decode.generate(model, PROMPTS, max_new_tokens=8, max_len=16, pad_multiple=1)
    assert cached == decode.generate_without_cache(model, PROMPTS, max_new_tokens=8, max_len=16)
    assert [len(g) for g in cached] == [8, 8, 8]
    assert len({tuple(g) for g in cached}) == 3
    # The shortest prompt, left-padded by 4 in the batch, generates what it generates alone.
    assert decode.generate(model, PROMPTS[:1], max_new_tokens=8, pad_multiple=1)[0] == cached[0]


def test_eos_and_stop_sequences_end_a_row(model):
    def gen(**kw):
        return decode.generate(model, PROMPTS, max_new_tokens=6, max_len=16, **kw)

    free = gen()
    assert [len(g) for g in free] == [6, 6, 6]
    eos = free[1][3]
    cut = [g[:g.index(eos)] if eos in g else g for g in free]
    assert gen(eos_id=eos) == cut  # prompts padded to 10 slots: max_len - max_new_tokens
    assert decode.generate_without_cache(model, PROMPTS, max_new_tokens=6, max_len=16,
                                         eos_id=eos) == cut
    # Token sequences: the row ends before the first one it produces.
    seq = free[0][2:4]
    end = next(i for i in range(2, 7) if free[0][i - 2:i] == seq)
    assert gen(stop=[seq, [-1]])[0] == free[0][:end - 2]
    # A callable: the tokens up to and including the one it fires on.
    assert gen(stop=lambda g: len(g) == 2 + (g[0] % 2)) == [g[:2 + (g[0] % 2)] for g in free]
    # (padded to gen's 10 slots: its compiled prefill)
    assert decode.generate(model, PROMPTS, max_new_tokens=2, max_len=16, pad_multiple=10) == [g[:2] for g in free]


def test_requests_that_do_not_fit_are_refused(model):
    with pytest.raises(ValueError, match="max_len"):
        decode.generate(model, PROMPTS, max_new_tokens=10, max_len=16)
    with pytest.raises(ValueError, match="at least one token"):
        decode.generate(model, [[1], []], max_new_tokens=4)
    fits = decode.generate(model, PROMPTS, max_new_tokens=9, max_len=16)
    assert [len(g) for g in fits] == [9, 9, 9]


def test_chunked_prefill_equals_one_shot_prefill(model):
    """A 13-token prompt (and a left-padded 7-token one) prefilled 4 tokens at a time: the same
    logits at every real position (a pad query sees no key; its output means nothing) and the
    same cache as one pass; generation with a prefill chunk gives the same tokens."""
    rows = [list(range(1, 14)), PROMPTS[1]]
    tokens, valid = padded(rows)
    one, one_cache = decode.prefill(model, tokens, valid, decode.init_cache(model, 2, 20))
    chunked, cache = decode.prefill(model, tokens, valid, decode.init_cache(model, 2, 20), chunk=4)
    np.testing.assert_allclose(chunked[valid], one[valid], rtol=1e-5, atol=1e-5)
    last, _ = decode.prefill(model, tokens, valid, decode.init_cache(model, 2, 20), chunk=4, last_only=True)
    np.testing.assert_allclose(last, one[:, -1], rtol=1e-5, atol=1e-5)
    assert int(cache["index"]) == int(one_cache["index"]) == 13
    np.testing.assert_array_equal(cache["valid"], one_cache["valid"])
    for name in ("k", "v"):  # [L, B, Hk, T, K] at the real tokens' slots
        a, b = (np.moveaxis(np.asarray(c[name]), 3, 2)[:, :, :13][:, valid] for c in (cache, one_cache))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    want = decode.generate(model, rows, max_new_tokens=5, max_len=24, pad_multiple=1)
    assert decode.generate(model, rows, max_new_tokens=5, max_len=24, prefill_chunk=4) == want
    with pytest.raises(ValueError, match="chunk"):
        decode.prefill(model, tokens, valid, decode.init_cache(model, 2, 20), chunk=0)


def test_a_scanned_model_generates_what_its_unscanned_twin_generates(model):
    """The scanned model's stacked cache and the layer loop's per-layer cache give the same
    tokens (generate donates both kinds of cache to its step)."""
    scanned, cfg = scanned_twin(model), model.cfg
    assert scanned.init_cache(2, 8)["k"].shape == (cfg.num_layers, 2, cfg.kv_heads, 8, cfg.head_dim)
    assert len(model.init_cache(2, 8)["k"]) == cfg.num_layers
    want = decode.generate(model, PROMPTS, max_new_tokens=6, max_len=16)
    assert decode.generate(scanned, PROMPTS, max_new_tokens=6, max_len=16) == want


def test_sampling_is_reproducible_equals_the_reference_and_compiles_once(model):
    """With temperature > 0 the cached path draws what the full-forward reference draws with the
    same key (row r's draw at step i uses fold_in(fold_in(key, r), i)); another key draws other
    tokens; new temperatures, top_p values and keys reuse the compiled step; a tiny top_p is
    greedy decoding; row 0 alone draws what it draws in a batch."""
    def gen(seed, temperature=1.5, top_p=0.9, prompts=PROMPTS):  # (pad_multiple=1: the prefill compiled above)
        return decode.generate(model, prompts, max_new_tokens=8, max_len=16, temperature=temperature,
                               top_p=top_p, key=jax.random.key(seed), pad_multiple=1)

    drawn = gen(0)
    assert drawn == gen(0) == decode.generate_without_cache(
        model, PROMPTS, max_new_tokens=8, max_len=16, temperature=1.5, top_p=0.9, key=jax.random.key(0))
    assert drawn != gen(1)
    # Row r's key is fold_in(key, r) in any batch: row 0 alone draws as row 0 of three.
    np.testing.assert_array_equal(decode.row_keys(jax.random.key(0), 1), decode.row_keys(jax.random.key(0), 3)[:1])
    greedy = decode.generate(model, PROMPTS, max_new_tokens=8, max_len=16, pad_multiple=1)
    assert drawn != greedy and gen(2, top_p=1e-6) == greedy  # the nucleus is then the argmax alone
    compiled = decode._step._cache_size()
    gen(5, temperature=0.7, top_p=0.5)
    assert decode._step._cache_size() == compiled


def test_nucleus_keeps_the_most_probable_tokens_that_first_reach_top_p():
    logits_1x4 = jnp.asarray(np.log(np.asarray([[0.1, 0.5, 0.3, 0.1]], np.float32)))
    nucleus = jax.jit(decode._nucleus)  # (one program, not ~20 eager ops' compiles)
    kept = lambda p: np.isfinite(np.asarray(nucleus(logits_1x4, np.float32(p))))[0].tolist()  # noqa: E731
    assert kept(0.5) == [False, True, False, False]
    assert kept(0.6) == [False, True, True, False]
    assert kept(0.85) == [True, True, True, True]  # the two 0.1s tie at the cut: both stay
    assert kept(1.0) == [True, True, True, True]


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1.0, top_p=0.0), "top_p"), (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0), "key"),
    # (before: a ZeroDivisionError, and an id past the vocabulary decoded as if it were 0)
    (dict(prefill_chunk=0), "prefill_chunk"), (dict(pad_multiple=0), "pad_multiple"),
    (dict(prompts=[[3, 10_000]]), "prompts"), (dict(prompts=[[-1, 3]]), "prompts")])
def test_bad_sampling_settings_are_one_config_error(model, kw, field):
    from gattn.config import ConfigError

    with pytest.raises(ConfigError, match=f"'{field}'"):
        decode.generate(model, kw.pop("prompts", PROMPTS), max_new_tokens=2, **kw)
