"""The paper's context extension at scale (Sec. 4.4, Table 5): the dense 1.7B, pretrained at 4k
with RoPE base 10k (`configs/dense_1p7b.py`), continued at a 32k sequence length with the base
raised to 1M for ~80B tokens (64 x 32,768 tokens a step, 38k steps):

    python train.py --config configs/extend_1p7b_32k.py --workdir gs://.../extend_32k \
        --init-from gs://.../dense_1p7b [--variant sdpa_elementwise]

then YaRN x4 to 128k at eval time (Sec. 4.4): eval.py --ruler --lengths 4096,...,131072
--config.model.yarn.factor=4 (`original_len` defaults to the run's 32,768; `YARN_EVAL` below).
Ours: the paper gives no learning rate, batch or step count for this stage; the schedule here
(1e-4 after 500 warmup steps, cosine to 1e-5) and the 64 x 32k batch are ours (every field and its
source: `python -m gattn.params --provenance extend_1p7b_32k`, docs/presets.md). The paper
extends its 3.5T-token models (Table 2 rows 3-4: batch 2048, `dense_3.5t`); `dense_1p7b.py` is the
400B-token recipe. The fused Pallas attention keeps the 32k step's memory linear in the sequence
length: `bench/aot_train_step.py --preset extend_1p7b_32k --topology v5p:4x4x2 --mesh 8,1,4
--variant sdpa_elementwise` compiles the step at 18.3 GiB per chip with one 32k row per data
shard and 55.1 GiB with four (of 95): the batch of 64 is four rows per shard on 64 v5p chips
(data 16, model 4).

Which slice it fits (`python bench/fit_presets.py --preset extend_1p7b_32k --topology v5p:4x4x2`:
the trainer's train and eval steps compiled by libtpu at the real batch of 64 x 32,768,
docs/presets.md): as configured, on a v5p-64 slice (v5p:4x4x2, 32 chips; dense_1p7b's mesh, FSDP
over all 32) in 2 gathered microbatches (1 row per chip each) with exec.remat="dots" (every matmul's
output kept) and exec.loss_chunk=1024, the train step takes 69.9 GiB per chip of 95, sends 15.5 GiB
per chip over ICI and runs 2,116 TFLOPs per chip counted from its HLO: 4.61 s modelled, against
4.91 s with full remat in one pass (21.6 GiB, 11.0 GiB sent; without remat the step needs 270 GiB)
(issue 58; the eval step with the resident AdamW moments: 2.5 GiB). The smallest slice measured to fit, before FSDP: v5p:2x2x1 (v5p-8, 4 chips;
mesh model 4) with --config.train.microbatches=16, 35.8 GiB train / 7.3 GiB eval.
"""

import dataclasses
import importlib.util
from pathlib import Path

from gattn.cli import load

# The preset this one continues (train.init_from must be a run of it): the test of the protocol
# checks that the extension changes its RoPE base (tests/test_presets.py).
CONTINUES = "dense_1p7b"
# eval.py's overrides for the 128k stage (Sec. 4.4: "we use YaRN to extend the context length to 128k").
YARN_EVAL = ("model.yarn.factor=4",)


def get_config():
    cfg = load(Path(__file__).with_name(f"{CONTINUES}.py"))
    train = dataclasses.replace(cfg.train, seq_len=32_768, batch_size=64, steps=38_000, lr_preset="",
                                learning_rate=1e-4, min_learning_rate=1e-5, warmup_steps=500,
                                eval_every=1000, checkpoint_every=500, microbatches=2)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rope_base=1_000_000.0), train=train,
                               exec=dataclasses.replace(cfg.exec, loss_chunk=1024, accumulate="gathered",
                                                        remat="dots"))


_spec = importlib.util.spec_from_file_location(CONTINUES, Path(__file__).with_name(f"{CONTINUES}.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)
_STAGE = "ours: the paper gives only the token count (~80B, Sec. 4.4)"

PROVENANCE = {
    **_base.PROVENANCE,
    "model.rope_base": "Sec. 4.4 ('We increase the RoPE base from 10k to 1M and continue training')",
    "model.yarn": "Sec. 4.4: none while training at 32k; at eval, YaRN x4 to 128k "
                  "(--config.model.yarn.factor=4, original_len 32,768)",
    "train.seq_len": "Sec. 4.4 (continue training on data with a sequence length of 32k)",
    "train.batch_size": _STAGE + ": 64 x 32,768 x 38,000 = 79.7B tokens",
    "train.steps": _STAGE + ": 64 x 32,768 x 38,000 = 79.7B tokens",
    "train.lr_preset": "none: the stage has its own schedule (learning_rate, min_learning_rate, warmup_steps)",
    "train.learning_rate": "ours: 1e-4 (the paper gives no LR for the extension)",
    "train.min_learning_rate": "ours: cosine to 1e-5",
    "train.warmup_steps": "ours: 500 steps",
    "train.microbatches": "ours: execution; the batch of 64 x 32k in 2 gathered microbatches under FSDP on "
                          "32 v5p chips, the shortest modelled step within HBM (docs/presets.md, 'Which "
                          "slice each preset fits')",
    "train.init_from": "Sec. 4.4: a run of configs/dense_1p7b.py (given with --init-from); the "
                       "paper continues its 3.5T-token models (Table 2 rows 3-4)",
}
