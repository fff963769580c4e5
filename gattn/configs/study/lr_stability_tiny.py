"""Table 2's stability question at tiny scale: the baseline and the SDPA elementwise gate across
three peak learning rates, two seeds each, with a deeper and narrower model than configs/tiny.py
(8 layers of d_model 64). The rates span two decades, fixed before any run: 3e-3 (the tiny model's),
3e-2 and 3e-1; 200 steps of 16 x 256 tokens per run. About 15 minutes on 2 CPU cores.

    python -m gattn.study configs/study/lr_stability_tiny.py --workdir workdir/study/lr_stability_tiny
"""

import dataclasses
from pathlib import Path

from gattn.cli import load
from gattn.experiments.study import Study


def get_study() -> Study:
    base = load(Path(__file__).parents[1] / "tiny.py")
    model = dataclasses.replace(base.model, num_layers=8, d_model=64, q_heads=4, kv_heads=2, head_dim=16, d_ff=176)
    train = dataclasses.replace(base.train, steps=200, warmup_steps=20, eval_every=200)
    return Study(
        base=dataclasses.replace(base, model=model, train=train),
        variants=("baseline", "sdpa_elementwise"),
        seeds=(0, 1),
        learning_rates=(3e-3, 3e-2, 3e-1),
        sink_points=3,
        measure_batches=2,
        description="learning-rate stability at tiny scale (8 layers, d_model 64)")
