"""A minimal multi-process entry point for tests/test_cluster.py: it joins the run as train.py
does (gattn.cli.start_distributed, gattn.cli.run_entry_point), prints "ready", then exchanges
data with the others once a second. `--fail-on N` makes process N raise a usage error after
joining, while the others wait at a barrier; with `--fail-with TEXT` it raises an OSError with
message TEXT instead (its own error, in words that may look like a peer's failure). SIGTERM to
any process stops them all at the same round with exit 0 (JAX's preemption sync point, as
train.py saves there).

    python tests/programs/peer.py [--fail-on N [--fail-with TEXT]] [--rounds R]   (JAX_* variables as gattn.launch sets them)
"""

import argparse
import os
import time

from gattn import cli
from gattn.config import ConfigError


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--fail-on", type=int)
    ap.add_argument("--fail-with")
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--workdir")
    args = ap.parse_args(argv)
    cli.start_distributed(args)
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415

    multihost_utils.process_allgather(jnp.ones(2))
    print(f"ready {jax.process_index()} {os.getpid()}", flush=True)
    if args.fail_on == jax.process_index():
        time.sleep(1)
        if args.fail_with:
            raise OSError(args.fail_with)
        raise ConfigError("data.source", "/no/such/corpus", "an existing file or directory")
    for step in range(args.rounds):
        multihost_utils.sync_global_devices("peer")
        if multihost_utils.reached_preemption_sync_point(step):  # SIGTERM to any process: all stop, as train.py
            print(f"stopped {jax.process_index()}", flush=True)
            return 0
        time.sleep(0.5)
    print(f"done {jax.process_index()}", flush=True)
    return 0


if __name__ == "__main__":
    cli.run_entry_point(main)
