"""Context extension of a tiny run, the paper's protocol at small scale (Sec. 4.4, Table 5):
raise the RoPE base 10k -> 1M and continue training at 4x the sequence length (256 -> 1024) from
the trained checkpoint, with a fresh optimizer and a short, lower-LR schedule:

    python train.py --config configs/extend_tiny.py --workdir workdir/extend/baseline \
        --init-from workdir/main/baseline --variant baseline

Then stretch it further at eval time without retraining (YaRN, 1024 -> 4096):

    python eval.py --workdir workdir/extend/baseline --ruler --lengths 512,1024,2048,4096 \
        --config.model.yarn.factor=4 --out workdir/extend/baseline/eval_yarn

The model must be the source run's architecture (train.init_from refuses another one, naming the
field); on a TPU slice scale `seq_len` and the batch as the paper does (4k -> 32k).
"""

import dataclasses
from pathlib import Path

from gattn.cli import load

# The preset this one continues (train.init_from must be a run of it): the test of the protocol
# checks that the extension changes its RoPE base (tests/test_presets.py).
CONTINUES = "tiny"


def get_config():
    cfg = load(Path(__file__).with_name(f"{CONTINUES}.py"))
    model = dataclasses.replace(cfg.model, rope_base=1_000_000.0)
    train = dataclasses.replace(cfg.train, seq_len=1024, batch_size=4, steps=100, learning_rate=1e-3,
                                min_learning_rate=1e-5, warmup_steps=10, eval_every=50,
                                checkpoint_every=50)
    return dataclasses.replace(cfg, model=model, train=train)
