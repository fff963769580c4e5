"""One attention layer (`gattn.model.attention.Attention`) against an independent float64 NumPy
reference.

The reference below is written from the paper's formulas (Qiu et al. 2025, Sec. 2, Fig. 1)
and the codebase's documented conventions; it calls no gattn function:

    Q = X W_Q, K = X W_K, V = X W_V            [N, heads, K], column h*K + j is head h dim j
    (optional QK RMSNorm) -> gate at query / key / value -> RoPE (rotate-half layout)
    Y = causal softmax(Q K^T / sqrt(K)) V      GQA: query head h reads kv head h // (Hq // Hk)
    (optional per-head SDPA non-linearity) -> gate at sdpa (G1)
    O = concat_heads(Y) W_O -> gate at dense (G5)

A gate is Y * act(X W_theta) (multiplicative) or Y + act(X W_theta) (additive), X the layer input
of the current token. The layer's own parameters are read out as numpy and fed to the reference,
so every test checks the formula, not the initialisation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gattn.config import ExecConfig, GateSpec, SwitchHeadsSpec
from gattn.kernels import attention_masked, attention_xla
from gattn.model.attention import Attention
from gattn.model.capture import NOTHING, Capture

from conftest import tiny_model

RTOL, ATOL = 1e-4, 1e-5

# Small but non-trivial: 4 query heads over 2 kv heads, head_dim 8, d_model 16. A large init_std
# makes the gate logits O(1), so sigmoid/silu are far from their linear regime around 0.
BASE = tiny_model(vocab_size=32, d_model=16, num_layers=1, q_heads=4, kv_heads=2, head_dim=8,
                  d_ff=32, init_std=0.3, rope_base=10_000.0, norm_eps=1e-6)
B, S = 2, 8


# --------------------------------------------------------------------------- numpy reference


def np_sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


NP_ACT = {
    "sigmoid": np_sigmoid,
    "silu": lambda z: z * np_sigmoid(z),
    "ns_sigmoid": lambda z: 0.5 + 0.5 * np_sigmoid(z),
    "identity": lambda z: z,
}


def np_rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_rope(x_NxHxK, positions_N, base):
    k = x_NxHxK.shape[-1]
    i = np.arange(k // 2, dtype=np.float64)
    theta = base ** (-2.0 * i / k)
    ang = positions_N.astype(np.float64)[:, None, None] * theta[None, None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x_NxHxK[..., : k // 2], x_NxHxK[..., k // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def np_gate_shape(spec, cfg):
    if spec.position == "dense":
        return 1, cfg.d_model
    heads = cfg.q_heads if spec.position in ("sdpa", "query") else cfg.kv_heads
    return heads, (cfg.head_dim if spec.granularity == "elementwise" else 1)


def np_gate_scores(spec, cfg, p, x_NxD):
    """act(X W_theta) as [N or 1, heads, width], averaged over heads (post-activation) if shared."""
    heads, width = np_gate_shape(spec, cfg)
    if spec.input_dependent:
        logits = (x_NxD @ p["gate_w"]).reshape(x_NxD.shape[0], heads, width)
    else:
        logits = p["gate_theta"].reshape(1, heads, width)
    s = NP_ACT[spec.activation](logits)
    if spec.sharing == "head_shared":
        s = s.mean(axis=1, keepdims=True)
    return s


def np_gate(spec, cfg, p, y_NxHxW, x_NxD, position):
    if spec is None or spec.position != position:
        return y_NxHxW
    s = np_gate_scores(spec, cfg, p, x_NxD)
    return y_NxHxW * s if spec.form == "multiplicative" else y_NxHxW + s


def np_sdpa(q_BSHK, k_BSHK, v_BSHK, segment_ids_BxS=None):
    """Causal GQA softmax attention; returns o [B, S, Hq, K] and probs [B, Hq, S, S].
    Segment ids: same-id keys only; id-0 (padding) queries have zero output and zero probs."""
    b, s, hq, kd = q_BSHK.shape
    hk = k_BSHK.shape[2]
    group = hq // hk
    o = np.zeros((b, s, hq, kd))
    probs = np.zeros((b, hq, s, s))
    causal = np.tril(np.ones((s, s), dtype=bool))
    for bi in range(b):
        mask = causal.copy()
        if segment_ids_BxS is not None:
            seg = np.asarray(segment_ids_BxS[bi])
            mask &= seg[:, None] == seg[None, :]
        for h in range(hq):
            kv = h // group
            logits = q_BSHK[bi, :, h] @ k_BSHK[bi, :, kv].T / np.sqrt(kd)
            logits = np.where(mask, logits, -np.inf)
            logits = logits - logits.max(axis=-1, keepdims=True)
            p = np.exp(logits)
            p = p / p.sum(axis=-1, keepdims=True)
            if segment_ids_BxS is not None:
                p = np.where((np.asarray(segment_ids_BxS[bi]) != 0)[:, None], p, 0.0)
            probs[bi, h] = p
            o[bi, :, h] = p @ v_BSHK[bi, :, kv]
    return o, probs


def np_switch_weights(cfg, p, x_NxD):
    sw = cfg.switch_heads
    s = np_sigmoid(x_NxD @ p["router"]).reshape(x_NxD.shape[0], cfg.kv_heads, sw.num_experts)
    order = np.argsort(-s, axis=-1)
    keep = np.zeros_like(s)
    np.put_along_axis(keep, order[..., : sw.top_k], 1.0, axis=-1)
    return s * keep


def np_switch_proj(cfg, w_ExDxHK, weights_NxHxE, x_NxD):
    n, hk, k = x_NxD.shape[0], cfg.kv_heads, cfg.head_dim
    out = np.zeros((n, hk, k))
    for e in range(w_ExDxHK.shape[0]):
        out += weights_NxHxE[:, :, e, None] * (x_NxD @ w_ExDxHK[e]).reshape(n, hk, k)
    return out


def np_attention(cfg, p, x_NxD, positions_N, segment_ids_BxS, batch, trace=None):
    """The whole layer in float64 numpy; `trace` (a dict), if given, receives the attention
    probabilities [B, Hq, S, S] and the SDPA output [N, Hq, K] before the G1 non-linearity."""
    x = np.asarray(x_NxD, np.float64)
    pos = np.asarray(positions_N)
    b, s = batch
    n, hq, hk, k = x.shape[0], cfg.q_heads, cfg.kv_heads, cfg.head_dim
    spec = cfg.gate
    q = (x @ p["wq"]).reshape(n, hq, k)
    if cfg.switch_heads is None:
        kk = (x @ p["wk"]).reshape(n, hk, k)
        v = (x @ p["wv"]).reshape(n, hk, k)
    else:
        wts = np_switch_weights(cfg, p, x)
        v = np_switch_proj(cfg, p["v_experts"], wts, x)
        if cfg.switch_heads.targets == "kv":
            kk = np_switch_proj(cfg, p["k_experts"], wts, x)
        else:
            kk = (x @ p["wk"]).reshape(n, hk, k)
    if cfg.qk_norm:
        q = np_rms_norm(q, p["q_norm"], cfg.norm_eps)
        kk = np_rms_norm(kk, p["k_norm"], cfg.norm_eps)
    q = np_gate(spec, cfg, p, q, x, "query")
    kk = np_gate(spec, cfg, p, kk, x, "key")
    v = np_gate(spec, cfg, p, v, x, "value")
    q = np_rope(q, pos, cfg.rope_base)
    kk = np_rope(kk, pos, cfg.rope_base)
    y, probs = np_sdpa(q.reshape(b, s, hq, k), kk.reshape(b, s, hk, k), v.reshape(b, s, hk, k),
                       segment_ids_BxS)
    y = y.reshape(n, hq, k)
    if trace is not None:
        trace.update(attn_probs=probs, sdpa_out=y)
    if cfg.sdpa_nonlinearity == "rmsnorm":
        y = np_rms_norm(y, p["sdpa_norm"], cfg.norm_eps)
    elif cfg.sdpa_nonlinearity == "silu":
        y = y * np_sigmoid(y)
    y = np_gate(spec, cfg, p, y, x, "sdpa")
    o = y.reshape(n, hq * k) @ p["wo"]
    return np_gate(spec, cfg, p, o[:, None, :], x, "dense")[:, 0, :]


# --------------------------------------------------------------------------- helpers


def f64(v):
    return np.asarray(v[...], np.float64)


def make_attention(cfg, seed=0, *, random_theta=True, ex=ExecConfig()):
    """Builds the layer and replaces the ones/zeros-initialised vectors (norm scales, gate theta)
    by random values so that the reference checks how they are used."""
    attn = Attention(cfg, ex, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 1000)
    for name in ("q_norm", "k_norm", "sdpa_norm"):
        if hasattr(attn, name):
            var = getattr(attn, name)
            var[...] = jnp.asarray(rng.uniform(0.5, 1.5, var[...].shape), jnp.float32)
    if random_theta and attn.gate is not None and not cfg.gate.input_dependent:
        th = attn.gate.theta
        th[...] = jnp.asarray(rng.normal(0.0, 1.5, th[...].shape), jnp.float32)
    return attn


def params_of(attn):
    """The layer's parameters as float64 numpy arrays, under the reference's names."""
    p = {}
    for name in ("wq", "wk", "wv", "wo", "q_norm", "k_norm", "sdpa_norm", "router"):
        if hasattr(attn, name):
            p[name] = f64(getattr(attn, name))
    if hasattr(attn, "v_experts"):
        p["v_experts"] = f64(attn.v_experts.w)
    if hasattr(attn, "k_experts"):
        p["k_experts"] = f64(attn.k_experts.w)
    if attn.gate is not None:
        if hasattr(attn.gate, "w"):
            p["gate_w"] = f64(attn.gate.w)
        else:
            p["gate_theta"] = f64(attn.gate.theta)
    return p


def inputs(cfg, b=B, s=S, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(b * s, cfg.d_model)).astype(np.float32)
    positions = np.tile(np.arange(s), b).astype(np.int32)
    return x, positions


_jitted_layer = nnx.jit(lambda attn, x, pos, seg, batch, capture: attn(x, pos, seg, batch, capture),
                        static_argnums=(4, 5))


def run_layer(attn, x, positions, segment_ids, batch, capture=NOTHING, jit=False):
    """The layer's output as numpy; `jit`: as one compiled program (for shapes no other test runs,
    where running eagerly would compile each op for them), else op by op (whose compiled ops the
    many same-shaped tests share)."""
    seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    call = _jitted_layer if jit else (lambda attn, *args: attn(*args))
    return np.asarray(call(attn, jnp.asarray(x), jnp.asarray(positions), seg, batch, capture))


def assert_matches_reference(cfg, seed=0, b=B, s=S, segment_ids=None, positions=None, ex=ExecConfig(), jit=False):
    attn = make_attention(cfg, seed, ex=ex)
    x, pos = inputs(cfg, b, s, seed)
    if positions is not None:
        pos = positions
    got = run_layer(attn, x, pos, segment_ids, (b, s), jit=jit)
    want = np_attention(cfg, params_of(attn), x, pos, segment_ids, (b, s))
    assert got.shape == (b * s, cfg.d_model)
    assert np.all(np.isfinite(got))
    # The output must not be trivially tiny, or the tolerance would hide any mistake.
    assert np.max(np.abs(want)) > 1e-2
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * max(1.0, np.abs(want).max()))
    return attn, x, pos, got


def gate(**kw):
    return GateSpec(**kw)


# --------------------------------------------------------------------------- the layer vs numpy

LAYER_CASES = {
    "baseline": {},
    # every position, elementwise sigmoid (the paper's Table 1 rows 1-10 gate form)
    "G1_sdpa_elementwise_sigmoid": dict(gate=gate(position="sdpa")),
    "G2_value_elementwise_sigmoid": dict(gate=gate(position="value")),
    "G3_key_elementwise_sigmoid": dict(gate=gate(position="key")),
    "G4_query_elementwise_sigmoid": dict(gate=gate(position="query")),
    "G5_dense_elementwise_sigmoid": dict(gate=gate(position="dense")),
    # headwise: one scalar per head (query heads at G1/G4, kv heads at G2/G3)
    "G1_sdpa_headwise": dict(gate=gate(position="sdpa", granularity="headwise")),
    "G2_value_headwise": dict(gate=gate(position="value", granularity="headwise")),
    "G3_key_headwise": dict(gate=gate(position="key", granularity="headwise")),
    "G4_query_headwise": dict(gate=gate(position="query", granularity="headwise")),
    # head-shared: score averaged over the head axis after the activation
    "G1_sdpa_head_shared": dict(gate=gate(position="sdpa", sharing="head_shared")),
    "G2_value_head_shared": dict(gate=gate(position="value", sharing="head_shared")),
    "G1_sdpa_headwise_head_shared": dict(gate=gate(position="sdpa", granularity="headwise",
                                                   sharing="head_shared")),
    # form and activation
    "G1_additive_silu": dict(gate=gate(position="sdpa", form="additive", activation="silu")),
    "G1_additive_identity": dict(gate=gate(position="sdpa", form="additive", activation="identity")),
    "G1_multiplicative_silu": dict(gate=gate(position="sdpa", activation="silu")),
    "G1_ns_sigmoid": dict(gate=gate(position="sdpa", activation="ns_sigmoid")),
    "G2_multiplicative_identity": dict(gate=gate(position="value", activation="identity")),
    # input-independent: act(theta), theta [heads, width] (random here; zero init tested below)
    "G1_input_independent": dict(gate=gate(position="sdpa", input_dependent=False)),
    "G2_headwise_input_independent": dict(gate=gate(position="value", granularity="headwise",
                                                    input_dependent=False)),
    "G1_input_independent_head_shared": dict(gate=gate(position="sdpa", sharing="head_shared",
                                                       input_dependent=False)),
    "G5_input_independent": dict(gate=gate(position="dense", input_dependent=False)),
    # non-gate non-linearities at G1 (Table 3 rows 5-6)
    "sdpa_rmsnorm": dict(sdpa_nonlinearity="rmsnorm"),
    "sdpa_silu": dict(sdpa_nonlinearity="silu"),
    "sdpa_rmsnorm_then_G1_gate": dict(sdpa_nonlinearity="rmsnorm", gate=gate(position="sdpa")),
    # QK-norm, alone and before a gate on Q/K (norm -> gate -> RoPE)
    "qk_norm": dict(qk_norm=True),
    "qk_norm_then_G3_key_gate": dict(qk_norm=True, gate=gate(position="key")),
    "qk_norm_then_G4_query_gate": dict(qk_norm=True, gate=gate(position="query")),
    # Switch Heads (Table 6)
    "switch_heads_v_4top2": dict(switch_heads=SwitchHeadsSpec(targets="v", num_experts=4, top_k=2)),
    "switch_heads_kv_4top4": dict(switch_heads=SwitchHeadsSpec(targets="kv", num_experts=4, top_k=4)),
    "switch_heads_kv_4top1_with_G1": dict(
        switch_heads=SwitchHeadsSpec(targets="kv", num_experts=4, top_k=1), gate=gate(position="sdpa")),
}


@pytest.mark.parametrize("case", list(LAYER_CASES), ids=list(LAYER_CASES))
def test_layer_matches_numpy_reference(case):
    """Every variant of the layer computes exactly the paper's formula (fp32 vs float64)."""
    cfg = dataclasses.replace(BASE, **LAYER_CASES[case])
    assert_matches_reference(cfg, seed=len(case))


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=lambda h: f"gqa_ratio_{4 // h}")
@pytest.mark.parametrize("gate_spec", [None, gate(position="value"), gate(position="key", granularity="headwise"),
                                       gate(position="sdpa", granularity="headwise")],
                         ids=["baseline", "G2_value", "G3_key_headwise", "G1_headwise"])
def test_gqa_grouping_matches_reference(kv_heads, gate_spec):
    """Query head h reads kv head h // (Hq // Hk) for group sizes 1 (MHA), 2 and 4 (MQA), and
    kv-position gates have one score per kv head."""
    cfg = dataclasses.replace(BASE, q_heads=4, kv_heads=kv_heads, gate=gate_spec)
    assert_matches_reference(cfg, seed=kv_heads)


def test_gqa_kv_head_assignment_is_grouped_not_interleaved():
    """Zeroing kv head 0's value projection zeroes exactly the query heads 0..G-1 of the SDPA
    output (contiguous groups), seen through W_O restricted to one query head at a time."""
    cfg = dataclasses.replace(BASE, q_heads=4, kv_heads=2)
    attn = make_attention(cfg)
    k = cfg.head_dim
    wv = np.asarray(attn.wv[...]).copy()
    wv[:, :k] = 0.0  # kv head 0
    attn.wv[...] = jnp.asarray(wv)
    x, pos = inputs(cfg)
    wo_full = np.asarray(attn.wo[...]).copy()
    dead = []
    for h in range(cfg.q_heads):
        wo = np.zeros_like(wo_full)
        wo[h * k:(h + 1) * k] = wo_full[h * k:(h + 1) * k]
        attn.wo[...] = jnp.asarray(wo)
        dead.append(bool(np.all(run_layer(attn, x, pos, None, (B, S)) == 0.0)))
    assert dead == [True, True, False, False]


def test_layer_with_positions_offset_and_blocked_queries_matches_reference():
    """Longer sequences go through the blocked causal path (block_q < S) with the same result;
    RoPE uses the given positions (here shifted per row)."""
    cfg = dataclasses.replace(BASE, gate=gate(position="sdpa"))
    b, s = 2, 16
    pos = (np.tile(np.arange(s), b) + np.repeat([0, 37], s)).astype(np.int32)
    assert_matches_reference(cfg, seed=3, b=b, s=s, positions=pos, ex=ExecConfig(attention_block_q=4), jit=True)


def test_rope_is_applied_with_the_given_positions():
    """Attention depends on positions: moving one token's position changes the output of the
    queries that see it (so a missing or position-blind RoPE would be caught)."""
    cfg = BASE
    attn = make_attention(cfg)
    x, pos = inputs(cfg)
    base = run_layer(attn, x, pos, None, (B, S))
    pos2 = pos.copy()
    pos2[2] += 5
    moved = run_layer(attn, x, pos2, None, (B, S))
    assert not np.allclose(base[2:S], moved[2:S], atol=1e-6)
    np.testing.assert_array_equal(base[:2], moved[:2])
    np.testing.assert_allclose(moved, np_attention(cfg, params_of(attn), x, pos2, None, (B, S)),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", ["G1_sdpa_elementwise_sigmoid", "G2_value_headwise",
                                  "G1_sdpa_head_shared"])
def test_sown_intermediates_match_reference(case):
    """Given a capture of them, the layer sows the attention probabilities, the SDPA output
    (before non-linearity and gate) and the gate scores ([N, heads, width]) the reference has."""
    cfg = dataclasses.replace(BASE, **LAYER_CASES[case])
    attn = make_attention(cfg, seed=7)
    b, s = PACKED.shape
    x, _ = inputs(cfg, b=b, s=s, seed=7)
    pos = packed_positions(PACKED)
    capture = Capture(attn_probs=True, sdpa_out=True, gate=True)
    got = run_layer(attn, x, pos, PACKED, (b, s), capture, jit=True)
    inter = nnx.pop(attn, nnx.Intermediate)
    trace = {}
    want = np_attention(cfg, params_of(attn), x, pos, PACKED, (b, s), trace=trace)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    probs = np.asarray(inter["attn_probs"][0])
    np.testing.assert_allclose(probs, trace["attn_probs"], rtol=RTOL, atol=ATOL)
    real = PACKED != 0
    np.testing.assert_allclose(probs.sum(-1).transpose(0, 2, 1)[real], 1.0, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(inter["sdpa_out"][0]), trace["sdpa_out"], rtol=RTOL, atol=ATOL)
    scores = np.asarray(inter["gate"]["gate_scores"][0])
    want_s = np_gate_scores(cfg.gate, cfg, params_of(attn), x.astype(np.float64))
    assert scores.shape == (b * s,) + want_s.shape[1:]
    np.testing.assert_allclose(scores, np.broadcast_to(want_s, scores.shape), rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- gate scores


@pytest.mark.parametrize("spec", [
    gate(position="sdpa", input_dependent=False),
    gate(position="value", granularity="headwise", input_dependent=False),
    gate(position="dense", input_dependent=False),
    gate(position="query", sharing="head_shared", input_dependent=False),
], ids=["G1_elementwise", "G2_headwise", "G5_dense", "G4_head_shared"])
def test_input_independent_gate_is_exactly_half_at_init(spec):
    """theta is zero-initialised, so sigmoid(theta) = 0.5 for every head and dim, independent
    of the input; the layer then equals the ungated layer with that tensor scaled by 0.5."""
    cfg = dataclasses.replace(BASE, gate=spec)
    attn = make_attention(cfg, random_theta=False)
    heads, width = np_gate_shape(spec, cfg)
    if spec.sharing == "head_shared":
        heads = 1
    assert np.all(np.asarray(attn.gate.theta[...]) == 0.0)
    x, pos = inputs(cfg)
    scores = np.asarray(attn.gate.scores(jnp.asarray(x)))
    assert scores.shape[1:] == (heads, width)
    assert scores.shape[0] in (1, x.shape[0])
    assert np.all(scores == 0.5)
    got = run_layer(attn, x, pos, None, (B, S))
    want = np_attention(cfg, params_of(attn), x, pos, None, (B, S))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    if spec.position in ("sdpa", "dense"):  # linear in the gated tensor: exactly half the baseline
        ungated = np_attention(dataclasses.replace(cfg, gate=None), params_of(attn), x, pos, None, (B, S))
        np.testing.assert_allclose(got, 0.5 * ungated, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("spec", [
    gate(position="sdpa"), gate(position="value", granularity="headwise"),
    gate(position="dense"), gate(position="sdpa", sharing="head_shared"),
    gate(position="key", activation="silu", form="additive"),
], ids=["G1", "G2_headwise", "G5", "G1_head_shared", "G3_additive_silu"])
def test_gate_scores_match_reference(spec):
    """Gate.scores(x) is act(x W_theta) as [N, heads, width], head-averaged when shared."""
    cfg = dataclasses.replace(BASE, gate=spec)
    attn = make_attention(cfg)
    x, _ = inputs(cfg)
    got = np.asarray(attn.gate.scores(jnp.asarray(x)))
    want = np_gate_scores(spec, cfg, params_of(attn), x.astype(np.float64))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_head_shared_scores_are_identical_across_heads():
    """A head-shared gate applies the same score to every head: the G1 gated output equals
    the per-head SDPA output times one [N, 1, K] score."""
    cfg = dataclasses.replace(BASE, gate=gate(position="sdpa", sharing="head_shared"))
    attn = make_attention(cfg)
    x, _ = inputs(cfg)
    s = np.asarray(attn.gate.scores(jnp.asarray(x)))
    assert s.shape == (x.shape[0], 1, cfg.head_dim)
    y = np.random.default_rng(0).normal(size=(x.shape[0], cfg.q_heads, cfg.head_dim)).astype(np.float32)
    out = np.asarray(attn.gate(jnp.asarray(y), jnp.asarray(x)))
    ratio = out / y
    np.testing.assert_allclose(ratio, np.broadcast_to(ratio[:, :1], ratio.shape), rtol=1e-5)


def test_ns_sigmoid_scores_lie_in_half_to_one():
    """NS-sigmoid = 0.5 + 0.5 * sigmoid is bounded in [0.5, 1] even for extreme inputs, and
    matches its formula."""
    cfg = dataclasses.replace(BASE, gate=gate(position="sdpa", activation="ns_sigmoid"))
    attn = make_attention(cfg)
    x, _ = inputs(cfg)
    for scale in (1.0, 100.0):
        s = np.asarray(attn.gate.scores(jnp.asarray(x * scale)))
        assert s.min() >= 0.5 and s.max() <= 1.0
        assert s.max() - s.min() > 0.1  # non-trivial spread
    s = np.asarray(attn.gate.scores(jnp.asarray(x)))
    logits = x.astype(np.float64) @ params_of(attn)["gate_w"]
    want = (0.5 + 0.5 * np_sigmoid(logits)).reshape(s.shape)
    np.testing.assert_allclose(s, want, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- masking


@pytest.mark.parametrize("case", ["baseline", "G1_sdpa_elementwise_sigmoid", "G2_value_elementwise_sigmoid",
                                  "G3_key_elementwise_sigmoid", "G5_dense_elementwise_sigmoid",
                                  "G1_sdpa_head_shared", "switch_heads_kv_4top4"])
def test_causal_output_ignores_future_tokens(case):
    """Changing tokens after position t leaves the outputs at positions <= t unchanged (the
    gate reads only the current token), and does change some later output."""
    cfg = dataclasses.replace(BASE, **LAYER_CASES[case])
    attn = make_attention(cfg)
    s = 12
    x, pos = inputs(cfg, b=B, s=s)
    t = 5
    x2 = x.reshape(B, s, -1).copy()
    x2[:, t + 1:] = np.random.default_rng(9).normal(size=x2[:, t + 1:].shape)
    x2 = x2.reshape(B * s, -1)
    out1 = run_layer(attn, x, pos, None, (B, s)).reshape(B, s, -1)
    out2 = run_layer(attn, x2, pos, None, (B, s)).reshape(B, s, -1)
    np.testing.assert_allclose(out1[:, : t + 1], out2[:, : t + 1], rtol=1e-6, atol=1e-7)
    assert not np.allclose(out1[:, t + 1:], out2[:, t + 1:], atol=1e-4)


PACKED = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0, 0],
                   [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]], np.int32)


def packed_positions(seg):
    """Positions restart at 0 at each document start."""
    pos = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        for i in range(1, seg.shape[1]):
            pos[b, i] = pos[b, i - 1] + 1 if seg[b, i] == seg[b, i - 1] else 0
    return pos.reshape(-1)


@pytest.mark.parametrize("case", ["baseline", "G1_sdpa_elementwise_sigmoid", "G2_value_headwise",
                                  "G5_dense_elementwise_sigmoid", "sdpa_rmsnorm", "qk_norm"])
def test_segment_ids_padding_rows_are_zero_and_finite(case):
    """With packed documents and padding (id 0): no NaN, the padding rows are exactly zero for
    multiplicative variants, real rows are not, and everything matches the reference with
    segment masking (same-id keys only)."""
    cfg = dataclasses.replace(BASE, **LAYER_CASES[case])
    b, s = PACKED.shape
    pos = packed_positions(PACKED)
    _, _, _, got = assert_matches_reference(cfg, seed=4, b=b, s=s, segment_ids=PACKED, positions=pos)
    pad = PACKED.reshape(-1) == 0
    assert np.all(got[pad] == 0.0)
    assert np.all(np.any(got[~pad] != 0.0, axis=-1))


def test_layer_gradients_are_finite_with_padding():
    """Gradients through the masked softmax stay finite with padding rows (finite mask value)."""
    cfg = dataclasses.replace(BASE, qk_norm=True, gate=gate(position="sdpa"))
    attn = make_attention(cfg)
    b, s = PACKED.shape
    x, _ = inputs(cfg, b=b, s=s)
    pos, seg = jnp.asarray(packed_positions(PACKED)), jnp.asarray(PACKED)

    def loss(xx):
        return jnp.sum(attn(xx, pos, seg, (b, s)) ** 2)

    grad = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(x)))
    assert np.all(np.isfinite(grad))
    assert np.any(grad != 0.0)


@pytest.mark.parametrize("case", ["baseline", "G1_sdpa_elementwise_sigmoid", "G3_key_headwise",
                                  "switch_heads_v_4top2"])
def test_packed_row_equals_documents_run_separately(case):
    """A row packing two documents gives, per document, the output of running that document
    alone (positions restarting at 0, no segment ids)."""
    cfg = dataclasses.replace(BASE, **LAYER_CASES[case])
    attn = make_attention(cfg, seed=5)
    b, s = PACKED.shape
    x, _ = inputs(cfg, b=b, s=s, seed=5)
    pos = packed_positions(PACKED)
    packed = run_layer(attn, x, pos, PACKED, (b, s), jit=True)
    for lo, hi in [(0, 4), (4, 9), (s, 2 * s)]:  # doc 1, doc 2 of row 0; the whole of row 1
        alone = run_layer(attn, x[lo:hi], np.arange(hi - lo, dtype=np.int32), None, (1, hi - lo), jit=True)
        np.testing.assert_allclose(packed[lo:hi], alone, rtol=RTOL, atol=ATOL)


# A row holding a context (segment 1) once and three choices that share it (segments 2-4, prefix
# id 1), then a document alone (segment 5) and padding: each choice sees the context and itself.
SHARED_SEG = np.array([[1, 1, 1, 1, 1, 2, 2, 3, 4, 4, 4, 5, 5, 5, 0, 0]], np.int32)
SHARED_PRE = np.array([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]], np.int32)


@pytest.mark.parametrize("options", [{}, {"block_q": 4}, {"query_chunk": 5}])
def test_prefix_ids_let_choices_share_a_context(options):
    """With prefix ids each choice's queries see the shared context and their own earlier keys,
    never another choice's: the same output as the explicit mask, and as the context and that
    choice laid out alone (keys in the same order); padding rows stay zero."""
    q, k, v = kernel_inputs(b=1, s=16, seed=7)  # (numpy; each call below is one jitted program)
    seg, pre = jnp.asarray(SHARED_SEG), jnp.asarray(SHARED_PRE)
    got = np.asarray(_kernel(q, k, v, segment_ids=seg, prefix_ids=pre, **options))
    i = np.arange(16)
    visible = ((SHARED_SEG[0][None, :] == SHARED_SEG[0][:, None]) | (SHARED_PRE[0][:, None] == SHARED_SEG[0][None, :])
               & (SHARED_SEG[0][None, :] != 0)) & (i[None, :] <= i[:, None])
    want = np.asarray(_masked(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), jnp.asarray(visible[None])))
    np.testing.assert_allclose(got[0, :14], want[0, :14], rtol=1e-6, atol=1e-6)
    assert np.all(got[0, 14:] == 0)
    for choice in ([5, 6], [7], [8, 9, 10]):
        idx = [0, 1, 2, 3, 4] + choice
        alone = np.asarray(_kernel(q[:, idx], k[:, idx], v[:, idx]))
        np.testing.assert_allclose(got[0, choice], alone[0, 5:], rtol=1e-6, atol=1e-6)
    without = np.asarray(_kernel(q, k, v, segment_ids=seg, **options))  # no prefix: a choice sees itself only
    assert not np.allclose(without[0, 5:11], got[0, 5:11], atol=1e-3)
    np.testing.assert_allclose(without[0, :5], got[0, :5], rtol=1e-6, atol=1e-6)


def test_two_levels_of_prefix_ids_share_few_shot_examples_and_questions():
    """Few-shot examples (segment 1) shared by two questions (segments 2 and 5, prefix ids [1]),
    each shared by its choices (prefix ids [question, 1]): every choice's output is that of its
    examples, question and choice laid out alone."""
    seg = np.array([[1, 1, 1, 1, 2, 2, 3, 3, 4, 5, 5, 5, 6, 7, 7, 0]], np.int32)
    pre = np.array([[[0, 0]] * 4 + [[1, 0]] * 2 + [[2, 1]] * 3 + [[1, 0]] * 3 + [[5, 1]] * 3 + [[0, 0]]], np.int32)
    q, k, v = kernel_inputs(b=1, s=16, seed=8)
    got = np.asarray(_kernel(q, k, v, segment_ids=jnp.asarray(seg), prefix_ids=jnp.asarray(pre), block_q=4))
    for alone_idx, mine in [([0, 1, 2, 3, 4, 5, 6, 7], [6, 7]), ([0, 1, 2, 3, 4, 5, 8], [8]),
                            ([0, 1, 2, 3, 9, 10, 11, 12], [12]), ([0, 1, 2, 3, 9, 10, 11, 13, 14], [13, 14]),
                            ([0, 1, 2, 3, 9, 10, 11], [9, 10, 11])]:
        alone = np.asarray(_kernel(q[:, alone_idx], k[:, alone_idx], v[:, alone_idx]))
        np.testing.assert_allclose(got[0, mine], alone[0, -len(mine):], rtol=1e-6, atol=1e-6)
    assert np.all(got[0, 15] == 0)


def test_prefix_ids_need_segment_ids():
    q, k, v = (jnp.asarray(a[:1]) for a in kernel_inputs(b=1, s=16))
    with pytest.raises(ValueError, match="prefix_ids.*segment_ids"):
        attention_xla(q, k, v, prefix_ids=jnp.asarray(SHARED_PRE))


# --------------------------------------------------------------------------- the kernel


def kernel_inputs(b=2, s=16, hq=4, hk=2, k=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, s, hq, k)).astype(np.float32)
    kk = rng.normal(size=(b, s, hk, k)).astype(np.float32)
    v = rng.normal(size=(b, s, hk, k)).astype(np.float32)
    return q, kk, v


KERNEL_SEGMENTS = {
    "no_segments": None,
    "packed_with_padding": np.array([[1] * 5 + [2] * 7 + [0] * 4,
                                     [4] * 3 + [5] * 13], np.int32),
}


# One jitted program per call's shapes and options (eager, each jnp op would compile its own).
_kernel = jax.jit(attention_xla, static_argnames=("causal", "block_q", "query_chunk", "return_probs"))
_masked = jax.jit(attention_masked)


@pytest.mark.parametrize("hk,block_q", [(4, 4), (2, 2), (1, 8)],
                         ids=["mha_block4", "gqa2_block2", "mqa_block8"])
@pytest.mark.parametrize("seg_name", list(KERNEL_SEGMENTS))
def test_kernel_blocked_causal_equals_unblocked_and_reference(hk, block_q, seg_name):
    """attention_xla with causal query blocks (block_q < S, S a multiple of block_q), and with the
    sequential query chunks of long contexts (a last chunk padded), gives the unblocked result
    and the numpy reference, outputs and probabilities; probabilities sum to 1 over keys for real
    queries, are zero on padding queries, above the diagonal and across segments."""
    seg = KERNEL_SEGMENTS[seg_name]
    q, k, v = kernel_inputs(hk=hk, seed=block_q + hk)
    segj = None if seg is None else jnp.asarray(seg)
    o_blk, p_blk = _kernel(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True,
                           segment_ids=segj, block_q=block_q, return_probs=True)
    o_full, p_full = _kernel(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True,
                             segment_ids=segj, block_q=0, return_probs=True)
    o_chk, p_chk = _kernel(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True,
                           segment_ids=segj, query_chunk=block_q + 1, return_probs=True)  # 16 % chunk != 0
    o_ref, p_ref = np_sdpa(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), seg)
    o_blk, p_blk, o_full, p_full = map(np.asarray, (o_blk, p_blk, o_full, p_full))
    np.testing.assert_allclose(o_chk, o_full, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p_chk, p_full, rtol=1e-5, atol=1e-7)
    b, s, hq, _ = q.shape
    assert o_blk.shape == q.shape and p_blk.shape == (b, hq, s, s)
    np.testing.assert_allclose(o_blk, o_full, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p_blk, p_full, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(o_blk, o_ref, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(p_blk, p_ref, rtol=RTOL, atol=ATOL)

    assert np.all(np.triu(np.ones((s, s), bool), 1)[None, None] <= (p_blk == 0.0))
    valid = np.ones((b, s), bool) if seg is None else seg != 0
    sums = p_blk.sum(-1)  # [B, Hq, S]
    np.testing.assert_allclose(sums.transpose(0, 2, 1)[valid], 1.0, rtol=1e-5)
    if seg is not None:
        np.testing.assert_array_equal(sums.transpose(0, 2, 1)[~valid], 0.0)
        np.testing.assert_array_equal(o_blk[~valid], 0.0)
        cross = seg[:, :, None] != seg[:, None, :]  # [B, S, T]
        assert np.all(p_blk[np.broadcast_to(cross[:, None], p_blk.shape)] == 0.0)
    assert np.all(np.isfinite(o_blk)) and np.all(np.isfinite(p_blk))


def test_query_chunks_give_the_gradients_of_one_pass():
    """The sequential query loop (query_chunk) differentiates to the one-pass gradients, with a
    gate and packed segments: long-context continued training may use it."""
    q, k, v = kernel_inputs(hk=2, seed=5)
    gate = jnp.asarray(np.random.default_rng(6).normal(size=q.shape).astype(np.float32))
    seg = jnp.asarray(KERNEL_SEGMENTS["packed_with_padding"])

    def loss(chunk):
        return jax.jit(jax.grad(lambda qq, kk, vv, gg: jnp.sum(jnp.sin(attention_xla(
            qq, kk, vv, gg, segment_ids=seg, block_q=0, query_chunk=chunk))), argnums=(0, 1, 2, 3)))

    for a, b in zip(loss(4)(q, k, v, gate), loss(0)(q, k, v, gate)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_kernel_fully_padded_row_is_zero_and_finite():
    """A row that is entirely padding gives zero output and zero probabilities, and finite
    gradients (the mask is finite, so no inf - inf)."""
    q, k, v = kernel_inputs(b=2, s=8, seed=11)
    seg = jnp.asarray(np.array([[0] * 8, [1] * 6 + [0] * 2], np.int32))
    o, p = _kernel(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), segment_ids=seg,
                   block_q=4, return_probs=True)
    assert np.all(np.asarray(o)[0] == 0.0) and np.all(np.asarray(p)[0] == 0.0)
    grads = jax.jit(jax.grad(
        lambda qq, kk, vv: jnp.sum(attention_xla(qq, kk, vv, segment_ids=seg, block_q=4) ** 2),
        argnums=(0, 1, 2)))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
