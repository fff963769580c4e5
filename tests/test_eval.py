"""eval.py end to end on tiny checkpoints trained here: every field, figures, --step, --compare."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gattn import cli

from conftest import entry_point

ROOT = Path(__file__).resolve().parents[1]
CONFIG = textwrap.dedent("""
    from gattn.config import Config, DataConfig, ExecConfig, ModelConfig, TrainConfig

    def get_config():
        return Config(
            exec=ExecConfig(scan_layers=True),
            model=ModelConfig(vocab_size=512, d_model=32, num_layers=3, q_heads=4, kv_heads=2,
                              head_dim=8, d_ff=64),
            train=TrainConfig(batch_size=4, seq_len=32, steps=6, warmup_steps=2, log_every=3,
                              eval_every=6, checkpoint_every=3, keep_checkpoints=3),
            data=DataConfig(code_max_bytes=200_000, eval_batches=2, eval_batch_size=4))
    """)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 6-step runs (baseline and SDPA-gated; scanned layers, as a large run would use) that
    share data, seed and tokenizer."""
    from gattn import cli
    from gattn.train import trainer

    root = tmp_path_factory.mktemp("eval")
    (root / "tiny.py").write_text(CONFIG)
    dirs = {}
    for name in ("baseline", "sdpa_elementwise"):
        overrides = [f"data.tokenizer={next((root / 'baseline' / 'tokenizer').glob('*.model'))}"] if dirs else []
        cfg = cli.load(root / "tiny.py", overrides, variant=name)
        trainer.train(cfg, root / name, progress=False)
        dirs[name] = root / name
    return dirs


def run_eval(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "eval.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env)


def refused(capsys, *args):
    """(exit code, stderr) of eval.py's main() called in this process: for the refusals, which
    stop before restoring anything, so starting an interpreter for each would cost more than the
    check (the successful runs above stay real subprocesses)."""
    main = entry_point("eval").main
    capsys.readouterr()
    code = cli.run_cli(main, list(map(str, args)))
    return code, capsys.readouterr().err


def test_eval_writes_every_field_and_figure(runs):
    tasks = ROOT / "tests" / "data" / "tasks"
    out = run_eval("--workdir", runs["sdpa_elementwise"], "--map-layers", "0,2", "--tasks",
                   f"{tasks / 'python_mc.jsonl'},{tasks / 'arith.jsonl'}", "--shots", 2, "--limit", 3)
    assert out.returncode == 0, out.stderr
    res = json.loads((runs["sdpa_elementwise"] / "eval" / "results.json").read_text())
    assert res["step"] == 6 and res["variant"] == "sdpa_elementwise"
    assert set(res["perplexity"]) == {"code", "docs"}
    assert all(1 < p["ppl"] < 512 for p in res["perplexity"].values())
    m = res["measurements"]
    assert len(m["per_layer"]) == 3
    for row in m["per_layer"]:
        assert set(row) >= {"m_act", "f_attn", "f_attn_per_head", "sink_head_share", "gate_score", "sparsity",
                            "m_act_per_token", "ffn_act", "mean_abs_y", "mean_abs_y_gated"}
        assert 0 < row["m_act_per_token"] <= row["m_act"] and row["ffn_act"] > 0
        assert 0 < row["mean_abs_y_gated"] < row["mean_abs_y"]  # a sigmoid gate shrinks Y (Fig. 4)
        assert len(row["f_attn_per_head"]) == 4 and 0 < row["gate_score"] < 1 and row["m_act"] > 0
        assert set(row["sparsity"]) == {"sdpa_out", "gated", "mean_gate_scaled"}
    assert sum(m["gate_histogram"]["all_layers"]) == m["counts"]["tokens"] * 3 * 4 * 8
    assert sorted(m["attn_maps"]) == ["0", "2"]
    assert m["overall"]["m_act"] == pytest.approx(sum(r["m_act"] for r in m["per_layer"]) / 3)
    sinks = res["sinks"]  # Gu et al.'s Sink_1^0.3 (gattn/eval/sinks.py)
    assert len(sinks["per_layer"]) == 3 and len(sinks["per_layer"][0]["alpha_1_per_head"]) == 4
    assert 0 <= sinks["overall"]["sink_share"] <= 1 and sinks["overall"]["window"] == 32  # (rows of 32 < T = 64)
    assert (runs["sdpa_elementwise"] / "eval" / "sink_heads.png").is_file()
    for png in ("per_layer", "sparsity", "f_attn_heads", "attention_maps", "gate_scores", "mean_abs_y"):
        assert (runs["sdpa_elementwise"] / "eval" / f"{png}.png").stat().st_size > 10_000
    assert "gate score (mean)" in (runs["sdpa_elementwise"] / "eval" / "results.md").read_text()
    mc, gen = res["fewshot"]["python_mc"], res["fewshot"]["arith"]
    assert mc["n"] == 3 and mc["shots"] == 2 and 0 <= mc["acc"] <= 1 and 0 <= mc["acc_norm"] <= 1
    assert gen["n"] == 3 and "exact_match" in gen and "exact_match_number" in gen
    assert all("\n" not in e["output"] for e in gen["examples"])  # cut at the stop string
    # The measurements are the checkpoint's: validation PPL equals what training logged at step 6.
    summary = json.loads((runs["sdpa_elementwise"] / "summary.json").read_text())
    assert res["perplexity"]["docs"]["ppl"] == pytest.approx(summary["val_ppl/docs"], rel=1e-5)


def test_ungated_runs_report_gate_fields_as_absent_and_step_selects_a_checkpoint(runs, capsys):
    out = run_eval("--workdir", runs["baseline"], "--step", 3, "--no-figures", "--max-batches", 1)
    assert out.returncode == 0, out.stderr
    res = json.loads((runs["baseline"] / "eval" / "results.json").read_text())
    assert res["step"] == 3 and res["gate"] is None
    assert "gate_score" not in res["measurements"]["overall"] and "gate_histogram" not in res["measurements"]
    assert all("gate_score" not in r and set(r["sparsity"]) == {"sdpa_out"} for r in res["measurements"]["per_layer"])
    assert res["measured_on"]["batches"] == 2  # one per domain
    code, err = refused(capsys, "--workdir", runs["baseline"], "--map-layers", "0,3")
    assert code == 2 and "--map-layers" in err and "0..2" in err
    code, err = refused(capsys, "--workdir", runs["baseline"], "--step", 5)
    assert code == 2 and "--step" in err and "saved steps [" in err and "Traceback" not in err


def test_eval_refuses_an_architecture_change_and_keeps_the_results(runs, capsys):
    """A checkpoint is evaluated with its own architecture: a changed model field is refused by
    name before anything is written; execution settings may change."""
    results = runs["baseline"] / "eval" / "results.json"
    before = results.read_bytes() if results.exists() else None
    code, err = refused(capsys, "--workdir", runs["baseline"], "--config.model.num_layers=2", "--no-figures")
    assert code == 2 and "Traceback" not in err
    assert "'model.num_layers' = 2" in err and "a model with 3" in err, err
    assert (results.read_bytes() if results.exists() else None) == before
    out = run_eval("--workdir", runs["baseline"], "--config.exec.scan_layers=false", "--config.exec.remat=full",
                   "--no-figures", "--max-batches", 1)
    assert out.returncode == 0, out.stderr
    assert json.loads(results.read_text())["overrides"] == ["--config.exec.scan_layers=false",
                                                            "--config.exec.remat=full"]


def test_compare_checks_every_run_before_it_measures_or_rewrites_any(runs, tmp_path, capsys):
    """`--compare RUN missing` used to re-evaluate RUN and overwrite its results.json first."""
    results = runs["baseline"] / "eval" / "results.json"
    before = results.read_bytes() if results.exists() else None
    (tmp_path / "not_a_run").mkdir()
    for bad, says in ((tmp_path / "missing", "does not exist"), (tmp_path / "not_a_run", "no config.json")):
        code, err = refused(capsys, "--compare", runs["baseline"], bad, "--out", tmp_path / "out")
        assert code == 2 and "--compare" in err and str(bad) in err and says in err, err
    assert (results.read_bytes() if results.exists() else None) == before
    assert not (tmp_path / "out").exists()


def test_compare_prints_a_table_4_row_per_run_and_overlays_curves(runs, tmp_path, capsys):
    out = run_eval("--compare", runs["baseline"], runs["sdpa_elementwise"], "--out", tmp_path)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| run | variant | step | PPL code | PPL docs | gate score | M-Act | F-Attn")
    assert lines[0].endswith("| max M-Act | params | final train loss | loss spikes | tokens/s |")
    # The baseline's results.json was of step 3 (the test before), the gated run's of other
    # settings (or neither has one): compare re-measures each, says why, shows progress, says it wrote.
    for name in ("baseline", "sdpa_elementwise"):
        assert f"re-measuring {name}: " in out.stderr and f"{name}: measuring batch 1/4" in out.stderr
        assert f"{name}: wrote {runs[name] / 'eval' / 'results.json'}" in out.stderr
    assert lines[1].startswith("| baseline | baseline | 6 |") and "| - |" in lines[1]  # no gate score
    assert lines[2].startswith("| sdpa_elementwise | sdpa_elementwise | 6 |")
    saved = json.loads((tmp_path / "results.json").read_text())
    for name, row in zip(("baseline", "sdpa_elementwise"), lines[1:3]):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3] == f"{saved[name]['perplexity']['code']['ppl']:.2f}"
        assert cells[6] == f"{saved[name]['overall']['m_act']:.2f}"
        summary = json.loads((runs[name] / "summary.json").read_text())
        assert cells[-3:-1] == [f"{summary['final_loss']:.3f}", str(summary["loss_spikes"])]
        assert int(cells[-4].replace(",", "")) > 0 and saved[name]["settings"]["batches_per_domain"] == 2
        # The loss curves' data: metrics.jsonl's training loss per logged step, validation loss at step 6.
        logged = [json.loads(line) for line in (runs[name] / "metrics.jsonl").read_text().splitlines()]
        curves = json.loads((tmp_path / "loss_curves.json").read_text())[name]
        assert curves["train"] == {"steps": [3, 6], "loss": [r["loss"] for r in logged]}
        assert curves["val"]["docs"] == {"steps": [6], "loss": [logged[-1]["val_loss/docs"]]}
    assert (tmp_path / "per_layer.png").stat().st_size > 10_000
    assert (tmp_path / "loss_curves.png").stat().st_size > 10_000
    gates = json.loads((tmp_path / "gate_scores.json").read_text())
    assert list(gates) == ["sdpa_elementwise"] and len(gates["sdpa_elementwise"]["share"]) == 50
    assert sum(gates["sdpa_elementwise"]["share"]) == pytest.approx(1)
    assert (tmp_path / "gate_scores.png").stat().st_size > 10_000
    assert set(json.loads((tmp_path / "results.json").read_text())) == {"baseline", "sdpa_elementwise"}

    # Again, with nothing changed: both results.json are reused (neither rewritten), the same table.
    written = {n: (runs[n] / "eval" / "results.json").stat().st_mtime_ns for n in runs}
    main = entry_point("eval").main  # (in this process: nothing is measured, an interpreter start would dominate)
    capsys.readouterr()
    assert cli.run_cli(main, list(map(str, ("--compare", runs["baseline"], runs["sdpa_elementwise"],
                                            "--out", tmp_path / "again")))) == 0
    err = capsys.readouterr().err
    assert err.startswith("no --max-batches given: 2 batches per domain, what the runs' eval/results.json"), err
    assert "reusing baseline: its eval/results.json was measured at step 6, over all (up to 2) batches per domain" in err
    assert "reusing sdpa_elementwise:" in err and "measuring batch" not in err
    assert {n: (runs[n] / "eval" / "results.json").stat().st_mtime_ns for n in runs} == written
    assert (tmp_path / "again" / "table.md").read_text() == (tmp_path / "table.md").read_text()


def test_eval_restores_onto_another_device_count(runs, tmp_path):
    """Trained on one device, evaluated on 8 simulated devices with a (4, 1, 2) mesh: the same
    perplexity and measurements as on one device."""
    import os

    one = run_eval("--workdir", runs["sdpa_elementwise"], "--no-figures", "--max-batches", 1, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    eight = run_eval("--workdir", runs["sdpa_elementwise"], "--no-figures", "--max-batches", 1,
                     "--out", tmp_path / "eight", "--config.mesh.model=2", env=env)
    assert eight.returncode == 0, eight.stderr
    assert "note:" not in eight.stderr  # the requested mesh fitted: no fallback to data-only
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "eight"))
    for domain in ("code", "docs"):
        assert b["perplexity"][domain]["ppl"] == pytest.approx(a["perplexity"][domain]["ppl"], rel=1e-4)
    for key in ("m_act", "f_attn", "gate_score"):
        assert b["measurements"]["overall"][key] == pytest.approx(a["measurements"]["overall"][key], rel=1e-4)


def test_ruler_with_yarn_and_a_table_5_comparison(runs, tmp_path, capsys):
    """eval.py --ruler at two lengths with YaRN switched on at eval time (its original length is
    the run's own seq_len), then --compare of the plain run against that result: a Table-5 row each,
    the YaRN row with its change against the plain one; bad lengths are refused before restoring."""
    run, tasks = runs["sdpa_elementwise"], "niah_single,common_words"
    common = ["--ruler", "--lengths", "512,1024", "--samples", 2, "--ruler-tasks", tasks]
    out = run_eval("--workdir", run, *common, "--config.model.yarn.factor=4", "--out", tmp_path / "yarn")
    assert out.returncode == 0, out.stderr
    yarn = json.loads((tmp_path / "yarn" / "ruler.json").read_text())
    assert yarn["yarn"]["factor"] == 4 and yarn["yarn"]["original_len"] == 32 == yarn["trained_len"]
    assert yarn["label"] == "sdpa_elementwise + YaRN x4" and yarn["tasks"] == tasks.split(",")
    assert list(yarn["per_length"]) == ["512", "1024"]
    for n, res in yarn["per_length"].items():
        for task in tasks.split(","):
            r = res["tasks"][task]
            assert 0 <= r["exact"] <= r["partial"] <= 100 and len(r["examples"]) == 2
        assert res["exact"] == sum(res["tasks"][t]["exact"] for t in res["tasks"]) / 2
        assert res["seconds"] > 0 and res["peak_rss_mb"] > 0
        ppl = res["perplexity"]["code"]  # the same held-out text at both lengths: 4 windows of 1024
        assert ppl["windows"] == 4 * 1024 // int(n) and 1 < ppl["ppl"] < 512 and 1 < ppl["ppl_second_half"] < 512
    assert (tmp_path / "yarn" / "ruler.png").stat().st_size > 10_000

    cmp = run_eval(*common, "--compare", run, tmp_path / "yarn" / "ruler.json", "--out", tmp_path / "cmp")
    assert cmp.returncode == 0, cmp.stderr
    table5 = (tmp_path / "cmp" / "ruler_table.md").read_text().split("\n\n")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table5.splitlines()[2:]]
    plain = json.loads((run / "eval" / "ruler.json").read_text())
    assert [r[0] for r in rows] == ["sdpa_elementwise", "sdpa_elementwise + YaRN x4"]
    for col, n in ((4, "512"), (5, "1024")):
        p, y = plain["per_length"][n]["exact"], yarn["per_length"][n]["exact"]
        assert rows[0][col] == f"{p:.1f}" and rows[1][col] == f"{y:.1f} ({y - p:+.1f})"
    assert (tmp_path / "cmp" / "ruler.png").stat().st_size > 10_000
    code = next(line for line in (tmp_path / "cmp" / "ruler_table.md").read_text().splitlines()
                if line.startswith("| sdpa_elementwise + YaRN x4 | code |"))
    assert f"{yarn['per_length']['1024']['perplexity']['code']['ppl']:.1f}" in code

    # The plain run's result is reused only for the same lengths, settings and overrides; a result
    # file of other settings is refused, not mixed in.
    from gattn.config import ConfigError
    from gattn.eval import long_context as evaluate

    settings = {"tasks": tasks.split(","), "num_samples": 2, "seed": 0, "overrides": []}
    assert plain["overrides"] == [] and evaluate.reusable(plain, run, [512], settings)
    assert not evaluate.reusable(plain, run, [512, 2048], settings)
    assert not evaluate.reusable(plain, run, [512], settings | {"overrides": ["model.yarn.factor=4"]})
    assert not evaluate.reusable(plain, run, [512], settings | {"num_samples": 8})
    with pytest.raises(ConfigError) as e:
        evaluate.compare_ruler([tmp_path / "yarn" / "ruler.json", run], [512], tasks=tasks.split(","), num_samples=8)
    assert e.value.field == "--compare" and "num_samples = 2" in e.value.allowed

    code, err = refused(capsys, "--workdir", run, "--ruler", "--lengths", "64,512")
    assert code == 2 and "--lengths" in err and "niah_single needs" in err


def test_help_shows_the_defaults(capsys):
    """(--help did not say what --max-batches or --sink-threshold default to.)"""
    main = entry_point("eval").main
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: all of the run's data.eval_batches; with --compare, the count the runs' " \
        "eval/results.json were measured over, where they agree: the main job's 1)" in text
    assert "sink head (default: 0.3)" in text and "(default: 64)" in text and "(default: 8)" in text


@pytest.mark.parametrize("args, named", [
    # before: RULER ran and --lm-eval was dropped without a word
    (["--ruler", "--lengths", "512", "--lm-eval", "paper_table4", "--data-dir", "d"], "drop --lm-eval, --data-dir"),
    (["--ruler", "--lengths", "512", "--shots", "2", "--sink-threshold", "0.2"], "drop --sink-threshold, --shots"),
    # before: the measurements ran; --shots, --limit and the measurement options did nothing
    (["--shots", "0"], "--shots needs --tasks FILES or --lm-eval TASKS"),
    (["--limit", "3", "--shots", "2"], "--shots and --limit need --tasks"),
    (["--lm-eval", "local_arc", "--map-layers", "0", "--map-len", "8"], "drop --map-layers, --map-len"),
    (["--lm-eval", "local_arc", "--batch-rows", "2"], "drop --batch-rows"),
    (["--seed", "0"], "--seed needs --ruler"),
])
def test_a_flag_another_mode_would_drop_is_refused_by_name(tmp_path, capsys, args, named):
    """Each of eval.py's modes (the measurements, --lm-eval, --ruler) refuses the flags of the
    others in one line (exit 2) before anything loads, instead of running without them."""
    with pytest.raises(SystemExit) as e:
        entry_point("eval").main(["--workdir", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and named in err and "Traceback" not in err, err


def test_a_map_longer_than_a_row_or_a_threshold_outside_a_share_is_refused(runs, capsys):
    """(Before: --map-len 100000 failed for 298 GiB after the perplexity pass; --sink-threshold 7,
    -1 or nan gave 0% or 100%.) A map may be as long as a row, or the default's 64 positions."""
    for args, flag in ((["--map-len", "65"], "--map-len"), (["--sink-threshold", "7"], "--sink-threshold"),
                       (["--sink-threshold", "nan"], "--sink-threshold")):
        code, err = refused(capsys, "--workdir", runs["baseline"], *args)
        assert code == 2 and f"'{flag}'" in err and "Traceback" not in err, err
    code, err = refused(capsys, "--compare", runs["baseline"], runs["sdpa_elementwise"], "--map-len", "100000")
    assert code == 2 and "'--map-len' = 100000" in err and "at most 64" in err, err
