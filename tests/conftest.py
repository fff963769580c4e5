"""Test-session setup. libtpu is installed (for AOT TPU compiles), but this machine has no TPU:
pin the runtime to CPU before jax is imported so it does not probe for one. Topology
descriptions for ahead-of-time compilation still work under this setting."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
