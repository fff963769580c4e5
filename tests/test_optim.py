"""AdamW with the paper's schedule, the weight-decay mask and the non-finite step guard."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gattn.train import optim
from gattn.train import trainer
from gattn.config import (LR_PRESETS, Config, ConfigError, ExecConfig, GateSpec, ModelConfig, MoESpec,
                          SwitchHeadsSpec, TrainConfig)

TRAIN = TrainConfig(steps=1000, learning_rate=4e-3, min_learning_rate=4e-5, warmup_steps=100)


def test_schedule_warmup_midpoint_and_end():
    """schedule(count) is the LR of update count + 1 (optax counts the updates applied before)."""
    lr = optim.schedule(TRAIN)
    update = lambda k: float(lr(k - 1))  # noqa: E731
    assert update(1) == pytest.approx(4e-3 / 100, rel=1e-5)    # the first update moves the weights
    assert update(50) == pytest.approx(2e-3)                   # linear warmup: peak * k / warmup
    assert update(100) == pytest.approx(4e-3)                  # max LR at the end of warmup
    assert update(550) == pytest.approx((4e-3 + 4e-5) / 2)     # cosine midpoint
    assert update(1000) == pytest.approx(4e-5)                 # the floor, at the last update
    assert all(update(s) >= update(s + 10) for s in range(100, 990, 10))


def test_the_first_update_moves_the_weights_at_peak_over_warmup():
    params = _params()
    tx = optim.optimizer(dataclasses.replace(TRAIN, weight_decay=0.0, grad_clip=0.0))
    state = tx.init(params)
    assert float(optim.schedule(TRAIN)(optim.schedule_count(state))) == pytest.approx(4e-3 / 100, rel=1e-5)
    updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    # Adam's first step is lr * g / (|g| + eps): every weight moves by the LR applied
    for u in jax.tree.leaves(updates):
        np.testing.assert_allclose(u, -4e-3 / 100, rtol=1e-4)
    assert int(optim.schedule_count(state)) == 1


def test_paper_presets():
    assert LR_PRESETS["moe_15a2b"] == (2e-3, 3e-5, 1000)        # Sec. 3.2.1
    t = TrainConfig(lr_preset="moe_15a2b", steps=100_000)
    lr = optim.schedule(t)
    assert float(lr(999)) == pytest.approx(2e-3) and float(lr(99_999)) == pytest.approx(3e-5)  # updates 1k, 100k
    assert {p[0] for p in LR_PRESETS.values()} >= {4e-3, 4.5e-3, 5.3e-3, 8e-3}
    with pytest.raises(ConfigError) as e:
        TrainConfig(lr_preset="moe_15a2b", steps=1000)          # 1000 warmup >= 1000 steps
    assert e.value.field == "warmup_steps"
    with pytest.raises(ConfigError):
        TrainConfig(lr_preset="dense_9000")


def _params(gate=None):
    cfg = ModelConfig(vocab_size=32, d_model=16, num_layers=1, q_heads=2, kv_heads=1, head_dim=8,
                      d_ff=32, gate=gate)
    return nnx.split(trainer.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)[1]


def test_weight_decay_mask_skips_norms_and_the_gate_tensor():
    params = _params(GateSpec(input_dependent=False))
    flat = {tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)): v
            for path, v in jax.tree_util.tree_leaves_with_path(optim.decay_mask(params))}
    assert flat[("blocks", 0, "attn", "wq")] and flat[("embed",)] and flat[("lm_head",)]
    assert flat[("blocks", 0, "ffn", "w2")]
    assert not flat[("blocks", 0, "attn_norm", "scale")] and not flat[("final_norm", "scale")]
    assert not flat[("blocks", 0, "attn", "gate", "theta")]


def test_weight_decay_acts_only_where_the_mask_says():
    params = _params()
    tx = optim.optimizer(dataclasses.replace(TRAIN, weight_decay=0.5, warmup_steps=0))
    zeros = jax.tree.map(jnp.zeros_like, params)
    state = tx.init(params)
    for _ in range(3):
        updates, state = tx.update(zeros, state, params)
        params = optax.apply_updates(params, updates)
    fresh = _params()
    assert float(jnp.abs(params["blocks"][0]["attn"]["wq"][...]).sum()) < \
        float(jnp.abs(fresh["blocks"][0]["attn"]["wq"][...]).sum())
    np.testing.assert_array_equal(params["final_norm"]["scale"][...], fresh["final_norm"]["scale"][...])


def test_non_finite_step_is_skipped_and_reported():
    cfg = Config(model=ModelConfig(vocab_size=32, d_model=16, num_layers=1, q_heads=2, kv_heads=1,
                                   head_dim=8, d_ff=32),
                 train=TrainConfig(batch_size=2, seq_len=8, steps=10, warmup_steps=1))
    graphdef, state = trainer.init_state(cfg)
    step = trainer.make_train_step(cfg, graphdef)
    batch = {"tokens": jnp.ones((2, 9), jnp.int32), "segment_ids": jnp.ones((2, 9), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(9), (2, 9))}
    state, m = step(state, batch)
    assert bool(m["finite"]) and int(state["step"]) == 1
    poisoned = jax.tree.map(lambda x: x, state)
    poisoned["params"]["embed"][...] = poisoned["params"]["embed"][...].at[1, 0].set(jnp.nan)
    before = jax.tree.map(np.asarray, poisoned)
    after, m = step(poisoned, batch)
    assert not bool(m["finite"]) and int(after["step"]) == 2
    for a, b in zip(jax.tree.leaves(after["opt_state"]), jax.tree.leaves(before["opt_state"])):
        np.testing.assert_array_equal(a, b)   # nothing learned from the bad step
    np.testing.assert_array_equal(after["params"]["lm_head"][...], before["params"]["lm_head"][...])
    # The schedule paused with the optimizer state: the next step applies, and logs, the LR of
    # update 1 (optax's count), not of trainer step 2.
    after["params"]["embed"][...] = after["params"]["embed"][...].at[1, 0].set(0.0)
    after, m = step(after, batch)
    lr = optim.schedule(cfg.train)
    assert bool(m["finite"]) and int(after["step"]) == 3 and int(optim.schedule_count(after["opt_state"])) == 2
    assert float(m["lr"]) == pytest.approx(float(lr(1))) and float(lr(1)) != pytest.approx(float(lr(2)))


# Every kind of parameter the model can have, by its name: the matrices are decayed; biases, norm
# scales and the input-independent gate tensor are not (the spec the roles must meet).
DECAYED = {"w", "wq", "wk", "wv", "wo", "router", "w1", "w2", "w3", "embed", "lm_head"}
NOT_DECAYED = {"bq", "bk", "bv", "bo", "b", "scale", "q_norm", "k_norm", "sdpa_norm", "theta"}
EVERY_KIND = [  # (model changes, exec scan): together they build every parameter there is
    dict(attention_bias=True, qk_norm=True, gate=GateSpec(), sandwich_norm=True),
    dict(gate=GateSpec(position="value", input_dependent=False), sdpa_nonlinearity="rmsnorm"),
    dict(switch_heads=SwitchHeadsSpec(targets="kv", num_experts=2, top_k=1), tie_embeddings=True),
    dict(moe=MoESpec(num_experts=4, top_k=2, expert_width=8), gate=GateSpec(position="dense")),
]


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("changes", EVERY_KIND)
def test_decay_mask_covers_every_kind_of_parameter(changes, scan):
    cfg = ModelConfig(vocab_size=32, d_model=16, num_layers=2, q_heads=2, kv_heads=1, head_dim=8, d_ff=32,
                      **changes)
    params = nnx.split(trainer.Transformer(cfg, ExecConfig(scan_layers=scan), rngs=nnx.Rngs(0)), nnx.Param)[1]
    mask = {path: v for path, v in jax.tree_util.tree_leaves_with_path(optim.decay_mask(params))}
    names = {path: [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1] for path in mask}
    assert set(names.values()) <= DECAYED | NOT_DECAYED, set(names.values()) - DECAYED - NOT_DECAYED
    for path, decayed in mask.items():
        assert bool(decayed) == (names[path] in DECAYED), jax.tree_util.keystr(path)


def test_adamw_leaves_biases_and_scales_alone():
    """One step with zero gradients: only weight decay moves anything, and only the matrices."""
    cfg = ModelConfig(vocab_size=32, d_model=16, num_layers=1, q_heads=2, kv_heads=1, head_dim=8, d_ff=32,
                      attention_bias=True, gate=GateSpec())
    params = nnx.split(trainer.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)[1]
    params = jax.tree.map(lambda x: x + 0.5, params)  # biases start at 0: make any decay visible
    tx = optim.optimizer(TrainConfig(steps=10, warmup_steps=0, learning_rate=0.1, weight_decay=0.5))
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    after = optax.apply_updates(params, updates)
    moved = {".".join(str(getattr(k, "key", getattr(k, "idx", ""))) for k in p if not isinstance(k, jax.tree_util.GetAttrKey)):
             bool(jnp.any(a != b)) for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(after), jax.tree.leaves(params))}
    assert moved["blocks.0.attn.wq"] and moved["embed"] and moved["blocks.0.attn.gate.w"], moved
    for name in ("bq", "bk", "bv", "bo", "gate.b"):
        assert not moved[f"blocks.0.attn.{name}"], name
    assert not moved["final_norm.scale"] and not moved["blocks.0.attn_norm.scale"]


def test_an_update_that_overflows_the_weights_is_skipped():
    """Finite loss and gradients, but a huge LR makes the new weights inf: the step is skipped."""
    cfg = Config(model=ModelConfig(vocab_size=32, d_model=16, num_layers=1, q_heads=2, kv_heads=1,
                                   head_dim=8, d_ff=32),
                 train=TrainConfig(batch_size=2, seq_len=8, steps=10, warmup_steps=1,
                                   learning_rate=1e39, min_learning_rate=0.0, grad_clip=0.0))
    graphdef, state = trainer.init_state(cfg)
    step = trainer.make_train_step(cfg, graphdef)
    batch = {"tokens": jnp.ones((2, 9), jnp.int32), "segment_ids": jnp.ones((2, 9), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(9), (2, 9))}
    state, _ = step(state, batch)              # lr(0) = 0: a finite no-op
    before = np.asarray(state["params"]["lm_head"][...])
    state, m = step(state, batch)              # lr(1) = 1e39: weights would overflow
    assert np.isfinite(float(m["loss"])) and not bool(m["finite"])
    np.testing.assert_array_equal(state["params"]["lm_head"][...], before)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))


def test_a_resume_with_more_steps_names_the_lr_jump_or_continues_from_the_lr_reached():
    """Issue 34: resuming a finished 100-step run with 200 steps used to re-warm the LR silently
    (the cosine recomputed for the new total). "recompute" still does, and says from what to
    what; "constant" holds the LR reached; "decay" takes it to the floor by the last update."""
    saved = TrainConfig(steps=100, learning_rate=4e-3, min_learning_rate=4e-5, warmup_steps=10)
    count = 60  # resumed after 60 updates, the old schedule halfway down its cosine
    before = float(optim.schedule(saved)(count))
    longer = dataclasses.replace(saved, steps=200)

    same, note = optim.continued(saved, saved, count)
    assert same == saved and note == ""
    cfg, note = optim.continued(longer, saved, count)
    after = float(optim.schedule(longer)(count))
    assert cfg == longer and after > 1.5 * before
    assert f"from {before:.3g}" in note and f"to {after:.3g}" in note and "extend=constant" in note

    held, note = optim.continued(dataclasses.replace(longer, extend="constant"), saved, count)
    assert (held.continue_step, held.continue_lr) == (count, pytest.approx(before)) and "continues from" in note
    lr = optim.schedule(held)
    assert [float(lr(k)) for k in (count, 150, 199)] == pytest.approx([before] * 3)
    assert float(lr(30)) == pytest.approx(float(optim.schedule(longer)(30)))  # before the continuation: as trained

    decayed, _ = optim.continued(dataclasses.replace(longer, extend="decay"), saved, count)
    lr = optim.schedule(decayed)
    values = [float(lr(k)) for k in range(count, 200)]
    assert values[0] == pytest.approx(before) and values[-1] == pytest.approx(4e-5)
    assert all(a >= b for a, b in zip(values, values[1:]))

    # A later resume at the same length goes on with the recorded continuation.
    again, note = optim.continued(dataclasses.replace(longer, extend="constant"), held, 120)
    assert (again.continue_step, again.continue_lr, note) == (count, held.continue_lr, "")


def test_a_continuation_is_checked_field_by_field():
    with pytest.raises(ConfigError) as e:
        TrainConfig(extend="rewarm")
    assert e.value.field == "extend" and "'decay'" in e.value.allowed
    with pytest.raises(ConfigError) as e:
        TrainConfig(continue_step=10, continue_lr=1e-4)
    assert e.value.field == "continue_step" and "extend='constant' or 'decay'" in e.value.allowed
    with pytest.raises(ConfigError) as e:
        TrainConfig(steps=50, extend="constant", continue_step=50)
    assert e.value.field == "continue_step" and "expected < train.steps (50)" in e.value.allowed
