"""One writer per run directory (gattn.train.lease): a second train.py on a directory a live run
holds is refused in one line naming the holder; a lease whose process is gone, or that another
host stopped renewing, is taken over; the lease is given back when the run ends."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_config_file
from gattn.config import ConfigError
from gattn.train import lease

ROOT = Path(__file__).resolve().parents[1]


def write_holder(workdir: Path, **holder):
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / lease.LOCK).write_text(json.dumps({"since": "earlier", "token": "theirs", **holder}))


def test_a_live_holder_on_this_host_is_named_and_the_lease_is_kept(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_holder(tmp_path, host=socket.gethostname(), pid=other.pid, renewed=time.time())
        with pytest.raises(ConfigError, match=rf"--workdir.*pid {other.pid} has held it since earlier"):
            with lease.hold(tmp_path):
                pass
        assert json.loads((tmp_path / lease.LOCK).read_text())["pid"] == other.pid  # untouched
    finally:
        other.kill()
        other.wait()


def test_a_lease_whose_process_is_gone_is_taken_over_and_given_back(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_holder(tmp_path, host=socket.gethostname(), pid=gone.pid, renewed=time.time())
    with lease.hold(tmp_path):
        assert json.loads((tmp_path / lease.LOCK).read_text())["pid"] == os.getpid()
    assert not (tmp_path / lease.LOCK).exists()


def test_another_hosts_lease_holds_until_it_is_not_renewed(tmp_path):
    write_holder(tmp_path, host="some-other-host", pid=1, renewed=time.time() - 10)
    with pytest.raises(ConfigError, match="some-other-host pid 1"):
        with lease.hold(tmp_path):
            pass
    write_holder(tmp_path, host="some-other-host", pid=1, renewed=time.time() - lease.STALE_SECONDS - 1)
    with lease.hold(tmp_path):
        pass


def test_only_process_0_holds_the_lease(tmp_path):
    with lease.hold(tmp_path, primary=False):
        assert not (tmp_path / lease.LOCK).exists()


@pytest.mark.slow  # two train.py runs (~1 min)
def test_a_second_train_py_on_a_running_directory_is_refused_and_a_killed_one_is_taken_over(tmp_path):
    config = tmp_path / "run.py"
    config.write_text(run_config_file(steps=400, checkpoint_every=5, warmup_steps=2, eval_every=400))
    args = [sys.executable, "train.py", "--config", str(config), "--workdir", str(tmp_path / "run"), "--quiet"]
    first = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert first.poll() is None, first.communicate()
        time.sleep(0.1)
    second = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert f"pid {first.pid}" in lines[0] and "--workdir" in lines[0]
    first.send_signal(signal.SIGKILL)
    first.wait()
    third = subprocess.run([*args, "--steps", "12"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-2000:]
    assert not (tmp_path / "run" / lease.LOCK).exists()
