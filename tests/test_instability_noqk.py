"""The instability lab with the paper's own baseline (configs/instability_lab_noqk.py, issue 61):
no QK-norm, and biases on W_Q, W_K and W_V only (`model.qkv_bias`, Qwen2.5's attention)."""

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model
from flax import nnx

from gattn import cli, variants
from gattn.config import ConfigError
from gattn.model.params import count_params
from gattn.model.transformer import Transformer

TINY = tiny_model()


def _params(model) -> dict:
    return {".".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_qkv_bias_biases_q_k_v_and_not_the_output_or_the_gate():
    cfg = dataclasses.replace(variants.apply("sdpa_elementwise", TINY), qkv_bias=True)
    names = _params(Transformer(cfg, rngs=nnx.Rngs(0)))
    attn = {k.split("attn.")[1] for k in names if k.startswith("blocks.0.attn.")}
    assert {"bq", "bk", "bv"} <= attn
    assert "bo" not in attn and "gate.w" in attn and "gate.b" not in attn
    # the parameters: W_Q's, W_K's and W_V's biases per layer, no more (the gate adds its weight only)
    q, kv = TINY.q_heads * TINY.head_dim, TINY.kv_heads * TINY.head_dim
    no_bias = dataclasses.replace(cfg, qkv_bias=False)
    assert count_params(cfg) - count_params(no_bias) == TINY.num_layers * (q + 2 * kv)
    # attention_bias adds W_O's and the (elementwise) gate's on top
    assert count_params(dataclasses.replace(no_bias, attention_bias=True)) - count_params(cfg) == \
        TINY.num_layers * (TINY.d_model + q)


@pytest.mark.parametrize("name", ["bq", "bk", "bv"])
def test_each_bias_reaches_the_logits(name):
    """A random bias on one projection changes the model's output (RoPE rotates q's and k's
    biases per position, so neither cancels in the softmax)."""
    cfg = dataclasses.replace(TINY, qkv_bias=True, qk_norm=False)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 12)))
    before = model(x)
    rng = np.random.default_rng(1)
    for block in model.blocks:
        bias = getattr(block.attn, name)
        assert float(jnp.max(jnp.abs(bias[...]))) == 0.0  # initialised at zero, as Qwen2.5's
        bias[...] = jnp.asarray(rng.normal(0.0, 1.0, bias[...].shape), bias[...].dtype)
    assert float(jnp.max(jnp.abs(model(x) - before))) > 1e-4


@pytest.mark.parametrize("changes, allowed", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(switch_heads=variants.apply("switch_v_4top4", TINY).switch_heads), "switch_heads"),
])
def test_qkv_bias_is_refused_beside_other_biases_or_switch_heads(changes, allowed):
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(TINY, qkv_bias=True, **changes)
    assert e.value.field == "qkv_bias" and allowed in str(e.value)


def test_the_no_qk_norm_lab_trains(tmp_path):
    """The lab (shrunk: 2 layers, a 512-piece vocabulary, 4 steps of 2 x 32 tokens) through the
    trainer: the paper's baseline attention, finite losses, counted spikes."""
    from gattn.experiments.study.runner import read_metrics
    from gattn.train import trainer

    cfg = cli.load("instability_lab_noqk", ["model.num_layers=2", "model.vocab_size=512", "train.steps=4",
                                            "train.warmup_steps=1", "train.batch_size=2", "train.seq_len=32",
                                            "train.eval_every=4", "train.checkpoint_every=4", "data.eval_batches=1",
                                            "data.code_max_bytes=200000"])
    assert (cfg.model.qk_norm, cfg.model.qkv_bias, cfg.model.attention_bias) == (False, True, False)
    assert cfg.train.grad_clip == 0.0 and cfg.model.d_model == cli.load("instability_lab").model.d_model
    summary = trainer.train(cfg, tmp_path, progress=False)
    assert summary["completed"] and summary["loss_spikes"] >= 0
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert json.loads((tmp_path / "config.json").read_text())["model"]["qkv_bias"] is True


def test_the_noqk_study_keeps_the_rule_and_trains_the_unstable_rate_first(tmp_path, monkeypatch):
    """configs/study/instability_noqk.py: the rule fixed by instability_verdict.py, on the no-QK-norm
    lab; as a script, the claim's cells at the higher rate, then its controls, then the lower rate;
    --part shares the cells, --lr keeps one rate."""
    import importlib.util
    from pathlib import Path

    from gattn.experiments import study as study_pkg

    path = Path(__file__).resolve().parents[1] / "configs" / "study" / "instability_noqk.py"
    spec = importlib.util.spec_from_file_location("instability_noqk", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    study = script.get_study()
    assert study.stability_rule == study_pkg.load("instability_verdict").stability_rule
    assert (study.base.model.qk_norm, study.base.model.qkv_bias) == (False, True) and len(study.seeds) == 10
    grid = script.order(study)
    assert len(grid) == 100 and {(c.variant, c.lr) for c in grid[:30]} == {(v, 1.0) for v in script.CLAIM_VARIANTS}
    assert {c.variant for c in grid[30:50]} == {"sandwich_norm", "output_clip_100"} and {c.lr for c in grid[:50]} == {1.0}
    trained = []
    monkeypatch.setattr(study_pkg, "run_cell", lambda s, c, root: trained.append((c.variant, c.lr, c.seed)) or {})
    assert script.main(["--workdir", str(tmp_path), "--lr", "1.0", "--part", "1/2"]) == 0
    assert len(trained) == 25 and {lr for _, lr, _ in trained} == {1.0}
    assert trained[:2] == [("sdpa_elementwise_ffn_matched", 1.0, 0), ("baseline", 1.0, 1)]
    with pytest.raises(SystemExit):
        script.main(["--workdir", str(tmp_path), "--lr", "0.3"])
