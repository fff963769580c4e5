"""Parameter counting: the paper's Table 1 column, analytic counts, and FFN-width matching."""

import dataclasses
import json
import logging
import os
import math
import subprocess
from pathlib import Path
import sys

import jax
import pytest
from flax import nnx

from gattn import variants
from gattn.model import params
from gattn.config import ExecConfig, ModelConfig, MoESpec
from gattn.experiments import tables
from gattn.model.transformer import Transformer

ROOT = Path(__file__).resolve().parents[1]

SMALL = ModelConfig(vocab_size=64, d_model=48, num_layers=2, q_heads=4, kv_heads=2, head_dim=8, d_ff=96)
AVAILABLE = variants.applicable(SMALL)


def _attention_only(name):
    cfg = variants.apply(name, SMALL)
    return not (cfg.match_ffn_params or cfg.sandwich_norm or cfg.kv_heads != SMALL.kv_heads
                or cfg.q_heads != SMALL.q_heads)


ATTENTION_ONLY = [n for n in AVAILABLE if _attention_only(n)]


def test_table1_added_params_reproduce_the_paper_column():
    """Table 1's 'Added Param' at ordinary rounding: every row matches but row 4, computed from the
    moe_15a2b preset's own expert width, and row 9, which the paper printed truncated; both are
    marked with the reason."""
    rows = tables.added_params_table(tables.TABLE1)
    assert [r["row"] for r in rows] == list(range(1, 16))
    mismatched = {r["row"]: (r["rounded"], r["paper"]) for r in rows if not r["match"]}
    assert mismatched == {4: ("415", "400"), 9: ("101", "100")}
    assert all(r["note"] for r in rows if not r["match"]) and not any(r["note"] for r in rows if r["match"])
    by_row = {r["row"]: r["added_params"] for r in rows}
    assert by_row[5] == 24 * 2048 * 32 * 128  # 24 x 2048 x 32 x 128 = 201M
    assert by_row[11] == 24 * 2048 * 4        # one scalar per kv head (Table 1 row 11)
    width = tables.PAPER_MOE_DIMS.moe.expert_width
    assert width == 704                       # the preset's, not a width fitted to row 4
    assert by_row[4] == 24 * 4 * (3 * 2048 * width + 2048)  # 4 experts and their router columns


def test_ordinary_rounding():
    assert [tables.rounded(m) for m in (0, 0.197, 0.25, 1.573, 25.17, 100.5, 100.66, 201.33)] == \
        ["0", "0.2", "0.3", "1.6", "25", "101", "101", "201"]


def test_table6_no_expert_width_reproduces_the_papers_column():
    """The derivation: the formula is gattn's built count at full width, and no one expert width
    (replacing W_V/W_K, or beside them) gives every row of the paper's Table 6 column."""
    base = tables.PAPER_MOE_DIMS
    for name, _ in tables.TABLE6.values():
        built = params.count_params(variants.apply(name, base)) - params.count_params(base)
        assert tables.switch_added(name, base.head_dim) == built
    for replace in (True, False):
        fit = tables.switch_width_fit(replace)
        assert fit["common"] == [] and all(fit["rows"][r] for r in (3, 4, 5))
    assert tables.switch_width_fit(True)["rows"][5] == [31]  # 24 x 2048 x (32 x 31 - 480) = 25.2M


def test_eval_shape_count_equals_materialised_count():
    cfg = variants.apply("sdpa_elementwise", SMALL)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    real = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert params.count_params(cfg) == real


@pytest.mark.parametrize("name", ["sdpa_elementwise", "sandwich_norm", "switch_kv_4top4"])
@pytest.mark.parametrize("scan", [False, True])
def test_count_from_one_and_two_layers_equals_building_every_layer(name, scan):
    cfg = dataclasses.replace(variants.apply(name, SMALL), num_layers=5)
    assert params.count_params(cfg) == params._count_built(cfg)
    built = nnx.eval_shape(lambda: Transformer(cfg, ExecConfig(scan_layers=scan), rngs=nnx.Rngs(0)))
    assert params.count_params(cfg) == sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(built, nnx.Param)))
    moe = dataclasses.replace(cfg, moe=MoESpec(num_experts=4, top_k=2, expert_width=16))
    assert params.count_params(moe) == params._count_built(moe)


def test_variant_lists_cover_the_paper_rows():
    assert len(ATTENTION_ONLY) >= 20
    rows = {r for v in variants.REGISTRY.values() for r in v.rows}
    for t1 in range(1, 16):
        assert any(r.startswith("Table 1 (") and f"({t1})" in r for r in rows), t1
    for expected in ("Table 3 (5)", "Table 3 (6)", "Table 3 (7)", "Table 4 (6)", "Table 4 (7)",
                     "Table 2 (7)", "Table 2 (9)", "Table 6 (6)", "Appendix A.5"):
        assert expected in rows


@pytest.mark.parametrize("name", ATTENTION_ONLY)
def test_analytic_added_params_match_the_built_model(name):
    """The config's analytic count (used for FFN matching) agrees with what the model builds."""
    cfg = variants.apply(name, SMALL)
    assert params.count_params(cfg) - params.count_params(SMALL) == \
        cfg.attention_added_params * SMALL.num_layers


def test_ffn_matching_gives_equal_counts_when_divisible():
    # G1 elementwise adds d_model * q * d_k per layer: with q * d_k = 48 that is exactly 16 FFN
    # columns of 3 * d_model parameters each.
    base = dataclasses.replace(SMALL, q_heads=6, kv_heads=3, head_dim=8)
    for name in ("sdpa_elementwise_ffn_matched",):
        cfg = variants.apply(name, base)
        assert cfg.ffn_width < base.d_ff
        assert params.count_params(cfg) == params.count_params(base)


@pytest.mark.parametrize("name", ["sdpa_elementwise_ffn_matched", "sdpa_headwise_ffn_matched"])
def test_ffn_matching_is_within_half_an_ffn_column_per_layer(name):
    base = ModelConfig(vocab_size=64, d_model=64, num_layers=3, q_heads=4, kv_heads=2, head_dim=16, d_ff=200)
    cfg = variants.apply(name, base)
    diff = params.count_params(cfg) - params.count_params(base)
    assert abs(diff) <= 1.5 * base.d_model * base.num_layers
    unmatched = dataclasses.replace(cfg, match_ffn_params=False)
    assert params.count_params(unmatched) - params.count_params(base) > abs(diff)


def test_params_cli_table1_json():
    out = subprocess.run([sys.executable, "-m", "gattn.params", "--table1", "--json"],
                         capture_output=True, text=True, check=True, timeout=300)
    result = json.loads(out.stdout)["table1"]
    assert result["dims"] == {"num_layers": 24, "d_model": 2048, "q_heads": 32, "kv_heads": 4,
                              "head_dim": 128}
    assert {r["row"]: r["rounded"] for r in result["rows"]} == \
        {1: "0", 2: "50", 3: "201", 4: "415", 5: "201", 6: "25", 7: "25", 8: "201", 9: "101",
         10: "1.6", 11: "0.2", 12: "201", 13: "25", 14: "201", 15: "201"}


def test_paper_scale_count_allocates_nothing():
    """Counting the 24-layer paper model must not materialise its ~1.2B weights."""
    n = params.count_params(tables.PAPER_MOE_DIMS)
    assert n > 1e9 and math.isfinite(n)


@pytest.mark.parametrize("name", ["baseline", "sdpa_elementwise", "sdpa_headwise"])
def test_attention_biases_add_one_per_projection_output(name):
    """attention_bias: biases on W_Q, W_K, W_V, W_O and the gate's W_theta; only the gate's count
    as the variant's added parameters (the baseline has the others too)."""
    cfg = variants.apply(name, SMALL)
    biased = dataclasses.replace(cfg, attention_bias=True)
    heads, width = cfg.gate.shape(cfg) if cfg.gate else (0, 0)
    per_layer = (cfg.q_heads + 2 * cfg.kv_heads) * cfg.head_dim + cfg.d_model + heads * width
    assert params.count_params(biased) - params.count_params(cfg) == per_layer * cfg.num_layers
    assert biased.attention_added_params - cfg.attention_added_params == heads * width


def test_presets_work_after_a_plain_install_from_any_directory(tmp_path):
    """`pip install .` (not editable) ships the presets inside the package: `--preset` then works
    from a directory without the repository's configs/."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True, timeout=300)
    assert (target / "gattn" / "configs" / "moe_15a2b.py").is_file()
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import gattn; print(gattn.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(target))  # the installed copy, not the repository
    out = subprocess.run([sys.executable, "-m", "gattn.params", "--preset", "moe_15a2b", "--json"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["config"]["params"] > 10e9


def test_an_eagerly_built_model_has_the_values_of_a_jitted_one_from_few_sampler_programs(caplog):
    """Built outside jit, each new weight shape compiled its own truncated-normal sampler (~0.5 s
    each on 2 cores: 22 of test_model.py's compiles, 21 s); gattn.model.layers draws a power-of-two
    count and cuts it. The values are jax.random.truncated_normal's for the shape, bit for bit (as
    the jitted init draws them), and 6 new weight shapes of 2 size classes compile 2 samplers."""
    from gattn.model import layers

    cfg = ModelConfig(vocab_size=61, d_model=40, num_layers=2, q_heads=4, kv_heads=2, head_dim=8, d_ff=72)
    eager = nnx.state(Transformer(cfg, rngs=nnx.Rngs(3)), nnx.Param)
    jitted = jax.jit(lambda: nnx.state(Transformer(cfg, rngs=nnx.Rngs(3)), nnx.Param))()
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        assert a.shape == b.shape and bool((a == b).all())

    shapes = [(37, 29), (29, 37), (33, 33), (41, 47), (70, 30), (45, 45)]  # 1,073-2,100 elements
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        got = [layers.param("weight", nnx.Rngs(5), shape, ("embed", "mlp"), std=0.02)[...] for shape in shapes]
    samplers = [r for r in caplog.records if "compilation of jit(_truncated_normal)" in r.getMessage()]
    assert len(samplers) <= 2, len(samplers)  # the 2,048 and 4,096 classes (before: one per shape, 6)
    for shape, g in zip(shapes, got, strict=True):
        want = 0.02 * jax.random.truncated_normal(nnx.Rngs(5).params(), -2.0, 2.0, shape)
        assert g.shape == shape and bool((g == want).all()), shape
