"""`python -m gattn.convert`: Hugging Face conversion, from-hf and to-hf (see gattn.interop.convert)."""

from gattn.cli import run_entry_point
from gattn.interop.convert import main

if __name__ == "__main__":
    run_entry_point(main)
