"""The sink verdict's preset rule (gattn/eval/verdict.py) on synthetic paired seeds with a known
answer, and the measures it reads (gattn/eval/sinks.py): non-trigger alpha_1 without query 0,
alpha_1 weighted by the gate, the head output after the gate, the <s>-ablation cost."""

import math

import numpy as np
import pytest

from gattn.eval import sinks
from gattn.eval.verdict import (CANNOT, INCREASES, NONE, REDUCES, REMOVES, SAME, SinkRule, judge, paired,
                                verdict)

RULE = SinkRule()
SEEDS = range(10)


def runs(alpha, f_attn, m_act=2.0, resid=5.0, cost=0.1, noise=0.01, seed=0):
    """{seed: measures}: each measure at its level plus N(0, noise x level) per seed."""
    rng = np.random.default_rng(seed)
    level = {"alpha_1_non_trigger_rest_mean": alpha, "f_attn": f_attn, "m_act": m_act, "residual_norm_first": resid,
             "ablation_cost": cost}
    return {s: {k: v * (1 + noise * rng.standard_normal()) for k, v in level.items()} for s in SEEDS}


def test_the_interval_is_student_t_of_the_paired_differences():
    p = paired([1.0, 1.0, 1.0], [2.0, 3.0, 4.0], RULE)  # d = 1, 2, 3: mean 2, sd 1, t(0.975, 2) = 4.3027
    assert p["diff"] == pytest.approx(2.0) and p["n"] == 3
    assert (p["lo"], p["hi"]) == pytest.approx((2 - 4.3027 / 3 ** 0.5, 2 + 4.3027 / 3 ** 0.5), abs=1e-3)
    assert p["change"] == pytest.approx(2.0)  # relative to the reference's mean
    boot = paired([1.0] * 8, [0.5] * 8, SinkRule(interval="bootstrap"))
    assert (boot["lo"], boot["hi"]) == pytest.approx((-0.5, -0.5))  # every resample's mean is the same
    wide = paired([0, 0, 0, 0, 0, 0], [-1, 1, -2, 2, -3, 3.5], SinkRule(interval="bootstrap"))
    assert wide["lo"] < 0 < wide["hi"]
    assert math.isnan(paired([1.0], [0.2], RULE)["lo"])  # one pair: no interval


@pytest.mark.parametrize("gated, expected", [
    (dict(alpha=0.2, f_attn=0.1), REMOVES),            # both drop by 75%
    (dict(alpha=0.6, f_attn=0.3), REDUCES),            # both drop by 25%, clearly
    (dict(alpha=0.2, f_attn=0.3), REDUCES),            # alpha_1 removes, F-Attn only reduces
    (dict(alpha=0.8, f_attn=0.4), SAME),               # no change, a tight interval
    (dict(alpha=0.9, f_attn=0.5), INCREASES),          # both higher
    (dict(alpha=0.6, f_attn=0.5), CANNOT),             # the two measures disagree
    (dict(alpha=0.7, f_attn=0.35, noise=0.5), CANNOT),  # a wide interval across 0
])
def test_the_sink_verdict_on_synthetic_seeds(gated, expected):
    base = runs(alpha=0.8, f_attn=0.4)
    v = verdict(base, runs(**gated, seed=1), RULE)
    assert v["matters"] and v["pairs"] == 10 and v["ablation_cost"] == pytest.approx(0.1, rel=0.02)
    assert v["sink"] == expected


def test_no_verdict_when_the_sink_does_not_matter():
    base = runs(alpha=0.8, f_attn=0.4, cost=0.004)
    v = verdict(base, runs(alpha=0.1, f_attn=0.05, seed=1), RULE)
    assert v["sink"] == NONE and not v["matters"] and "0.0040 nats < 0.05" in v["why"]
    assert v["alone"] == {"m_act": NONE, "residual_norm_first": NONE}
    assert v["measures"]["alpha_1_non_trigger_rest_mean"]["verdict"] == REMOVES  # (measured, not judged)
    no_cost = {s: {k: x for k, x in r.items() if k != "ablation_cost"} for s, r in base.items()}
    assert verdict(no_cost, base, RULE)["sink"] == NONE


def test_m_act_and_the_residual_norm_are_judged_alone_and_only_paired_seeds_count():
    base = runs(alpha=0.8, f_attn=0.4, m_act=3.0, resid=5.0)
    gated = runs(alpha=0.8, f_attn=0.4, m_act=1.2, resid=4.0, seed=1)
    v = verdict(base, gated, RULE)
    assert v["alone"] == {"m_act": REMOVES, "residual_norm_first": REDUCES} and v["sink"] == SAME
    fewer = verdict(base, {s: gated[s] for s in (3, 4)}, RULE)
    assert fewer["pairs"] == 2 and fewer["measures"]["m_act"]["n"] == 2
    assert verdict(base, {3: gated[3]}, RULE)["sink"] == CANNOT  # one pair: no interval


def test_judge_needs_the_interval_to_exclude_zero_for_a_drop():
    p = {"n": 10, "reference_mean": 1.0, "diff": -0.6, "lo": -1.3, "hi": 0.1}
    assert judge(p, RULE) == CANNOT
    assert judge({**p, "hi": -0.01}, RULE) == REMOVES
    assert judge({**p, "diff": -0.4, "hi": -0.01}, RULE) == REDUCES
    assert judge({**p, "diff": 0.0, "lo": -0.09, "hi": 0.09}, RULE) == SAME
    assert judge({**p, "diff": 0.0, "lo": -0.11, "hi": 0.09}, RULE) == CANNOT


def test_the_rule_is_checked():
    from gattn.config import ConfigError

    for kwargs, field in ((dict(interval="z"), "interval"), (dict(confidence=1.5), "confidence"),
                          (dict(min_ablation_cost=-1), "min_ablation_cost"), (dict(sink=()), "sink")):
        with pytest.raises(ConfigError, match=field):
            SinkRule(**kwargs)
    assert SinkRule().as_dict()["sink"] == ["alpha_1_non_trigger_rest_mean", "f_attn"]


def test_gate_weighted_alpha_and_head_output_on_constructed_layers():
    b, h, t, k = 1, 2, 4, 3
    probs = np.zeros((b, h, t))
    probs[:, 0] = [1.0, 0.8, 0.8, 0.8]     # head 0 parks on token 0
    probs[:, 1] = [1.0, 0.1, 0.1, 0.1]
    scores = np.zeros((b * t, h, k))
    scores[:, 0] = 0.25                     # head 0's gate is mostly shut ...
    scores[:, 1] = 1.0
    scores[2, 0] = 0.75                     # ... but for query 2 (a trigger)
    sdpa = np.ones((b * t, h, k))
    layer = {"first_probs": probs, "sdpa_out": sdpa, "gate_scores": scores, "gated": sdpa * scores,
             "block_out": np.ones((b * t, 5))}
    trigger = np.array([[False, False, True, False]])
    stats = sinks.SinkStats(1, h)
    stats.add([layer], np.ones((b, t), np.int64),
              {"non_trigger": ~trigger, "non_trigger_rest": ~trigger & (np.arange(t) > 0), "trigger": trigger})
    row = stats.result(t)["per_layer"][0]
    assert row["alpha_1_non_trigger_per_head"] == pytest.approx([(1 + 0.8 + 0.8) / 3, 1.2 / 3])  # query 0 in
    assert row["alpha_1_non_trigger_rest_per_head"] == pytest.approx([0.8, 0.1])                 # query 0 out
    assert row["alpha_1_gated_non_trigger_rest_per_head"] == pytest.approx([0.2, 0.1])
    assert row["gate_score_trigger_per_head"] == pytest.approx([0.75, 1.0])
    assert row["gate_score_non_trigger_rest_per_head"] == pytest.approx([0.25, 1.0])
    assert row["head_out_norm_non_trigger_rest_per_head"] == pytest.approx([0.25 * 3 ** 0.5, 3 ** 0.5])
    assert row["value_norm_first_per_head"] == pytest.approx([3 ** 0.5] * 2)          # before the gate
    assert row["value_norm_first_gated_per_head"] == pytest.approx([0.25 * 3 ** 0.5, 3 ** 0.5])
    ungated = sinks.SinkStats(1, h)
    ungated.add([{k_: v for k_, v in layer.items() if k_ not in ("gated", "gate_scores")}],
                np.ones((b, t), np.int64), {"non_trigger_rest": ~trigger & (np.arange(t) > 0)})
    o = ungated.result(t)["overall"]
    assert o["alpha_1_gated_non_trigger_rest_mean"] == pytest.approx(o["alpha_1_non_trigger_rest_mean"])
    assert "gate_score_non_trigger_rest_mean" not in o


def test_hiding_the_first_token_hides_it_from_later_queries_only():
    from gattn.config import ModelConfig
    from gattn.eval import analysis
    from gattn.model.transformer import Transformer
    from flax import nnx

    seg = np.array([[1, 1, 1, 2, 2, 0]])
    assert sinks.hide_first_BxS(seg).tolist() == [[3, 2, 2, 5, 4, 0]]
    model = Transformer(ModelConfig(vocab_size=16, d_model=32, num_layers=1, q_heads=2, kv_heads=2, head_dim=16,
                                    d_ff=64), rngs=nnx.Rngs(0))
    tokens = np.array([[0, 3, 4, 5, 6, 7, 8, 9]])
    ones = np.ones_like(tokens)
    hidden = sinks.hide_first_BxS(ones)
    layers = analysis.collect(model, tokens, hidden, map_layers=(0,), map_len=8)
    attn = layers[0]["attn_map"][0]
    assert attn[:, 0, 0] == pytest.approx(1.0) and np.abs(attn[:, 1:, 0]).max() == 0.0
    assert attn.sum(axis=-1) == pytest.approx(np.ones((2, 8)), abs=1e-5)
    pos = np.arange(8)[None]
    plain = np.asarray(sinks._token_losses(model, tokens[:, :-1], pos[:, :-1], ones[:, :-1], tokens[:, 1:]))
    hid = np.asarray(sinks._token_losses(model, tokens[:, :-1], pos[:, :-1], hidden[:, :-1], tokens[:, 1:]))
    assert hid[0, 0] == pytest.approx(plain[0, 0]) and np.abs(hid[0, 1:] - plain[0, 1:]).max() > 1e-6


def test_the_ablation_cost_counts_non_copy_targets_after_the_first_query():
    from flax import nnx

    from gattn.config import BackcopySpec, Config, DataConfig, ModelConfig, TrainConfig
    from gattn.data import backcopy, pipeline
    from gattn.model.transformer import Transformer

    spec = BackcopySpec(chars=20, triggers="0|1,2", offsets="1,3")
    cfg = Config(model=ModelConfig(vocab_size=21, d_model=32, num_layers=1, q_heads=2, kv_heads=2, head_dim=16,
                                   d_ff=64),
                 train=TrainConfig(batch_size=4, seq_len=40),
                 data=DataConfig(source="bigram_backcopy", backcopy=spec, eval_batches=1, eval_batch_size=3))
    batches = pipeline.validation_batches(cfg, None, None)["backcopy"]
    model = Transformer(cfg.model, rngs=nnx.Rngs(0))
    a = sinks.ablation(model, cfg, batches)
    tokens = batches[0]["tokens"]
    copies = backcopy.is_copy_target(backcopy.task(spec), tokens)[:, 2:]  # targets of queries 1..S-1
    assert a["targets"] == copies.size - copies.sum() and a["targets"] > 0
    assert a["cost"] == pytest.approx(a["loss_hidden"] - a["loss_plain"]) and a["cost"] != 0.0


def verdict_study(seeds=range(4)):
    from gattn.config import Config, ModelConfig, TrainConfig
    from gattn.experiments import study

    base = Config(model=ModelConfig(vocab_size=512, d_model=32, num_layers=1, q_heads=2, kv_heads=2, head_dim=16,
                                    d_ff=64), train=TrainConfig(steps=3, warmup_steps=1))
    return study.Study(base=base, variants=("baseline", "sdpa_elementwise", "sdpa_headwise"), seeds=tuple(seeds),
                       sink_points=0, sink_rule=SinkRule())


def sink_record(variant, seed, alpha, cost, lr):
    """A finished cell whose sink measures are `alpha` (non-trigger alpha_1 per head) and F-Attn
    half of it, with seed-to-seed noise of 2% (the same in every variant)."""
    wobble = 1 + 0.02 * ((seed * 7919) % 5 - 2)
    a = [x * wobble for x in alpha]
    gated = variant != "baseline"
    layer = {"layer": 0, "m_act": 3.0, "f_attn": float(np.mean(a)) / 2, "sink_head_share": 0.0}
    per_head = {"alpha_1_non_trigger_rest_per_head": a, "gate_score_non_trigger_rest_per_head": [0.2] * len(a),
                "gate_score_trigger_per_head": [0.6] * len(a)} if gated else {"alpha_1_non_trigger_rest_per_head": a}
    return {"variant": variant, "lr": lr, "seed": seed, "clip": 1.0, "path": "x", "final_loss": 1.6,
            "losses": {"steps": [1, 2, 3], "loss": [6.0, 5.0, 1.6], "spike_steps": []}, "diverged": None,
            "seconds": {"train": 1.0, "measure": 0.0}, "loss_spikes": 0, "skipped_steps": 0,
            "perplexity": {"backcopy": 5.0}, "sink_curve": [],
            "measurements": {"overall": {"m_act": 3.0 * wobble, "f_attn": layer["f_attn"], "sink_head_share": 0.0},
                             "per_layer": [layer]},
            "sinks": {"overall": {"alpha_1_non_trigger_rest_mean": float(np.mean(a)), "ablation_cost": cost * wobble,
                                  "residual_norm_first": 4.0 * wobble, "sink_share": 0.5},
                      "per_layer": [{"layer": 0, **per_head}]}}


def test_the_study_report_gives_the_preset_verdict(tmp_path):
    """Synthetic cells with a known answer: the elementwise gate cuts alpha_1 (and F-Attn) by 75%,
    the headwise gate leaves it; with a baseline sink that costs 0.1 nats that is "removes" and
    "does not change"; with one that costs 0.01 nats there is no verdict."""
    from gattn.experiments.study import describe
    from gattn.experiments.study.report import write_report

    s = verdict_study()
    assert describe(s)["sink_rule"]["min_ablation_cost"] == 0.05  # the rule is part of study.json
    alpha = {"baseline": [0.8, 0.6], "sdpa_elementwise": [0.2, 0.15], "sdpa_headwise": [0.8, 0.6]}
    records = [sink_record(v, seed, alpha[v], 0.1, s.reference_lr) for v in s.variants for seed in s.seeds]
    report = write_report(s, records, tmp_path)
    by = {r["variant"]: r for r in report["sink_rule"]}
    assert by["sdpa_elementwise"]["sink"] == "removes" and by["sdpa_headwise"]["sink"] == "does not change"
    assert by["sdpa_elementwise"]["pairs"] == 4 and by["sdpa_elementwise"]["alone"]["m_act"] == "does not change"
    md = (tmp_path / "report.md").read_text()
    assert "## The preset sink rule" in md and "sink: **removes**" in md
    assert "figures/gate_vs_alpha_1.png" in report["figures"] and (tmp_path / "figures" / "gate_vs_alpha_1.png").is_file()
    weak = [sink_record(v, seed, alpha[v], 0.01, s.reference_lr) for v in s.variants for seed in s.seeds]
    assert {r["sink"] for r in write_report(s, weak, tmp_path / "weak")["sink_rule"]} == {"no verdict"}


def test_the_sink_verdict_preset_carries_its_rule():
    from gattn.experiments import study

    s = study.load("sink_verdict")
    assert s.variants == ("baseline", "sdpa_elementwise", "sdpa_headwise") and len(s.seeds) >= 10
    assert s.sink_rule == SinkRule() and s.base.data.source == "bigram_backcopy"
    assert study.describe(s)["sink_rule"]["sink"] == ["alpha_1_non_trigger_rest_mean", "f_attn"]


def test_the_background_decides_what_follows_a_non_trigger():
    from gattn.config import BackcopySpec, ConfigError
    from gattn.data import backcopy

    uniform = backcopy.task(BackcopySpec(chars=15, triggers="0|1", offsets="1,2", background="uniform"))
    assert np.allclose(uniform.bigram_VxV[1:, 1:], 1 / 15) and np.allclose(uniform.unigram_V[3:], 1 / 13)
    unigram = backcopy.task(BackcopySpec(chars=15, triggers="0|1", offsets="1,2", background="unigram"))
    assert np.allclose(unigram.bigram_VxV[1:], unigram.bigram_VxV[1]) and unigram.bigram_VxV[1, 1] > 0.1
    bigram = backcopy.task(BackcopySpec(chars=15, triggers="0|1", offsets="1,2"))
    assert not np.allclose(bigram.bigram_VxV[1], bigram.bigram_VxV[2])  # the docs' bigrams differ by row
    x = backcopy.sample(uniform, [(0, r, 0) for r in range(64)], 200)
    free = x[:, 1:][~backcopy.is_copy_target(uniform, x)[:, 1:]]
    counts = np.bincount(free, minlength=16)[1:]
    assert counts.min() > 0.8 * counts.mean()  # every character alike
    with pytest.raises(ConfigError, match="background"):
        BackcopySpec(background="zipf")
