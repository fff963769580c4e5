"""Evaluation entry point: python eval.py --workdir DIR [--step N] [--config.FIELD=VALUE ...]

Not there yet: restoring Orbax checkpoints and the paper's measurements as tools land with the
eval issue. The measurements' seam exists: `gattn.analysis.collect` / `summarize` read gate
scores, attention probabilities and hidden states from the model's own forward pass.
"""

import sys


def main():
    print("eval.py is not implemented yet: it arrives with the eval issue "
          "(see gattn/analysis.py for what exists).", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
