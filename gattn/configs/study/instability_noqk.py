"""The instability verdict on the paper's own baseline attention (docs/instability.md, issue 61):
configs/study/instability_verdict.py's study and rule on configs/instability_lab_noqk.py (no
QK-norm; biases on W_Q, W_K, W_V as Qwen2.5 has them). The baseline, the G1 elementwise and G1
headwise gates with their FFN narrowed to the baseline's parameter count, and the paper's two
controls (sandwich norm; branch outputs clipped at 100), at the learning rate the search found
unstable for this baseline (1.0: dozens of loss spikes a run; nothing diverged at any rate) and
the one below it (0.5: a few spikes a run), 10 seeds each, paired by seed, judged by the
rule fixed in `instability_verdict.RULE` before the runs (study.json records it).

100 cells (5 variants x 2 learning rates x 10 seeds) of the lab's budget (100 steps of 8 x 128
tokens, 2-4 minutes a cell on 2 shared cores); resumable cell by cell.
Run as a script, this file trains them in the order that gives a verdict soonest (`order`): the
claim's three variants at the higher rate, seeds outer; then the controls at that rate; then the
same at the lower rate. It writes the report (DIR/report.md, report.json) from the cells finished
so far; `--report` writes it without training; `--lr` trains only the cells at one rate; `--part
K/N` every N-th cell of the order from the K-th (N processes side by side, one per core).
`python -m gattn.study configs/study/instability_noqk.py --workdir DIR` trains the same cells in
its own order; either resumes what the other left.

    nice -n 10 python configs/study/instability_noqk.py --workdir workdir/study/instability_noqk [--report]
"""

import math
from pathlib import Path

from gattn.cli import load
from gattn.experiments.study import Study
from gattn.experiments.study.stability_rule import StabilityRule

# The rule, as configs/study/instability_verdict.py fixed it before its runs.
RULE = StabilityRule(margin=1.0, window=10, alpha=0.05, confidence=0.95, interval="t", min_spikes=1.0)
VARIANTS = ("baseline", "sdpa_elementwise_ffn_matched", "sdpa_headwise_ffn_matched", "sandwich_norm",
            "output_clip_100")
LEARNING_RATES = (0.5, 1.0)  # the search (docs/instability.md): 1.0 spikes ~36 times a run, 0.5 a few times
CLAIM_VARIANTS = VARIANTS[:3]  # the verdict's; the controls (sandwich norm, clipping) follow them


def get_study() -> Study:
    return Study(
        base=load(Path(__file__).parents[1] / "instability_lab_noqk.py"),
        variants=VARIANTS,
        seeds=tuple(range(10)),
        learning_rates=LEARNING_RATES,
        diverged_loss=math.inf,  # (the rule judges divergence from the losses; the runner only a stop)
        sink_points=0,
        measure_batches=1,
        cell_dir="runs/{variant}/lr_{lr:g}/seed_{seed}",
        gated="sdpa_elementwise_ffn_matched",
        stability_rule=RULE,
        description="the instability verdict without QK-norm: the no-QK-norm lab (q/k/v biases, as Qwen2.5), "
                    "baseline vs G1 gates and the paper's controls, 10 paired seeds at two learning rates")


def order(study: Study) -> list:
    """The cells in the order the script trains them: the higher rate first; at a rate, the
    claim's variants before the controls; in each of those, seed by seed, every variant."""
    from gattn.experiments.study import cells  # noqa: PLC0415

    rank = {v: i for i, v in enumerate(study.variants)}
    return sorted(cells(study), key=lambda c: (-c.lr, c.variant not in CLAIM_VARIANTS, c.seed, rank[c.variant]))


def main(argv=None) -> int:
    from gattn.experiments.study import ordered  # noqa: PLC0415

    return ordered.main(get_study(), order, argv, description="the no-QK-norm instability verdict in its order (see the docstring)")


if __name__ == "__main__":
    from gattn.cli import run_entry_point

    run_entry_point(main)  # (as python -m gattn.study: the compilation cache, the malloc settings)
