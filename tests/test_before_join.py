"""A usage error on one host before it joins (issue 57 item 7). Before: process 1 printed its
error at 0.7 s and exited 2, and process 0 waited silently for GATTN_JOIN_SECONDS (300 s), then
blamed process 1 for not starting. Now process 0 quotes process 1's line within seconds."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from gattn import launch

from test_pod import CONFIG, QUIET, train_args

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bad", [1, 0])
def test_a_usage_error_before_the_join_is_quoted_by_the_others_within_seconds(tmp_path, bad):
    config = tmp_path / "config.py"
    config.write_text(CONFIG)
    port = launch.free_port()
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, *train_args(config, tmp_path / "run", *(
        ["--config.train.steps=many"] if i == bad else []))], cwd=ROOT, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**launch.worker_env(i, 2, 1, port), **QUIET, "GATTN_JOIN_SECONDS": "120"})
        for i in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=60))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a process still waited 60 s after the other's usage error")
    seconds = time.monotonic() - start
    good = 1 - bad
    assert procs[bad].returncode == 2 and "train.steps" in outs[bad][1], outs[bad]
    assert procs[good].returncode == 1, outs[good]
    lines = [line for line in outs[good][1].splitlines() if line.startswith("error")]
    assert len(lines) == 1, outs[good][1]
    assert f"process {bad} failed before joining" in lines[0] and "train.steps" in lines[0], lines
    assert seconds < 30, seconds  # (the interpreters' start-ups; before: 120 s, then "did not join")
