"""Process-level settings the entry points need before JAX starts."""

from __future__ import annotations

import os
import sys

# glibc serves buffers over 32 MB (the logits) by mmap/munmap, costing ~220 ms of page faults per
# step on CPU (PERFORMANCE.md, item 1). glibc reads this only at process start.
MALLOC_TUNABLES = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                   "glibc.malloc.trim_threshold=100000000000")


def ensure_malloc_tunables() -> None:
    """Re-executes the current command once with GLIBC_TUNABLES set, unless it is already set
    (by the user or by an earlier re-execution) or GATTN_NO_REEXEC=1."""
    if os.environ.get("GLIBC_TUNABLES") or os.environ.get("GATTN_NO_REEXEC") == "1":
        return
    argv = sys.orig_argv
    if len(argv) < 2 or argv[1] == "-c":
        return  # interactive or `python -c`: nothing to re-execute
    os.execve(sys.executable, [sys.executable, *argv[1:]], dict(os.environ, GLIBC_TUNABLES=MALLOC_TUNABLES))
