"""The notebooks run top to bottom (on a small setting: the parameters cell is replaced)."""

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.num_layers=2", "model.d_model=32", "model.q_heads=2", "model.kv_heads=1",
         "model.head_dim=16", "model.d_ff=64", "model.vocab_size=512", "train.batch_size=4",
         "train.seq_len=32", "train.warmup_steps=1", "data.code_max_bytes=200000",
         "data.eval_batches=1", "data.eval_batch_size=2"]


@pytest.mark.parametrize("variant", ["sdpa_elementwise"])
def test_prototype_notebook_runs(tmp_path, variant):
    nb = nbformat.read(ROOT / "notebooks" / "prototype.ipynb", as_version=4)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1
    params[0].source = (f"VARIANT = {variant!r}\nSTEPS = 4\nWORKDIR = {str(tmp_path)!r}\n"
                        f"OVERRIDES = {json.dumps(SMALL)}")
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "layer 1: gate score" in text and "F-Attn" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3  # curves, histogram, maps
    assert (tmp_path / variant / "notebook_figures" / "gate_scores.png").is_file()
