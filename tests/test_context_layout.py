"""What each device computes under context parallelism (tests/multidevice/context_layout.py, 8
simulated CPU devices, the sequence split over context 4): the residual stream's token order
gives each device its rows' pieces of the sequence, so no layer reshards however many rows a
batch shard holds; the expert-parallel MoE (ragged and all_to_all) routes each device's own
tokens only, and equals one device."""

import pytest

import multidevice


def test_context_layout_keeps_each_devices_pieces_and_moe_tokens():
    """The default set's cousin of the whole check below: the dense model at 2 and 4 layers (before
    the fix: 10 more all-to-alls a layer) and the ragged MoE on data 2 x context 4 (before: a
    routing sort of 4 x the device's own assignments), ~25 s."""
    out = multidevice.run("context_layout", "--quick")
    assert [line for line in out.splitlines() if line.startswith("ok ")] == [
        "ok rows dense", "ok moe ragged (2, 4, 1)"], out


@pytest.mark.slow  # ~2.5 min: the hybrid with MTP, 8 layers, the expert axis and the all_to_all path
def test_context_layout_splits_rows_and_moe_tokens_over_context():
    out = multidevice.run("context_layout")
    assert [line for line in out.splitlines() if line.startswith("ok ")] == [
        "ok rows dense", "ok rows hybrid", "ok moe ragged (2, 4, 1)", "ok moe ragged (1, 4, 2)",
        "ok moe all_to_all (1, 4, 2)"], out


def test_expert_parallel_refuses_the_per_micro_batch_lbl_under_context():
    """A device holds pieces of rows there, not whole micro-batches: refused by name."""
    import jax

    from gattn.config import ConfigError, MoESpec
    from gattn.model.expert_parallel import micro_groups_per_shard

    spec = MoESpec(num_experts=4, top_k=2, expert_width=16, lbl_scope="micro", micro_batches=8)
    assert micro_groups_per_shard(spec, jax.sharding.AbstractMesh((8, 1), ("data", "context"))) == 1
    with pytest.raises(ConfigError, match="moe.lbl_scope"):
        micro_groups_per_shard(spec, jax.sharding.AbstractMesh((2, 4), ("data", "context")))
