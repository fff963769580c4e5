"""Long-context continued pretraining of Qwen3.5-2B at 65,536 tokens a row, the sequence split over
the mesh's context axis (context parallelism, gattn/model/context.py; docs/long-context.md):

    python train.py --config configs/qwen3_5_2b_64k.py --init-from workdir/qwen3_5_2b_hf \
        --workdir gs://BUCKET/runs/qwen3_5_2b_64k --config.data.source=shards:gs://BUCKET/data/long

The model is `configs/qwen3_5_2b.py`'s, unchanged: the released RoPE (base 10M on a quarter of
each attention head) already covers Qwen3.5's native 262,144 positions, so no YaRN and no new
base (docs/long-context.md, "Qwen3.5 at 64k and 256k"). The 3:1 Gated DeltaNet layers carry no
position at all.

Ours: the batch keeps qwen3_5_2b's 1M tokens a step (16 rows of 65,536), its schedule and MTP
weight, for 5,000 steps (5.2B tokens, a long-context stage's order of size). The mesh splits each
row over 4 devices (mesh.context = 4) and FSDP takes the rest of the slice; 4 gathered
microbatches hold one row per FSDP shard each, 16,384 tokens per chip as qwen3_5_2b's 4 x 4,096;
every matmul's output is kept for the backward pass (exec.remat = "dots"). Its fit (`python
bench/fit_presets.py --preset qwen3_5_2b_64k --topology v5p:2x2x4`, docs/presets.md): 48.7 GiB
per chip of 95, 42.2 GiB sent per chip per step (31.7 over the context axis), 4.06 s a step
modelled (compute-bound; MFU 0.59). Without rematerialisation it needs 101 GiB.
"""

import dataclasses
from pathlib import Path

from gattn.cli import load
from gattn.config import MeshConfig

CONTEXT = 65_536
ROWS = 16
MESH = MeshConfig(data=1, fsdp=-1, context=4)


def get_config(context: int = CONTEXT, rows: int = ROWS, mesh: MeshConfig = MESH, microbatches: int = 4):
    cfg = load(Path(__file__).with_name("qwen3_5_2b.py"))
    train = dataclasses.replace(cfg.train, seq_len=context, batch_size=rows, steps=5_000, warmup_steps=100,
                                microbatches=microbatches, eval_every=500, checkpoint_every=250)
    return dataclasses.replace(cfg, train=train, mesh=mesh, exec=dataclasses.replace(cfg.exec, remat="dots"))
