"""The instability lab with the paper's own baseline attention (docs/instability.md, issue 61):
configs/instability_lab.py without QK-norm and with biases on W_Q, W_K and W_V only, as Qwen2.5,
which the paper's dense models follow, has them; everything else (sizes, data, AdamW without
clipping, warmup and cosine, the 200-step budget) is the QK-norm lab's. QK-norm bounds the
attention logits, the path by which a pre-norm baseline is said to blow up at a high LR; this lab
lets them grow. The search that chose the learning rates: docs/instability.md.

    python train.py --config configs/instability_lab_noqk.py --config.train.learning_rate=0.1 \
        --config.train.min_learning_rate=0.001 --workdir workdir/instability_lab_noqk
"""

import dataclasses
from pathlib import Path

from gattn.cli import load
from gattn.config import Config


def get_config() -> Config:
    cfg = load(Path(__file__).parent / "instability_lab.py")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, qk_norm=False, qkv_bias=True))
