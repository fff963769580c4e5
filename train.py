"""Training entry point: python train.py --config configs/NAME.py --workdir DIR [--steps N] [--config.FIELD=VALUE ...]

Not there yet: the data pipeline (Grain + TFDS), the optimizer schedules and Orbax checkpoints land
with the training issue. Until then this script checks the config and says so; `python -m
gattn.demo` trains every variant briefly on the embedded corpus.
"""

import argparse
import sys

from gattn import config as config_lib


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--variant")
    args, rest = ap.parse_known_args(argv)
    rest, overrides = config_lib.split_argv(rest)
    if rest:
        ap.error(f"unrecognised arguments: {' '.join(rest)}")
    cfg = config_lib.load(args.config, overrides, variant=args.variant)
    print(f"config OK (variant {cfg.variant}, {cfg.model.num_layers} layers, d_model {cfg.model.d_model}).\n"
          "train.py is not implemented yet: it arrives with the training issue. "
          "Meanwhile run `python -m gattn.demo`.", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(config_lib.run_cli(main))
