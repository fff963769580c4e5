"""`python -m gattn.study`: run an ablation study and write its report (see gattn.experiments.study)."""

from gattn.cli import run_entry_point
from gattn.experiments.study import main

if __name__ == "__main__":
    run_entry_point(main)
