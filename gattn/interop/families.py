"""The Hugging Face families gattn reads and writes, one module each, by the layout names they own.
Every family module has the same names: LAYOUTS, ARCHITECTURES and MODEL_TYPES (what it reads, by
layout), model_config / hf_config / kept_fields (config.json <-> ModelConfig), hf_shapes / to_gattn /
from_gattn (tensors <-> parameters), read_files (what a folder's files need before reading)."""

from __future__ import annotations

from types import ModuleType

from gattn.config import ConfigError
from gattn.interop import llama, qwen3_5, qwen3_moe, qwen3_next, release

FAMILIES = (llama, qwen3_moe, qwen3_next, qwen3_5, release)
BY_LAYOUT = {layout: family for family in FAMILIES for layout in family.LAYOUTS}
LAYOUTS = ("qwen3", "llama", "release", "qwen3_next", "qwen3_moe", "qwen3_5")


def family(layout: str) -> ModuleType:
    """The module that owns `layout`."""
    if layout not in BY_LAYOUT:
        raise ConfigError("--layout", layout, f"expected auto or one of {', '.join(LAYOUTS)}")
    return BY_LAYOUT[layout]
