"""The trainer's step as a pod slice runs it (tests/multidevice/trainer_step.py on 8 simulated
devices): gradient accumulation equals the plain step, and validation runs with an eval batch
that is not a multiple of the data x expert shards."""

import pytest

import multidevice
from gattn.config import Config, ConfigError, MoESpec, TrainConfig

from conftest import tiny_model


def test_microbatches_equal_the_plain_step_and_any_eval_batch_validates_on_a_mesh():
    out = multidevice.run("trainer_step", "--mesh", "2,2,2")
    assert out.count("ok microbatches") == 1, out
    assert "ok validation" in out, out


def test_microbatches_of_a_moe_equal_the_plain_step_without_the_per_microbatch_lbl():
    """Loads and the z-loss add up over microbatches; the global-batch LBL's expert counts are
    per microbatch (docs/training.md), so it is left out here (lbl_coef 0)."""
    from multidevice.trainer_step import check_microbatches

    moe = MoESpec(num_experts=8, top_k=2, expert_width=16, lbl_coef=0.0, z_loss_coef=1e-3)
    check_microbatches((1, 1, 1), tiny_model(vocab_size=64, num_layers=1, moe=moe), counts=(2,))


def test_microbatches_must_divide_the_batch_into_whole_rows():
    with pytest.raises(ConfigError, match="microbatches.*divisor of batch_size"):
        TrainConfig(batch_size=8, microbatches=3)
    moe = MoESpec(num_experts=4, top_k=2, expert_width=16, lbl_scope="micro", micro_batches=4)
    with pytest.raises(ConfigError, match="train.microbatches"):
        Config(model=tiny_model(moe=moe), train=TrainConfig(batch_size=8, microbatches=4))
