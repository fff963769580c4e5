"""The sink lab (docs/sinks.md): the Bigram-Backcopy data source, the natural-text BOS / no-reset
options, Gu et al.'s Sink_1^eps on constructed attention, and the sink verdict when the baseline
formed no sink."""

import dataclasses

import numpy as np
import pytest

from gattn import cli
from gattn.config import BackcopySpec, Config, ConfigError, DataConfig, ModelConfig, TrainConfig
from gattn.data import backcopy, pipeline
from gattn.eval import sinks
from gattn.experiments import study

SPEC = BackcopySpec(chars=20, triggers="0|1,2", offsets="1,3")


def bb_config(**train) -> Config:
    return Config(model=ModelConfig(vocab_size=21), train=TrainConfig(**{"batch_size": 4, "seq_len": 40, **train}),
                  data=DataConfig(source="bigram_backcopy", backcopy=SPEC, eval_batches=2, eval_batch_size=3))


def test_backcopy_rows_are_deterministic_per_row_and_follow_the_rules():
    cfg = bb_config()
    full = pipeline.train_iterator(cfg, None, None)
    first, second = next(full), next(full)
    assert first["tokens"].shape == (4, 41) and first["tokens"].dtype == np.int32
    assert (first["segment_ids"] == 1).all() and (first["positions"] == np.arange(41)).all()
    assert (first["tokens"][:, 0] == backcopy.START).all() and (first["tokens"][:, 1:] > 0).all()
    assert not np.array_equal(first["tokens"], second["tokens"])
    # Rows 2-3 alone (another process's share) are the same rows; a restored state continues.
    part = pipeline.train_iterator(cfg, None, None, rows=range(2, 4))
    assert np.array_equal(next(part)["tokens"], first["tokens"][2:])
    again = pipeline.train_iterator(cfg, None, None)
    again.set_state(full.get_state())
    assert np.array_equal(next(again)["tokens"], next(full)["tokens"])
    assert not np.array_equal(next(pipeline.train_iterator(dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, seed=1)), None, None))["tokens"], first["tokens"])

    t = backcopy.task(SPEC)
    x = backcopy.sample(t, [(0, r, 0) for r in range(64)], 200)
    offset = {1: 1, 2: 3, 3: 3}  # token k + 1 is the character of rank k
    copied = backcopy.is_copy_target(t, x)
    for b, i in zip(*np.nonzero(copied)):
        assert x[b, i] == x[b, i - 1 - offset[x[b, i - 1]]]  # a copy of the token offset before the trigger
    after_trigger = np.isin(x[:, :-1], [1, 2, 3])
    assert copied[:, 1:].sum() > 0.8 * after_trigger.sum() and copied.sum() > 0.05 * x.size
    assert not np.isin(x[:, 1], [1, 2, 3]).any()  # x_1 is never a trigger
    val = pipeline.validation_batches(cfg, None, None)
    assert list(val) == ["backcopy"] and [b["tokens"].shape for b in val["backcopy"]] == [(3, 41)] * 2
    assert np.array_equal(val["backcopy"][1]["tokens"], pipeline.validation_batches(cfg, None, None)["backcopy"][1]["tokens"])


@pytest.mark.parametrize("seed", [0, 1 << 30, 2**32 - 1])
def test_held_out_rows_are_never_training_rows_whatever_the_seed(seed):
    # Bigram-Backcopy and synthetic held-out rows were once seeded (2**30, i, r), exactly a training
    # row's (train.seed, r, i) when train.seed = 2**30 (a valid seed): every held-out row leaked.
    from gattn.data import synthetic

    cfg = bb_config(seed=seed)
    val = [v for b in pipeline.validation_batches(cfg, None, None)["backcopy"] for v in b["tokens"]]
    train = pipeline.train_iterator(cfg, None, None)
    seen = [t for _ in range(cfg.data.eval_batch_size) for t in next(train)["tokens"]]
    assert not any((v == t).all() for v in val for t in seen)
    syn = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source="synthetic"))
    val = [v for b in synthetic.validation_batches(syn)["synthetic"] for v in b["tokens"]]
    train = synthetic.train_iterator(syn)
    seen = [t for _ in range(cfg.data.eval_batch_size) for t in next(train)["tokens"]]
    assert not any((v == t).all() for v in val for t in seen)


def test_backcopy_tokenizer_is_the_task_s_characters(tmp_path):
    from gattn.data.tokenizer import load_tokenizer

    cfg = bb_config()
    tok = load_tokenizer(cfg, tmp_path)
    assert tok.get_piece_size() == 21 and tok.decode([0, 1]) == "^ " and tok.encode(" e") == [1, 2]
    assert load_tokenizer(cfg, tmp_path).chars == tok.chars  # read back from WORKDIR/tokenizer
    with pytest.raises(ConfigError, match="model.vocab_size"):
        load_tokenizer(dataclasses.replace(cfg, model=ModelConfig(vocab_size=16)), tmp_path)


def test_data_config_is_checked():
    for kwargs, field in [(dict(triggers="0,0"), "triggers"), (dict(triggers="x"), "triggers"),
                          (dict(triggers="0|1", offsets="1"), "offsets"), (dict(offsets="0"), "offsets"),
                          (dict(chars=3), "triggers"), (dict(triggers="70"), "triggers")]:
        with pytest.raises(ConfigError, match=field):
            BackcopySpec(**kwargs)
    for kwargs in (dict(bos=True), dict(document_resets=False), dict(tokenizer="x.model")):
        with pytest.raises(ConfigError, match="own <s> start token"):
            DataConfig(source="bigram_backcopy", **kwargs)
    with pytest.raises(ConfigError, match="'data.backcopy.offsets'"):
        cli.apply_overrides(Config(), ["data.source=bigram_backcopy", "data.backcopy.triggers=0|1"])
    cfg = cli.apply_overrides(Config(), ["data.backcopy.triggers=0|1|2|3", "data.backcopy.offsets=1,2,3,4"])
    assert cfg.data.backcopy.trigger_sets == [[0], [1], [2], [3]] and cfg.data.backcopy.offset_list == [1, 2, 3, 4]


class Chars:  # a tokenizer stand-in: one id per character
    def encode(self, text):
        return [ord(c) for c in text]

    def eos_id(self):
        return 2

    def bos_id(self):
        return 1


def test_natural_text_bos_and_plain_windows():
    assert pipeline._tokenize(Chars(), bos=True)({"text": "ab"})["tokens"].tolist() == [1, 97, 98, 2]
    assert pipeline._tokenize(Chars())({"text": b"ab"})["tokens"].tolist() == [97, 98, 2]
    packed = {"tokens": np.arange(6), "tokens_segment_ids": np.array([1, 1, 2, 2, 2, 0]),
              "tokens_positions": np.array([0, 1, 0, 1, 2, 0])}
    assert pipeline._layout(True)(packed)["positions"].tolist() == [0, 1, 0, 1, 2, 0]
    plain = pipeline._layout(False)(packed)
    assert plain["segment_ids"].tolist() == [1, 1, 1, 1, 1, 0] and plain["positions"].tolist() == list(range(6))


def test_padding_rows_leave_the_first_token_norms_alone():
    """validation_batches pads a small domain's last batch with segment-0 rows: they have no first
    token, so the first token's value and residual norms average over the real rows only."""
    b, h, t = 2, 2, 8
    real = {"first_probs": np.full((b, h, t), 0.5), "sdpa_out": np.ones((b * t, h, 4)),
            "block_out": np.ones((b * t, 5))}
    real["sdpa_out"][0::t], real["block_out"][0::t] = 3.0, 2.0
    padded = {k: np.concatenate([v, np.zeros_like(v)]) for k, v in real.items()}
    seg = np.ones((b, t), np.int64)
    results = []
    for layer, ids in ((real, seg), (padded, np.concatenate([seg, 0 * seg]))):
        stats = sinks.SinkStats(num_layers=1, heads=h)
        stats.add([layer], ids, {})
        results.append(stats.result(t))
    (one,), (two,) = (r["per_layer"] for r in results)
    for key in ("value_norm_first", "residual_norm_first", "residual_norm_rest"):
        assert two[key] == pytest.approx(one[key])
    assert one["value_norm_first"] == pytest.approx(6.0)
    assert results[1]["overall"]["windows"] == b


def test_sink_1_eps_on_constructed_attention():
    b, h, t = 2, 3, 16
    probs = np.zeros((b, h, t))
    probs[:, 0] = 1.0                            # head 0: every query on token 0 -> alpha_1 = 1
    probs[:, 1] = 1.0 / np.arange(1, t + 1)      # head 1: uniform -> H_T / T
    probs[:, 2] = np.where(np.arange(t) == 0, 1.0, 0.4)  # head 2: (1 + 0.4 (T - 1)) / T
    seg = np.ones((b, t), np.int64)
    layer = {"first_probs": probs, "sdpa_out": np.zeros((b * t, h, 4)), "block_out": np.ones((b * t, 5))}
    layer["sdpa_out"][0::t] = 3.0                # the first token's value: norm 6 in every head
    layer["block_out"][0::t] = 2.0               # its residual: norm 2 sqrt(5); the rest sqrt(5)
    stats = sinks.SinkStats(num_layers=1, heads=h)
    trigger = np.zeros((b, t), bool)
    trigger[:, 1::2] = True
    stats.add([layer], seg, {"non_trigger": ~trigger})
    res = stats.result(t)
    uniform = sum(1 / k for k in range(1, t + 1)) / t
    assert res["overall"]["uniform_alpha_1"] == pytest.approx(uniform) and uniform < 0.3
    assert res["per_layer"][0]["alpha_1_per_head"] == pytest.approx([1.0, uniform, (1 + 0.4 * 15) / 16])
    assert res["overall"]["sink_share"] == pytest.approx(2 / 3)
    # Non-trigger queries: positions 0, 2, ..., 14.
    assert res["per_layer"][0]["alpha_1_non_trigger_per_head"] == pytest.approx(
        [1.0, sum(1 / k for k in range(1, 16, 2)) / 8, (1 + 0.4 * 7) / 8])
    assert res["per_layer"][0]["value_norm_first"] == pytest.approx(6.0)
    assert res["per_layer"][0]["residual_norm_first"] == pytest.approx(2 * 5 ** 0.5)
    assert res["per_layer"][0]["residual_norm_rest"] == pytest.approx(5 ** 0.5)
    assert sinks.uniform_level(64) == pytest.approx(0.0741, abs=1e-4)
    # A window holding two documents: only the first one's queries count.
    seg2 = np.array([[1] * 4 + [2] * 12] * 2)
    two = sinks.SinkStats(1, h)
    two.add([layer], seg2, {})
    assert two.result(t)["per_layer"][0]["alpha_1_per_head"][1] == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    batch = {"segment_ids": np.array([[1, 1, 1, 2, 2, 2, 0]])}  # F-Attn's queries: 2 of doc 1, 2 of doc 2
    assert sinks.uniform_f_attn([batch]) == pytest.approx((1 / 2 + 1 / 3) / 2)


def test_the_two_sink_head_shares_are_named_apart():
    """analysis's `sink_head_share` (F-Attn > 0.3) and sinks' `sink_share` (Gu et al.'s Sink_1^0.3)
    average different queries and can disagree (0.00 against 0.25 on the sink lab's baseline):
    each is shown under a label naming its own definition, and docs/sinks.md says why."""
    import inspect
    from pathlib import Path

    from gattn.eval import analysis

    f_attn, gu = analysis.sink_heads_label(0.3), sinks.share_label(0.3, 64)
    assert f_attn != gu
    assert "F-Attn > 0.3" in f_attn and "Sink_1" not in f_attn and "Gu" not in f_attn
    assert all(x in gu for x in ("Sink_1^0.3", "Gu et al.", "alpha_1 > 0.3", "T = 64")) and "F-Attn" not in gu
    assert "every query" in analysis.SINK_HEADS_DEFINITION and "first query included" in sinks.SHARE_DEFINITION
    assert "sink metric of Gu" not in inspect.getsource(analysis)  # (it is F-Attn's count, not Gu's)
    o = {"eps": 0.3, "window": 64, "sink_share": 0.25, "alpha_1_mean": 0.2, "alpha_1_max": 0.31,
         "uniform_alpha_1": 0.074}
    assert sinks.report_lines({"overall": o, "per_layer": []})[0].startswith(f"- {gu}: 25%")
    docs = Path(__file__).resolve().parents[1] / "docs"
    section = (docs / "sinks.md").read_text().split("### Two sink-head shares")[1].split("\n## ")[0]
    assert f"**{f_attn}**" in section and f"**{gu}**" in section and "why they disagree" in section
    row = next(x for x in (docs / "evaluation.md").read_text().splitlines() if "`sink_head_share` |" in x)
    assert "F-Attn sink heads" in row and "not Gu et al.'s" in row


def group(variant, f_attn, std, m_act, share=None, uniform=None, n=3):
    stat = lambda m, s=std: {"mean": m, "std": s, "n": n}  # noqa: E731
    return {"variant": variant, "lr": 1e-3, "seeds": n, "diverged": 0, "ppl_avg": stat(20.0),
            "f_attn": stat(f_attn), "m_act": stat(m_act, 1.0), "final_loss": stat(3.0), "final_loss_per_seed": [3.0] * n,
            "sink_share": stat(share, 0.0) if share is not None else None,
            "uniform_f_attn": stat(uniform, 0.0) if uniform is not None else None}


def sink_verdict(groups):
    return {c["claim"]: c for c in study.claims(groups, 1e-3)}["gating_removes_sink_and_massive_activations"]


def test_no_sink_in_the_baseline_means_cannot_tell():
    # The case: both at the uniform level, the gated one a little higher: not "contradicts".
    c = sink_verdict([group("baseline", 0.020, 0.001, 30.0, share=0.0, uniform=0.024),
                      group("sdpa_elementwise", 0.022, 0.001, 30.0, share=0.0, uniform=0.024)])
    assert c["verdict"] == "inconclusive" and c["parts"] == {"sink": "inconclusive", "m_act": "inconclusive"}
    assert "cannot tell: no sink formed in the baseline (its Sink_1^0.3 share is 0" in c["text"]
    # No share measured, but F-Attn within the seed spread of uniform attention's.
    c = sink_verdict([group("baseline", 0.0235, 0.001, 30.0, uniform=0.024),
                      group("sdpa_elementwise", 0.030, 0.001, 30.0, uniform=0.024)])
    assert c["verdict"] == "inconclusive" and "within the seed spread of uniform attention's 0.024" in c["text"]
    # M-Act is judged on its own: lower by far with the gate -> that part is supported, the claim cannot tell.
    c = sink_verdict([group("baseline", 0.020, 0.001, 100.0, share=0.0), group("sdpa_elementwise", 0.022, 0.001, 10.0)])
    assert c["parts"]["m_act"] == "supported" and c["verdict"] == "inconclusive"
    assert "M-Act, judged on its own: this run supports it" in c["text"]
    c = sink_verdict([group("baseline", 0.020, 0.001, 10.0, share=0.0), group("sdpa_elementwise", 0.022, 0.001, 100.0)])
    assert c["verdict"] == "contradicted" and c["parts"]["m_act"] == "contradicted"
    # A baseline with a sink: the F-Attn comparison counts again, both ways.
    c = sink_verdict([group("baseline", 0.40, 0.02, 100.0, share=0.5, uniform=0.024),
                      group("sdpa_elementwise", 0.05, 0.02, 10.0, share=0.0, uniform=0.024)])
    assert c["verdict"] == "supported" and not c["no_sink_in_reference"]
    c = sink_verdict([group("baseline", 0.40, 0.02, 100.0, share=0.5, uniform=0.024),
                      group("sdpa_elementwise", 0.60, 0.02, 10.0, share=0.75, uniform=0.024)])
    assert c["verdict"] == "contradicted" and c["parts"]["sink"] == "contradicted"


def fake_record(variant, lr, seed, clip, diverged):
    losses = {"steps": [1, 2, 3], "loss": [6.0, 5.0, None if diverged else 4.0], "spike_steps": [2] if diverged else []}
    rec = {"variant": variant, "lr": lr, "seed": seed, "clip": clip, "path": "x", "losses": losses,
           "final_loss": 5.0 if diverged else 4.0, "diverged": "training stopped: nan" if diverged else None,
           "seconds": {"train": 1.0, "measure": 0.0}}
    if not diverged:
        layer = {"layer": 0, "m_act": 3.0, "f_attn": 0.1, "sink_head_share": 0.0}
        rec.update(loss_spikes=0, skipped_steps=0, perplexity={"text": 50.0}, sink_curve=[],
                   measurements={"overall": {"m_act": 3.0, "f_attn": 0.1, "sink_head_share": 0.0},
                                 "per_layer": [layer]})
    return rec


def clip_study():
    from gattn.config import Config, ModelConfig, TrainConfig

    base = Config(model=ModelConfig(vocab_size=512, d_model=32, num_layers=1, q_heads=2, kv_heads=1, head_dim=16,
                                    d_ff=64), train=TrainConfig(steps=3, warmup_steps=1))
    with pytest.raises(ConfigError, match="cell_dir.*several grad_clips"):
        study.Study(base=base, seeds=(0,), grad_clips=(1.0, 0.0), sink_points=0)
    with pytest.raises(ConfigError, match="grad_clips"):
        study.Study(base=base, seeds=(0,), grad_clips=(-1.0,), sink_points=0)
    s = study.Study(base=base, variants=("baseline", "sdpa_elementwise"), seeds=(0,), learning_rates=(1e-3, 1e-1),
                    grad_clips=(1.0, 0.0), sink_points=0, cell_dir="{variant}/clip_{clip:g}/lr_{lr:g}")
    grid = study.cells(s)
    assert len(grid) == 8 and {c.clip for c in grid} == {1.0, 0.0}
    assert [study.cell_config(s, c).train.grad_clip for c in grid[:1] + grid[-1:]] == [1.0, 0.0]
    # Without clipping the baseline diverges at the high LR and the gate does not; with it, neither.
    records = [fake_record(c.variant, c.lr, c.seed, c.clip, c.clip == 0 and c.lr == 1e-1 and c.variant == "baseline")
               for c in grid]
    return s, records


def test_gradient_clipping_is_a_study_axis():
    from gattn.experiments.study.report import clip_claims
    from gattn.experiments.study.stats import aggregate

    s, records = clip_study()
    groups = aggregate(s, records)
    assert {(g["clip"], g["lr"], g["variant"]): g["diverged"] for g in groups}[(0.0, 1e-1, "baseline")] == 1
    lr_claims = {c["grad_clip"]: c for c in clip_claims(s, groups) if c["claim"].startswith("gating_tolerates_higher_lr")}
    assert lr_claims[0.0]["verdict"] == "supported" and lr_claims[1.0]["verdict"] != "supported"
    assert lr_claims[0.0]["text"].startswith("*no gradient clipping:*")


@pytest.mark.slow
def test_a_report_with_a_clipping_axis(tmp_path):
    from gattn.experiments.study.report import write_report

    s, records = clip_study()
    report = write_report(s, records, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## Stability across learning rates (no gradient clipping)" in md and "1/1 diverged" in md
    assert "figures/stability_clip_0.png" in report["figures"]


@pytest.mark.slow
def test_the_sink_lab_trains_and_eval_reports_sinks(tmp_path):
    import json

    from gattn.eval import evaluate
    from gattn.train import trainer

    cfg = cli.apply_overrides(cli.load("sink_lab"), ["train.steps=40", "train.warmup_steps=5", "train.eval_every=40",
                                                     "train.checkpoint_every=40", "data.eval_batches=1"])
    summary = trainer.train(cfg, tmp_path, progress=False)
    assert summary["completed"] and summary["final_loss"] < 3.5  # below ln(64): it learns the bigrams
    evaluate.evaluate(tmp_path)
    res = json.loads((tmp_path / "eval" / "results.json").read_text())
    o = res["sinks"]["overall"]
    window = min(64, cfg.train.seq_len)  # (the lab's rows are 32 tokens)
    assert o["window"] == window and o["uniform_alpha_1"] == pytest.approx(sinks.uniform_level(window))
    assert o["ablation_cost"] == pytest.approx(res["sinks"]["ablation"]["cost"]) and "hiding the first token" in \
        (tmp_path / "eval" / "results.md").read_text()
    assert 0 <= o["sink_share"] <= 1 and "sink_share_non_trigger" in o and o["windows"] == 32
    assert len(res["sinks"]["per_layer"][0]["alpha_1_per_head"]) == 4
    assert "Sink_1^0.3" in (tmp_path / "eval" / "results.md").read_text()
    assert (tmp_path / "eval" / "sink_heads.png").is_file()


def test_bos_is_the_tokenizer_s_own_or_refused(tmp_path):
    # A tokenizer without a BOS token (Qwen's tokenizer.json: id 1 is '"') must not get id 1 as one.
    from tokenizers import Tokenizer, models, pre_tokenizers

    from gattn.data.tokenizer import HFTokenizer

    vocab = {"<|endoftext|>": 0, '"': 1, "hello": 2, "<s>": 3, "[UNK]": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>", "bos_token": null}')
    hf = HFTokenizer(tmp_path / "tokenizer.json")
    assert hf.bos_id() == -1 and pipeline._tokenize(hf)({"text": "hello"})["tokens"].tolist() == [2, 0]
    with pytest.raises(ConfigError, match="'data.bos'.*no BOS token"):
        pipeline._tokenize(hf, bos=True)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>", "bos_token": {"content": "<s>"}}')
    with_bos = pipeline._tokenize(HFTokenizer(tmp_path / "tokenizer.json"), bos=True)
    assert with_bos({"text": "hello"})["tokens"].tolist() == [3, 2, 0]
    no_bos = type("NoBos", (Chars,), {"bos_id": lambda self: -1})()  # a SentencePiece model with bos_id=-1
    with pytest.raises(ConfigError, match="'data.bos'"):
        pipeline._tokenize(no_bos, bos=True)


@pytest.mark.slow
def test_natural_text_with_bos_and_without_document_resets(tmp_path):
    from gattn.data.tokenizer import load_tokenizer

    cfg = cli.apply_overrides(cli.load("tiny"), ["model.vocab_size=512", "data.code_max_bytes=100000",
                                                 "data.bos=true", "data.document_resets=false",
                                                 "train.batch_size=2", "train.seq_len=64"])
    pipeline.prepare(cfg, tmp_path)
    tok = load_tokenizer(cfg, tmp_path)
    batch = next(pipeline.train_iterator(cfg, tok, tmp_path))
    assert (batch["segment_ids"] == 1).all() and (batch["positions"] == np.arange(65)).all()
    val = pipeline.validation_batches(cfg, tok, tmp_path)
    rows = np.concatenate([b["tokens"] for d in val.values() for b in d])
    # Every document opens with BOS, right after the previous one's EOS.
    after_eos = rows[:, 1:][rows[:, :-1] == 2]
    assert len(after_eos) > 0 and (after_eos == 1).all()


def test_the_presets():
    from gattn.model.params import count_params

    lab = study.load("sink_lab")
    assert lab.variants == ("baseline", "sdpa_elementwise", "sdpa_headwise", "sdpa_ns_sigmoid")
    assert lab.base.data.source == "bigram_backcopy" and len(lab.seeds) == 3
    assert {"sdpa_headwise_removes_sink", "sdpa_ns_sigmoid_removes_sink"} <= {c.key for c in lab.claims}
    stab = study.load("lr_stability_tiny")
    assert stab.clips == (1.0, 0.0) and stab.gated == "sdpa_elementwise_ffn_matched"
    base, gated = (count_params(study.cell_config(stab, c).model) for c in study.cells(stab)[::2][:2])
    assert abs(gated - base) < 0.001 * base  # Table 2's protocol: the gate paid for by FFN columns
