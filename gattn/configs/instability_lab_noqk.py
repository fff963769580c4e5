"""The instability lab with the paper's own baseline attention (docs/instability.md, issue 61):
configs/instability_lab.py without QK-norm and with biases on W_Q, W_K and W_V only, as Qwen2.5,
which the paper's dense models follow, has them. QK-norm bounds the attention logits, the path by
which a pre-norm baseline is said to blow up at a high LR; this lab lets them grow.

Everything else (the 12 layers of d_model 64, the data, AdamW without clipping, warmup and cosine
to 1% of the peak, fp32) is the QK-norm lab's, but the budget is halved twice to fit a 100-cell
study on 2 shared CPU cores: 100 steps of 8 x 128 tokens (0.1M tokens), 15 warmup steps (the same
15% of the steps). Ours, for time: the QK-norm lab runs 200 steps of 16 x 128. The search that chose
the learning rates, with the QK-norm lab at this budget beside it: docs/instability.md.

    python train.py --config configs/instability_lab_noqk.py --config.train.learning_rate=1.0 \
        --config.train.min_learning_rate=0.01 --workdir workdir/instability_lab_noqk
"""

import dataclasses
from pathlib import Path

from gattn.cli import load
from gattn.config import Config


def get_config() -> Config:
    cfg = load(Path(__file__).parent / "instability_lab.py")
    model = dataclasses.replace(cfg.model, qk_norm=False, qkv_bias=True)
    train = dataclasses.replace(cfg.train, steps=100, batch_size=8, warmup_steps=15, eval_every=100,
                                checkpoint_every=100)
    return dataclasses.replace(cfg, model=model, train=train)
