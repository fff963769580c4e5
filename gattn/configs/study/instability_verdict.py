"""The instability verdict (docs/instability.md): does the G1 gate let the paper's baseline
architecture train at a learning rate where it loses stability (Table 2 rows 5-14)? The baseline,
the G1 elementwise and G1 headwise gates with their FFN narrowed to the baseline's parameter count
(Table 2's protocol), and the paper's two controls (sandwich norm, Table 2 row 7; branch outputs
clipped at 100, Appendix A.5) on configs/instability_lab.py, at two peak learning rates, 10 seeds
each, paired by seed (the same data order and initialisation seed), judged by a rule fixed here
before the runs (gattn/experiments/study/stability_rule.py; study.json records it):

- a run diverged if training stopped on non-finite losses, or its final loss (the mean of its last
  10 losses) is above its best (the lowest mean of 10 consecutive losses) by more than 1.0 nats;
- divergence counts: an exact one-sided McNemar test on the paired seeds, alpha 0.05;
- loss spikes (the trainer's counter: a loss 0.5 nats above the median of the previous 50):
  the 95% Student-t interval of the paired differences;
- no verdict at a rate where the baseline neither diverged nor averaged >= 1 spike.

100 cells (5 variants x 2 learning rates x 10 seeds) of the lab's budget; resumable cell by cell:
rerun the same command.

    nice -n 10 python -m gattn.study configs/study/instability_verdict.py --workdir workdir/study/instability_verdict

`python -m gattn.study` trains the cells learning rate by learning rate, variant by variant, seed
by seed, so a study stopped part way has some variants and no others. Run as a script, this file
trains the same cells in the same directory in the order a partial study stays balanced and
paired in (`order`: seeds outer, the three variants the claim needs at both rates, the higher
first, before the two controls), and writes the report (DIR/report.md, report.json) from the cells finished so far;
`--report` writes it without training; `--part K/N` trains every N-th cell of the order from the
K-th, so that N processes can share the cells (one per core); `--lr 1.0` only the cells at that
rate (the controls where the baseline loses stability before the rate where it has no verdict).
Either command resumes what the other left.

    nice -n 10 python configs/study/instability_verdict.py --workdir workdir/study/instability_verdict [--report]
"""

import math
import sys
from pathlib import Path

from gattn.cli import load
from gattn.experiments.study import Study
from gattn.experiments.study.stability_rule import StabilityRule

RULE = StabilityRule(margin=1.0, window=10, alpha=0.05, confidence=0.95, interval="t", min_spikes=1.0)
VARIANTS = ("baseline", "sdpa_elementwise_ffn_matched", "sdpa_headwise_ffn_matched", "sandwich_norm",
            "output_clip_100")
LEARNING_RATES = (3e-1, 1.0)
CLAIM_VARIANTS = VARIANTS[:3]  # the verdict's; the controls (sandwich norm, clipping) follow them


def get_study() -> Study:
    return Study(
        base=load(Path(__file__).parents[1] / "instability_lab.py"),
        variants=VARIANTS,
        seeds=tuple(range(10)),
        learning_rates=LEARNING_RATES,
        diverged_loss=math.inf,  # (the rule judges divergence from the losses; the runner only a stop)
        sink_points=0,
        measure_batches=1,
        cell_dir="runs/{variant}/lr_{lr:g}/seed_{seed}",
        gated="sdpa_elementwise_ffn_matched",
        stability_rule=RULE,
        description="the instability verdict: the instability lab, baseline vs G1 gates and the paper's "
                    "controls, 10 paired seeds at two learning rates")


def order(study: Study) -> list:
    """The study's cells in the order the script trains them: the claim's variants first, seed by
    seed (in a seed: the highest learning rate first, where the baseline loses stability, then the
    lower; at each, every variant), then the controls the same way."""
    from gattn.experiments.study import cells  # noqa: PLC0415

    first = [v for v in study.variants if v in CLAIM_VARIANTS]
    rank = {v: i for i, v in enumerate(first + [v for v in study.variants if v not in first])}
    return sorted(cells(study), key=lambda c: (c.variant not in first, c.seed, -c.lr, rank[c.variant]))


def main(argv=None) -> int:
    from gattn.experiments.study import ordered  # noqa: PLC0415

    return ordered.main(get_study(), order, argv, description="the instability verdict in a balanced, paired order (see the docstring)")


if __name__ == "__main__":
    sys.exit(main())
