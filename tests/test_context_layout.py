"""What each device computes under context parallelism (tests/multidevice/context_layout.py, 8
simulated CPU devices, the sequence split over context 4): the residual stream's token order
gives each device its rows' pieces of the sequence, so no layer reshards however many rows a
batch shard holds; the expert-parallel MoE (ragged and all_to_all) routes each device's own
tokens only, and equals one device."""

import multidevice


def test_context_layout_splits_rows_and_moe_tokens_over_context():
    out = multidevice.run("context_layout")
    assert [line for line in out.splitlines() if line.startswith("ok ")] == [
        "ok rows dense", "ok rows hybrid", "ok moe ragged (2, 4, 1)", "ok moe ragged (1, 4, 2)",
        "ok moe all_to_all (1, 4, 2)"], out


def test_expert_parallel_refuses_the_per_micro_batch_lbl_under_context():
    """A device holds pieces of rows there, not whole micro-batches: refused by name."""
    import jax
    import pytest

    from gattn.config import ConfigError, MoESpec
    from gattn.model.expert_parallel import micro_groups_per_shard

    spec = MoESpec(num_experts=4, top_k=2, expert_width=16, lbl_scope="micro", micro_batches=8)
    assert micro_groups_per_shard(spec, jax.sharding.AbstractMesh((8, 1), ("data", "context"))) == 1
    with pytest.raises(ConfigError, match="moe.lbl_scope"):
        micro_groups_per_shard(spec, jax.sharding.AbstractMesh((2, 4), ("data", "context")))
