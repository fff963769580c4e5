"""`python -m gattn.rehearse PRESET --processes P --local-devices D`: a dress rehearsal of a preset on
local CPU processes before a slice is spent on it (see gattn.experiments.rehearse)."""

from gattn.cli import run_entry_point
from gattn.experiments.rehearse import main

if __name__ == "__main__":
    run_entry_point(main)
