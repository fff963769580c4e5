"""eval.py --compare reuses a run's eval/results.json only when it was measured as requested: the
same step, --config overrides, --max-batches and measurement options (sink threshold, map layers)."""

import json

from gattn.eval import analysis, evaluate


def _fake_run(root, name, measured_with):
    (root / name / "eval").mkdir(parents=True)
    res = {"workdir": str(root / name), "step": 100, "variant": name, "overrides": [],
           "perplexity": {"docs": {"loss": 3.0, "ppl": 20.0}},
           "measurements": {"overall": {"m_act": 50.0, "m_act_max": 50.0, "f_attn": 0.2, "sink_head_share": 0.1},
                            "per_layer": []}}
    if measured_with is not None:
        res["measured_with"] = measured_with
    (root / name / "eval" / "results.json").write_text(json.dumps(res))
    (root / name / "config.json").write_text(json.dumps({"model": {}}))  # a run (compare checks for one)
    return res


def test_compare_reevaluates_results_measured_with_other_settings(tmp_path, monkeypatch):
    options = analysis.Options(sink_threshold=0.3, map_layers=(0, 1))
    asked = evaluate.measured_with(options, 16)
    runs = {"same": asked, "fewer_batches": evaluate.measured_with(options, 1),
            "other_threshold": evaluate.measured_with(analysis.Options(sink_threshold=0.5, map_layers=(0, 1)), 16),
            "before_the_record": None}
    fakes = {name: _fake_run(tmp_path, name, m) for name, m in runs.items()}
    monkeypatch.setattr(evaluate.checkpoint, "saved_steps", lambda w: [100])
    monkeypatch.setattr(evaluate.plots, "per_layer", lambda *a, **k: None)
    calls = []
    monkeypatch.setattr(evaluate, "evaluate", lambda w, **kw: calls.append((w.name, kw)) or fakes[w.name])
    evaluate.compare([tmp_path / n for n in runs], options=options, max_batches=16, out_dir=tmp_path / "cmp")
    assert sorted(name for name, _ in calls) == ["before_the_record", "fewer_batches", "other_threshold"]
    assert all(kw["max_batches"] == 16 and kw["options"] == options for _, kw in calls)
    # JSON's round trip (tuples as lists) still matches the request.
    assert json.loads(json.dumps(asked)) == evaluate.measured_with(options, 16)
