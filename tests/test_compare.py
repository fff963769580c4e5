"""eval.py --compare reuses a run's eval/results.json only when it was measured as requested (the
same step, --config overrides, held-out batches per domain and measurement options), says per run
what it reused or re-measured and why, and adds the main job's training rows and overlay figures
with their data as JSON. Runs here are fakes (config.json, metrics.jsonl, results.json): nothing
is restored or measured."""

import json

import pytest

from gattn.config import Config, DataConfig, ModelConfig, to_dict
from gattn.eval import analysis, evaluate, plots

CFG = Config(model=ModelConfig(vocab_size=64, d_model=16, num_layers=1, q_heads=2, kv_heads=1, head_dim=8, d_ff=32),
             data=DataConfig(eval_batches=4))
GATE_HIST = {"range": [0.0, 1.0], "per_layer": [[1, 3, 0, 4]], "all_layers": [1, 3, 0, 4]}


def _fake_run(root, name, settings, *, step=100, gated=False):
    """A run with a checkpoint at `step` (saved_steps is patched), a metrics.jsonl of 3 logged
    steps (validation at 20 and 30), a summary.json and, unless `settings` is "none", an
    eval/results.json measured with `settings` (None: one written before settings were recorded)."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(to_dict(CFG)))
    rows = [{"step": 10, "loss": 4.0, "loss_spikes": 0, "tokens_per_sec": 900.0},
            {"step": 20, "loss": 3.5, "loss_spikes": 1, "tokens_per_sec": 1000.0, "val_loss/code": 3.6,
             "val_loss/docs": 3.7},
            {"step": 30, "loss": 3.0, "loss_spikes": 1, "tokens_per_sec": 1234.0, "val_loss/code": 3.1,
             "val_loss/docs": 3.2}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"step": 30, "final_loss": 3.0, "loss_spikes": 1}))
    overall = {"m_act": 50.0, "m_act_max": 50.0, "f_attn": 0.2, "sink_head_share": 0.1}
    res = {"workdir": str(run), "step": step, "variant": name, "overrides": [],
           "perplexity": {"docs": {"loss": 3.0, "ppl": 20.0}},
           "measurements": {"overall": overall | ({"gate_score": 0.4} if gated else {}),
                            "per_layer": [{"layer": 0, **overall}]}}
    if gated:
        res["measurements"]["gate_histogram"] = GATE_HIST
    if settings is not None:
        res["settings"] = settings
    if settings != "none":
        (run / "eval").mkdir()
        (run / "eval" / "results.json").write_text(json.dumps(res))
    return run, res


@pytest.fixture
def patched(monkeypatch):
    """saved_steps -> [100]; evaluate() records its calls and returns the run's fake result
    measured as asked."""
    monkeypatch.setattr(evaluate.checkpoint, "saved_steps", lambda w: [100])
    monkeypatch.setattr(evaluate.plots, "per_layer", lambda *a, **k: None)
    calls = []

    def fake_evaluate(w, *, overrides=(), options=None, max_batches=None, log=None, **kw):
        calls.append((w.name, max_batches, options))
        res = json.loads((w / "eval" / "results.json").read_text()) if (w / "eval" / "results.json").exists() else {
            "workdir": str(w), "step": 100, "variant": w.name, "overrides": [], "perplexity": {},
            "measurements": {"overall": {"m_act": 1.0, "m_act_max": 1.0, "f_attn": 0.1, "sink_head_share": 0.0},
                             "per_layer": [{"layer": 0, "m_act": 1.0}]}}
        return res | {"settings": evaluate.settings(CFG, 100, overrides, options, max_batches, workdir=w)}
    monkeypatch.setattr(evaluate, "evaluate", fake_evaluate)
    return calls


def test_compare_reuses_results_measured_as_asked_and_adds_training_rows_and_curves(tmp_path, patched):
    options = analysis.Options(sink_threshold=0.3, map_layers=(0,))
    asked = evaluate.settings(CFG, 100, [], options, 2)
    runs = [_fake_run(tmp_path, "base", asked), _fake_run(tmp_path, "gated", asked, gated=True)]
    before = {r.name: (r / "eval" / "results.json").stat().st_mtime_ns for r, _ in runs}
    lines = []
    text = evaluate.compare([r for r, _ in runs], options=options, max_batches=2, out_dir=tmp_path / "cmp",
                            log=lines.append)
    assert patched == []  # nothing measured, nothing rewritten
    assert {r.name: (r / "eval" / "results.json").stat().st_mtime_ns for r, _ in runs} == before
    assert lines == [f"reusing {n}: its eval/results.json was measured at step 100, over 2 batches per domain, "
                     "with no overrides, as asked" for n in ("base", "gated")]
    # The main job's rows: params, final train loss, loss spikes, tokens/s (the last logged).
    head, _, base, gated = (line.strip("|").split("|") for line in text.splitlines())
    assert [c.strip() for c in head[-4:]] == ["params", "final train loss", "loss spikes", "tokens/s"]
    assert [c.strip() for c in base[-4:]] == ["4,400", "3.000", "1", "1,234"]
    saved = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert saved["gated"]["training"] == {"params": 4400, "final_loss": 3.0, "loss_spikes": 1, "tokens_per_sec": 1234.0}
    assert saved["gated"]["settings"] == asked
    # Loss curves: each run's training loss per logged step, validation loss per domain.
    curves = json.loads((tmp_path / "cmp" / "loss_curves.json").read_text())
    assert curves["base"]["train"] == {"steps": [10, 20, 30], "loss": [4.0, 3.5, 3.0]}
    assert curves["gated"]["val"] == {"code": {"steps": [20, 30], "loss": [3.6, 3.1]},
                                      "docs": {"steps": [20, 30], "loss": [3.7, 3.2]}}
    assert (tmp_path / "cmp" / "loss_curves.png").stat().st_size > 10_000
    # Gate scores of the gated runs only, over all layers, as shares per bin.
    hist = json.loads((tmp_path / "cmp" / "gate_scores.json").read_text())
    assert list(hist) == ["gated"] and hist["gated"]["edges"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert hist["gated"]["share"] == [0.125, 0.375, 0.0, 0.5] and hist["gated"]["mean"] == 0.4
    assert (tmp_path / "cmp" / "gate_scores.png").stat().st_size > 10_000


def test_compare_remeasures_results_of_other_settings_and_says_why(tmp_path, patched):
    options = analysis.Options(sink_threshold=0.3, map_layers=(0,))
    asked = evaluate.settings(CFG, 100, [], options, None)  # all 4 batches per domain
    runs = {"same": asked, "fewer_batches": evaluate.settings(CFG, 100, [], options, 1),
            "older_step": evaluate.settings(CFG, 60, [], options, None),
            "other_threshold": evaluate.settings(CFG, 100, [], analysis.Options(sink_threshold=0.5, map_layers=(0,)),
                                                 None),
            "before_the_record": None, "never_measured": "none"}
    dirs = [_fake_run(tmp_path, name, s)[0] for name, s in runs.items()]
    lines = []
    evaluate.compare(dirs, options=options, max_batches=4, out_dir=tmp_path / "cmp", log=lines.append)
    assert sorted(name for name, *_ in patched) == sorted(set(runs) - {"same"})
    assert all(m == 4 and o == options for _, m, o in patched)
    said = {line.split(":")[0]: line for line in lines if line.startswith(("reusing", "re-measuring"))}
    assert said["reusing same"]
    assert said["re-measuring fewer_batches"] == (
        "re-measuring fewer_batches: its results.json was measured over 1 batch per domain, "
        "this comparison asks for all (up to 4) batches per domain")
    assert ("measured at step 60, this comparison asks for step 100 (the latest checkpoint)"
            in said["re-measuring older_step"])
    assert ("with sink_threshold = 0.5, this comparison asks for sink_threshold = 0.3"
            in said["re-measuring other_threshold"])
    assert "records no measurement settings" in said["re-measuring before_the_record"]
    assert "no eval/results.json yet" in said["re-measuring never_measured"]
    assert sum("wrote" in line and "results.json" in line for line in lines) == 5  # each rewrite is said
    # JSON's round trip (tuples as lists) still matches the request.
    assert json.loads(json.dumps(asked)) == evaluate.settings(CFG, 100, [], options, None)


def _seal(run, step, digest):
    """WORKDIR/checkpoints/STEP sealed (gattn/train/seal.py) with one file of sha256 `digest`."""
    folder = run / "checkpoints" / str(step) / evaluate.checkpoint.CHECKSUMS
    folder.mkdir(parents=True)
    (folder / "process_0.json").write_text(json.dumps(
        {"process": 0, "processes": 1, "files": {"state/x": {"bytes": 4, "sha256": digest}}}))


def test_compare_remeasures_results_of_a_checkpoint_set_aside_since(tmp_path, patched):
    """A --resume-step 2 trained back to step 100: the old step-100 checkpoint is set aside, its
    eval/results.json stays (before: reused, the old checkpoint's PPL and M-Act beside the new
    run's loss). Its seals differ, so it is measured again; a results.json that records no
    checkpoint (an older eval.py) too; the same checkpoint is reused."""
    run, res = _fake_run(tmp_path, "resumed", None)
    _seal(run, 100, "a" * 64)
    measured = evaluate.settings(CFG, 100, [], None, 4, workdir=run)  # as evaluate() records it
    assert measured["checkpoint"] and measured == evaluate.settings(CFG, 100, [], None, 4, workdir=run)
    (run / "eval" / "results.json").write_text(json.dumps(res | {"settings": measured}))
    legacy = _fake_run(tmp_path, "legacy", {k: v for k, v in measured.items() if k != "checkpoint"})[0]
    _seal(legacy, 100, "a" * 64)
    lines = []
    evaluate.compare([run, legacy], max_batches=4, out_dir=tmp_path / "cmp", log=lines.append, figures=False)
    assert patched == [("legacy", 4, None)], lines
    assert "reusing resumed: its eval/results.json was measured at step 100" in lines[0]
    assert lines[1] == ("re-measuring legacy: its results.json was measured on a checkpoint of step 100 that it does "
                        "not identify (written by an older eval.py: that checkpoint may have been set aside since, "
                        "e.g. by a --resume-step), this comparison asks for the checkpoint now at step 100")
    (run / "checkpoints").rename(run / "checkpoints_set_aside")
    _seal(run, 100, "b" * 64)  # the new step 100, trained since
    patched.clear()
    lines.clear()
    evaluate.compare([run], max_batches=4, out_dir=tmp_path / "cmp", log=lines.append, figures=False)
    assert patched == [("resumed", 4, None)]
    assert lines[0] == ("re-measuring resumed: its results.json was measured on another checkpoint of step 100 "
                        "(set aside since, e.g. by a --resume-step), this comparison asks for the checkpoint now "
                        "at step 100")


def test_compare_without_max_batches_takes_the_count_the_runs_were_measured_over(tmp_path, patched):
    """After the main job (one batch per domain), a plain --compare reuses its measurements; runs
    measured over different counts are measured again over all batches."""
    options = analysis.Options()
    one = evaluate.settings(CFG, 100, [], options, 1)
    dirs = [_fake_run(tmp_path, name, one)[0] for name in ("baseline", "sdpa_elementwise")]
    lines = []
    evaluate.compare(dirs, options=options, out_dir=tmp_path / "cmp", log=lines.append)
    assert patched == []
    assert lines[0] == "no --max-batches given: 1 batch per domain, what the runs' eval/results.json were measured over"
    assert all(line.startswith("reusing") for line in lines[1:])
    other = _fake_run(tmp_path, "all", evaluate.settings(CFG, 100, [], options, None))[0]
    lines.clear()
    evaluate.compare([*dirs, other], options=options, out_dir=tmp_path / "cmp", log=lines.append)
    assert "disagree (1 vs 4 batches per domain)" in lines[0]
    assert sorted(name for name, *_ in patched) == ["baseline", "sdpa_elementwise"]


def _captured(monkeypatch):
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    return figures


def test_sink_head_lines_of_runs_that_coincide_both_stay_visible(monkeypatch, tmp_path):
    """Two runs without sink heads (both 0 in every layer): their lines differ in x (dodged),
    marker, line style and marker size, and the panel's legend names both."""
    figures = _captured(monkeypatch)
    rows = [{"layer": i, "m_act": 1.0, "m_act_per_token": 1.0, "ffn_act": 1.0, "f_attn": 0.1, "sink_head_share": 0.0}
            for i in range(3)]
    plots.per_layer({"baseline": {"per_layer": rows}, "gated": {"per_layer": rows}}, tmp_path / "p.png")
    (ax,) = [a for a in figures[0].axes if a.get_title().startswith("F-Attn sink heads")]
    a, b = ax.lines
    assert list(a.get_ydata()) == list(b.get_ydata()) == [0.0] * 3
    assert all(xa < xb for xa, xb in zip(a.get_xdata(), b.get_xdata()))
    assert max(abs(x - i) for line in (a, b) for i, x in enumerate(line.get_xdata())) < 0.1
    assert a.get_marker() != b.get_marker() and a.get_linestyle() != b.get_linestyle()
    assert b.get_markersize() < a.get_markersize() and b.get_zorder() > a.get_zorder()  # the smaller on top
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["baseline", "gated"]
    # The same over training (sink_curves' share panel).
    curve = [{"tokens": t, "f_attn": 0.1, "m_act": 1.0, "sink_share": 0.0} for t in (100, 200)]
    plots.sink_curves({"baseline": curve, "gated": curve}, tmp_path / "s.png")
    ax = figures[1].axes[2]
    a, b = ax.lines
    assert a.get_marker() != b.get_marker() and a.get_linestyle() != b.get_linestyle()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["baseline", "gated"]


def test_a_run_that_trained_past_its_checkpoint_shows_the_training_rows_of_the_evaluated_step(
        tmp_path, monkeypatch):
    """Killed at step 30 with its newest usable checkpoint at step 20: the table shows step 20's
    training loss, loss spikes and tokens/s beside step 20's measurements, and says where the log ends."""
    monkeypatch.setattr(evaluate.checkpoint, "saved_steps", lambda w: [20])
    monkeypatch.setattr(evaluate.plots, "per_layer", lambda *a, **k: None)
    asked = evaluate.settings(CFG, 20, [], analysis.Options(), 4)
    run, _ = _fake_run(tmp_path, "killed", asked, step=20)
    lines = []
    text = evaluate.compare([run], max_batches=4, out_dir=tmp_path / "cmp", log=lines.append, figures=False)
    row = [c.strip() for c in text.splitlines()[2].strip("|").split("|")]
    assert row[2] == "20" and row[-3:] == ["3.500", "1", "1,000"]
    saved = json.loads((tmp_path / "cmp" / "results.json").read_text())["killed"]["training"]
    assert (saved["final_loss"], saved["tokens_per_sec"], saved["logged_to"]) == (3.5, 1000.0, {"step": 30, "loss": 3.0})
    assert any("step 20" in line and "step 30" in line and "3.000" in line for line in lines), lines
