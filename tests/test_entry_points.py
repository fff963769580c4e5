"""The command lines the README promises."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args, check=True):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          check=check, timeout=600)


def test_variants_cli_lists_every_variant_with_its_table_row():
    rows = json.loads(run("-m", "gattn.variants", "--json").stdout)
    by_name = {r["name"]: r for r in rows}
    assert "Table 1 (5)" in by_name["sdpa_elementwise"]["rows"]
    assert by_name["switch_v_1top1"]["rows"] == ["Table 6 (6)"]
    assert by_name["more_experts"]["moe_only"] is True and by_name["sdpa_elementwise"]["moe_only"] is False
    text = run("-m", "gattn.variants").stdout
    assert all(name in text for name in by_name)


@pytest.mark.slow  # the demo is a preset of the study runner, which the main job's test runs too
def test_demo_trains_variants_and_reports_gate_statistics(tmp_path):
    args = ("-m", "gattn.demo", "--variants", "baseline,sdpa_headwise", "--steps", "3", "--json",
            "--workdir", str(tmp_path), "--config.model.num_layers=1", "--config.train.seq_len=32")
    out = run(*args).stdout
    rows = json.loads(out)                     # --json: stdout holds only the rows
    base, gated = rows
    assert "gate_score" not in base            # ungated: absent, not zero
    assert 0 < gated["gate_score"] < 1
    assert gated["added_params"] == 128 * 4    # d_model x q_heads, one layer
    for r in rows:
        assert 0 <= r["f_attn"] <= 1 and r["m_act"] > 0 and r["held_out_loss"] > 0
        assert r["first_loss"] > r["last_loss"] > 0
        # Trained by train.py's loop: its metrics.jsonl, one row per step, in WORKDIR/KEY/VARIANT.
        (metrics,) = tmp_path.glob(f"*/{r['variant']}/metrics.jsonl")
        assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    # Rerunning with the same settings reuses the finished runs (no new run directory).
    assert json.loads(run(*args).stdout) == rows
    assert len({p.parent for p in tmp_path.glob("*/*/cell.json")}) == 2


def test_bad_config_on_the_command_line_is_a_clear_error():
    out = run("train.py", "--config", "configs/tiny.py", "--workdir", "/tmp/x",
              "--config.model.gate.position=G9", check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "model.gate.position" in out.stderr and "'G9'" in out.stderr and "'sdpa'" in out.stderr
    out = run("-m", "gattn.demo", "--variants", "nope", check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "'nope'" in out.stderr and "sdpa_elementwise" in out.stderr


def test_main_job_trains_both_variants_and_prints_the_comparison(tmp_path, capsys):
    args = ("-m", "gattn.main_job", "--workdir", str(tmp_path), "--steps", "6", "--quiet",
            "--config", str(ROOT / "configs" / "tiny.py"),
            "--config.train.warmup_steps=1", "--config.model.num_layers=1",
            "--config.train.seq_len=64", "--config.train.batch_size=4",
            "--config.data.code_max_bytes=200000", "--config.data.eval_batches=1")
    out = run(*args).stdout
    assert "| | baseline | sdpa_elementwise |" in out
    rows = json.loads((tmp_path / "results.json").read_text())
    base, gated = rows
    assert base["step"] == gated["step"] == 6
    assert "gate_score" not in base and 0 < gated["gate_score"] < 1
    for r in rows:
        assert {"val_ppl/code", "val_ppl/docs", "loss_spikes", "f_attn", "m_act"} <= set(r)
        assert (tmp_path / r["variant"] / "metrics.jsonl").is_file()
    gate_line = next(line for line in out.splitlines() if line.startswith("| gate score"))
    assert gate_line.split("|")[2].strip() == "-"
    # Rerunning finds both runs finished: nothing is retrained and the same table comes back.
    # (main() in this process: the command line was run above, and an interpreter start costs
    # more than the rerun itself.)
    from gattn.experiments import main_job

    capsys.readouterr()
    assert main_job.main(list(args[2:])) == 0
    again = capsys.readouterr().out
    assert again[again.index("| |"):] == out[out.index("| |"):]
    assert json.loads((tmp_path / "results.json").read_text())[1]["final_loss"] == gated["final_loss"]

    # The follow-up the README and the main job name, eval.py --compare, reuses each run's
    # eval/results.json (measured by the main job over one batch per domain, as it records) and
    # adds figures: its numbers are the main job's, and nothing is measured or rewritten again.
    runs = [tmp_path / r["variant"] for r in rows]
    assert f"python eval.py --compare {runs[0]} {runs[1]}" in out
    written = {r: (r / "eval" / "results.json").stat().st_mtime_ns for r in runs}
    from gattn import cli

    from conftest import entry_point

    assert cli.run_cli(entry_point("eval").main, ["--compare", *map(str, runs)]) == 0
    err = capsys.readouterr().err
    assert "reusing baseline: " in err and "reusing sdpa_elementwise: " in err and "measuring" not in err.lower(), err
    assert {r: (r / "eval" / "results.json").stat().st_mtime_ns for r in runs} == written
    saved = json.loads((tmp_path / "compare" / "results.json").read_text())
    for r in rows:
        s = saved[r["variant"]]
        assert s["settings"]["batches_per_domain"] == 1
        assert {k: s["overall"].get(k) for k in ("m_act", "f_attn", "gate_score")} == \
            {k: r.get(k) for k in ("m_act", "f_attn", "gate_score")}
        assert s["training"] == {"params": r["params"], "final_loss": r["final_loss"], "loss_spikes": r["loss_spikes"],
                                 "tokens_per_sec": r["tokens_per_sec"] or None}
    assert all((tmp_path / "compare" / f).is_file() for f in ("loss_curves.json", "gate_scores.png"))
