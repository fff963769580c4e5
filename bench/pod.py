"""A pod slice on this machine: the same tiny run on 1 process x 8 CPU devices and on P processes
x 8/P devices (gattn.launch: gloo over 127.0.0.1), compared step by step; then a worker is
SIGKILLed mid-run and the time until the others stop is measured. Prints JSON.

    python bench/pod.py [--processes 2] [--steps 16]

What it reports: the largest relative difference of any logged loss / gradient norm between the two
layouts (the issue's bar: 1e-6), whether they are bit-identical, each layout's wall time (their
ratio is what carries over: the processes share this machine's cores), and the seconds the
surviving workers took to exit after the kill, with the lines they printed (gattn.cluster: each
names the dead process in one line).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
from gattn.config import Config, DataConfig, ModelConfig, TrainConfig

def get_config():
    return Config(
        model=ModelConfig(vocab_size=512, d_model=64, num_layers=2, q_heads=4, kv_heads=2, head_dim=16, d_ff=128),
        train=TrainConfig(batch_size=8, seq_len=64, steps={steps}, warmup_steps=2, log_every=1,
                          eval_every={steps}, checkpoint_every=4),
        data=DataConfig(code_max_bytes=200_000, eval_batches=1, eval_batch_size=2))
"""


def train(config, workdir, *, processes: int, devices: int) -> float:
    args = [str(ROOT / "train.py"), "--config", str(config), "--workdir", str(workdir), "--quiet"]
    t0 = time.perf_counter()
    if processes == 1:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        subprocess.run([sys.executable, *args], env=env, check=True, capture_output=True)
    else:
        subprocess.run([sys.executable, "-m", "gattn.launch", "--processes", str(processes), "--local-devices",
                        str(devices), *args], check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - t0


def metrics(workdir):
    return {r["step"]: r for r in map(json.loads, (Path(workdir) / "metrics.jsonl").read_text().splitlines())}


def kill_time(config, workdir, processes: int, devices: int) -> tuple[float, list[str]]:
    """Seconds from SIGKILL of the last worker to the exit of all the others, and their stderr."""
    from gattn import launch  # noqa: PLC0415

    port = launch.free_port()
    args = [str(ROOT / "train.py"), "--config", str(config), "--workdir", str(workdir), "--quiet"]
    procs = [subprocess.Popen([sys.executable, *args], env=launch.worker_env(i, processes, devices, port),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(processes)]
    path = Path(workdir) / "metrics.jsonl"
    while not (path.exists() and len(path.read_text().splitlines()) >= 5):
        time.sleep(0.05)
    procs[-1].send_signal(signal.SIGKILL)
    t0 = time.perf_counter()
    errors = [p.communicate(timeout=300)[1].strip() for p in procs[:-1]]
    return time.perf_counter() - t0, errors


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args(argv)
    devices = 8 // args.processes
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = tmp / "pod.py"
        config.write_text(CONFIG.format(steps=args.steps))
        one_s = train(config, tmp / "one", processes=1, devices=8)
        many_s = train(config, tmp / "many", processes=args.processes, devices=devices)
        a, b = metrics(tmp / "one"), metrics(tmp / "many")
        diffs = {k: max(abs(a[s][k] - b[s][k]) / abs(a[s][k]) for s in a if a[s][k]) for k in ("loss", "grad_norm", "lr")}
        first_step_diffs = {k: abs(a[1][k] - b[1][k]) / abs(a[1][k]) for k in ("loss", "grad_norm") if a[1][k]}
        (tmp / "long.py").write_text(CONFIG.format(steps=400))
        stop_s, survivors = kill_time(tmp / "long.py", tmp / "kill", args.processes, devices)
    print(json.dumps({"layouts": f"1x8 vs {args.processes}x{devices}", "steps": args.steps,
                      "max_rel_diff": diffs, "step_1_rel_diff": first_step_diffs,
                      "bit_identical": max(diffs.values()) == 0.0,
                      "wall_s": {"one_process": round(one_s, 1), f"{args.processes}_processes": round(many_s, 1)},
                      "seconds_to_stop_after_sigkill": round(stop_s, 1), "survivors_said": survivors}, indent=1))


if __name__ == "__main__":
    main()
