"""What a forward pass records for analysis: an explicit setting handed down the layers (as Flax's
Gemma example hands down its sow config), never a flag flipped on live modules.

The recorded values are sown as `nnx.Intermediate` under each block; `gattn.eval.analysis`
pops them. Capturing the attention matrix needs the xla attention (the Pallas kernel never forms
it): a model built with `exec.attention_impl="pallas"` refuses such a capture rather than
switching kernels behind the caller's back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capture:
    block_out: bool = False   # each block's output (the residual stream; M-Act)
    ffn_out: bool = False     # what each block's FFN adds to the residual stream (Fig. 6)
    attn_probs: bool = False  # the attention matrix [B, Hq, S, S] (F-Attn, attention maps)
    sdpa_out: bool = False    # the SDPA output before any G1 gate or non-linearity
    gate: bool = False        # gate scores, and what the gate takes and returns at its position
    qk: bool = False          # q and k as SDPA takes them (after QK-norm and RoPE): the attention
    #                           logits' inputs (the stability trace); not part of EVERYTHING

    @property
    def any(self) -> bool:
        return self.block_out or self.ffn_out or self.attn_probs or self.sdpa_out or self.gate or self.qk


NOTHING = Capture()
EVERYTHING = Capture(block_out=True, ffn_out=True, attn_probs=True, sdpa_out=True, gate=True)
