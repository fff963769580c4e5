"""An empty decoding cache is built from the config's shapes alone: it never reads, slices or
copies a weight, scanned or not, hybrid or not, and a scanned model's is its layer loop's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gattn.config import ExecConfig, GateSpec, LinearAttentionSpec, ModelConfig, hybrid_layer_types
from gattn.eval import decode
from gattn.model.transformer import Transformer, with_exec

HYBRID = ModelConfig(vocab_size=64, d_model=32, num_layers=8, q_heads=4, kv_heads=2, head_dim=8, d_ff=64,
                     qk_norm=True, zero_centered_norm=True, gate=GateSpec(), layer_types=hybrid_layer_types(8),
                     linear_attention=LinearAttentionSpec(2, 4, 8, 8, 4))
DENSE = ModelConfig(vocab_size=64, d_model=32, num_layers=4, q_heads=4, kv_heads=2, head_dim=8, d_ff=64)
PROMPTS = [[5, 17, 3, 40, 2, 9, 33, 8, 60], [12, 1, 44]]


@pytest.fixture(scope="module", params=["hybrid", "dense"])
def twins(request):
    """(the layer loop, its scanned twin: a hybrid's groups of the 3:1 pattern, a dense model's stack)."""
    cfg = HYBRID if request.param == "hybrid" else DENSE
    loop = Transformer(cfg, ExecConfig(gdn_chunk=4), rngs=nnx.Rngs(0))
    return loop, with_exec(loop, ExecConfig(gdn_chunk=4, scan_layers=True))


def nbytes(avals) -> int:
    return sum(a.size * a.dtype.itemsize for a in avals)


def created(fn) -> tuple[list, list]:
    """(the arrays `fn` makes: its jaxpr's equations' outputs, the arrays it reads: closed-over constants)."""
    jaxpr = jax.make_jaxpr(fn)()
    return [v.aval for e in jaxpr.eqns for v in e.outvars], jaxpr.consts


@pytest.mark.parametrize("layout", ["loop", "scanned"])
def test_init_cache_reads_no_weight_and_makes_only_the_cache(twins, layout):
    model = twins[layout == "scanned"]
    made, read = created(lambda: model.init_cache(2, 16))
    assert read == [], f"init_cache read {len(read)} weights"
    assert nbytes(made) <= nbytes(jax.tree.leaves(jax.eval_shape(lambda: model.init_cache(2, 16))))


def test_the_scanned_cache_is_the_layer_loops(twins):
    """Same structure, shapes, dtypes and (zero) values: a scanned hybrid keeps the loop's
    per-layer tuples; a scanned dense model stacks its layers' k and v into [L, ...]."""
    loop, scanned = (m.init_cache(3, 16) for m in twins)
    if isinstance(scanned["k"], tuple):
        assert jax.tree.structure(scanned) == jax.tree.structure(loop)
    else:
        loop = {**loop, "k": jnp.stack(loop["k"]), "v": jnp.stack(loop["v"])}
    for a, b in zip(jax.tree.leaves(scanned), jax.tree.leaves(loop), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and not np.asarray(a).any() and not np.asarray(b).any()
    if "gdn" in loop:  # each GDN layer's state is its layer's own init_state
        for block, state in zip(twins[0].blocks, scanned["gdn"], strict=True):
            want = block.linear_attn.init_state(3) if block.layer_type == "linear_attention" else None
            assert jax.tree.structure(state) == jax.tree.structure(want)
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want), strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype == jnp.float32 and np.array_equal(a, b)


def test_a_scanned_model_generates_the_loops_tokens_slicing_a_hybrids_groups_once(twins, monkeypatch):
    """generate's decoding step reads a scanned hybrid's weights per layer (the layer loop's
    parameters, sliced once for the call), not the stacked groups it would slice at every token;
    a scanned dense model decodes with its scan."""
    loop, scanned = twins
    want = decode.generate(loop, PROMPTS, max_new_tokens=3, max_len=16)
    states, step = [], decode._step
    monkeypatch.setattr(decode, "_step", lambda graphdef, state, *a: states.append(state) or step(graphdef, state, *a))
    assert decode.generate(scanned, PROMPTS, max_new_tokens=3, max_len=16) == want
    want_paths = {p for p, _ in nnx.to_flat_state(nnx.state(loop if scanned.grouped else scanned))}
    assert len(states) == 2 and {p for p, _ in nnx.to_flat_state(states[0])} == want_paths


def test_speculative_decoding_of_a_scanned_hybrid_slices_its_groups_once(monkeypatch):
    """speculative.generate reads a scanned hybrid's weights per layer too (before: its steps
    sliced every stacked group at every token, as decode.generate did), and drafts the loop's tokens."""
    import dataclasses

    from gattn.eval import speculative

    loop = Transformer(dataclasses.replace(HYBRID, mtp_layers=1), ExecConfig(gdn_chunk=4), rngs=nnx.Rngs(0))
    scanned = with_exec(loop, ExecConfig(gdn_chunk=4, scan_layers=True))
    want = speculative.generate(loop, PROMPTS, max_new_tokens=4)
    states, prefill = [], speculative._prefill
    monkeypatch.setattr(speculative, "_prefill", lambda graphdef, state, *a: states.append(state)
                        or prefill(graphdef, state, *a))
    assert speculative.generate(scanned, PROMPTS, max_new_tokens=4) == want
    assert {p for p, _ in nnx.to_flat_state(states[0])} == {p for p, _ in nnx.to_flat_state(nnx.state(loop))}
