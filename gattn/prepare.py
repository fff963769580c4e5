"""`python -m gattn.prepare`: a corpus tokenized once into ArrayRecord shards on Apache Beam
(gattn/data/prepare.py; docs/training.md#real-corpora)."""

import logging

from gattn import cli
from gattn.data.prepare import main

if __name__ == "__main__":
    # Beam warns on import that Google's BigQuery client is missing: nothing here uses it.
    logging.getLogger().addFilter(lambda record: "apitools not found" not in record.getMessage())
    raise SystemExit(cli.run_cli(main))
