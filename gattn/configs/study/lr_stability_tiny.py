"""Table 2's stability question at tiny scale, with Table 2's protocol: the baseline against the SDPA
elementwise gate with its FFN narrowed to the baseline's parameter count (sdpa_elementwise_ffn_matched),
across three peak learning rates, with gradient clipping at 1.0 and without it (the paper states
no clipping), two seeds each, with a deeper and narrower model than configs/tiny.py (8 layers of
d_model 64). The rates span two decades, fixed before any run: 3e-3 (the tiny model's), 3e-2 and
3e-1; 200 steps of 16 x 256 tokens per run. About 30 minutes on 2 CPU cores. Losses spikes
(train.spike_window / spike_margin) and divergences are counted per cell; bf16 compute:
`--config.exec.dtype=bfloat16`. What it showed: docs/sinks.md ("Stability").

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
        variants=("baseline", "sdpa_elementwise_ffn_matched"),
        seeds=(0, 1),
        learning_rates=(3e-3, 3e-2, 3e-1),
        grad_clips=(1.0, 0.0),
        cell_dir="runs/{variant}/clip_{clip:g}/lr_{lr:g}/seed_{seed}",
        gated="sdpa_elementwise_ffn_matched",
        sink_points=3,
        measure_batches=2,
        description="learning-rate stability at tiny scale (8 layers, d_model 64), FFN-matched gate, clipping on/off")
