"""`python -m gattn.experiments.study` (the same as `python -m gattn.study`)."""

from gattn.cli import run_entry_point
from gattn.experiments.study.command import main

run_entry_point(main)
