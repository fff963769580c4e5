"""The paper's 48-layer dense model (Table 2 rows 5-10). The paper gives only the depth; gattn
keeps the 1.7B budget of `dense_1p7b.py` by narrowing the SwiGLU to 2,720 (1.72B parameters)."""

import importlib.util
from pathlib import Path

from gattn.config import Config

_spec = importlib.util.spec_from_file_location("dense_1p7b", Path(__file__).with_name("dense_1p7b.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)


def get_config() -> Config:
    cfg = _base.get_config()
    return Config(model=_base.model(num_layers=48, d_ff=2720), train=cfg.train, mesh=cfg.mesh, exec=cfg.exec)
