"""The sink lab's study (docs/sinks.md): does gating remove an attention sink that the baseline
forms? On configs/sink_lab.py (Bigram-Backcopy, 1 layer of d_model 128, 4 heads): the baseline,
the G1 elementwise and headwise sigmoid gates and the non-sparse NS-sigmoid gate, three seeds
each; F-Attn, M-Act and the Sink_1^0.3 share at 4 checkpoints (the emergence
curve) and at the end. 12 runs of the config's budget (400 steps of 256 x 32 tokens since the lab
became one whose sink matters; the 2-seed results in docs/sinks.md are of the earlier lab, 1,200
steps of 64 x 128 tokens). configs/study/sink_verdict.py is the 10-seed study with a preset rule.

    python -m gattn.study configs/study/sink_lab.py --workdir workdir/study/sink_lab
"""

import dataclasses
from pathlib import Path

from gattn.cli import load
from gattn.experiments.study import Claim, Study
from gattn.experiments.study.claims import CLAIMS

VARIANTS = ("baseline", "sdpa_elementwise", "sdpa_headwise", "sdpa_ns_sigmoid")


def get_study() -> Study:
    base = load(Path(__file__).parents[1] / "sink_lab.py")
    train = dataclasses.replace(base.train, eval_every=base.train.steps)
    # The paper's claims (its sink claim is about G1 elementwise), and the same sink claim for the
    # headwise and the non-sparse gate.
    claims = CLAIMS + tuple(
        Claim(f"{v}_removes_sink", f"{v} removes the attention sink and massive activations", ((v, "baseline"),),
              test="sink") for v in VARIANTS[2:])
    return Study(
        base=dataclasses.replace(base, train=train),
        variants=VARIANTS,
        seeds=(0, 1, 2),
        sink_points=4,
        measure_batches=4,
        claims=claims,
        description="the sink lab: Bigram-Backcopy, 1 layer, d_model 128, 4 heads")
