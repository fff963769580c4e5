"""`python -m gattn.params`: parameter counts and the paper's Table 1 and Table 6
(gattn.experiments.tables); with `--plan SLICE --days D`, a reservation planned from the preset's
modelled step (gattn.experiments.plan)."""

import sys

from gattn.cli import run_entry_point
from gattn.experiments import plan, tables


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--plan" or a.startswith("--plan=") for a in argv):
        return plan.main(argv)
    return tables.main(argv)


if __name__ == "__main__":
    run_entry_point(main)
