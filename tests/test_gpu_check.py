"""The GPU check runs here as a dry run (CPU, tiny shapes, the Pallas GPU kernel in interpret
mode), and the trainer needs neither Grain nor TFDS for synthetic tokens (the GPU machine has
neither)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _dry_run(tmp_path, *extra):
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(tmp_path), "--dry-run", *extra],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(proc.stdout)
    assert printed == json.loads((tmp_path / "gpu_check.json").read_text())
    return printed


def test_gpu_check_dry_run(tmp_path):
    out = _dry_run(tmp_path, "--skip", "torch")
    assert out["dry_run"] and out["kernels"]["status"] == "ok" and out["steps"]["status"] == "ok"
    kern = out["kernels"]["kernels"]["32"]
    for path in ("pallas_gpu_fused", "pallas_gpu_ungated", "cudnn_plus_gate", "cudnn_ungated", "xla_plus_gate"):
        assert kern[path]["ms"] > 0, (path, kern[path])
    # the fused kernel (interpret mode) against the XLA path on the same bf16 inputs
    assert max(kern["fused_vs_xla_rel_err"].values()) < 3e-2, kern["fused_vs_xla_rel_err"]
    steps = out["steps"]["steps"]
    run = steps["gpu_125m/sdpa_elementwise/pallas_gpu"]
    assert run["attention"] == "pallas_gpu" and run["tokens_per_s"] > 0 and run["mfu"] >= 0
    assert set(out["targets"]) and "torch" not in out


@pytest.mark.slow
def test_gpu_check_dry_run_with_the_torch_peer(tmp_path):
    out = _dry_run(tmp_path)
    peers = out["torch"]["torch"]
    assert len(peers) == 2 and all(p["tokens_per_s"] > 0 for p in peers.values()), peers
    assert "dry run" in out["targets"]["note"]


def test_targets_are_read_off_the_measurements():
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    r = {"steps": {"steps": {"gpu_125m/baseline/auto": {"tokens_per_s": 300, "mfu": 0.42},
                             "gpu_125m/sdpa_elementwise/auto": {"error": "OOM"}}},
         "torch": {"torch": {"qwen3 (baseline)": {"tokens_per_s": 100}, "qwen3_next, gated": {"tokens_per_s": 50}}},
         "kernels": {"kernels": {"8192": {"fused_over_ungated": 1.02}}}}
    t = gpu_check.targets(r)
    assert t["baseline_vs_torch_tokens_per_s (>= 1.5)"] == 3.0 and t["mfu_125m_baseline (>= 0.40)"] == 0.42
    assert t["gated_vs_torch_tokens_per_s (>= 1.5)"] is None and t["mfu_125m_gated (>= 0.40)"] is None
    assert t["fused_over_ungated_8k (<= 1.05)"] == 1.02 and t["fused_over_cudnn_plus_gate_8k (< 1)"] is None


_ABSENT = """
import sys
class Absent:  # Grain and TFDS as if not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("grain", "tensorflow_datasets"):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Absent())
"""


def test_trainer_imports_without_grain_or_tfds():
    script = _ABSENT + textwrap.dedent("""
        from gattn import cli
        from gattn.data import synthetic
        from gattn.train import trainer
        assert trainer.data_source(cli.load("tiny", ["data.source=synthetic"])) is synthetic
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


def test_synthetic_batches_are_seeded_per_row_and_resume():
    from gattn import cli
    from gattn.data import synthetic
    cfg = cli.load("tiny", ["data.source=synthetic", "train.batch_size=4", "train.seq_len=8"])
    whole = synthetic.train_iterator(cfg)
    first, second = next(whole), next(whole)
    assert first["tokens"].shape == (4, 9) and (first["segment_ids"] == 1).all()
    assert not (first["tokens"] == second["tokens"]).all()
    half = synthetic.train_iterator(cfg, rows=range(2, 4))  # another process's rows: the same numbers
    assert (next(half)["tokens"] == first["tokens"][2:]).all()
    resumed = synthetic.train_iterator(cfg)
    synthetic.set_state(resumed, {"synthetic_batches": 1})
    assert (next(resumed)["tokens"] == second["tokens"]).all()
    assert first["tokens"].max() < cfg.model.vocab_size


@pytest.mark.slow
def test_synthetic_training_needs_neither_grain_nor_tfds(tmp_path):
    """With Grain and TFDS unimportable, the trainer trains on synthetic tokens."""
    script = _ABSENT + textwrap.dedent(f"""
        from gattn import cli
        from gattn.train import trainer
        cfg = cli.load("tiny", ["data.source=synthetic", "train.steps=2", "train.warmup_steps=1",
                                "train.batch_size=2", "train.seq_len=16", "model.num_layers=1",
                                "data.eval_batches=1", "data.eval_batch_size=2"])
        summary = trainer.train(cfg, {str(tmp_path / "run")!r}, progress=False)
        assert summary["completed"] and "val_loss/synthetic" in summary, summary
        assert "grain" not in sys.modules and "tensorflow_datasets" not in sys.modules
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


def test_docs_gpu_md_installs_the_jax_that_pyproject_pins():
    """Issue 34: docs/gpu.md told users `pip install -U "jax[cuda13]"`, which moves JAX past the
    version pyproject.toml pins. Every CUDA install line on the page pins pyproject's version."""
    import re

    pinned = re.search(r'"jax==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    page = (ROOT / "docs" / "gpu.md").read_text()
    installs = [line for line in page.splitlines() if line.startswith("pip install") and "jax[cuda" in line]
    assert installs and all(f"=={pinned}" in line for line in installs), installs
    assert not re.search(r"^pip install -U", page, re.M)


def test_a_kernels_part_cut_short_still_reports_its_ratios(tmp_path, monkeypatch):
    """On the H200 the part's time cap killed it inside the `xla` path at 8k, after the fused,
    ungated and cuDNN paths were timed: the ratios, written only after the last path, were lost."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    from gattn import kernels

    def killed(*a, **k):
        raise SystemExit("killed by the part's time cap")  # not an Exception: like the kill, it ends the part

    monkeypatch.setattr(kernels, "attention_xla", killed)
    report = gpu_check.Report(tmp_path / "kernels.json", "kernels")
    with pytest.raises(SystemExit):
        gpu_check.part_kernels(report, True, float("inf"))
    written = json.loads((tmp_path / "kernels.json").read_text())["kernels"]["32"]
    assert "xla_plus_gate" not in written
    assert written["fused_over_ungated"] > 0 and written["fused_over_cudnn_plus_gate"] > 0


def test_gpu_blocks_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_blocks.py"), "--out", str(tmp_path), "--dry-run"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "gpu_blocks.json").read_text())["rows"]
    assert "cudnn_plus_gate" in rows and len(rows) == 3
    assert all(r[p]["ms"] > 0 for r in rows.values() for p in ("fwd", "fwd_bwd")), rows
