"""One writer per run directory (gattn.train.lease): a second train.py on a directory a live run
holds is refused in one line naming the holder; of runs starting, or taking over a stale lease, at
the same instant exactly one wins (a local disk, and a gs:// bucket's generations); a lease whose
process is gone, or that was not renewed, is taken over; a run that loses its lease stops in one
line; a failing store does not stop the renewal; the lease is given back when the run ends."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from google.api_core.exceptions import PreconditionFailed

from conftest import run_config_file
from gattn import cli
from gattn.config import ConfigError
from gattn.train import lease

ROOT = Path(__file__).resolve().parents[1]


def write_holder(workdir: Path, **holder):
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / lease.LOCK).write_text(json.dumps({"since": "earlier", "token": "theirs", **holder}))


@pytest.fixture
def quick(monkeypatch):
    """Renewals every 20 ms, a lease stale after 2 s (a test waits milliseconds, not minutes)."""
    monkeypatch.setattr(lease, "RENEW_SECONDS", 0.02)
    monkeypatch.setattr(lease, "STALE_SECONDS", 2.0)


def wait_for(condition, seconds=10.0):
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


def holder(workdir: Path) -> dict:
    return json.loads((workdir / lease.LOCK).read_text())


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


@pytest.mark.parametrize("pid", [os.getpid(), 1], ids=["this_pid", "pid_1"])
def test_a_restarted_run_on_this_host_takes_over_a_lease_not_renewed_although_its_pid_runs(tmp_path, pid):
    # A restarted container: the same hostname, and the dead run's pid now another live process.
    write_holder(tmp_path, host=socket.gethostname(), pid=pid, renewed=time.time() - 86_400)
    with lease.hold(tmp_path):
        assert holder(tmp_path)["token"] != "theirs"


@pytest.mark.skipif(lease._started(os.getpid()) is None, reason="no /proc to tell a reused pid")
def test_a_reused_pid_on_this_host_does_not_hold(tmp_path):
    write_holder(tmp_path, host=socket.gethostname(), pid=os.getpid(), started="another-boot/17",
                 renewed=time.time())
    with lease.hold(tmp_path):
        assert holder(tmp_path)["token"] != "theirs"


def test_simultaneous_acquires_have_one_holder(tmp_path):
    result = lease.trials(tmp_path, n=1000)
    assert result["double_holders"] == 0 and result["no_holder"] == 0, result


def test_simultaneous_takeovers_of_a_stale_lease_have_one_winner(tmp_path):
    result = lease.trials(tmp_path, n=300, stale_holder=True)
    assert result["double_holders"] == 0 and result["no_holder"] == 0, result


class FakeBucket:
    """What lease needs of a GCS bucket, with its generations: every write makes a new one, and a
    request whose if_generation_match names another fails (412), as on GCS."""

    def __init__(self):
        self.objects, self.generation, self.mutex = {}, 0, threading.Lock()  # name -> (generation, bytes)

    def get_blob(self, name):
        with self.mutex:
            found = self.objects.get(name)
        time.sleep(0)  # (another racer may write between a read and the write)
        return None if found is None else FakeBlob(self, name, found[0])

    def blob(self, name):
        return FakeBlob(self, name, None)


class FakeBlob:
    def __init__(self, bucket, name, generation):
        self.bucket, self.name, self.generation = bucket, name, generation

    def _at(self, generation):
        found = self.bucket.objects.get(self.name, (0, b""))
        if found[0] != generation:
            raise PreconditionFailed(f"412 {self.name}: generation {found[0]}, not {generation}")
        return found[1]

    def download_as_bytes(self, *, if_generation_match):
        with self.bucket.mutex:
            data = self._at(if_generation_match)
        time.sleep(0)
        return data

    def upload_from_string(self, data, *, if_generation_match):
        with self.bucket.mutex:
            self._at(if_generation_match)
            self.bucket.generation += 1
            self.bucket.objects[self.name] = (self.bucket.generation, data.encode())

    def delete(self, *, if_generation_match):
        with self.bucket.mutex:
            self._at(if_generation_match)
            del self.bucket.objects[self.name]


def test_on_a_bucket_one_of_simultaneous_acquires_and_takeovers_wins_by_generation(monkeypatch):
    bucket = FakeBucket()
    monkeypatch.setattr(lease, "_bucket", lambda name: bucket)
    for stale_holder in (False, True):
        result = lease.trials(f"gs://runs/stale_{stale_holder}", n=200, stale_holder=stale_holder)
        assert result["double_holders"] == 0 and result["no_holder"] == 0, result
    with lease.hold("gs://runs/given_back"):
        assert "given_back/lock.json" in bucket.objects
    assert "given_back/lock.json" not in bucket.objects


def test_a_run_whose_lease_another_run_took_stops_in_one_line_naming_it(tmp_path, quick):
    with lease.hold(tmp_path) as held:
        lease.check()  # held: nothing to say
        write_holder(tmp_path, host="other-host", pid=77, since="21:20:00", renewed=time.time())
        wait_for(lambda: held.lost)  # the next renewal finds the other run
        with pytest.raises(lease.LeaseLost) as e:
            lease.check()
        assert isinstance(e.value, cli.Failure) and "\n" not in str(e.value)
        assert "other-host pid 77 took it over at 21:20:00" in str(e.value) and str(tmp_path) in str(e.value)
        assert holder(tmp_path)["pid"] == 77  # renewals stopped: the other run's lease is left as it is
    assert holder(tmp_path)["pid"] == 77  # and the release leaves it too


def test_a_failing_store_is_retried_and_a_store_down_too_long_loses_the_lease(tmp_path, monkeypatch, quick, capfd):
    real, failing = lease._swap, threading.Event()

    def flaky(path, decide):  # the store as a bucket fails (gcsfs's HttpError, google-auth's RefreshError)
        if failing.is_set():
            raise RuntimeError("HttpError 503: Service Unavailable")
        return real(path, decide)

    monkeypatch.setattr(lease, "_swap", flaky)
    with lease.hold(tmp_path) as held:
        failing.set()
        wait_for(lambda: held.error)
        time.sleep(5 * lease.RENEW_SECONDS)  # several failed beats
        renewed = holder(tmp_path)["renewed"]
        assert held.thread.is_alive() and held.lost is None
        lease.check()  # not yet long enough for another run to take it
        failing.clear()  # the store recovers: renewed again
        wait_for(lambda: holder(tmp_path)["renewed"] > renewed and not held.error)
        lease.check()

        monkeypatch.setattr(lease, "STALE_SECONDS", 0.3)  # down for STALE_SECONDS less a beat: lost
        failing.set()
        wait_for(lambda: time.monotonic() - held.renewed > lease.STALE_SECONDS - lease._beat())
        with pytest.raises(lease.LeaseLost, match=r"could not be renewed for \d+ s \(RuntimeError: HttpError 503"):
            lease.check()
        failing.clear()
    assert "warning: could not renew" in capfd.readouterr().err
    assert not (tmp_path / lease.LOCK).exists()  # given back all the same


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
    from gattn.train import checkpoint

    steps = max(checkpoint.saved_steps(tmp_path / "run")) + 2  # (however far the first run got meanwhile)
    third = subprocess.run([*args, "--steps", str(steps)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-2000:]
    assert not (tmp_path / "run" / lease.LOCK).exists()


@pytest.mark.slow  # a training run in this process (~30 s on 2 CPU cores)
def test_training_stops_before_its_next_step_when_another_run_takes_its_lease(tmp_path, monkeypatch):
    from gattn.train import checkpoint, trainer

    monkeypatch.setattr(lease, "RENEW_SECONDS", 0.02)
    config = tmp_path / "small.py"
    config.write_text(run_config_file(steps=400, checkpoint_every=2, warmup_steps=2, eval_every=400))
    metrics, taken = tmp_path / "run" / "metrics.jsonl", []

    def take_over():  # another run, once this one has logged 3 steps
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 3, seconds=300)
        write_holder(tmp_path / "run", host="other-host", pid=77, renewed=time.time())
        taken.append(checkpoint.saved_steps(tmp_path / "run"))

    other = threading.Thread(target=take_over, daemon=True)
    other.start()
    with pytest.raises(lease.LeaseLost, match="other-host pid 77 took it over"):
        trainer.train(cli.load(config), tmp_path / "run", progress=False)
    other.join()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert max(steps) < 20, steps  # stopped within a renewal or two, not trained on
    assert holder(tmp_path / "run")["pid"] == 77
