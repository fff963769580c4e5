"""RoPE and YaRN (gattn/model/layers.py): YaRN at scale 1 is plain RoPE; its frequencies follow the
NTK-by-parts ramp of Peng et al. 2023; its temperature scales the logits; the config switch works
on a built model."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gattn.cli import apply_overrides
from gattn.config import Config, ConfigError, ModelConfig, YarnSpec
from gattn.model.layers import apply_rope, rope_frequencies
from gattn.model.transformer import Transformer

from conftest import tiny_model


def test_yarn_at_scale_1_is_plain_rope():
    plain, one = rope_frequencies(64, 1e4), rope_frequencies(64, 1e4, YarnSpec(1.0, 256))
    np.testing.assert_array_equal(plain[0], one[0])
    assert plain[1] == one[1] == 1.0
    x = jax.random.normal(jax.random.key(0), (9, 3, 64))
    pos = jnp.arange(9) * 37
    np.testing.assert_array_equal(apply_rope(x, pos, 1e4), apply_rope(x, pos, 1e4, YarnSpec(1.0, 256)))
    cfg = tiny_model(vocab_size=64, num_layers=1, q_heads=2, kv_heads=1, head_dim=16, d_ff=32)
    tokens = jnp.arange(24).reshape(2, 12) % 64
    a = Transformer(cfg, rngs=nnx.Rngs(0))(tokens)
    b = Transformer(dataclasses.replace(cfg, yarn=YarnSpec(1.0, 8)), rngs=nnx.Rngs(0))(tokens)
    np.testing.assert_array_equal(a, b)


def test_yarn_frequencies_follow_the_formula():
    """head_dim 32, base 1e4, L = 128, s = 4. Pair i turns L theta_i / (2 pi) times within L; it
    turns beta_fast = 32 times at dim 32 ln(128 / (64 pi)) / (2 ln 1e4) = -0.78 (floored, clipped: 0)
    and beta_slow = 1 time at dim 32 ln(128 / (2 pi)) / (2 ln 1e4) = 5.24 (ceiled: 6). Pair 0 keeps
    its frequency, pairs >= 6 are divided by s, pair 3 is halfway: theta (1/2 + 1/(2 s))."""
    theta = 1e4 ** (-np.arange(16) * 2 / 32)
    got, scale = rope_frequencies(32, 1e4, YarnSpec(4.0, 128))
    assert got[0] == pytest.approx(theta[0], rel=1e-6)
    assert got[1] == pytest.approx(theta[1] * (5 / 6 + 1 / 24), rel=1e-6)
    assert got[3] == pytest.approx(theta[3] * (0.5 + 0.125), rel=1e-6)
    np.testing.assert_allclose(got[6:], theta[6:] / 4, rtol=1e-6)
    assert scale == pytest.approx(0.1 * math.log(4) + 1)
    assert rope_frequencies(32, 1e4, YarnSpec(4.0, 128, attention_factor=1.5))[1] == 1.5
    # A longer original context moves the ramp to lower frequencies (higher dims).
    later, _ = rope_frequencies(32, 1e4, YarnSpec(4.0, 4096))
    assert later[6] > got[6] and later[-1] == pytest.approx(theta[-1] / 4, rel=1e-6)


def test_interpolated_pairs_at_position_s_p_equal_plain_rope_at_p_and_q_k_carry_the_temperature():
    yarn = YarnSpec(4.0, 128)
    x = jax.random.normal(jax.random.key(1), (3, 2, 32))
    plain = apply_rope(x, jnp.asarray([0, 5, 11]), 1e4)
    stretched = apply_rope(x, jnp.asarray([0, 20, 44]), 1e4, yarn) / yarn.temperature_factor
    lowfreq = np.r_[6:16, 22:32]  # rotate-half layout: pair i is dims i and i + 16
    np.testing.assert_allclose(stretched[..., lowfreq], plain[..., lowfreq], rtol=1e-4, atol=1e-5)
    # At position 0 nothing rotates: q and k are only scaled, so q.k grows by 1/t = scale^2.
    np.testing.assert_allclose(apply_rope(x, jnp.zeros(3, int), 1e4, yarn)[0],
                               x[0] * yarn.temperature_factor, rtol=1e-6)


def test_yarn_is_a_command_line_switch_with_clear_errors():
    cfg = apply_overrides(Config(), ["model.yarn.factor=8", "model.yarn.original_len=4096"])
    assert cfg.model.yarn == YarnSpec(8.0, 4096)
    assert apply_overrides(cfg, ["model.yarn=none"]).model.yarn is None
    for overrides, field in ((["model.yarn.factor=4"], "model.yarn.original_len"),
                             (["model.yarn.factor=0.5", "model.yarn.original_len=8"], "model.yarn.factor"),
                             (["model.yarn.beta_slow=40", "model.yarn.original_len=8"], "model.yarn.beta_slow"),
                             (["model.yarn.original_len=-3"], "model.yarn.original_len")):
        with pytest.raises(ConfigError) as e:
            apply_overrides(Config(), overrides)
        assert e.value.field == field


def test_partial_rotary_rotates_the_first_rope_dim_dims_as_qwen3_next_does():
    """rope_dim = K / 4: the first 8 of 32 dims rotate as a head of 8 (pairs i and i + 4, the
    frequencies over 8 dims), written out in numpy as Hugging Face's apply_rotary_pos_emb with
    partial_rotary_factor does; the other 24 pass through. rope_dim = K is plain RoPE."""
    x = np.asarray(jax.random.normal(jax.random.key(2), (5, 3, 32)))
    pos = np.array([0, 1, 7, 100, 4095])
    r = 8
    inv_freq = 1.0 / 1e6 ** (np.arange(0, r, 2) / r)
    emb = np.concatenate([pos[:, None] * inv_freq] * 2, axis=-1)[:, None, :]  # [N, 1, r]
    x_rot = x[..., :r]
    rotate_half = np.concatenate([-x_rot[..., r // 2:], x_rot[..., :r // 2]], axis=-1)
    want = np.concatenate([x_rot * np.cos(emb) + rotate_half * np.sin(emb), x[..., r:]], axis=-1)
    got = apply_rope(jnp.asarray(x), jnp.asarray(pos), 1e6, rope_dim=r)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(apply_rope(jnp.asarray(x), jnp.asarray(pos), 1e6, rope_dim=32),
                                  apply_rope(jnp.asarray(x), jnp.asarray(pos), 1e6))
    for bad in (7, 34, 0):
        with pytest.raises(ConfigError) as e:
            ModelConfig(head_dim=32, rope_dim=bad)
        assert e.value.field == "rope_dim"


def test_bf16_rope_rotates_in_bf16_as_transformers_does():
    """A bf16 model's RoPE kept float32 copies of q and k ([N, H, K]) alive in each layer's
    recomputed backward, 0.8 GiB of dense_1p7b's per-chip peak on v5p-64 (docs/presets.md). The
    rotation runs in x's dtype with float32 angles, cos and sin cast to it, as transformers'
    Qwen3 and Llama do; float32 inputs are unchanged."""
    n, h, k = 12, 3, 16
    x32 = jax.random.normal(jax.random.key(0), (n, h, k), jnp.float32)
    pos = jnp.arange(n) * 37
    x16 = x32.astype(jnp.bfloat16)
    shapes = [(v.aval.dtype, v.aval.shape) for eq in jax.make_jaxpr(lambda x: apply_rope(x, pos, 1e4))(x16).eqns
              for v in eq.outvars]
    assert (jnp.dtype(jnp.float32), (n, h, k)) not in shapes, shapes
    theta = 1.0 / (1e4 ** (np.arange(0, k, 2) / k))
    ang = np.asarray(pos, np.float32)[:, None] * theta[None, :].astype(np.float32)
    cos = jnp.asarray(np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, None, :]).astype(jnp.bfloat16)
    sin = jnp.asarray(np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, None, :]).astype(jnp.bfloat16)
    rotate_half = jnp.concatenate([-x16[..., k // 2:], x16[..., : k // 2]], axis=-1)
    want = x16 * cos + rotate_half * sin  # transformers' apply_rotary_pos_emb, in bf16
    got = apply_rope(x16, pos, 1e4)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0, atol=1e-2)
    full = apply_rope(x32, pos, 1e4)
    assert full.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(full), atol=4e-2)
