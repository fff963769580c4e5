"""Qwen3.5-2B at its native 262,144 tokens a row: `configs/qwen3_5_2b_64k.py` with each row split
over 16 devices (mesh.context = 16; a chunk of 8,192 tokens per device, two per row) and 4 rows
a step (1M tokens), one row per microbatch: 16,384 tokens per chip again, each layer's
activations rematerialised (exec.remat = "full"). Same model and RoPE (docs/long-context.md). Its
fit (`python bench/fit_presets.py --preset qwen3_5_2b_256k --topology v5p:2x2x4`, docs/presets.md):
43.5 GiB per chip of 95, 122 GiB sent per chip per step (all of it over the context axis), 12.2 s
a step modelled (HBM-bound; MFU 0.36).
"""

import dataclasses
import importlib.util
from pathlib import Path

from gattn.config import MeshConfig

_spec = importlib.util.spec_from_file_location("qwen3_5_2b_64k", Path(__file__).with_name("qwen3_5_2b_64k.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)


def get_config():
    cfg = _base.get_config(context=262_144, rows=4, mesh=MeshConfig(data=1, fsdp=-1, context=16), microbatches=4)
    return dataclasses.replace(cfg, exec=dataclasses.replace(cfg.exec, remat="full"))
