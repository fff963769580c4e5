"""`python -m gattn.params`: parameter counts and the paper's Table 1 and Table 6 (gattn.experiments.tables)."""

from gattn.cli import run_entry_point
from gattn.experiments.tables import main

if __name__ == "__main__":
    run_entry_point(main)
