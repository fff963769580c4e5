"""The sink verdict (docs/sinks.md): does G1 gating remove an attention sink that the baseline
relies on? The baseline, G1 elementwise and G1 headwise on configs/sink_lab.py, 10 seeds each,
paired by seed (same data order), judged by a rule fixed here before the runs
(gattn/eval/verdict.py, `SinkRule`; study.json records it and a resumed study must keep it):

- no verdict unless the baseline's mean <s>-ablation cost (the loss on non-copy tokens with <s>
  hidden from every query after the first, minus the plain loss) is >= 0.05 nats;
- "removes": the paired drop in mean non-trigger alpha_1 (queries after the first) AND in F-Attn
  is >= 50% of the baseline's mean, with a 95% Student-t interval of the mean paired difference
  below 0; "reduces": below 0, a smaller drop; "increases": above 0; "does not change": the
  interval within +-10% of the baseline's mean; otherwise "cannot tell";
- M-Act and the first token's residual norm: each judged alone by the same rule.

30 runs of the lab's budget. Resumable cell by cell: rerun the same command.

    nice -n 10 python -m gattn.study configs/study/sink_verdict.py --workdir workdir/study/sink_verdict
"""

import dataclasses
from pathlib import Path

from gattn.cli import load
from gattn.eval.verdict import SinkRule
from gattn.experiments.study import Study

RULE = SinkRule(min_ablation_cost=0.05, removes=0.5, same=0.1, confidence=0.95, interval="t",
                sink=("alpha_1_non_trigger_rest_mean", "f_attn"), alone=("m_act", "residual_norm_first"))


def get_study() -> Study:
    base = load(Path(__file__).parents[1] / "sink_lab.py")
    train = dataclasses.replace(base.train, eval_every=base.train.steps)
    return Study(
        base=dataclasses.replace(base, train=train),
        variants=("baseline", "sdpa_elementwise", "sdpa_headwise"),
        seeds=tuple(range(10)),
        sink_points=0,  # (no emergence curve: the verdict is on the final models)
        measure_batches=4,
        cell_dir="runs/{variant}/seed_{seed}",
        sink_rule=RULE,
        description="the sink verdict: the sink lab, baseline vs G1 elementwise and headwise, 10 paired seeds")
