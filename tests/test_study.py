"""The study runner (gattn/study.py): a 2-variant x 2-seed study end to end, killed mid-study and
resumed without retraining finished cells; the per-claim verdicts from constructed numbers."""

import json
import math
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gattn.eval import plots
from gattn.experiments import study
from gattn.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
STUDY = textwrap.dedent("""
    from gattn.config import Config, DataConfig, ModelConfig, TrainConfig
    from gattn.experiments.study import Study

    def get_study():
        base = Config(model=ModelConfig(vocab_size=512, d_model=32, num_layers=2, q_heads=2, kv_heads=1,
                                        head_dim=16, d_ff=64),
                      train=TrainConfig(batch_size=4, seq_len=32, steps=6, warmup_steps=2, learning_rate=3e-3,
                                        eval_every=6),
                      data=DataConfig(code_max_bytes=200_000, eval_batches=1, eval_batch_size=2))
        return Study(base=base, variants=("baseline", "sdpa_elementwise"), seeds=(0, 1), sink_points=2,
                     measure_batches=1, description="test study")
    """)


def test_study_runs_resumes_after_a_kill_and_reports_everything(tmp_path):
    path = tmp_path / "mini.py"
    path.write_text(STUDY)
    root = tmp_path / "study"
    proc = subprocess.Popen([sys.executable, "-m", "gattn.study", str(path), "--workdir", str(root)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = root / "runs" / "baseline" / "lr_0.003" / "seed_0"
    deadline = time.time() + 300
    while not (first / "cell.json").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline, "the first cell did not finish in time"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)  # mid-study: the second cell is training or about to
    proc.wait()
    assert not (root / "report.json").exists()
    saved = {f: (first / f).read_bytes() for f in ("cell.json", "metrics.jsonl")}

    lines = []
    report = study.run(study.load(path), root, log=lambda msg, **_: lines.append(msg))
    assert "finished earlier, skipped" in lines[0] and all("skipped" not in x for x in lines[2:])
    assert {f: (first / f).read_bytes() for f in saved} == saved  # never retrained

    assert report["study"]["tokens"] == 6 * 4 * 32 and report["study"]["seeds"] == [0, 1]
    assert [(g["variant"], g["seeds"], g["diverged"]) for g in report["groups"]] == [("baseline", 2, 0),
                                                                                   ("sdpa_elementwise", 2, 0)]
    for g in report["groups"]:
        for key in ("ppl_avg", "final_loss", "m_act", "f_attn", "loss_spikes"):
            assert g[key]["n"] == 2 and g[key]["std"] >= 0, key
        assert set(g["ppl"]) == {"code", "docs"} and len(g["per_layer"]) == 2
        assert [r["step"] for r in g["sink_curve"]] == [1, 3, 6]  # F-Attn at each checkpoint (the first too)
    base, gated = report["groups"]
    assert base["added_params"] == 0 and gated["added_params"] == 2 * 32 * 2 * 16  # layers x D x q_heads x K
    assert base["gate_score"] is None and 0 < gated["gate_score"]["mean"] < 1
    cells = [json.loads((root / c["path"] / "cell.json").read_text()) for c in report["cells"]]
    for g in report["groups"]:  # the table's means are the seeds' numbers
        ppls = [sum(c["perplexity"].values()) / 2 for c in cells if c["variant"] == g["variant"]]
        assert g["ppl_avg"]["mean"] == pytest.approx(sum(ppls) / 2)
    assert len(report["claims"]) == 7 and {c["verdict"] for c in report["claims"]} <= set(study.WORDS)
    assert report["claims"][0]["verdict"] != "untested" and report["claims"][-1]["verdict"] == "untested"
    for fig in ("loss_curves", "per_layer", "gate_scores", "attention_maps", "f_attn_vs_tokens", "mean_abs_y"):
        assert (root / "figures" / f"{fig}.png").stat().st_size > 5000, fig
    assert report["seconds"]["train"] > 0 and report["seconds"]["measure"] > 0
    md = (root / "report.md").read_text()
    assert "| sdpa_elementwise | 2,048 |" in md and md.count("This run") == 7
    assert "| variant | 128 | 384 | 768 |" in md  # F-Attn against training tokens
    # A rerun of a finished study retrains nothing and writes the same report; another budget
    # in the same directory is refused.
    again = study.run(study.load(path), root, log=lambda *a, **k: None)
    assert again["groups"] == report["groups"]
    with pytest.raises(ConfigError, match="base.train.steps.*holds a study run with base.train.steps = 6"):
        study.run(study.load(path, ["train.steps=8"]), root, log=lambda *a, **k: None)


def test_non_finite_losses_are_read_as_missing(tmp_path):
    rows = [{"step": 1, "loss": 6.0, "loss_spikes": 0}, {"step": 2, "loss": None, "loss_spikes": 0},
            {"step": 3, "loss": 9.0, "loss_spikes": 1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert study.runner._losses(tmp_path) == {"steps": [1, 2, 3], "loss": [6.0, None, 9.0], "spike_steps": [3]}


def group(variant, ppl, std=0.1, n=3, lr=1e-3, diverged=0, f_attn=None, m_act=None, final=3.0):
    stat = lambda m, s=std: {"mean": m, "std": s, "n": n}  # noqa: E731
    return {"variant": variant, "lr": lr, "seeds": n, "diverged": diverged,
            "ppl_avg": stat(ppl) if diverged < n else None, "f_attn": stat(f_attn) if f_attn is not None else None,
            "m_act": stat(m_act) if m_act is not None else None, "final_loss": stat(final),
            "final_loss_per_seed": [final] * n}


def verdicts(groups, lr=1e-3):
    return {c["claim"]: c for c in study.claims(groups, lr)}


def test_verdicts_follow_the_numbers_both_ways():
    better = verdicts([group("baseline", 20.0, f_attn=0.5, m_act=100.0),
                       group("sdpa_elementwise", 18.0, f_attn=0.1, m_act=10.0),
                       group("v_elementwise", 19.0), group("sdpa_head_shared", 18.5),
                       group("sdpa_ns_sigmoid", 19.5), group("sdpa_input_independent", 19.9)])
    for key in ("gated_beats_baseline", "head_specific_beats_shared", "sparse_beats_ns_sigmoid",
                "input_dependent_beats_independent", "gating_removes_sink_and_massive_activations"):
        assert better[key]["verdict"] == "supported", key
    assert better["position_order"]["verdict"] == "partly supported"  # G1 > G2 only: no G3/G4/G5 run
    assert "supports part of it" in better["position_order"]["text"]
    text = better["gated_beats_baseline"]["text"]
    assert "supports it" in text and "18.00 ± 0.10 vs baseline 20.00 ± 0.10 (3 seeds)" in text
    assert "2.00 lower, by more than the seed spread (0.10)" in text
    assert "v_elementwise vs k_elementwise not tested (the study has no k_elementwise run: add it to " \
        "Study.variants (--variants))" in better["position_order"]["text"]

    worse = verdicts([group("baseline", 18.0, f_attn=0.1, m_act=10.0),
                      group("sdpa_elementwise", 20.0, f_attn=0.5, m_act=100.0)])
    assert worse["gated_beats_baseline"]["verdict"] == "contradicted"
    assert "contradicts it" in worse["gated_beats_baseline"]["text"] and "2.00 higher" in \
        worse["gated_beats_baseline"]["text"]
    assert worse["gating_removes_sink_and_massive_activations"]["verdict"] == "contradicted"
    assert worse["head_specific_beats_shared"]["verdict"] == "untested"
    assert "does not test it" in worse["head_specific_beats_shared"]["text"]

    noisy = verdicts([group("baseline", 20.0, std=1.5), group("sdpa_elementwise", 19.0, std=1.5)])
    assert noisy["gated_beats_baseline"]["verdict"] == "inconclusive"
    assert "1.00 within the seed spread (1.50)" in noisy["gated_beats_baseline"]["text"]
    one_seed = verdicts([group("baseline", 20.0, std=0.0, n=1), group("sdpa_elementwise", 19.0, std=0.0, n=1)])
    assert one_seed["gated_beats_baseline"]["verdict"] == "inconclusive"
    assert "one seed, so no spread to judge by" in one_seed["gated_beats_baseline"]["text"]
    lost = verdicts([group("baseline", 20.0), group("sdpa_elementwise", 18.0, diverged=1)])
    assert lost["gated_beats_baseline"]["verdict"] == "inconclusive"
    assert "1 of 3 seeds of sdpa_elementwise diverged and are left out" in lost["gated_beats_baseline"]["text"]
    reduced = verdicts([group("baseline", 20.0, f_attn=0.5, m_act=100.0),
                        group("sdpa_elementwise", 18.0, f_attn=0.3, m_act=10.0)])
    sink = reduced["gating_removes_sink_and_massive_activations"]
    assert sink["verdict"] == "partly supported" and "but not removed (60% of the baseline's" in sink["text"]
    mixed = verdicts([group("baseline", 20.0, f_attn=0.5, m_act=10.0),
                      group("sdpa_elementwise", 18.0, f_attn=0.1, m_act=100.0)])
    assert mixed["gating_removes_sink_and_massive_activations"]["verdict"] == "contradicted"


def test_learning_rate_claim_both_ways(tmp_path):
    def sweep(base_div, gated_div):
        return [g for lr, b, d in zip((1e-3, 1e-2), base_div, gated_div)
                for g in (group("baseline", 20.0, lr=lr, diverged=b),
                          group("sdpa_elementwise", 19.0, lr=lr, diverged=d))]

    assert verdicts(sweep((0, 3), (0, 0)))["gating_tolerates_higher_lr"]["verdict"] == "supported"
    text = verdicts(sweep((0, 3), (0, 0)))["gating_tolerates_higher_lr"]["text"]
    assert "LR 0.01: baseline diverged in 3/3 seeds" in text and "sdpa_elementwise in 0/3" in text
    assert verdicts(sweep((0, 0), (0, 2)))["gating_tolerates_higher_lr"]["verdict"] == "contradicted"
    quiet = verdicts(sweep((0, 0), (0, 0)))["gating_tolerates_higher_lr"]  # equal final losses
    assert quiet["verdict"] == "inconclusive" and "nothing diverged at these learning rates" in quiet["text"]
    lower = sweep((0, 0), (0, 0))
    lower[-1]["final_loss"] = {"mean": 2.0, "std": 0.1, "n": 3}  # gated at the highest LR
    claim = verdicts(lower)["gating_tolerates_higher_lr"]
    assert claim["verdict"] == "partly supported" and "at the highest LR, sdpa_elementwise final loss 2.000" in \
        claim["text"]
    assert verdicts([group("baseline", 20.0), group("sdpa_elementwise", 19.0)])[
        "gating_tolerates_higher_lr"]["verdict"] == "untested"
    assert plots.stability(sweep((0, 3), (0, 0)), 8.3, tmp_path / "s.png").stat().st_size > 5000
    assert "| baseline | 0/3 diverged; final loss 3.000, 3.000, 3.000 | 3/3 diverged;" in \
        study.stability_table(sweep((0, 3), (0, 0)))


def test_bad_study_configs_name_the_field(tmp_path):
    from gattn.config import Config, TrainConfig

    base = Config(train=TrainConfig(steps=10, warmup_steps=2))
    for kwargs, match in [(dict(variants=("baseline", "no_such_gate")), "variants.*no_such_gate"),
                          (dict(seeds=(0, 0)), "seeds"), (dict(learning_rates=(1e-3, -1.0)), "learning_rates"),
                          (dict(sink_points=11), r"sink_points.*\[1, train.steps=10\]")]:
        with pytest.raises(ConfigError, match=match):
            study.Study(base=base, **kwargs)
    path = tmp_path / "s.py"
    path.write_text(STUDY)
    with pytest.raises(ConfigError, match="sink_points"):
        study.load(path, ["train.steps=1", "train.warmup_steps=0"])  # 2 sink points in 1 step


def test_a_study_refuses_what_would_file_a_cell_under_another_setting(tmp_path):
    """A review's findings, each accepted before: overrides that set what each cell sets (train.seed=5
    trained every "seed" alike); a base model override the cells drop (sandwich_norm, reset by the
    baseline, yet recorded in study.json); a sink rule without its reference (a KeyError once every
    cell had trained); an ungated `gated`; and, on resume, changed sink_points, measure_batches or
    cell_dir (cells measured over 2 batches beside new ones over 8)."""
    from gattn.config import Config, ModelConfig, TrainConfig
    from gattn.eval.verdict import SinkRule
    from gattn.experiments.study.runner import _check_same_study

    base = Config(model=ModelConfig(vocab_size=64, d_model=32, num_layers=1, q_heads=2, kv_heads=1, head_dim=16,
                                    d_ff=64), train=TrainConfig(steps=10, warmup_steps=2))
    two = dict(base=base, variants=("baseline", "sdpa_elementwise"), seeds=(0, 1))
    for o in ("train.seed=5", "--config.train.learning_rate=0.1", "train.grad_clip=0"):
        with pytest.raises(ConfigError) as e:
            study.Study(**two, overrides=(o,))
        assert e.value.field == "overrides" and e.value.value == o
    path = tmp_path / "s.py"
    path.write_text(STUDY)
    with pytest.raises(ConfigError) as e:
        study.load(path, ["model.sandwich_norm=true"])
    assert e.value.field == "base.variant" and "sandwich_norm" in e.value.value
    with pytest.raises(ConfigError, match="sink verdict.*the reference, baseline: include it"):
        study.Study(base=base, variants=("sdpa_elementwise", "sdpa_headwise"), seeds=(0,), sink_rule=SinkRule())
    with pytest.raises(ConfigError, match="'gated' = 'sdpa_rmsnorm'.*a variant with a gate"):
        study.Study(base=base, variants=("baseline", "sdpa_rmsnorm"), seeds=(0,), gated="sdpa_rmsnorm")
    first = study.Study(**two, measure_batches=2)
    (tmp_path / "study.json").write_text(json.dumps(study.describe(first)))
    for change in (dict(measure_batches=8), dict(sink_points=1), dict(cell_dir="{variant}/{seed}")):
        with pytest.raises(ConfigError) as e:
            _check_same_study(study.Study(**two, **change), tmp_path)
        assert e.value.field == next(iter(change))
    old = {k: v for k, v in study.describe(first).items() if k not in ("measure_batches", "sink_points", "cell_dir")}
    (tmp_path / "study.json").write_text(json.dumps(old))  # written before they were recorded: still matches
    _check_same_study(first, tmp_path)


def test_added_parameters_count_the_models_the_cells_train():
    """(Before: counted on the study's baseline without its overrides: with d_model 64 the gate's
    parameters were those of the 32-wide model.)"""
    from gattn.config import Config, ModelConfig, TrainConfig
    from gattn.experiments.study.spec import cell_config, cells
    from gattn.experiments.study.stats import aggregate
    from gattn.model.params import count_params

    base = Config(model=ModelConfig(vocab_size=64, d_model=32, num_layers=1, q_heads=2, kv_heads=1, head_dim=16,
                                    d_ff=64), train=TrainConfig(steps=10, warmup_steps=2))
    s = study.Study(base=base, variants=("baseline", "sdpa_elementwise"), seeds=(0,), overrides=("model.d_model=64",))
    trained = {c.variant: count_params(cell_config(s, c).model) for c in cells(s)}
    added = {g["variant"]: g["added_params"] for g in aggregate(s, [])}
    assert added == {"baseline": 0, "sdpa_elementwise": trained["sdpa_elementwise"] - trained["baseline"]}
    assert added["sdpa_elementwise"] == 64 * 2 * 16  # W_theta: d_model x q_heads x head_dim


def test_cell_dir_is_a_checked_template(tmp_path):
    from gattn.config import Config, TrainConfig

    base = Config(train=TrainConfig(steps=10, warmup_steps=2))
    flat = study.Study(base=base, seeds=(0,), cell_dir="{variant}")
    assert [str(c.path) for c in study.cells(flat)] == ["baseline", "sdpa_elementwise"]
    assert str(study.cells(study.Study(base=base))[1].path) == "runs/baseline/lr_0.003/seed_1"
    for kwargs, match in [(dict(cell_dir="runs/{variant}"), r"cell_dir.*expected \{seed\}"),
                          (dict(cell_dir="runs/{seed}"), r"expected \{variant\}"),
                          (dict(cell_dir="{variant}/{seed}", learning_rates=(1e-3, 2e-3)), r"expected \{lr\}"),
                          (dict(cell_dir="{variant}/{seed}/{step}"), "only the fields"),
                          (dict(cell_dir="../{variant}/{seed}"), "relative directory"),
                          (dict(cell_dir="shared/{variant}/{seed}"), "relative directory"),
                          (dict(cell_dir="{variant}/{seed}/{lr:.0f}", learning_rates=(1e-3, 2e-3)), "same directory")]:
        with pytest.raises(ConfigError, match=match):
            study.Study(base=base, **kwargs)


def test_claims_point_at_the_study_s_variants():
    from gattn.config import Config, TrainConfig

    base = Config(train=TrainConfig(steps=10, warmup_steps=2))
    for kwargs, match in [(dict(gated="no_such_gate"), "gated.*no_such_gate"), (dict(gated="baseline"), "gated"),
                          (dict(reference="nope"), "reference")]:
        with pytest.raises(ConfigError, match=match):
            study.Study(base=base, **kwargs)
    with pytest.raises(ConfigError, match="claims.x.pairs"):
        study.Claim("x", "X", ((study.GATED, study.REFERENCE), ("baseline", "v_elementwise")), test="sink")
    groups = [group("baseline", 20.0, f_attn=0.5, m_act=100.0), group("sdpa_headwise", 18.0, f_attn=0.1, m_act=10.0)]
    assert verdicts(groups)["gated_beats_baseline"]["verdict"] == "untested"  # the paper's: sdpa_elementwise
    headwise = {c["claim"]: c for c in study.claims(groups, 1e-3, gated="sdpa_headwise")}
    assert headwise["gated_beats_baseline"]["verdict"] == "supported"
    assert "sdpa_headwise PPL 18.00 ± 0.10 vs baseline 20.00" in headwise["gated_beats_baseline"]["text"]
    assert headwise["gating_removes_sink_and_massive_activations"]["verdict"] == "supported"
    assert "it needs baseline and sdpa_headwise" in headwise["gating_tolerates_higher_lr"]["text"]
    own = (study.Claim("headwise_beats_baseline", "Headwise beats the baseline", (("sdpa_headwise", "baseline"),)),)
    (claim,) = study.claims(groups, 1e-3, table=own)
    assert claim["claim"] == "headwise_beats_baseline" and claim["verdict"] == "supported"


def test_a_preset_loads_by_name():
    s = study.load("table4_tiny", ["train.steps=60"])
    assert s.base.train.steps == 60 and "sdpa_headwise" in s.variants
    assert study.load("configs/study/lr_stability_tiny.py").lrs == (3e-3, 3e-2, 3e-1)
    with pytest.raises(ConfigError, match="table4_tiny"):
        study.load("no_such_study")


def test_a_study_on_an_lr_preset_trains_each_cell_at_its_own_lr():
    """A base with train.lr_preset (dense_1p7b.py's dense_400b: 4e-3 -> 4e-5, 1k warmup): each cell
    trains at its own peak LR with the preset's warmup and floor ratio, and an LR-less study is
    labelled with the LR it trains at (the preset's, not learning_rate's default)."""
    from gattn.config import Config, TrainConfig

    base = Config(train=TrainConfig(steps=2000, lr_preset="dense_400b"))
    s = study.Study(base=base, seeds=(0,), learning_rates=(1e-3, 8e-3))
    for cell in study.cells(s):
        t = study.cell_config(s, cell).train
        assert t.schedule == pytest.approx((cell.lr, cell.lr / 100, 1000)) and t.lr_preset == ""
    plain = study.Study(base=base, seeds=(0,))
    assert plain.lrs == (4e-3,) and plain.reference_lr == 4e-3
    assert {study.cell_config(plain, c).train.schedule for c in study.cells(plain)} == {(4e-3, 4e-5, 1000)}


def test_diverged_seeds_leave_the_final_loss_and_the_lr_claim_inconclusive():
    """A diverged seed's last finite loss is not a final loss: the group's final_loss averages the
    finished seeds (the per-seed list keeps them all); with seeds lost at the highest LR on either
    side, the final losses there cannot decide the LR claim."""
    from gattn.config import Config, ModelConfig, TrainConfig

    base = Config(model=ModelConfig(vocab_size=64, d_model=16, num_layers=1, q_heads=2, kv_heads=1, head_dim=8,
                                    d_ff=32), train=TrainConfig(steps=10, warmup_steps=2))
    s = study.Study(base=base, seeds=(0, 1, 2), learning_rates=(1e-3, 1e-2))

    def rec(v, lr, seed, final, diverged=None):
        r = {"variant": v, "lr": lr, "seed": seed, "clip": s.clips[0], "diverged": diverged, "final_loss": final,
             "loss_spikes": 0}
        return r if diverged else {**r, "perplexity": {"d": 20.0}, "sinks": {}, "sink_curve": [],
                                   "measurements": {"overall": {"f_attn": 0.1, "m_act": 1.0}, "per_layer": []}}

    records = [rec(v, lr, seed, loss + 0.01 * seed) for lr in (1e-3, 1e-2) for seed in (0, 1)
               for v, loss in (("baseline", 3.05), ("sdpa_elementwise", 3.0))]
    records += [rec("baseline", 1e-3, 2, 3.07), rec("sdpa_elementwise", 1e-3, 2, 3.02),  # seed 2 diverged at 1e-2
                rec("baseline", 1e-2, 2, 3.2, "stopped"), rec("sdpa_elementwise", 1e-2, 2, 9.9, "stopped")]
    top = {g["variant"]: g for g in study.aggregate(s, records) if g["lr"] == 1e-2}
    assert top["sdpa_elementwise"]["final_loss"] == pytest.approx({"mean": 3.005, "std": 0.00707, "n": 2}, rel=1e-3)
    assert top["sdpa_elementwise"]["final_loss_per_seed"] == [3.0, 3.01, 9.9]
    lr_claim = verdicts(study.aggregate(s, records))["gating_tolerates_higher_lr"]
    assert lr_claim["verdict"] == "inconclusive" and "lost seeds at the highest LR" in lr_claim["text"]


def test_gated_and_reference_default_to_the_study_s_own_variants():
    """Unset, `gated` is sdpa_elementwise when the study runs it, else its only gated variant (else
    sdpa_elementwise); `reference` likewise baseline, else its only ungated variant; set, they stay."""
    from gattn.config import Config, TrainConfig

    base = Config(train=TrainConfig(steps=10, warmup_steps=2))

    def roles(names, **kwargs):
        s = study.Study(base=base, variants=names, seeds=(0,), **kwargs)
        return s.gated_variant, s.reference_variant

    assert roles(("baseline", "sdpa_elementwise")) == ("sdpa_elementwise", "baseline")
    assert roles(("baseline", "sdpa_headwise")) == ("sdpa_headwise", "baseline")
    assert roles(("baseline", "sdpa_headwise", "sdpa_elementwise")) == ("sdpa_elementwise", "baseline")
    assert roles(("sdpa_rmsnorm", "sdpa_headwise")) == ("sdpa_headwise", "sdpa_rmsnorm")  # the only ungated one
    assert roles(("baseline", "sdpa_headwise", "v_elementwise")) == ("sdpa_elementwise", "baseline")  # two: none
    assert roles(("baseline", "sdpa_headwise", "v_elementwise"), gated="v_elementwise") == ("v_elementwise",
                                                                                           "baseline")
    assert roles(("sdpa_headwise", "sdpa_elementwise"), reference="sdpa_elementwise") == ("sdpa_headwise",
                                                                                          "sdpa_elementwise")
    with pytest.raises(ConfigError, match="reference.*its default, baseline, is also `gated`"):
        roles(("baseline", "sdpa_elementwise"), gated="baseline")
    # The report's claims use them: a study of the headwise gate tests the claims about gating.
    s = study.Study(base=base, variants=("baseline", "sdpa_headwise"), seeds=(0,))
    groups = [group("baseline", 20.0, f_attn=0.5, m_act=100.0, lr=s.reference_lr),
              group("sdpa_headwise", 18.0, f_attn=0.1, m_act=10.0, lr=s.reference_lr)]
    by = {c["claim"]: c for c in study.report.clip_claims(s, [{**g, "clip": s.clips[0]} for g in groups])}
    assert by["gated_beats_baseline"]["verdict"] == "supported"
    assert by["gating_removes_sink_and_massive_activations"]["verdict"] == "supported"


def test_an_untested_claim_says_which_field_and_flag_would_test_it():
    groups = [group("baseline", 20.0, f_attn=0.5, m_act=100.0), group("sdpa_headwise", 18.0, f_attn=0.1, m_act=10.0),
              group("v_elementwise", 19.0)]
    by = verdicts(groups)  # gated: sdpa_elementwise, which the study does not run
    fix = ("sdpa_elementwise vs baseline not tested (needs the gated variant sdpa_elementwise, which this study "
           "does not run: set Study.gated (--gated) to one of sdpa_headwise, v_elementwise, or add sdpa_elementwise "
           "to Study.variants (--variants))")
    for key in ("gated_beats_baseline", "gating_removes_sink_and_massive_activations", "gating_tolerates_higher_lr"):
        assert by[key]["verdict"] == "untested" and fix in by[key]["text"], key
    assert by["gating_removes_sink_and_massive_activations"]["text"].count(fix) == 1  # once for F-Attn and M-Act
    assert "(the study has no sdpa_elementwise or sdpa_head_shared run: add them to Study.variants (--variants))" \
        in by["head_specific_beats_shared"]["text"]
    no_reference = {c["claim"]: c for c in study.claims(groups[1:], 1e-3, gated="sdpa_headwise")}
    assert ("needs the reference baseline, which this study does not run: set Study.reference (--reference) to "
            "one of v_elementwise, or add baseline to Study.variants (--variants)") in \
        no_reference["gated_beats_baseline"]["text"]
    one_lr = {c["claim"]: c for c in study.claims(groups, 1e-3, gated="sdpa_headwise")}
    assert "set Study.learning_rates (--lrs) to two or more" in one_lr["gating_tolerates_higher_lr"]["text"]
    lost = verdicts([group("baseline", 20.0), group("sdpa_elementwise", 18.0, diverged=3)])
    assert "(every seed of one of them diverged)" in lost["gated_beats_baseline"]["text"]


def test_the_command_line_builds_a_study_without_a_study_file(tmp_path, monkeypatch):
    from gattn.experiments.study import command

    s, args = command.parse(["--variants", "baseline,sdpa_headwise", "--seeds", "0,1", "--lrs", "1e-3,3e-3",
                             "--steps", "200", "--config", "tiny", "--config.model.d_model=64",
                             "--workdir", str(tmp_path)])
    assert (s.variants, s.seeds, s.learning_rates) == (("baseline", "sdpa_headwise"), (0, 1), (1e-3, 3e-3))
    assert s.base.train.steps == 200 and s.base.model.d_model == 64 and s.base.model.num_layers == 4  # tiny's
    assert (s.gated_variant, s.reference_variant) == ("sdpa_headwise", "baseline")
    assert [str(c.path) for c in study.cells(s)][:2] == ["runs/baseline/lr_0.001/seed_0",
                                                         "runs/baseline/lr_0.001/seed_1"]
    plain, _ = command.parse(["--workdir", str(tmp_path), "--steps", "2", "--config.train.warmup_steps=1"])
    assert plain.variants == ("baseline", "sdpa_elementwise") and plain.seeds == (0, 1, 2)
    assert plain.lrs == (3e-3,) and plain.sink_points == 2
    # With a study file the flags replace its fields; overrides apply to its base.
    preset, _ = command.parse(["table4_tiny", "--variants", "baseline,sdpa_headwise", "--seeds", "3",
                               "--gated", "sdpa_headwise", "--config.model.d_ff=128", "--workdir", str(tmp_path)])
    assert preset.variants == ("baseline", "sdpa_headwise") and preset.seeds == (3,) and preset.gated == "sdpa_headwise"
    assert preset.base.train.steps == 300 and preset.base.model.d_ff == 128  # the file's steps
    stab, _ = command.parse(["lr_stability_tiny", "--variants", "baseline,sdpa_headwise", "--workdir", str(tmp_path)])
    assert stab.gated == "" and stab.gated_variant == "sdpa_headwise"  # the file's gated is not in --variants
    # main runs the study the flags describe.
    seen = []
    monkeypatch.setattr(command, "run", lambda st, workdir, progress: seen.append((st, workdir)))
    assert command.main(["--variants", "baseline,sdpa_headwise", "--seeds", "0", "--steps", "60",
                         "--workdir", str(tmp_path)]) == 1  # (run said it was stopped)
    assert seen[0][0].variants == ("baseline", "sdpa_headwise") and seen[0][0].base.train.steps == 60


@pytest.mark.parametrize("flags, message", [
    ("--variants baseline,no_such_gate", "'--variants' = 'no_such_gate' is not allowed: expected comma-separated "
                                         r"registered variants \(baseline, "),
    ("--variants baseline,baseline", "'--variants' = 'baseline,baseline'.*each once"),
    ("--lrs 1e-3,fast", "'--lrs' = 'fast' is not allowed: expected comma-separated numbers > 0"),
    ("--lrs 0", "'--lrs' = '0' is not allowed: expected comma-separated numbers > 0"),
    ("--seeds 0,1.5", "'--seeds' = '1.5' is not allowed: expected comma-separated integers >= 0"),
    ("--seeds -1", "'--seeds' = '-1' is not allowed"),
    ("--steps 0", "'--steps' = '0' is not allowed: expected an integer >= 1"),
    ("--steps ten", "'--steps' = 'ten' is not allowed: expected an integer >= 1"),
    ("--gated sdpa_headwise", r"'--gated' = 'sdpa_headwise' is not allowed: expected one of the study's variants "
                              r"\(baseline, sdpa_elementwise\)"),
    ("--reference nope", "'--reference' = 'nope' is not allowed: expected a registered variant"),
    ("--config.variant=sdpa_headwise", "choose the variants with --variants"),
])
def test_bad_flags_are_one_line_naming_the_flag(flags, message, tmp_path):
    from gattn.experiments.study import command

    with pytest.raises(ConfigError, match=message):
        command.parse(flags.split() + ["--workdir", str(tmp_path)])


def test_the_command_line_s_errors_and_help(tmp_path):
    """A bad flag is one line on stderr and exit 2, before anything trains; --help shows the defaults."""
    proc = subprocess.run([sys.executable, "-m", "gattn.study", "--variants", "baseline,nope", "--workdir",
                           str(tmp_path / "s")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "'--variants' = 'nope'" in proc.stderr
    assert not (tmp_path / "s").exists()
    text = subprocess.run([sys.executable, "-m", "gattn.study", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120).stdout
    for default in ("the study file's base, else tiny", "else baseline,sdpa_elementwise", "else 0,1,2", "--gated",
                    "--reference", "--lrs"):
        assert default in " ".join(text.split()), default


def test_the_report_says_what_diverged_counts():
    """A study whose runner only stops on non-finite losses (diverged_loss inf, as the instability
    verdict's) read 'its final loss is above inf'; with a stability rule the margin is the rule's."""
    from gattn.experiments.study.report import divergence_words
    assert divergence_words({"diverged_loss": 9.0}) == \
        "A run diverged if training stopped on non-finite losses or its final loss is above 9.000."
    ruled = divergence_words({"diverged_loss": math.inf, "stability_rule": {"margin": 1.0}})
    assert "inf" not in ruled and "stability rule below" in ruled
