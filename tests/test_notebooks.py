"""The notebooks run top to bottom, from any folder, on a small setting (given as papermill gives
it: a cell of values after the cell tagged `parameters`)."""

import json
from pathlib import Path

import matplotlib
import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
# No train.warmup_steps: the notebook fits the tiny preset's 50 warmup steps to a short run.
SMALL = ["model.num_layers=2", "model.d_model=32", "model.q_heads=2", "model.kv_heads=1",
         "model.head_dim=16", "model.d_ff=64", "model.vocab_size=512", "train.batch_size=4",
         "train.seq_len=32", "data.code_max_bytes=200000", "data.eval_batches=1", "data.eval_batch_size=2"]
STEPS = 12  # fewer than the tiny preset's 50 warmup steps


def execute(nb, cwd: Path, **values) -> list:
    """Runs `nb` in a kernel whose current folder is `cwd`, `values` replacing parameters;
    returns the code cells' outputs."""
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1
    given = "\n".join(f"{k} = {json.dumps(v) if isinstance(v, list) else repr(v)}" for k, v in values.items())
    nb.cells.insert(nb.cells.index(params[0]) + 1, nbformat.v4.new_code_cell(given))
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


@pytest.mark.parametrize("variant", ["sdpa_elementwise"])
def test_prototype_notebook_runs(tmp_path, monkeypatch, variant):
    """From a folder outside the repository, with its default WORKDIR (under the home folder) and
    fewer steps than the preset warms up over: it trains the baseline and the variant on the same
    data and seed, shows their progress and both loss curves, and measures and plots the variant."""
    home, cwd = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("GATTN_NOTEBOOK_WORKDIR", raising=False)
    monkeypatch.setenv("MPLCONFIGDIR", matplotlib.get_cachedir())  # the font cache: not rebuilt in the new home
    nb = nbformat.read(ROOT / "notebooks" / "prototype.ipynb", as_version=4)
    outputs = execute(nb, cwd, VARIANT=variant, STEPS=STEPS, OVERRIDES=SMALL)
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "compiling the train step" in text and f"{STEPS}/{STEPS}" in text  # stage lines, progress bar
    assert "same data, tokenizer and seed: yes" in text
    assert "layer 1: gate score" in text and "F-Attn" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4  # loss, per-layer, histogram, maps
    [setting] = (home / "gattn-runs" / "prototype").iterdir()  # the default WORKDIR: not in the repository
    for name in ("baseline", variant):  # the loss curves' data: every step of both runs
        rows = [json.loads(line) for line in (setting / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and all(r["loss"] > 0 for r in rows)
        assert json.loads((setting / name / "config.json").read_text())["variant"] == name
    assert (setting / "loss_curves.png").is_file()
    assert (setting / variant / "notebook_figures" / "gate_scores.png").is_file()
