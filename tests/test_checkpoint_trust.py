"""Which checkpoint a run trusts: only one that every process sealed, checked by every process
together (one process's bad share or failed read is everyone's, on gloo as on a slice); a
storage error that passes is retried, never taken for a bad checkpoint; the newest sealed
checkpoint outlives the rotation; sealing runs beside training."""

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gattn import launch
from gattn.train import checkpoint

from test_faults import STATE, read_all, saved_run

ROOT = Path(__file__).resolve().parents[1]
HOSTS = ROOT / "tests" / "programs" / "checkpoint_hosts.py"


def test_two_processes_agree_on_every_checkpoint_fault(tmp_path):
    """2 processes x 2 CPU devices on gloo, a state sharded over all four (tests/programs/checkpoint_hosts.py).
    Before: a changed file in process 1's share made process 1 skip the read while process 0
    entered Orbax's restore barrier (gloo aborted: a collective-size mismatch), a missing seal of
    process 1 was not noticed (step 2 restored), and a read error of process 1 alone aborted too."""
    port = launch.free_port()
    env = lambda i: {**launch.worker_env(i, 2, 2, port), "GATTN_HEARTBEAT_SECONDS": "10"}  # noqa: E731
    procs = [subprocess.Popen([sys.executable, str(HOSTS), "--workdir", str(tmp_path)], cwd=ROOT, env=env(i),
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180) + (p.returncode,))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the processes did not finish (a hang)")
    for index, (out, err, code) in enumerate(outs):
        assert code == 0, (index, out[-2000:], err[-3000:])
        results = dict(line.split(" ", 2)[1:] for line in out.splitlines() if line.startswith("result "))
        assert results["flip"] == "1" and results["unseal"] == "1" and results["read_error"] == "1", results
        assert results["transient"] == "2", results  # a 503 once: tried again, not set aside
        assert results["unavailable"].startswith("failed reading checkpoint step 2"), results
        assert "failed 4 times" in results["unavailable"] and "nothing was set aside" in results["unavailable"]
        blocks = err.split("end ")  # each scenario's stderr, up to its end line
        warnings = [[line for line in block.splitlines() if line.startswith("warning:")] for block in blocks[:5]]
        assert [len(w) for w in warnings] == [1, 1, 1, 0, 0], err
        assert "state/ocdbt.process_1/" in warnings[0][0] and "does not match its checksum" in warnings[0][0]
        assert "the seal of process 1 of 2 is missing" in warnings[1][0]
        assert "DATA_LOSS" in warnings[2][0] and all("using step 1 instead" in w[0] for w in warnings[:3])
        assert "Traceback" not in err, err
    assert (tmp_path / "unavailable" / "checkpoints" / "2").is_dir()


def test_an_unsealed_checkpoint_is_not_trusted_when_a_sealed_one_exists(tmp_path, capfd):
    """Before: a finished but unsealed newest checkpoint whose arrays changed afterwards restored
    without a word (verify returned None without a seal); here step 3's arrays are step 1's."""
    saved_run(tmp_path).close()
    three = tmp_path / "checkpoints" / "3"
    shutil.rmtree(three / checkpoint.CHECKSUMS)
    shutil.rmtree(three / "state")
    shutil.copytree(tmp_path / "checkpoints" / "1" / "state", three / "state")
    mngr = checkpoint.manager(tmp_path, 3, 1)
    step, (state, _, _) = checkpoint.first_readable(mngr, read_all(mngr))
    mngr.close()
    err = capfd.readouterr().err
    assert step == 2 and int(state["step"]) == 2, (step, state["step"])
    assert "checkpoint step 3" in err and "it has no seal: its save did not finish" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_the_newest_sealed_checkpoint_outlives_the_rotation(tmp_path):
    """keep_checkpoints=1: before, the save after a sealed one rotated it away at once, leaving
    only a checkpoint whose seal had not been written yet (a kill then lost every trusted step)."""
    mngr = saved_run(tmp_path, steps=(1,), keep=1)
    for step in (2, 3):  # saved, never sealed (their process stopped before)
        checkpoint.save(mngr, step, STATE, {}, {}, force=True)
        mngr.wait_until_finished()
    assert sorted(mngr.all_steps()) == [1, 3]
    checkpoint.seal(mngr.directory / "3")
    checkpoint.save(mngr, 4, STATE, {}, {}, force=True)
    mngr.wait_until_finished()
    assert sorted(mngr.all_steps()) == [3, 4]  # step 3 sealed: step 1 may go
    mngr.close()


def test_a_transient_read_error_is_retried_and_a_lasting_one_sets_nothing_aside(tmp_path, monkeypatch, capfd):
    """Before: one GCS 503 while reading the newest checkpoint set it aside, and the run went back
    checkpoint_every steps without a word."""
    monkeypatch.setattr(checkpoint, "RETRY_SECONDS", 0.01)
    mngr = saved_run(tmp_path)
    real, calls = read_all(mngr), []

    def flaky(step, fails):
        calls.append(step)
        if len(calls) <= fails:
            raise OSError("503 Service Unavailable: GET https://storage.googleapis.com/b/o")
        return real(step)

    assert checkpoint.first_readable(mngr, lambda s: flaky(s, 2))[0] == 3 and calls == [3, 3, 3]
    assert capfd.readouterr().err == ""
    calls.clear()
    with pytest.raises(checkpoint.CheckpointFailure) as e:
        checkpoint.first_readable(mngr, lambda s: flaky(s, 99))
    assert calls == [3] * checkpoint.READ_TRIES and "nothing was set aside" in str(e.value)
    assert sorted(mngr.all_steps()) == [1, 2, 3]
    mngr.close()
    assert checkpoint.transient(RuntimeError("x")) is False
    assert checkpoint.transient(ValueError("DATA_LOSS: checksum mismatch")) is False
    assert checkpoint.transient(TimeoutError()) and checkpoint.transient(Exception("UNAVAILABLE: connection reset"))


def test_sealing_runs_beside_training(tmp_path, monkeypatch):
    """The seal reads back every byte written; before, it ran on the training thread after each
    save. Now check() starts it on a thread of its own and returns; the next save waits for it."""
    release, sealed = threading.Event(), []
    real_seal = checkpoint.seal

    def slow_seal(folder, *a):
        release.wait(30)
        sealed.append(folder.name)
        return real_seal(folder, *a)

    monkeypatch.setattr(checkpoint, "seal", slow_seal)
    saves = checkpoint.Saves(checkpoint.manager(tmp_path, 3, 1), last_good=None)
    saves.save(1, STATE, {}, {})
    saves.mngr.wait_until_finished()
    saves.check()  # starts the seal and returns at once, the seal still waiting
    assert saves.sealing is not None and not saves.sealing.done() and saves.good is None
    release.set()
    saves.save(2, STATE, {}, {})  # waits for step 1's seal first
    assert saves.good == 1 and sealed == ["1"]
    saves.close()
    assert saves.good == 2 and sealed == ["1", "2"]
    assert all(checkpoint.unsealed(tmp_path / "checkpoints" / s) is None for s in ("1", "2"))
    assert os.path.getsize(tmp_path / "checkpoints" / "2" / checkpoint.CHECKSUMS / "process_0.json") > 100
