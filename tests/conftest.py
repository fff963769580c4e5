"""Test-session setup. libtpu is installed (for AOT TPU compiles), but this machine has no TPU:
pin the runtime to CPU before jax is imported so it does not probe for one. Topology
descriptions for ahead-of-time compilation still work under this setting."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes a machine-wide lock file by default; a second process compiling for TPU at the same
# time (another test run, a benchmark) would fail on it. Compiling needs no exclusive device.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
