"""`python -m gattn.prepare`: a corpus tokenized once into ArrayRecord shards on Apache Beam
(gattn/data/prepare.py; docs/training.md#real-corpora)."""

from gattn import cli
from gattn.data.prepare import main

if __name__ == "__main__":
    raise SystemExit(cli.run_cli(main))
