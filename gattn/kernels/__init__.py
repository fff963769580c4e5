"""Attention kernels: pure functions on arrays that know nothing of the model.

`attention` is the one entry point the model calls; `impl` picks the implementation. The `xla`
implementation (reference.py) is plain jnp and is the reference every other implementation is
tested against.
"""

from gattn.kernels.reference import attention_xla

IMPLS = {"xla": attention_xla}


def attention(q, k, v, *, impl: str = "xla", **kwargs):
    """Runs the attention implementation named by `impl` (the model's `attention_impl`)."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl {impl!r} is not available; implemented: {sorted(IMPLS)}")
    return IMPLS[impl](q, k, v, **kwargs)


__all__ = ["IMPLS", "attention", "attention_xla"]
