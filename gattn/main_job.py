"""`python -m gattn.main_job`: the main job, baseline vs gated tiny models compared (see gattn.experiments.main_job)."""

from gattn.cli import run_entry_point
from gattn.experiments.main_job import main

if __name__ == "__main__":
    run_entry_point(main)
