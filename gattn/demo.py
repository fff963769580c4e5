"""`python -m gattn.demo`: a first look at every variant (see gattn.experiments.demo)."""

from gattn.cli import run_entry_point
from gattn.experiments.demo import main

if __name__ == "__main__":
    run_entry_point(main)
