"""The paper's measurements: hand-computed F-Attn, sparsity on constructed tensors, and M-Act and
gate statistics equal to direct computations on a tiny model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gattn.config import Config, ConfigError, ExecConfig, GateSpec, MoESpec
from gattn.eval import analysis
from gattn.model.transformer import Transformer, with_exec

from conftest import tiny_model

TINY = tiny_model(num_layers=3)
EX = ExecConfig(attention_block_q=4)  # 12-token rows run through 3 causal query blocks


def build(cfg, seed=0, **exec_changes):
    return Transformer(cfg, dataclasses.replace(EX, **exec_changes), rngs=nnx.Rngs(seed))


def test_first_token_attention_is_the_hand_computation_on_packed_rows():
    # One row: document A at positions 0-2, document B at 3-5, padding at 6. Two heads.
    s = 7
    seg = np.array([[1, 1, 1, 2, 2, 2, 0]])
    probs = np.zeros((1, 2, s, s))
    rng = np.random.default_rng(0)
    for h in range(2):
        for q in range(s):
            probs[0, h, q, : q + 1] = rng.dirichlet(np.ones(q + 1))
    picked = np.asarray(analysis.first_token_probs(jnp.asarray(probs), jnp.asarray(seg)))
    keep = np.asarray(analysis.f_attn_mask(jnp.asarray(seg)))
    # Queries that count: 1, 2 (first token 0) and 4, 5 (first token 3); 0, 3 start documents, 6 is padding.
    np.testing.assert_array_equal(keep, [[False, True, True, False, True, True, False]])
    expected = probs[0, :, 1, 0] + probs[0, :, 2, 0] + probs[0, :, 4, 3] + probs[0, :, 5, 3]
    np.testing.assert_allclose((picked * keep[:, None]).sum(axis=(0, 2)), expected, rtol=1e-6)
    # Without segment ids (all ones) the row is one document: every query but the first looks at 0.
    ones = jnp.ones((1, s), jnp.int32)
    picked = np.asarray(analysis.first_token_probs(jnp.asarray(probs), ones))
    np.testing.assert_allclose(picked[0, :, 1:], probs[0, :, 1:, 0], rtol=1e-6)
    assert np.asarray(analysis.f_attn_mask(ones)).sum() == s - 1


def constructed_layer(probs, sdpa_out, gate_scores=None, gated=None):
    """A layer as `collect` returns it, from a full attention matrix (rows are one document)."""
    b, h, s, _ = probs.shape
    seg = jnp.ones((b, s), jnp.int32)
    layer = {"first_probs": np.asarray(analysis.first_token_probs(jnp.asarray(probs), seg)),
             "attn_map": probs, "sdpa_out": sdpa_out, "block_out": np.zeros((b * s, 4), np.float32),
             "ffn_out": np.zeros((b * s, 4), np.float32)}
    if gate_scores is not None:
        layer.update(gate_scores=gate_scores, gate_input=sdpa_out, gated=gated)
    return layer


def test_sink_heads_and_f_attn_per_head():
    """Head 0 puts 0.9 on the first token, head 1 puts 0.1: F-Attn 0.5 overall, one sink head of two."""
    s = 5
    probs = np.zeros((1, 2, s, s))
    for q in range(1, s):
        for h, first in enumerate((0.9, 0.1)):
            probs[0, h, q, 0] = first
            probs[0, h, q, 1: q + 1] = (1 - first) / q
    probs[0, :, 0, 0] = 1
    cfg = dataclasses.replace(TINY, num_layers=1, q_heads=2, kv_heads=2)
    acc = analysis.Measurements(cfg, analysis.Options(map_layers=()))
    acc.add([constructed_layer(probs, np.ones((s, 2, 8), np.float32))])
    r = acc.result()
    np.testing.assert_allclose(r["per_layer"][0]["f_attn_per_head"], [0.9, 0.1])
    assert r["overall"]["f_attn"] == pytest.approx(0.5)
    assert r["overall"]["sink_head_share"] == 0.5
    assert "gate_score" not in r["overall"] and "gate_histogram" not in r  # ungated: absent, not 0


def test_sparsity_before_after_the_gate_and_with_the_mean_gate():
    """SDPA output of 1e-1 everywhere; headwise gate 1e-3 on half the tokens, 1 on the other half.
    Before: nothing below 1e-2. Gated: half the values are 1e-4 (< 1e-3 and < 1e-2). Scaled by the
    mean gate (~0.5) instead: nothing below either threshold."""
    n, h, k = 8, 2, 4
    y = np.full((n, h, k), 0.1, np.float32)
    scores = np.ones((n, h, 1), np.float32)
    scores[: n // 2] = 1e-3
    cfg = dataclasses.replace(TINY, num_layers=1, q_heads=h, kv_heads=h, head_dim=k,
                              gate=GateSpec(granularity="headwise"))
    probs = np.tril(np.ones((n, n)))[None, None].repeat(h, 1) / np.arange(1, n + 1)[:, None]
    acc = analysis.Measurements(cfg, analysis.Options(map_len=n))
    acc.add([constructed_layer(probs, y, scores, gated=y * scores)])
    sp = acc.result()["per_layer"][0]["sparsity"]
    assert sp["sdpa_out"] == {"0.01": 0.0, "0.001": 0.0}
    assert sp["gated"] == {"0.01": 0.5, "0.001": 0.5}
    assert sp["mean_gate_scaled"] == {"0.01": 0.0, "0.001": 0.0}
    hist = acc.result()["gate_histogram"]
    assert sum(hist["all_layers"]) == n * h and hist["all_layers"][0] == n // 2 * h
    # mean_gate_scaled uses the mean over all the data: |0.1 * 0.5005| = 0.05005 is below 0.06
    # and above 0.04 (the per-batch means, 1e-3 and 1, would put it below both or neither;
    # the histogram resolves 2.3%).
    acc = analysis.Measurements(cfg, analysis.Options(map_len=n, sparsity_thresholds=(0.06, 0.04)))
    for half in (slice(0, n // 2), slice(n // 2, n)):  # two batches with different mean gates
        probs_half = probs[:, :, : n // 2, : n // 2] / probs[:, :, : n // 2, : n // 2].sum(-1, keepdims=True)
        acc.add([constructed_layer(probs_half, y[half], scores[half], gated=y[half] * scores[half])])
    assert acc.result()["per_layer"][0]["sparsity"]["mean_gate_scaled"] == {"0.06": 1.0, "0.04": 0.0}


def direct_layers(model, tokens_BxS):
    """Block outputs and gate scores computed by calling the blocks one by one, outside `collect`."""
    b, s = tokens_BxS.shape
    pos = jnp.broadcast_to(jnp.arange(s), (b, s)).reshape(-1)
    x = jnp.take(model.embed[...], tokens_BxS.reshape(-1), axis=0)
    out = []
    for block in model.blocks:
        normed = block.attn_norm(x)
        scores = block.attn.gate.scores(normed) if block.attn.gate is not None else None
        x, _ = block(x, pos, None, (b, s))
        out.append((np.asarray(x), None if scores is None else np.asarray(scores)))
    return out


GATES = [None, GateSpec(), GateSpec(position="value", granularity="headwise"),
         GateSpec(sharing="head_shared"), GateSpec(form="additive", activation="silu"),
         GateSpec(input_dependent=False), GateSpec(position="dense", activation="ns_sigmoid")]


@pytest.mark.parametrize("gate", GATES + ["moe", "remat"])
def test_m_act_and_gate_score_equal_direct_computations(gate):
    cfg, remat = dataclasses.replace(TINY, gate=GateSpec()), "none"
    if gate == "moe":
        cfg = dataclasses.replace(cfg, moe=MoESpec(num_experts=4, top_k=2, expert_width=16))
    elif gate == "remat":
        remat = "full"
    else:
        cfg = dataclasses.replace(TINY, gate=gate)
    gate = cfg.gate
    model = build(cfg, remat=remat)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, TINY.vocab_size)
    before = np.asarray(model(tokens))
    r = analysis.summarize(model, tokens)
    direct = direct_layers(model, tokens)
    for row, (h, scores) in zip(r["per_layer"], direct):
        assert row["m_act"] == pytest.approx(float(np.abs(h).max()), rel=1e-5)
        if gate is None:
            assert "gate_score" not in row
        else:
            assert row["gate_score"] == pytest.approx(float(np.broadcast_to(scores, (24,) + scores.shape[1:]).mean()), rel=1e-5, abs=1e-7)
            assert ("gated" in row["sparsity"]) == (gate.position == "sdpa")
            assert ("mean_gate_scaled" in row["sparsity"]) == (gate.position == "sdpa" and gate.form == "multiplicative")
    maxima = [float(np.abs(h).max()) for h, _ in direct]
    assert r["overall"]["m_act"] == pytest.approx(np.mean(maxima), rel=1e-5)  # Sec. 4.3: mean over layers
    assert r["overall"]["m_act_max"] == pytest.approx(max(maxima), rel=1e-5)
    np.testing.assert_array_equal(np.asarray(model(tokens)), before)  # collecting changes nothing


@pytest.mark.parametrize("gate", [None, GateSpec()])
def test_ffn_act_per_token_m_act_and_mean_abs_y_equal_hand_computations(gate):
    """Fig. 6's FFN-output maxima from the blocks called one by one; M-Act per token (the mean of
    each token's max |hidden|) beside the running max; Fig. 4's mean |Y| and, for a G1 gate, mean
    |Y'| = mean |Y * score| from the captured SDPA output and gate scores."""
    model = build(dataclasses.replace(TINY, gate=gate))
    tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, TINY.vocab_size)
    r = analysis.summarize(model, tokens)
    # (summarize's attention maps: its compiled program again, not a second one)
    layers = analysis.collect(model, tokens, map_layers=(0, 1, 2))
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12)).reshape(-1)
    x = jnp.take(model.embed[...], tokens.reshape(-1), axis=0)
    for i, (block, row) in enumerate(zip(model.blocks, r["per_layer"])):
        after_attn = x + block.attn(block.attn_norm(x), pos, None, (2, 12))
        ffn_NxD = np.asarray(block.ffn(block.ffn_norm(after_attn)))
        x, _ = block(x, pos, None, (2, 12))
        h_NxD = np.abs(np.asarray(x))
        assert row["ffn_act"] == pytest.approx(float(np.abs(ffn_NxD).max()), rel=1e-5)
        assert row["m_act_per_token"] == pytest.approx(float(h_NxD.max(axis=1).mean()), rel=1e-5)
        assert row["m_act_per_token"] < row["m_act"] == pytest.approx(float(h_NxD.max()), rel=1e-5)
        y = layers[i]["sdpa_out"]
        assert row["mean_abs_y"] == pytest.approx(float(np.abs(y).mean()), rel=1e-5)
        if gate is None:
            assert "mean_abs_y_gated" not in row
        else:
            gated = y * layers[i]["gate_scores"]  # a sigmoid score per value (or per head)
            np.testing.assert_allclose(layers[i]["gated"], gated, rtol=1e-5, atol=1e-7)
            assert row["mean_abs_y_gated"] == pytest.approx(float(np.abs(gated).mean()), rel=1e-5)
            assert row["mean_abs_y_gated"] < row["mean_abs_y"]
    per_layer = r["per_layer"]
    assert r["overall"]["ffn_act_max"] == max(p["ffn_act"] for p in per_layer)
    assert r["overall"]["m_act_per_token"] == pytest.approx(np.mean([p["m_act_per_token"] for p in per_layer]))


def test_gated_sparsity_is_what_the_gate_returns():
    """An input-independent sigmoid gate pushed to ~0 (theta = -40): every gated SDPA value is
    below 1e-3 while the SDPA output itself is not; pushed to 1 (theta = +40) gating changes nothing."""
    cfg = dataclasses.replace(TINY, gate=GateSpec(input_dependent=False))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, TINY.vocab_size)
    for theta, gated_share in ((-40.0, 1.0), (40.0, None)):
        model = build(cfg)
        for blk in model.blocks:
            blk.attn.gate.theta[...] = jnp.full_like(blk.attn.gate.theta[...], theta)
        for row in analysis.summarize(model, tokens)["per_layer"]:
            sp = row["sparsity"]
            assert sp["sdpa_out"]["0.001"] < 0.5
            assert sp["gated"]["0.001"] == (gated_share if gated_share is not None else sp["sdpa_out"]["0.001"])


def test_measure_streams_batches_and_leaves_padding_out():
    """Two batches accumulate like one; padded tokens (segment 0) change nothing."""
    model = build(dataclasses.replace(TINY, gate=GateSpec()))
    tok = np.asarray(jax.random.randint(jax.random.key(2), (4, 13), 0, TINY.vocab_size))
    seg = np.ones_like(tok)
    pos = np.broadcast_to(np.arange(13), tok.shape)
    one = analysis.measure(model, [{"tokens": tok, "segment_ids": seg, "positions": pos}])
    two = analysis.measure(model, [{"tokens": tok[:2], "segment_ids": seg[:2], "positions": pos[:2]},
                                   {"tokens": tok[2:], "segment_ids": seg[2:], "positions": pos[2:]}])
    for a, b in zip(one["per_layer"], two["per_layer"]):
        assert a["m_act"] == pytest.approx(b["m_act"])
        assert a["f_attn"] == pytest.approx(b["f_attn"])
        assert a["gate_score"] == pytest.approx(b["gate_score"])
        for key in ("m_act_per_token", "ffn_act", "mean_abs_y", "mean_abs_y_gated"):  # token-weighted means, a max
            assert a[key] == pytest.approx(b[key], rel=1e-6)
    # Append padding columns with garbage tokens: statistics are unchanged.
    padded = {"tokens": np.concatenate([tok, np.full((4, 3), 7)], 1),
              "segment_ids": np.concatenate([seg, np.zeros((4, 3), int)], 1),
              "positions": np.concatenate([pos, np.zeros((4, 3), int)], 1)}
    # The last column is dropped as the next-token target, so keep the real row's length + padding.
    padded = {k: np.concatenate([v[:, :12], v[:, 13:], v[:, 12:13]], 1) for k, v in padded.items()}
    three = analysis.measure(model, [padded])
    for a, b in zip(one["per_layer"], three["per_layer"]):
        assert a["m_act"] == pytest.approx(b["m_act"], rel=1e-5)
        assert a["f_attn"] == pytest.approx(b["f_attn"], rel=1e-5)
        assert a["gate_score"] == pytest.approx(b["gate_score"], rel=1e-5)
        for key in ("m_act_per_token", "ffn_act", "mean_abs_y", "mean_abs_y_gated"):
            assert a[key] == pytest.approx(b[key], rel=1e-5)
        for kind in ("sdpa_out", "gated", "mean_gate_scaled"):
            assert a["sparsity"][kind] == pytest.approx(b["sparsity"][kind], abs=1e-9)
    assert sorted(three["attn_maps"]) == ["0", "1", "2"]  # first, middle and last layer
    m1, m3 = np.asarray(one["attn_maps"]["2"]), np.asarray(three["attn_maps"]["2"])  # [heads, query, key]
    np.testing.assert_allclose(m3[:, :12, :12], m1[:, :12, :12], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m1[:, :12].sum(-1), 1.0, rtol=1e-5)  # each query row is a distribution
    assert np.all(m3[:, 12:] == 0)  # padding queries (and positions past the rows) are in no document


def test_window_perplexity_is_the_mean_next_token_loss_of_each_window():
    """Three windows of 8 (+1) tokens cut from a 30-token stream, each read from position 0: the
    perplexities equal exp of the mean loss computed from the logits directly; query-chunked
    attention gives the same; a stream shorter than one window gives None."""
    model = build(TINY, seed=2)
    stream = np.random.default_rng(3).integers(0, TINY.vocab_size, 30)
    got = analysis.window_perplexity(model, stream, 8)
    nll = []
    log_softmax = nnx.jit(lambda model, w: jax.nn.log_softmax(model(w), axis=-1))  # (one program for the 3 windows)
    for i in range(3):
        w = jnp.asarray(stream[i * 8:i * 8 + 9][None])
        logp = log_softmax(model, w[:, :-1])[0]
        nll.append(-np.asarray(logp)[np.arange(8), stream[i * 8 + 1:i * 8 + 9]])
    nll = np.stack(nll)
    assert got["windows"] == 3
    assert got["ppl"] == pytest.approx(np.exp(nll.mean()), rel=1e-5)
    assert got["ppl_second_half"] == pytest.approx(np.exp(nll[:, 4:].mean()), rel=1e-5)
    chunked = build(TINY, seed=2, attention_query_chunk=2)
    assert analysis.window_perplexity(chunked, stream, 8)["ppl"] == pytest.approx(got["ppl"], rel=1e-5)
    assert analysis.window_perplexity(model, stream[:8], 8) is None


MOE = tiny_model(num_layers=1, moe=MoESpec(num_experts=4, top_k=2, expert_width=16))


def moe_batch(rows, seed=0):
    tokens = np.random.default_rng(seed).integers(0, MOE.vocab_size, (rows, 13)).astype(np.int32)
    return {"tokens": tokens, "segment_ids": np.ones_like(tokens), "positions": np.tile(np.arange(13), (rows, 1))}


def test_an_expert_parallel_moe_is_measured_without_its_mesh():
    """exec.moe_impl=ragged runs in shard_map over the mesh's expert axis, and the measurements
    set no mesh: they run the partitioned MoE, the same dropless function (this used to raise)."""
    ref = build(MOE)
    ragged = with_exec(ref, dataclasses.replace(ref.ex, moe_impl="ragged"))
    got, want = analysis.measure(ragged, [moe_batch(2)]), analysis.measure(ref, [moe_batch(2)])
    for key in ("m_act", "m_act_per_token", "f_attn", "mean_abs_y"):
        assert got["overall"][key] == pytest.approx(want["overall"][key], rel=1e-6)
    stream = np.random.default_rng(1).integers(0, MOE.vocab_size, 20)
    assert analysis.window_perplexity(ragged, stream, 8) == analysis.window_perplexity(ref, stream, 8)
    assert analysis.moe_shards(Config(model=MOE)) == 1  # partitioned: the batch split does not matter


def test_an_all_to_all_moe_is_measured_one_data_expert_shard_at_a_time():
    """all_to_all counts capacity per data x expert shard; `moe_shards` runs the partitioned MoE on
    one shard's rows per forward pass, so it drops what the run's mesh drops (the same logits on 8
    devices: tests/multidevice/expert_parallel_step.py), not what the whole batch would."""
    cap = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, capacity_factor=0.5))
    ref = build(cap)
    a2a = with_exec(ref, dataclasses.replace(ref.ex, moe_impl="all_to_all"))
    batch = moe_batch(4)
    shards = analysis.measure(a2a, [batch], analysis.Options(moe_shards=2))["overall"]
    halves = analysis.measure(ref, [batch], analysis.Options(batch_rows=2))["overall"]
    whole = analysis.measure(ref, [batch])["overall"]
    for key in ("m_act_per_token", "ffn_act", "mean_abs_y"):
        assert shards[key] == pytest.approx(halves[key], rel=1e-6)
    assert whole["ffn_act"] != pytest.approx(halves["ffn_act"], rel=0.01)  # the whole batch drops others
    with pytest.raises(ConfigError, match="data.eval_batch_size"):
        analysis.measure(a2a, [batch], analysis.Options(moe_shards=3))
