"""Hugging Face tensors <-> gattn parameters, whichever the family: every tensor name and shape of a
layout, and the mapping both ways (each family's module owns its names and packing:
gattn/interop/families.py; the shared decoder is gattn/interop/decoder.py, the files
gattn/interop/files.py)."""

from __future__ import annotations

import numpy as np

from gattn.config import ModelConfig
from gattn.interop.families import family


def hf_shapes(cfg: ModelConfig, layout: str = "qwen3_next") -> dict[str, tuple[int, ...]]:
    """Every tensor name of the Hugging Face model `cfg` in `layout` and its shape."""
    return family(layout).hf_shapes(cfg, layout)


def to_gattn(tensors: dict[str, np.ndarray], cfg: ModelConfig, layout: str) -> dict[tuple, np.ndarray]:
    """Hugging Face tensors -> gattn parameters {path: array} of the unscanned model."""
    return family(layout).to_gattn(tensors, cfg, layout)


def from_gattn(params: dict[tuple, np.ndarray], cfg: ModelConfig, layout: str) -> dict[str, np.ndarray]:
    """gattn parameters {path: array} of the unscanned model -> Hugging Face tensors."""
    return family(layout).from_gattn(params, cfg, layout)
