"""Stand-ins for the Pallas TPU kernels off a TPU, for dress rehearsals (gattn.rehearse).

Off a TPU the Pallas kernels run in interpret mode, whose cost grows with the whole array at every
grid step: one step of a rehearsal at a preset's batch of 1024 rows took minutes per layer on
2 CPU cores. With GATTN_PALLAS_STANDIN=1 in the environment, a program compiled for CPU keeps
everything around the kernels (exec settings, the shard_map over batch and heads, the MoE's
buffers and exchanges) and computes their bodies with XLA (flash attention -> `attention_xla`,
megablox -> `grouped_matmul.scanned_dot`, ragged_dot's result one group at a time), functions the
kernels are tested equal to. A program compiled for TPU is never affected.
"""

from __future__ import annotations

import os

ENV = "GATTN_PALLAS_STANDIN"


def enabled(platform: str) -> bool:
    """Whether a kernel in a program for `platform` runs its XLA stand-in."""
    return platform == "cpu" and os.environ.get(ENV, "") not in ("", "0")
