"""Every failure of a multi-process run is one line per process that names the process at fault
(gattn.cluster): a dead worker, an error on one process, a process that never joins. Local
processes on CPU devices with gloo, started by hand or by `python -m gattn.launch`; each case
runs a small program (tests/programs/peer.py) that joins the run as train.py does."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gattn import cluster, launch

ROOT = Path(__file__).resolve().parents[1]
PEER = str(ROOT / "tests" / "programs" / "peer.py")
NATIVE = ("Check failure", "*** ", "@     0x", "Traceback", "coordination_service", "Gloo connect")


def start(processes, tmp_path, *extra, env=None, indices=None):
    port = launch.free_port()
    return {i: subprocess.Popen([sys.executable, PEER, *map(str, extra)], cwd=ROOT, text=True,
                                env={**launch.worker_env(i, processes, 1, port), "GATTN_LOG_DIR": str(tmp_path / "logs"),
                                     **(env or {})},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for i in (range(processes) if indices is None else indices)}


def wait_ready(procs, timeout=120):
    """Reads each process's stdout up to its "ready" line."""
    for i, p in procs.items():
        start = time.time()
        while (line := p.stdout.readline()) and not line.startswith("ready"):
            assert time.time() - start < timeout
        assert line.startswith(f"ready {i} "), (i, line, p.stderr.read() if p.poll() is not None else "")


def assert_one_line(err: str, *needles):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert all(n in lines[0] for n in needles), lines[0]
    assert not any(n in err for n in NATIVE), err


@pytest.mark.parametrize("dead, says", [(2, "process 2 stopped responding"),
                                         (0, "process 0 (the coordinator) is gone")])
def test_a_dead_worker_is_named_by_every_other_in_one_line(tmp_path, dead, says):
    """SIGKILL to one of 3 processes (its supervisor: the worker under it dies with it). Each
    survivor exits 1 with one line naming the dead process and its own native log; the C++
    messages are in that log, not on the terminal."""
    procs = start(3, tmp_path)
    wait_ready(procs)
    procs[dead].send_signal(signal.SIGKILL)
    killed = time.time()
    for i in {0, 1, 2} - {dead}:
        _, err = procs[i].communicate(timeout=120)
        assert procs[i].returncode == 1, err
        assert_one_line(err, f"error (process {i}): {says}", f"process_{i}.log")
    assert time.time() - killed < 60
    assert "native messages of this process" in (tmp_path / "logs" / "process_1.log").read_text()


def test_an_error_on_one_process_is_quoted_by_the_others_and_the_launcher_keeps_its_status(tmp_path):
    """A usage error on process 0 alone (the others wait at a barrier): it exits 2 with its line,
    the others exit 1 quoting it, the launcher exits 2."""
    start_time = time.time()
    out = subprocess.run([sys.executable, "-m", "gattn.launch", "--processes", "3", PEER, "--fail-on", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "GATTN_LOG_DIR": str(tmp_path / "logs")})
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert time.time() - start_time < 60
    errors = [line for line in out.stdout.splitlines() if "error (process" in line]
    assert errors[0].startswith("[0] error (process 0): config field 'data.source'"), errors
    for i in (1, 2):
        assert [e for e in errors if e.startswith(f"[{i}] ")] == \
            [f"[{i}] error (process {i}): process 0 failed: " + errors[0].split("(process 0): ", 1)[1]], errors
    assert not any(n in out.stdout for n in NATIVE), out.stdout
    assert "[launch] exit 2: worker 0 failed first" in out.stderr, out.stderr


def test_an_error_on_another_process_stops_process_0_too(tmp_path):
    procs = start(2, tmp_path, "--fail-on", 1)
    wait_ready(procs)
    outs = {i: p.communicate(timeout=120) for i, p in procs.items()}
    assert procs[1].returncode == 2 and procs[0].returncode == 1, outs
    assert_one_line(outs[1][1], "error (process 1): config field 'data.source'")
    assert_one_line(outs[0][1], "error (process 0): process 1 failed: config field 'data.source'")


@pytest.mark.parametrize("failing, text", [
    (1, "503 Service Unavailable: GET https://storage.googleapis.com/corpus/shard-00003"),
    (0, "the checkpoint names barrier 'save-7', which this run never made")])
def test_an_own_error_in_the_words_of_a_peers_failure_is_quoted_by_the_others(tmp_path, failing, text):
    """An error of one process of two whose text has words that a peer's failure causes
    ("unavailable", "barrier"), while the other process is alive: the failing process gives its
    own line, the other quotes it (not "stopped responding" 40 s later), within seconds."""
    procs = start(2, tmp_path, "--fail-on", failing, "--fail-with", text)
    wait_ready(procs)
    ready = time.time()
    outs = {i: p.communicate(timeout=120) for i, p in procs.items()}
    took = time.time() - ready
    other = 1 - failing
    assert procs[failing].returncode == 1 and procs[other].returncode == 1, outs
    assert_one_line(outs[failing][1], f"error (process {failing}): OSError: {text}")
    assert_one_line(outs[other][1], f"error (process {other}): process {failing} failed: OSError: {text}")
    assert took < 12, (took, outs)


@pytest.mark.slow  # ~18 s
def test_a_killed_launcher_takes_its_workers_with_it(tmp_path):
    """SIGKILL to the launcher: each worker's supervisor gets SIGTERM (Linux's parent-death
    signal), passes it on, and the workers stop together (train.py saves there); none runs on."""
    launcher = subprocess.Popen([sys.executable, "-m", "gattn.launch", "--processes", "2", PEER], cwd=ROOT, text=True,
                                env={**os.environ, "GATTN_LOG_DIR": str(tmp_path / "logs")},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    workers = []
    while len(workers) < 2:
        line = launcher.stdout.readline()
        assert line, launcher.stderr.read()
        if "] ready " in line:
            workers.append(int(line.split()[-1]))
    launcher.kill()
    launcher.wait()
    deadline = time.time() + 60
    while time.time() < deadline and any(alive(pid) for pid in workers):
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def test_a_process_that_never_joins_is_named(tmp_path):
    """Processes 0 and 1 of 3 start; 2 never does. Both name it after GATTN_JOIN_SECONDS."""
    start_time = time.time()
    procs = start(3, tmp_path, env={"GATTN_JOIN_SECONDS": "4"}, indices=(0, 1))
    for i, p in procs.items():
        _, err = p.communicate(timeout=60)
        assert p.returncode == 1, err
        assert_one_line(err, f"error (process {i}): process 2 did not join the run within 4 s", "GATTN_JOIN_SECONDS")
    assert time.time() - start_time < 30


def test_a_missing_coordinator_is_named(tmp_path):
    procs = start(2, tmp_path, env={"GATTN_JOIN_SECONDS": "3"}, indices=(1,))
    _, err = procs[1].communicate(timeout=60)
    assert procs[1].returncode == 1
    assert_one_line(err, "error (process 1): process 0 (the coordinator, 127.0.0.1:", "did not answer within 3 s")


def test_the_launcher_passes_on_a_killed_workers_signal_as_a_shell_would():
    assert launch.exit_status(-9) == 137 and launch.exit_status(2) == 2 and launch.exit_status(0) == 0


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_a_bad_timeout_variable_is_a_clear_error(monkeypatch, value):
    from gattn.config import ConfigError

    monkeypatch.setenv("GATTN_PEER_SECONDS", value)
    with pytest.raises(ConfigError, match="GATTN_PEER_SECONDS.*positive number of seconds"):
        cluster.peer_seconds()


@pytest.mark.parametrize("address", ["nocolon", "host:", ":1234", "host:port", "host:70000"])
def test_a_coordinator_address_without_host_and_port_is_one_line(address):
    """(Before: "nocolon" reached jax.distributed, which raised an IndexError.)"""
    import argparse

    from gattn import cli
    from gattn.config import ConfigError

    args = argparse.Namespace(coordinator=address, num_processes=2, process_id=0, distributed=False)
    with pytest.raises(ConfigError) as e:
        cli.start_distributed(args)
    assert (e.value.field, e.value.value) == ("--coordinator", address) and "HOST:PORT" in e.value.allowed


def test_native_logs_go_to_the_workdir_or_beside_a_remote_one(monkeypatch, tmp_path):
    monkeypatch.delenv("GATTN_LOG_DIR", raising=False)
    assert cluster.log_path(str(tmp_path / "run"), 3) == tmp_path / "run" / "logs" / "process_3.log"
    remote = cluster.log_path("gs://bucket/runs/moe", 0)
    assert remote.name == "process_0.log" and remote.parent.name == "moe" and "gs:" not in str(remote)


def test_the_launcher_runs_a_module_as_its_docstring_says(monkeypatch):
    """`python -m gattn.launch --processes 2 -m MODULE ...` (argparse's REMAINDER refused the -m)."""
    from gattn import launch

    seen = {}
    monkeypatch.setattr(launch, "launch", lambda command, p, d, grace, stop_grace: seen.update(command=command, p=p, d=d) or 0)
    assert launch.main(["--processes", "2", "--local-devices=3", "-m", "gattn.lm_eval", "--tasks", "x"]) == 0
    assert seen == {"command": ["-m", "gattn.lm_eval", "--tasks", "x"], "p": 2, "d": 3}
    assert launch.main(["--processes", "1", "train.py", "--processes", "9"]) == 0
    assert seen["command"] == ["train.py", "--processes", "9"] and seen["p"] == 1


def test_a_finished_process_waits_for_its_watch_to_leave_the_coordination_client(monkeypatch):
    """(A 2-process run that succeeded exited 1 once in two: process 1 aborted at exit, "FATAL:
    exception not rethrown", its daemon watch thread still inside a call into JAX's client while
    the interpreter shut down.) cluster.finished() returns only once the watch has stopped."""
    import threading
    import time

    from gattn import cluster

    in_call = threading.Event()

    class SlowClient:  # the coordination service's key-value store, answering after 0.5 s
        def key_value_set(self, key, value, allow_overwrite=False):
            in_call.set()
            time.sleep(0.5)

        def key_value_dir_get(self, prefix):
            time.sleep(0.1)
            return []

    monkeypatch.setattr(cluster, "_watch", None)
    monkeypatch.setattr(cluster, "_process", None)
    cluster.watch(SlowClient(), 1, 2)
    assert in_call.wait(5)
    cluster.finished()
    assert not cluster._watch.is_alive()
