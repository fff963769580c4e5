"""A multi-process entry point for tests/test_liveness.py: it joins the run as train.py does,
then process 0 trains a tokenizer on CORPUS (as train.py's prepare does on first use) while the
others wait at a barrier; every process then prints "done N".

    python tests/programs/tokenizer_peer.py CORPUS MODEL [--vocab V]   (JAX_* variables as gattn.launch sets them)
"""

import argparse
import time
from pathlib import Path

from gattn import cli


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("corpus")
    ap.add_argument("model")
    ap.add_argument("--vocab", type=int, default=8000)
    args = ap.parse_args(argv)
    cli.start_distributed(args)
    import jax  # noqa: PLC0415

    from gattn.data.tokenizer import train_tokenizer  # noqa: PLC0415
    from gattn.train import hosts  # noqa: PLC0415

    hosts.barrier("joined")
    if hosts.primary():
        start = time.monotonic()
        train_tokenizer(args.corpus, 0, args.vocab, Path(args.model))
        print(f"trained in {time.monotonic() - start:.1f} s", flush=True)
    hosts.barrier("prepared")
    print(f"done {jax.process_index()}", flush=True)
    return 0


if __name__ == "__main__":
    cli.run_entry_point(main)
