"""The paper's context extension at scale (Sec. 4.4, Table 5): the dense 1.7B continued at a
32k sequence length with RoPE base 1M for ~80B tokens (64 x 32,768 tokens a step, 38k steps),
from a 4k checkpoint of `configs/dense_1p7b.py`:

    python train.py --config configs/extend_1p7b_32k.py --workdir gs://.../extend_32k \
        --init-from gs://.../dense_1p7b [--variant sdpa_elementwise]

then YaRN to 128k at eval time: eval.py --ruler --lengths 4096,...,131072
--config.model.yarn.factor=4. The paper gives no learning rate for this stage; the schedule here
(1e-4 after 500 warmup steps, cosine to 1e-5) is ours. The paper pretrains with base 10k and raises
it to 1M here; `dense_1p7b.py` pretrains with 1M (as Qwen3 does): for the paper's protocol,
pretrain with --config.model.rope_base=10000. The fused Pallas attention keeps the 32k step's
memory linear in the sequence length: `bench/aot_train_step.py --preset extend_1p7b_32k
--topology v5p:4x4x2 --mesh 8,1,4 --variant sdpa_elementwise` compiles the step at 18.3 GiB per
chip with one 32k row per data shard and 55.1 GiB with four (of 95): the batch of 64 is four rows
per shard on 64 v5p chips (data 16, model 4).
"""

import dataclasses
from pathlib import Path

from gattn.cli import load


def get_config():
    cfg = load(Path(__file__).with_name("dense_1p7b.py"))
    train = dataclasses.replace(cfg.train, seq_len=32_768, batch_size=64, steps=38_000, lr_preset="",
                                learning_rate=1e-4, min_learning_rate=1e-5, warmup_steps=500,
                                eval_every=1000, checkpoint_every=500)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rope_base=1_000_000.0), train=train)
