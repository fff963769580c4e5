"""Table 4 at the main job's scale: the baseline and six gates, three seeds each, identical data and
token budget (the tiny model of configs/tiny.py, 300 steps of 16 x 256 tokens = 1.2M tokens per run,
3/4 of the main job's budget so that the 21 runs fit in an hour: about 50 minutes on 2 CPU cores).

    python -m gattn.study configs/study/table4_tiny.py --workdir workdir/study/table4_tiny

Scale it by changing sizes: `--config.model.d_model=...`, `--steps N`, or a copy of this file
with configs/dense_1p7b.py as the base and a mesh for a TPU slice.
"""

import dataclasses
from pathlib import Path

from gattn.cli import load
from gattn.experiments.study import Study


def get_study() -> Study:
    base = load(Path(__file__).parents[1] / "tiny.py")
    train = dataclasses.replace(base.train, steps=300, warmup_steps=40, eval_every=300)
    return Study(
        base=dataclasses.replace(base, train=train),
        variants=("baseline", "sdpa_elementwise", "sdpa_headwise", "v_elementwise", "sdpa_head_shared",
                  "sdpa_input_independent", "sdpa_ns_sigmoid"),
        seeds=(0, 1, 2),
        sink_points=4,
        measure_batches=2,
        description="Table 4 at tiny scale (1.8M parameters, 1.2M tokens per run)")
