"""Faults and bad input at the entry points and in checkpoints: one line naming the thing, exit 2
for a usage error and 1 for a runtime failure, --debug for the traceback, and no lost checkpoint
(an unreadable one gives way to the previous one, a failed save stops the run, the checkpoint
from before a divergence outlives the rotation)."""

import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from gattn import cli
from gattn.config import ConfigError, TrainConfig
from gattn.train import checkpoint, rundir

from conftest import entry_point, run_config_file

ROOT = Path(__file__).resolve().parents[1]


def test_a_config_file_that_fails_is_named_with_its_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from gattn.config import Config\n\ndef get_config(:\n    return Config()\n")
    with pytest.raises(ConfigError) as e:
        cli.load(bad)
    assert e.value.field == "--config" and e.value.value == f"{bad}:3" and "syntax error" in str(e.value)
    bad.write_text("def get_config():\n    x = 1\n    return undefined_name\n")
    with pytest.raises(ConfigError) as e:
        cli.load(bad)
    assert e.value.value == f"{bad}:3" and "NameError" in str(e.value)
    bad.write_text("def get_config():\n    return {'model': {}}\n")
    with pytest.raises(ConfigError) as e:
        cli.load(bad)
    assert "must return a gattn.config.Config" in str(e.value) and "dict" in str(e.value)


def test_a_seed_beyond_32_bits_is_refused_at_validation():
    assert TrainConfig(seed=2**32 - 1).seed == 2**32 - 1
    with pytest.raises(ConfigError) as e:
        TrainConfig(seed=2**32)
    assert e.value.field == "seed" and "4294967295" in str(e.value)


def test_errors_are_one_line_with_exit_2_for_usage_and_1_for_failures(capsys, monkeypatch):
    monkeypatch.setenv("GATTN_DEBUG", "0")  # (restored after the test: --debug below sets it to 1)

    def main_raising(error):
        def main(argv):
            assert "--debug" not in argv  # taken out by run_cli
            raise error
        return main

    cases = [(ConfigError("train.steps", -1, "expected > 0"), 2, "'train.steps' = -1"),
             (cli.Failure("the run diverged"), 1, "the run diverged"),
             (ValueError("first line\nsecond line"), 1, "ValueError: first line (rerun with --debug")]
    for error, code, text in cases:
        assert cli.run_cli(main_raising(error), []) == code
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and text in err and "Traceback" not in err, err
    assert cli.run_cli(main_raising(cli.Failure("boom")), ["--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith("error: boom")
    monkeypatch.setenv("GATTN_DEBUG", "0")
    assert cli.run_cli(main_raising(ValueError("x")), []) == 1
    assert "Traceback" not in capsys.readouterr().err
    monkeypatch.setenv("GATTN_DEBUG", "1")
    assert cli.run_cli(main_raising(ValueError("x")), []) == 1
    assert "Traceback" in capsys.readouterr().err


def test_workdir_tasks_and_missing_checkpoint_are_one_line(tmp_path, capsys):
    train, evaluate = entry_point("train"), entry_point("eval")
    afile = tmp_path / "afile"
    afile.write_text("not a run")
    assert cli.run_cli(train.main, ["--config", "tiny", "--workdir", str(afile), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "'--workdir'" in err and "this is a file" in err and err.count("\n") == 1
    # Item 6 of the issue (kept): --steps and --config.train.steps together are refused, naming both.
    assert cli.run_cli(train.main, ["--config", "tiny", "--workdir", str(tmp_path / "w"), "--steps", "5",
                                    "--config.train.steps=7"]) == 2
    err = capsys.readouterr().err
    assert "train.steps" in err and "'5'" in err and "'7'" in err and not (tmp_path / "w").exists()
    run = tmp_path / "run"
    run.mkdir()
    rundir.write_config(run, cli.load("tiny"))
    assert cli.run_cli(evaluate.main, ["--workdir", str(run), "--tasks", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "'--tasks'" in err and "nope.jsonl" in err and "no such file" in err
    assert cli.run_cli(evaluate.main, ["--workdir", str(run), "--no-figures"]) == 2
    err = capsys.readouterr().err
    assert "has none yet" in err and "Traceback" not in err and err.count("\n") == 1, err
    assert not (run / "eval").exists()


# --------------------------------------------------------------------------- checkpoints

STATE = {"step": jnp.zeros((), jnp.int32),  # "big": TensorStore reads a cut array file of this size with a bare Exception
         "params": {"w": jnp.arange(32.0).reshape(4, 8), "big": jnp.sin(jnp.arange(65536.0)).reshape(256, 256)}}


def saved_run(workdir, steps=(1, 2, 3), keep=3, sealed=True, state=STATE):
    mngr = checkpoint.manager(workdir, keep, 1)
    for s in steps:
        checkpoint.save(mngr, s, {**state, "step": jnp.asarray(s)}, {"k": s}, {"m": s}, force=True)
        mngr.wait_until_finished()
        if sealed:  # as the trainer's saves do (checkpoint.Saves)
            checkpoint.seal(mngr.directory / str(s))
    return mngr


def read_all(mngr):
    return lambda s: checkpoint.restore(mngr, checkpoint.abstract(STATE), s)


def largest(c):
    return max((p for p in (c / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip(path, n=256):
    """XOR `n` bytes in the middle of a file (what the issue did to the largest array file)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    path.write_bytes(bytes(data))


CORRUPTIONS = {  # what the issues tried on a latest checkpoint
    "a truncated array file": lambda c: [p.write_bytes(p.read_bytes()[:10])
                                         for p in (c / "state").rglob("d/*") if p.is_file()],
    "the largest array file cut in half": lambda c: largest(c).write_bytes(largest(c).read_bytes()[:largest(c).stat().st_size // 2]),
    "a missing manifest": lambda c: (c / "state" / "manifest.ocdbt").unlink(),
    "emptied metadata": lambda c: (c / "state" / "_METADATA").write_text(""),
}


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "unsealed (an older gattn's)"])
def test_an_unreadable_checkpoint_gives_way_to_the_previous_one(tmp_path, capfd, sealed):
    """Sealed: the checksums name the file. Unsealed (a run none of whose checkpoints has a seal):
    the read fails, and any error of the read counts (TensorStore raises a bare Exception for a
    truncated array file); one note says the checkpoint used could not be verified."""
    saved_run(tmp_path / "clean", sealed=sealed).close()
    for name, corrupt in CORRUPTIONS.items():
        work = tmp_path / name.replace(" ", "_")
        shutil.copytree(tmp_path / "clean", work)
        corrupt(work / "checkpoints" / "3")
        mngr = checkpoint.manager(work, 3, 1)
        step, (state, data, meta) = checkpoint.first_readable(mngr, read_all(mngr))
        mngr.close()
        assert (step, data, meta) == (2, {"k": 2}, {"m": 2}), name
        np.testing.assert_array_equal(state["params"]["w"], STATE["params"]["w"])
        err = capfd.readouterr().err
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith("note:")]
        notes = [line for line in err.splitlines() if line.startswith("note: checkpoint step 2") and "no seal" in line]
        assert len(notes) == (0 if sealed else 1), err
        assert len(lines) == 1 and "checkpoint step 3" in lines[0] and "using step 2" in lines[0], (name, err)
        assert ("its file state/" in lines[0]) == sealed, lines[0]  # the seal names the file
        assert "TensorStore details" not in lines[0], lines[0]
        assert (work / "checkpoints" / "3").is_dir()  # never deleted
    # None readable: one clear failure, and the checkpoints stay as they were.
    work = tmp_path / "all_bad"
    shutil.copytree(tmp_path / "clean", work)
    for s in (1, 2, 3):
        CORRUPTIONS["a missing manifest"](work / "checkpoints" / str(s))
    mngr = checkpoint.manager(work, 3, 1)
    with pytest.raises(checkpoint.CheckpointFailure) as e:
        checkpoint.first_readable(mngr, read_all(mngr))
    assert "no checkpoint in" in str(e.value) and "step 1:" in str(e.value) and "\n" not in str(e.value)
    assert all(f"step {s}:" in str(e.value) for s in (1, 2, 3))
    assert sorted(mngr.all_steps()) == [1, 2, 3]
    # A resumed run sets the later checkpoints aside (moved, never deleted; their metrics rows are
    # set aside by metrics.MetricsLog: tests/test_rundir.py).
    folder = checkpoint.set_aside(mngr, [2, 3])
    assert sorted(mngr.all_steps()) == [1] and sorted(p.name for p in folder.iterdir()) == ["2", "3"]
    mngr.close()
    assert "Event loop is closed" not in capfd.readouterr().err


def test_flipped_bytes_and_non_finite_arrays_are_caught_on_restore(tmp_path, capfd):
    """A bit flip in the largest array file read back with no warning (eval exited 0 with
    perplexity NaN, train resumed from it). Sealed: the checksum catches it. Unsealed, or a
    checkpoint saved with NaN in it: the restored arrays are checked to be finite."""
    saved_run(tmp_path / "sealed").close()
    flip(largest(tmp_path / "sealed" / "checkpoints" / "3"))
    mngr = checkpoint.manager(tmp_path / "sealed", 3, 1)
    assert checkpoint.first_readable(mngr, read_all(mngr))[0] == 2
    mngr.close()
    assert "does not match its checksum" in capfd.readouterr().err
    # NaN saved in step 3 (and no seal could tell): passed over, naming the array.
    nan_state = {**STATE, "params": {**STATE["params"], "w": STATE["params"]["w"].at[1, 2].set(jnp.nan)}}
    mngr = saved_run(tmp_path / "nan", steps=(1, 2), sealed=False)
    checkpoint.save(mngr, 3, {**nan_state, "step": jnp.asarray(3)}, {"k": 3}, {"m": 3}, force=True)
    mngr.wait_until_finished()
    step, (state, _, _) = checkpoint.first_readable(mngr, read_all(mngr))
    mngr.close()
    err = capfd.readouterr().err
    assert step == 2 and "not finite" in err and "['params']['w']" in err, err
    assert checkpoint.not_finite(state) is None and checkpoint.not_finite(nan_state) is not None
    # A seal that does not parse is a reason too, never a crash.
    (tmp_path / "sealed" / "checkpoints" / "2" / checkpoint.CHECKSUMS / "process_0.json").write_text("{")
    mngr = checkpoint.manager(tmp_path / "sealed", 3, 1)
    assert checkpoint.first_readable(mngr, read_all(mngr))[0] == 1
    mngr.close()
    assert "not a readable seal" in capfd.readouterr().err


def test_each_process_seals_and_checks_its_own_share_of_the_files(tmp_path):
    folder = tmp_path / "7"
    for name in ("state/ocdbt.process_0/d/a", "state/ocdbt.process_1/d/b", "state/array_metadatas/process_1",
                 "state/_METADATA", "meta/metadata"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(name)
    from etils.epath import Path as EPath
    for k in (0, 1):
        checkpoint.seal(EPath(folder), process=k, processes=2)
    files = checkpoint.sealed(EPath(folder))
    assert sorted(files) == sorted(["state/ocdbt.process_0/d/a", "state/ocdbt.process_1/d/b",
                                    "state/array_metadatas/process_1", "state/_METADATA", "meta/metadata"])
    seal1 = json.loads((folder / "checksums" / "process_1.json").read_text())["files"]
    assert sorted(seal1) == ["state/array_metadatas/process_1", "state/ocdbt.process_1/d/b"]
    assert all(checkpoint.verify(EPath(folder), k, 2) is None for k in (0, 1))
    (folder / "state/ocdbt.process_1/d/b").unlink()
    shares = [checkpoint.verify(EPath(folder), k, 2) for k in (0, 1)]  # each checks every other file
    assert sum(bool(s) for s in shares) == 1 and "state/ocdbt.process_1/d/b is missing" in "".join(filter(None, shares))


def test_a_failed_save_stops_the_run_naming_the_last_good_checkpoint(tmp_path, capfd, monkeypatch):
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

    mngr = saved_run(tmp_path, steps=(1,))
    saves = checkpoint.Saves(mngr, last_good=1)
    saves.save(2, STATE, {"k": 2}, {"m": 2})
    saves.check(wait=True)
    assert saves.good == 2

    async def disk_full(self, x, directory):  # the background write of a save
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))

    monkeypatch.setattr(handler.JsonCheckpointHandler, "_save_fn", disk_full)
    saves.save(3, STATE, {"k": 3}, {"m": 3})  # returns at once: the write runs in the background
    with pytest.raises(checkpoint.CheckpointFailure) as e:
        saves.check(wait=True)
    message = str(e.value)
    assert "saving checkpoint step 3 failed" in message and "No space left on device" in message
    assert "the last good checkpoint is step 2" in message and "\n" not in message
    saves.close()  # (the failure was reported: closing does not raise it again)
    assert "Traceback" not in capfd.readouterr().err  # Orbax's own tracebacks are not shown
    assert sorted(checkpoint.saved_steps(tmp_path)) == [1, 2]


def test_the_checkpoint_before_trouble_outlives_the_rotation(tmp_path):
    """Checkpoint k holds the weights after step k; step k + 1 is the first to use them. So the one
    kept is the newest whose next step read back fine, never the one saved just before the trouble
    (the issue's LR 1e6 run kept a checkpoint whose weights had already collapsed)."""
    keep_also = set()
    mngr = checkpoint.manager(tmp_path, 2, 1, keep_also)
    trouble = checkpoint.BeforeTrouble(keep_also, {}, clean=3)

    def run(steps, bad=()):
        for step in steps:  # the loop: the step's scalars are read, then the step is saved
            if step in bad:
                trouble(step)
            else:
                trouble.fine(step, mngr.latest_step())
            checkpoint.save(mngr, step, STATE, {}, {"m": step, **trouble.meta()}, force=True)
            mngr.wait_until_finished()

    run(range(1, 10), bad=(4, 6))  # trouble at 4: the weights of step 3 caused it; step 2's gave a fine step 3
    assert trouble.step == 2 and sorted(mngr.all_steps()) == [2, 8, 9]
    # Step 6's trouble came 2 steps after step 4's: step 4 (mid-trouble, confirmed by step 5) did not
    # replace step 2. After a clean stretch, new trouble keeps a newer checkpoint (and step 2 goes).
    run(range(10, 14), bad=(12,))
    assert trouble.step == 10 and sorted(mngr.all_steps()) == [10, 12, 13]
    mngr.close()
    # Trouble in the very step after the first save: nothing before it is known good.
    first = checkpoint.BeforeTrouble(set(), {}, clean=3)
    first.fine(1, None)
    first(2)
    assert first.step is None
    # A resumed run reads the kept and confirmed steps back from the checkpoint's metadata.
    resumed = set()
    assert checkpoint.BeforeTrouble(resumed, {"kept_step": 9, "last_trouble": 12, "confirmed_step": 11},
                                    clean=3).step == 9
    assert resumed == {9, 11}


# --------------------------------------------------------------------------- end to end (slow)

CONFIG = run_config_file(steps=6, warmup_steps=1, eval_every=100, checkpoint_every=2, keep_checkpoints=2)


def run(script, *args):
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow  # three runs of train.py and one of eval.py (~1 min on 2 CPU cores)
def test_train_and_eval_fall_back_and_resume_from_a_chosen_step(tmp_path):
    config = tmp_path / "small.py"
    config.write_text(CONFIG)
    work = tmp_path / "run"
    out = run("train.py", "--config", config, "--workdir", work, "--quiet")
    assert out.returncode == 0, out.stderr
    CORRUPTIONS["a truncated array file"](work / "checkpoints" / "6")
    # eval: the previous checkpoint, with one warning; nothing is moved.
    out = run("eval.py", "--workdir", work, "--no-figures", "--max-batches", "1")
    assert out.returncode == 0, out.stderr
    assert "checkpoint step 6" in out.stderr and "using step 4" in out.stderr and "Traceback" not in out.stderr
    assert json.loads((work / "eval" / "results.json").read_text())["step"] == 4
    # train: resumes from step 4, sets step 6 aside (not deleted), and goes on.
    out = run("train.py", "--config", config, "--workdir", work, "--quiet", "--steps", "8")
    assert out.returncode == 0, out.stderr
    assert sum("checkpoint step 6" in line for line in out.stderr.splitlines()) == 1
    assert "Traceback" not in out.stderr and "Event loop" not in out.stderr
    assert (work / "checkpoints_set_aside" / "6").is_dir()
    assert sorted(int(p.name) for p in (work / "checkpoints").iterdir()) == [6, 8]
    # --resume-step: an earlier step; the later checkpoints are moved aside, the run continues.
    out = run("train.py", "--config", config, "--workdir", work, "--quiet", "--steps", "8", "--resume-step", "6")
    assert out.returncode == 0, out.stderr
    assert "resuming from step 6" in out.stderr and (work / "checkpoints_set_aside" / "8").is_dir()
    # Both resumes set the metrics rows after their step aside: the fallback's 5-6, --resume-step's 7-8.
    aside = [json.loads(line) for line in (work / "metrics.set_aside.jsonl").read_text().splitlines()]
    assert [(r["step"], r["resumed_from"]) for r in aside] == [(5, 4), (6, 4), (7, 6), (8, 6)]
    assert [json.loads(line)["step"] for line in (work / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, 9))
    out = run("train.py", "--config", config, "--workdir", work, "--quiet", "--resume-step", "5")
    assert out.returncode == 2 and "'--resume-step' = 5" in out.stderr and "[6, 8]" in out.stderr


@pytest.mark.slow  # two runs of train.py (~1 min on 2 CPU cores)
def test_a_divergence_names_the_checkpoint_kept_from_before_it(tmp_path):
    config = tmp_path / "small.py"
    config.write_text(CONFIG)
    work = tmp_path / "run"
    # 4 good steps, then LR 1e5: the weights collapse (loss at ln V, grad norm 0) or turn non-finite.
    # The checkpoint kept (step 4: step 5 still read back fine) trains at a sane LR.
    out = run("train.py", "--config", config, "--workdir", work, "--quiet", "--steps", "4")
    assert out.returncode == 0, out.stderr
    out = run("train.py", "--config", config, "--workdir", work, "--quiet", "--steps", "40",
              "--config.train.learning_rate=1e5", "--config.train.max_bad_steps=3",
              "--config.train.keep_checkpoints=1")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    (message,) = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    kept = int(message.split("--resume-step ")[1].rstrip("."))
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    first_skipped = min(r["step"] for r in rows if r["skipped_steps"] or r["collapsed_steps"])  # trouble
    steps = sorted(int(p.name) for p in (work / "checkpoints").iterdir())
    assert kept == 4 < first_skipped and kept in steps and len(steps) == 2  # keep 1, plus the kept one
    summary = json.loads((work / "summary.json").read_text())
    assert (summary["stopped"], summary["kept_step"], summary["completed"]) == ("diverged", kept, False)
    # A plain rerun (it finished "completed" on ruined weights) is refused, naming the way on.
    out = run("train.py", "--config", config, "--workdir", work, "--quiet", "--steps", "40",
              "--config.train.learning_rate=1e5", "--config.train.max_bad_steps=3", "--config.train.keep_checkpoints=1")
    assert out.returncode == 1 and f"--resume-step {kept}" in out.stderr and "--resume-anyway" in out.stderr
    assert len((work / "metrics.jsonl").read_text().splitlines()) == len(rows)  # nothing trained
    out = run("train.py", "--config", config, "--workdir", work, "--quiet", "--steps", "12",
              "--config.train.learning_rate=1e-3", f"--resume-step={kept}")
    assert out.returncode == 0, out.stderr
    assert f"resuming from step {kept}" in out.stderr
    assert sorted(p.name for p in (work / "checkpoints_set_aside").iterdir() if p.name.isdigit()) == \
        [str(s) for s in steps if s > kept]
    # --steps below the step reached: refused, and config.json keeps train.steps = 12.
    out = run("train.py", "--config", config, "--workdir", work, "--quiet", "--steps", "5")
    assert out.returncode == 2 and "train.steps" in out.stderr and "at least 12" in out.stderr, out.stderr
    assert json.loads((work / "config.json").read_text())["train"]["steps"] == 12


@pytest.mark.slow  # a training run in this process (~30 s on 2 CPU cores)
def test_training_stops_at_once_when_a_save_fails(tmp_path, monkeypatch, capfd):
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

    from gattn.train import trainer

    config = tmp_path / "small.py"
    config.write_text(CONFIG)
    cfg = cli.load(config, ["train.steps=12"])
    real, calls = handler.JsonCheckpointHandler._save_fn, []

    async def full_from_step_4(self, x, directory):  # steps 2 and 4 save; from 4 on the disk is full
        calls.append(str(directory))
        if "/4." in str(directory):
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))
        return await real(self, x, directory)

    monkeypatch.setattr(handler.JsonCheckpointHandler, "_save_fn", full_from_step_4)
    with pytest.raises(checkpoint.CheckpointFailure) as e:
        trainer.train(cfg, tmp_path / "run", progress=False)
    assert "saving checkpoint step 4 failed" in str(e.value) and "last good checkpoint is step 2" in str(e.value)
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) < 12  # stopped, not trained to the end
    assert checkpoint.saved_steps(tmp_path / "run") == [1, 2]  # (Orbax saves the first step too)
    assert "Traceback" not in capfd.readouterr().err


# --------------------------------------------------------------------------- trouble that persists

class _Latest:  # the manager, as Reports sees it
    def __init__(self):
        self.step = None

    def latest_step(self):
        return self.step


def _reports(tmp_path, meta=None, max_bad=3):
    from etils.epath import Path as EPath

    from gattn.train.reports import Reports

    cfg = cli.load("tiny", ["train.max_bad_steps=%d" % max_bad, "train.warmup_steps=0", "train.steps=100"])
    meta = {**rundir.meta(cfg), **(meta or {})}
    return Reports(cfg, EPath(tmp_path), meta, 0, _Latest(), set(), progress=False)


def _step(reports, step, loss, grad_norm, finite=True):
    reports.pending(step, {"loss": np.float32(loss), "finite": np.bool_(finite), "grad_norm": np.float32(grad_norm),
                           "lr": np.float32(1e-3)})
    reports.read_previous()


def test_a_collapse_is_trouble_and_the_trouble_state_survives_a_resume(tmp_path):
    """The issue's LR 1e6 run: its loss went to ln V (uniform predictions) with finite steps, so the
    bad-step count kept restarting at 0, and a rerun restarted it from 0 as well."""
    from gattn.train.reports import TrainingStopped, collapsed

    uniform = float(np.log(4096))
    assert not collapsed(uniform, 1.0, lowest=uniform, vocab_size=4096)  # every run starts at ln V
    assert collapsed(uniform + 1e-4, 1.0, lowest=uniform - 2, vocab_size=4096)  # back at ln V after learning
    assert collapsed(3.0, 0.0, lowest=3.0, vocab_size=4096)  # nothing left to learn from
    assert not collapsed(uniform - 0.3, 1.0, lowest=uniform - 2, vocab_size=4096)

    reports = _reports(tmp_path / "a")
    for step, loss in enumerate([uniform, 6.0, 5.0, 4.0], start=1):  # learning
        _step(reports, step, loss, 1.0)
    _step(reports, 5, uniform, 1.0)  # collapsed
    _step(reports, 6, float("nan"), float("nan"), finite=False)  # then non-finite
    assert reports.bad_in_a_row == 2 and reports.collapsed_steps == 1 and reports.skipped == 1
    meta = reports.meta()
    reports.close()
    assert (meta["bad_in_a_row"], meta["collapsed_steps"], meta["lowest_loss"]) == (2, 1, 4.0)
    # Resumed from that checkpoint: one more bad step stops the run (max_bad_steps=3), as before the resume.
    resumed = _reports(tmp_path / "b", meta=meta)
    with pytest.raises(TrainingStopped) as e:
        _step(resumed, 7, uniform, 1.0)
    resumed.close()
    assert "3 consecutive steps were non-finite or collapsed" in str(e.value) and "ln V" in str(e.value)


def test_a_resume_flag_on_a_workdir_without_checkpoints_is_refused(tmp_path):
    """(Before: `--resume-step 2` on a mistyped --workdir trained a new run from step 0.) Refused
    before anything is written."""
    from gattn.config import Config
    from gattn.train import trainer

    from conftest import tiny_model

    for kwargs, flag in ((dict(resume_step=2), "--resume-step"), (dict(resume_anyway=True), "--resume-anyway")):
        with pytest.raises(ConfigError) as e:
            trainer.train(Config(model=tiny_model()), tmp_path / "typo", progress=False, **kwargs)
        assert e.value.field == flag and "has no checkpoint" in e.value.allowed
        assert not (tmp_path / "typo").exists()


def test_a_plain_rerun_after_a_divergence_stop_is_refused(tmp_path):
    from gattn.train import trainer

    (tmp_path / "summary.json").write_text(json.dumps({"step": 11, "completed": False, "stopped": "diverged",
                                                       "kept_step": 1, "reason": "10 consecutive steps ..."}))
    with pytest.raises(cli.Failure) as e:
        trainer.check_not_diverged(tmp_path)
    assert "--resume-step 1" in str(e.value) and "--resume-anyway" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "summary.json").write_text(json.dumps({"step": 11, "completed": False}))  # a SIGTERM stop
    trainer.check_not_diverged(tmp_path)


# --------------------------------------------------------------------------- check everything, then write

def test_flags_text_tokenizer_vocabulary_and_tasks_are_checked_first(tmp_path, capsys):
    train, evaluate = entry_point("train"), entry_point("eval")
    # --variant and --config.variant that disagree: refused (it trained B).
    with pytest.raises(ConfigError) as e:
        cli.load("tiny", ["--config.variant=sdpa_headwise"], variant="sdpa_elementwise")
    assert e.value.field == "--config.variant" and "sdpa_elementwise" in str(e.value)
    # A variant changed field by field is recorded as what it is.
    assert cli.load("tiny", ["model.gate.position=value"], variant="sdpa_elementwise").variant == \
        'sdpa_elementwise+gate.position="value"'
    assert cli.load("tiny", ["model.num_layers=1"], variant="sdpa_elementwise").variant == "sdpa_elementwise"
    # A byte-order mark is dropped from .txt as from .jsonl.
    from gattn.data import corpus

    folder = tmp_path / "bom"
    folder.mkdir()
    (folder / "a.txt").write_bytes(corpus.BOM + "héllo\n".encode())
    (folder / "b.jsonl").write_bytes(corpus.BOM + b'{"text": "hi"}\n')
    assert [d.text for d in corpus.folder_documents(folder)] == ["héllo\n", "hi"]
    # A tokenizer that is a text file: one line naming data.tokenizer (was sentencepiece's INTERNAL error).
    (tmp_path / "tok.txt").write_text("not a model")
    args = ["--config", "tiny", "--steps", "1", "--config.train.warmup_steps=0", "--quiet"]
    assert cli.run_cli(train.main, [*args, "--workdir", str(tmp_path / "t1"),
                                    f"--config.data.tokenizer={tmp_path / 'tok.txt'}"]) == 2
    err = capsys.readouterr().err
    assert "'data.tokenizer'" in err and "SentencePiece" in err and err.count("\n") == 1, err
    # A vocabulary larger than the corpus allows: names model.vocab_size and the maximum, exit 2.
    small = tmp_path / "small"
    small.mkdir()
    for i in range(30):
        (small / f"{i}.txt").write_text(f"hello world {i} " * 5)
    assert cli.run_cli(train.main, [*args, "--workdir", str(tmp_path / "t2"), f"--config.data.source={small}"]) == 2
    err = capsys.readouterr().err
    assert "'model.vocab_size' = 4096" in err and "at most" in err and err.count("\n") == 1, err
    # Bad task content: exit 2 before any model loads (this run has no checkpoint: that error came first).
    run = tmp_path / "run"
    run.mkdir()
    rundir.write_config(run, cli.load("tiny"))
    (tmp_path / "task.jsonl").write_text('{"context": "2+2=", "choices": ["4"], "answer": 0}\n')
    assert cli.run_cli(evaluate.main, ["--workdir", str(run), "--tasks", str(tmp_path / "task.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "'--tasks'" in err and "'choices' must be a list of >= 2" in err and err.count("\n") == 1, err


def test_ctrl_c_outside_the_training_loop_is_one_line_and_exit_130(capsys):
    """Ctrl-C while the data is prepared or the step compiles (the training loop saves first and
    exits 0: tests/test_train.py) printed a KeyboardInterrupt traceback of ~26 lines."""
    def main(argv):
        raise KeyboardInterrupt

    assert cli.run_cli(main, []) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted (Ctrl-C)" in err and "Traceback" not in err
