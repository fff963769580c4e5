"""Time to the first training step of `train.py --config tiny`, stage by stage.

    python bench/startup.py [--config tiny] [--steps 2]

Three starts, each a fresh `train.py` process:
  cold_no_cache  a new run directory and an empty compilation cache (a first run ever)
  cold           another new run directory, with the compilation cache the first one filled
                 (a new run of a model this machine has trained before)
  warm           the cold run resumed with two more steps (a rerun after a stop)

Prints JSON: per start the seconds to the first logged step (the process start included), the
trainer's own stages from WORKDIR/startup.json (tokenizer, dataset, model initialisation or
checkpoint restore, compile of the train step), and "python_and_imports": what the process spent
before the trainer began. The issue's target on this 2-core machine, idle: warm <= 15 s,
cold <= 30 s (docs/training.md, "Start-up").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(workdir: Path, cache: Path, config: str, steps: int) -> dict:
    """One train.py process: seconds to its first metrics.jsonl row, and its startup.json."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache))
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", config, "--workdir", str(workdir), "--quiet",
           "--steps", str(steps), "--config.train.warmup_steps=1", "--config.train.log_every=1"]
    metrics = workdir / "metrics.jsonl"
    rows_before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None:
        if first is None and metrics.exists() and len(metrics.read_text().splitlines()) > rows_before:
            first = time.perf_counter() - t0
        time.sleep(0.05)
    _, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"train.py failed ({proc.returncode}):\n{err[-2000:]}")
    first = first if first is not None else time.perf_counter() - t0
    path = workdir / "startup.json"  # (absent before gattn timed its stages: only the first step then)
    stages = json.loads(path.read_text()) if path.exists() else {}
    return {"first_step_s": round(first, 2), "stages_s": stages,
            "python_and_imports_s": round(first - stages["total"], 2) if stages else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gattn-startup-") as tmp:
        tmp = Path(tmp)
        cache = tmp / "jax-cache"
        out = {"config": args.config,
               "cold_no_cache": start(tmp / "run0", cache, args.config, args.steps),
               "cold": start(tmp / "run1", cache, args.config, args.steps),
               "warm": start(tmp / "run1", cache, args.config, args.steps + 2)}
    out["targets_s"] = {"warm": 15, "cold": 30}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
