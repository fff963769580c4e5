"""Test-session setup. libtpu is installed (for AOT TPU compiles), but this machine has no TPU:
pin the runtime to CPU before jax is imported so it does not probe for one. Topology
descriptions for ahead-of-time compilation still work under this setting."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes a machine-wide lock file by default; a second process compiling for TPU at the same
# time (another test run, a benchmark) would fail on it. Compiling needs no exclusive device.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# One persistent compilation cache for the session, inherited by every subprocess: the suite
# starts train.py, eval.py and the multi-device programs many times on the same tiny models, and
# each would compile the same executables again (the results do not depend on it).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="gattn-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# Every executable, however quick to compile: an eval.py run compiles ~20 small ones (0.5 s in all,
# 15% of the run), and the whole session's cache stays a few MB.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

from gattn.config import ModelConfig  # noqa: E402 (JAX-free: importing it here costs nothing)

# The tiny architecture most tests build: 2 layers, GQA 4 query heads over 2 kv heads, head_dim 8.
# A test that depends on other numbers passes them (tiny_model(vocab_size=96, head_dim=16)).
TINY_DIMS = dict(vocab_size=61, d_model=32, num_layers=2, q_heads=4, kv_heads=2, head_dim=8, d_ff=64)


def tiny_model(**changes) -> ModelConfig:
    """The shared tiny ModelConfig (TINY_DIMS) with `changes` (any ModelConfig field) applied.
    Tests import it (`from conftest import tiny_model`); so do the programs in tests/multidevice."""
    return ModelConfig(**{**TINY_DIMS, **changes})


def run_config_file(**train) -> str:
    """The text of a config file for end-to-end runs of train.py / eval.py: a tiny model on the
    embedded corpus, with `train` (TrainConfig fields: steps, warmup_steps, eval_every, ...)."""
    fields = ", ".join(f"{k}={v!r}" for k, v in {"batch_size": 4, "seq_len": 32, "log_every": 1, **train}.items())
    return (
        "from gattn.config import Config, DataConfig, ModelConfig, TrainConfig\n\n"
        "def get_config():\n"
        "    return Config(\n"
        "        model=ModelConfig(vocab_size=512, d_model=32, num_layers=2, q_heads=2, kv_heads=1,\n"
        "                          head_dim=16, d_ff=64),\n"
        f"        train=TrainConfig({fields}),\n"
        "        data=DataConfig(code_max_bytes=200_000, eval_batches=1, eval_batch_size=2))\n")


def entry_point(name: str):
    """train.py / eval.py as a module, to call its main() in the test's process (for checks that
    stop before any work, where an interpreter start would cost more than the check)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(f"entry_{name}", Path(__file__).resolve().parents[1] / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
