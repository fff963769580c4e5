"""Programs that need several devices, as real files, and `run`, which launches one.

XLA makes 8 CPU devices only if `--xla_force_host_platform_device_count=8` is in XLA_FLAGS before
jax is first imported, and the test process has imported jax long before; so each program runs in
a fresh interpreter, `python -m multidevice.NAME ARGS...`, with the flag in its environment and
tests/ on its path (the programs take the shared tiny configs from tests/conftest.py). Each program
is a module with `main(argv)` that asserts what it checks and prints "ok ..." lines the test
counts. By hand, from tests/:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m multidevice.sharded_step --help

(The module names do not start with test_, so pytest never collects them.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
DEVICES = 8
FLAG = f"--xla_force_host_platform_device_count={DEVICES}"


def run(program: str, *args, timeout: float = 900) -> str:
    """Runs tests/multidevice/`program`.py with `args` on 8 simulated CPU devices; asserts that it
    exited with 0 (showing the end of its stderr if not) and returns its stdout."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FLAG}".strip()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("JAX_PLATFORMS", "cpu")
    out = subprocess.run([sys.executable, "-m", f"multidevice.{program}", *map(str, args)],
                         capture_output=True, text=True, timeout=timeout, env=env)
    command = " ".join([f"multidevice.{program}", *map(str, args)])
    assert out.returncode == 0, f"{command} failed:\n{out.stderr[-3000:]}"
    return out.stdout


def check_devices() -> None:
    """For the programs: fail clearly when started without the flag (e.g. by hand)."""
    import jax  # noqa: PLC0415

    if jax.device_count() < DEVICES:
        raise SystemExit(f"needs {DEVICES} devices, found {jax.device_count()}: set XLA_FLAGS={FLAG} "
                         "before starting Python (multidevice.run does)")


def shape(text: str) -> tuple[int, ...]:
    """'2,2,2' -> (2, 2, 2): an argparse type for mesh shapes."""
    return tuple(int(n) for n in text.split(","))


EXPERT_MESHES = [(1, 4, 2), (2, 2, 2), (1, 8, 1)]  # (data, expert, model): the expert meshes


def expert_meshes(doc: str, argv=None) -> list[tuple[int, ...]]:
    """For the expert-parallel programs: their --meshes (default EXPERT_MESHES), once the
    devices are checked."""
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--meshes", nargs="+", type=shape, default=EXPERT_MESHES, help="data,expert,model shapes")
    meshes = ap.parse_args(argv).meshes
    check_devices()
    return meshes
