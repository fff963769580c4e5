"""The MoE FFN: dropless equals a per-token loop, the auxiliary losses equal their formulas, the
global-batch LBL is global on a mesh, capacity dropping is counted, and the model trains with it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gattn import variants
from gattn.config import Config, ConfigError, ExecConfig, MoESpec, TrainConfig
from gattn.model import params
from gattn.model.moe import MoE
from gattn.model.moe_ops import load_balancing_loss, route, router_z_loss
from gattn.model.transformer import Transformer
from gattn.train.loss import aux_loss, lm_loss, lm_loss_and_aux

import multidevice
from conftest import tiny_model

SPEC = MoESpec(num_experts=8, top_k=3, expert_width=16)
CFG = tiny_model(moe=SPEC)


def naive_moe(moe: MoE, x, keep=None):
    """Per token, per selected expert: weight * SwiGLU_e(x). `keep[n, j]` False drops one."""
    w, e, _ = route(x @ moe.router[...], moe.spec)
    w1, w3, w2 = (np.asarray(p[...]) for p in (moe.w1, moe.w3, moe.w2))
    out = np.zeros(x.shape, np.float64)
    for n in range(x.shape[0]):
        for j in range(moe.spec.top_k):
            if keep is not None and not keep[n, j]:
                continue
            ex, xn = int(e[n, j]), np.asarray(x[n], np.float64)
            h = jax.nn.silu(xn @ w1[ex]) * (xn @ w3[ex])
            out[n] += float(w[n, j]) * np.asarray(h @ w2[ex])
    return out, np.asarray(e)


@pytest.mark.parametrize("renormalize", [True, False])
def test_dropless_moe_equals_per_token_loop(renormalize):
    moe = MoE(dataclasses.replace(CFG, moe=dataclasses.replace(SPEC, renormalize=renormalize)),
              rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (40, 32))
    out, aux = moe(x)
    ref, experts = naive_moe(moe, x)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_array_equal(aux["load"], np.bincount(experts.reshape(-1), minlength=8))
    assert int(aux["dropped"]) == 0


def test_renormalized_top_k_weights_sum_to_one():
    w, e, p = route(jax.random.normal(jax.random.key(2), (10, 8)), SPEC)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    assert e.shape == (10, 3) and np.allclose(p.sum(-1), 1.0)


def test_router_computes_in_float32_under_bfloat16():
    """exec.dtype bfloat16 (experts in bf16): the router's logits still come from float32 inputs
    and weights, so the routing is the float32 one: the same experts for every token and the
    z-loss of the float32 logits (a bf16 router rounds the weights by ~2**-9: z-loss off by ~1e-3)."""
    moe = MoE(CFG, ExecConfig(dtype="bfloat16"), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (512, 32)).astype(jnp.bfloat16)  # the residual stream
    _, aux = moe(x)
    logits = np.asarray(x, np.float64) @ np.asarray(moe.router[...], np.float64)
    experts = np.argsort(-logits, axis=1)[:, :SPEC.top_k]
    np.testing.assert_array_equal(aux["load"], np.bincount(experts.reshape(-1), minlength=8))
    lse = np.log(np.sum(np.exp(logits - logits.max(1, keepdims=True)), 1)) + logits.max(1)
    assert float(aux["z_loss"]) == pytest.approx(np.mean(lse ** 2), rel=1e-5)


def test_load_balancing_loss_equals_the_formula_on_hand_made_routing():
    # 4 tokens, 2 experts, top-1: tokens 0-2 pick expert 0, token 3 picks expert 1.
    probs = jnp.asarray([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    experts = jnp.asarray([[0], [0], [0], [1]])
    f, p = np.array([3 / 4, 1 / 4]), probs.mean(0)
    assert np.isclose(load_balancing_loss(probs, experts), 2 * np.sum(f * p))
    # Per micro-batch of 2 tokens: (0.9,0.1),(0.8,0.2) -> f=(1,0); (0.6,0.4),(0.3,0.7) -> f=(.5,.5).
    micro = np.mean([2 * (1 * 0.85 + 0 * 0.15), 2 * (0.5 * 0.45 + 0.5 * 0.55)])
    assert np.isclose(load_balancing_loss(probs, experts, groups=2), micro)
    # Perfect balance with uniform probabilities gives 1.
    uniform = jnp.full((4, 2), 0.5)
    assert np.isclose(load_balancing_loss(uniform, jnp.asarray([[0], [1], [0], [1]])), 1.0)


def test_router_z_loss_is_mean_squared_logsumexp():
    logits = jnp.asarray([[0.0, 0.0], [1.0, 2.0]])
    expected = np.mean([np.log(2.0) ** 2, np.log(np.e + np.e ** 2) ** 2])
    assert np.isclose(router_z_loss(logits), expected)


def test_capacity_factor_drops_the_latest_tokens_and_counts_them():
    spec = dataclasses.replace(SPEC, capacity_factor=0.5)  # capacity ceil(0.5 * 40 * 3 / 8) = 8
    moe = MoE(dataclasses.replace(CFG, moe=spec), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (40, 32))
    out, aux = moe(x)
    _, experts = naive_moe(moe, x)
    keep, seen = np.zeros(experts.shape, bool), np.zeros(8, int)
    for n in range(40):  # the first 8 assignments of each expert, in token order, are kept
        for j in range(3):
            keep[n, j] = seen[experts[n, j]] < 8
            seen[experts[n, j]] += 1
    assert int(aux["dropped"]) == (~keep).sum() == np.maximum(seen - 8, 0).sum() > 0
    ref, _ = naive_moe(moe, x, keep)
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_the_explicit_all_to_all_needs_a_mesh_with_an_expert_axis():
    """exec.moe_impl='all_to_all' is chosen by the config, not by the mesh: without a context mesh
    that splits the experts it refuses to run (tests/multidevice/expert_parallel_step.py runs it)."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(SPEC, capacity_factor=2.0))
    moe = MoE(cfg, ExecConfig(moe_impl="all_to_all"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="moe_impl='all_to_all'.*expert axis"):
        moe(jax.random.normal(jax.random.key(3), (8, 32)))


def test_model_reports_aux_per_layer_and_keeps_it_out_of_the_lm_loss():
    model = Transformer(dataclasses.replace(CFG, moe=dataclasses.replace(SPEC, z_loss_coef=1e-3)),
                        rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 61)
    ce, aux = lm_loss_and_aux(model, tokens)
    assert set(aux) == {"lbl", "z_loss", "load", "dropped"}
    assert aux["lbl"].shape == (2,) and aux["load"].shape == (2, 8)
    assert np.all(aux["load"].sum(-1) == 11 * 2 * 3)  # every (token, k) assignment counted
    assert float(ce) == float(lm_loss(model, tokens))
    expected = 1e-3 * np.mean(aux["lbl"]) + 1e-3 * np.mean(aux["z_loss"])
    assert np.isclose(aux_loss(model.cfg.moe, aux), expected)
    assert float(aux_loss(None, {})) == 0.0


def test_scanned_moe_model_equals_the_loop():
    loop = Transformer(CFG, rngs=nnx.Rngs(0))
    scan = Transformer(CFG, ExecConfig(scan_layers=True), rngs=nnx.Rngs(1))
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b, nnx.Param) for b in loop.blocks])
    nnx.update(scan.blocks, stacked)
    nnx.update(scan, nnx.state(loop, nnx.Param).filter(lambda path, _: path[0] != "blocks"))
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 61)
    (l1, a1), (l2, a2) = lm_loss_and_aux(loop, tokens), lm_loss_and_aux(scan, tokens)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    np.testing.assert_allclose(a1["lbl"], a2["lbl"], rtol=1e-5)


def test_more_experts_variant_adds_four_experts_total_and_active():
    cfg = variants.apply("more_experts", CFG)
    assert (cfg.moe.num_experts, cfg.moe.top_k) == (12, 7)
    assert params.count_params(cfg) - params.count_params(CFG) == 2 * 4 * 3 * 32 * 16 + 2 * 32 * 4
    with pytest.raises(ConfigError, match="moe"):
        variants.apply("more_experts", dataclasses.replace(CFG, moe=None))


def test_bad_moe_config_names_the_field():
    with pytest.raises(ConfigError, match="'top_k' = 9"):
        MoESpec(num_experts=8, top_k=9)
    with pytest.raises(ConfigError, match="'lbl_scope' = 'local'"):
        MoESpec(lbl_scope="local")
    with pytest.raises(ConfigError, match="'capacity_factor' = -1"):
        MoESpec(capacity_factor=-1.0)


def test_global_batch_lbl_on_a_data_mesh_equals_single_device_and_not_micro():
    """On a (data=4) mesh the global-batch LBL of a data-sharded batch equals the single-device
    value on the whole batch; on a skewed batch it differs from the mean of per-shard LBLs
    (tests/multidevice/global_lbl.py, on 8 simulated devices)."""
    assert multidevice.run("global_lbl", "--shards", 4).splitlines()[-1] == "ok"


def test_micro_lbl_groups_whole_rows_and_is_nan_when_the_rows_do_not_split():
    """lbl_scope="micro": micro_batches groups of whole rows (what config checks for the trainer's
    batch, train.batch_size); a batch of other rows (validation, analysis: aux unused) gets NaN,
    never a silent split of a row or a crash."""
    spec = dataclasses.replace(SPEC, lbl_scope="micro", micro_batches=2)
    moe = nnx.jit(lambda: MoE(tiny_model(moe=spec), rngs=nnx.Rngs(0)))()  # jitted: eager ops are slow

    @nnx.jit
    def run(moe, x_NxD):  # 4 rows of 3 tokens; their first 3 rows
        _, experts, probs = route(x_NxD @ moe.router[...], spec)
        halves = [load_balancing_loss(probs[i:i + 6], experts[i:i + 6]) for i in (0, 6)]  # rows 0-1, 2-3
        return moe(x_NxD, 4)[1]["lbl"], jnp.mean(jnp.stack(halves)), load_balancing_loss(probs, experts), \
            moe(x_NxD[:9], 3)[1]["lbl"], moe(x_NxD[:9], 3, decoding=True)

    lbl, want, whole, lbl_3_rows, (out, aux) = run(moe, jax.random.normal(jax.random.key(3), (4 * 3, 32)))
    np.testing.assert_allclose(lbl, want, rtol=1e-6)
    assert abs(float(want) - float(whole)) > 1e-3  # the groups matter here
    assert np.isnan(lbl_3_rows)  # 3 rows: no two equal groups of whole rows
    assert aux == {} and out.shape == (9, 32)  # cached decoding: no aux at all
    with pytest.raises(ConfigError, match="'train.batch_size' = 6.*micro_batches \\(4\\)"):
        Config(model=tiny_model(moe=dataclasses.replace(spec, micro_batches=4)), train=TrainConfig(batch_size=6))


def test_unpermute_is_the_inverse_gather_with_no_operand_sized_integer_arrays_in_its_gradient():
    """(The rows went back by a scatter-set, which JAX differentiates by scattering the update ids
    over the whole [M, D] operand and gathering them back: four u32 [M, D] arrays a layer, ~1.9 of
    moe_15a2b's 17.2 TB of HBM traffic a step on v5p-64.) The same values and gradients as the
    per-token sum, and the gradient's program holds no integer array of the rows' shape."""
    from gattn.model.moe_ops import permute, unpermute

    n, p, d, e = 16, 2, 8, 4
    x = jax.random.normal(jax.random.key(0), (n, d))
    experts = jax.random.randint(jax.random.key(1), (n, p), 0, e)
    w = jax.random.uniform(jax.random.key(2), (n, p))
    rows, order, _ = permute(x, experts, e)

    def loss(rows, w):
        return jnp.sum(unpermute(rows * jnp.arange(1.0, 1.0 + rows.shape[0])[:, None], order, w) ** 2)

    def reference(rows, w):  # row r of the sorted rows is assignment order[r]: token order[r] // p
        scaled = rows * jnp.arange(1.0, 1.0 + rows.shape[0])[:, None]
        per = jnp.zeros((n * p, d)).at[order].add(scaled).reshape(n, p, d)
        return jnp.sum(jnp.einsum("npd,np->nd", per, w) ** 2)

    got, want = jax.value_and_grad(loss, (0, 1))(rows, w), jax.value_and_grad(reference, (0, 1))(rows, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1)))(rows, w)
    assert not [str(v.aval) for eq in jaxpr.eqns for v in eq.outvars
                if jnp.issubdtype(v.aval.dtype, jnp.integer) and v.aval.shape == rows.shape]
