"""`variants.applicable` lists exactly the variants that build on a baseline, so
`python -m gattn.demo --variants all` runs on every shipped config (configs only, no JAX)."""

from pathlib import Path

import pytest

from gattn import cli, variants
from gattn.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.py"))


def test_every_shipped_config_is_covered():
    assert {"configs/gpu_125m.py", "configs/moe_15a2b.py", "configs/peer.py"} <= set(SHIPPED)


@pytest.mark.parametrize("path", SHIPPED)
def test_applicable_variants_build_on_every_shipped_config_and_the_others_do_not(path):
    cfg = cli.load(ROOT / path)
    names = variants.applicable(cfg.model)
    assert "baseline" in names
    for name in names:  # as the demo builds them: the run's whole config, validated
        try:
            built = cli.load(ROOT / path, variant=name)
        except ConfigError as e:  # the model builds, the preset's expert-parallel path may not split it:
            assert "exec.moe_impl" in str(e) and "mesh.expert" in str(e), e  # named, with the way out
            built = cli.load(ROOT / path, ["exec.moe_impl=partitioned", "exec.grouped_matmul=ragged_dot",
                                           "exec.moe_buffer=None"], variant=name)
        assert built.model == variants.apply(name, cfg.model)
    for name in set(variants.REGISTRY) - set(names):
        with pytest.raises(ConfigError):
            variants.apply(name, cfg.model)


def test_head_count_and_ffn_matched_variants_are_left_out_where_they_cannot_build():
    gpu = cli.load(ROOT / "configs/gpu_125m.py").model  # q=12, kv=4: 18 % 4, 12 % 8
    assert not {"more_q_heads", "more_kv_heads"} & set(variants.applicable(gpu))
    moe = cli.load(ROOT / "configs/moe_15a2b.py").model  # no dense FFN to narrow
    assert not {"sdpa_elementwise_ffn_matched", "more_experts"} - set(variants.REGISTRY)
    assert "more_experts" in variants.applicable(moe)
    assert not {"sdpa_elementwise_ffn_matched", "sdpa_headwise_ffn_matched"} & set(variants.applicable(moe))
