"""Training end to end: exact resume after SIGKILL, clean SIGTERM, the NaN stop, mesh changes."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import entry_point, run_config_file

ROOT = Path(__file__).resolve().parents[1]
CONFIG = run_config_file(steps=24, warmup_steps=3, eval_every=12, checkpoint_every=6, keep_checkpoints=2)


@pytest.fixture()
def config_file(tmp_path):
    path = tmp_path / "small.py"
    path.write_text(CONFIG)
    return path


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory):
    """A finished 6-step run of CONFIG, trained once for the tests that resume or continue from
    one (each works on its own copy)."""
    from gattn import cli
    from gattn.train import trainer

    root = tmp_path_factory.mktemp("six_steps")
    (root / "small.py").write_text(CONFIG)
    trainer.train(cli.load(root / "small.py", ["train.steps=6"]), root / "run", progress=False)
    return root / "run"


def train_cmd(config_file, workdir, *extra):
    return [sys.executable, str(ROOT / "train.py"), "--config", str(config_file), "--workdir",
            str(workdir), "--quiet", *extra]


def losses(workdir):
    """(logged steps, {step: everything logged but the timing})."""
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows], {r["step"]: {k: v for k, v in r.items() if k != "tokens_per_sec"}
                                       for r in rows}


def wait_for_steps(workdir, n, proc, timeout=180):
    path, start = Path(workdir) / "metrics.jsonl", time.time()
    while time.time() - start < timeout:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise TimeoutError


def test_sigkill_then_resume_reproduces_the_uninterrupted_run(config_file, tmp_path):
    full = tmp_path / "full"
    subprocess.run(train_cmd(config_file, full), check=True, capture_output=True, timeout=300)
    steps, expected = losses(full)
    assert steps == list(range(1, 25))
    killed = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(config_file, killed), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_steps(killed, 15, proc)             # past the step-12 checkpoint, before step 18's
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 12 <= max(losses(killed)[0]) < 24
    logged = losses(killed)[0]
    subprocess.run(train_cmd(config_file, killed), check=True, capture_output=True, timeout=300)
    steps, resumed = losses(killed)
    assert steps == list(range(1, 25))          # each step logged once
    assert resumed == expected    # bit-identical: losses, grad norms, LRs, spike counts, val PPL
    # The rows logged after the resumed checkpoint were set aside, not dropped (and match).
    aside = killed / "metrics.set_aside.jsonl"
    aside = [json.loads(line) for line in aside.read_text().splitlines()] if aside.exists() else []
    (resumed_from,) = {r.pop("resumed_from") for r in aside} or {max(logged)}
    assert [r["step"] for r in aside] == [s for s in logged if s > resumed_from]
    assert all({k: v for k, v in r.items() if k != "tokens_per_sec"} == expected[r["step"]] for r in aside)
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["step"] == 24 and set(summary) >= {"val_ppl/code", "val_ppl/docs", "loss_spikes"}


def test_sigterm_saves_and_exits_cleanly(config_file, tmp_path):
    workdir = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(config_file, workdir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_steps(workdir, 8, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "SIGTERM: saved step" in out
    saved = int(out.split("SIGTERM: saved step ")[1].split()[0])
    assert (workdir / "checkpoints" / str(saved)).is_dir() and saved < 24
    subprocess.run(train_cmd(config_file, workdir), check=True, capture_output=True, timeout=300)
    assert losses(workdir)[0] == list(range(1, 25))


def test_divergence_stops_with_a_clear_message_and_finite_checkpoints(config_file, tmp_path):
    workdir = tmp_path / "diverge"
    # lr 1e39 overflows float32: from step 2 on, every update would make the weights non-finite.
    # A checkpoint is written every step, so without the guard step 2's would hold inf/NaN.
    out = subprocess.run(train_cmd(config_file, workdir, "--config.train.learning_rate=1e39",
                                   "--config.train.grad_clip=0", "--config.train.max_bad_steps=3",
                                   "--config.train.checkpoint_every=1"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "3 consecutive steps were non-finite or collapsed (last: step 3, non-finite" in out.stderr, out.stderr
    # (1e39 is inf in float32: step 1 is skipped already, so no checkpoint predates the trouble;
    # tests/test_faults.py has a run whose kept checkpoint is named.)
    assert losses(workdir)[1][1]["skipped_steps"] == 1
    assert "No checkpoint was saved before the trouble began" in out.stderr
    assert max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) >= 2
    import jax
    from flax import nnx

    from gattn.train import rundir

    model = rundir.load(workdir).model  # (in this process: another interpreter would only cost time)
    assert all(bool(np.isfinite(x).all()) for x in jax.tree.leaves(nnx.state(model)))


def test_restore_onto_a_different_mesh(tmp_path):
    """Saved sharded over 8 devices on one mesh, restored onto a (2, 4) mesh with other shardings;
    the trainer's state saved under FSDP x model (fsdp 4, model 2) restores replicated over 8 data
    shards, and the other way round."""
    code = textwrap.dedent(f"""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from gattn.train import checkpoint
        from gattn.train import trainer
        from gattn.config import Config, ModelConfig, TrainConfig
        cfg = Config(model=ModelConfig(vocab_size=64, d_model=32, num_layers=1, q_heads=2,
                                       kv_heads=1, head_dim=16, d_ff=64),
                     train=TrainConfig(steps=10, warmup_steps=1))
        _, state = trainer.init_state(cfg)
        devices = np.array(jax.devices())
        mesh_a = Mesh(devices.reshape(8), ("data",))
        shard_a = lambda x: NamedSharding(mesh_a, P("data") if x.ndim and x.shape[0] % 8 == 0 else P())
        state = jax.tree.map(lambda x: jax.device_put(x, shard_a(x)), state)
        mngr = checkpoint.manager({str(tmp_path)!r}, keep=1, every=1)
        checkpoint.save(mngr, 1, state, {{"k": 1}}, {{"m": 2}}, force=True)
        mngr.wait_until_finished()
        mesh_b = Mesh(devices.reshape(2, 4), ("data", "model"))
        shard_b = lambda x: NamedSharding(mesh_b, P(None, "model") if x.ndim == 2 and x.shape[1] % 4 == 0 else P())
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard_b(x)), state)
        restored, data, meta = checkpoint.restore(mngr, target)
        same = all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)))
        moved = all(r.sharding == t.sharding for r, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target)))
        wq = restored["params"]["blocks"][0]["attn"]["wq"][...]
        print(same, moved, wq.sharding.spec, data, meta)
        # The trainer's own layouts: saved under FSDP x model, restored replicated over data, and back.
        from gattn.config import MeshConfig
        from gattn.model import sharding
        import dataclasses
        layouts = [MeshConfig(data=1, fsdp=4, model=2), MeshConfig(data=8)]
        for i, (a, b) in enumerate((layouts, layouts[::-1])):
            mesh_a, mesh_b = sharding.make_mesh(a), sharding.make_mesh(b)
            _, saved = trainer.init_state(dataclasses.replace(cfg, mesh=a), mesh_a)
            mngr = checkpoint.manager({str(tmp_path)!r} + f"/layout{{i}}", keep=1, every=1)
            checkpoint.save(mngr, 1, saved, {{}}, {{}}, force=True)
            mngr.wait_until_finished()
            target = trainer.abstract_state(dataclasses.replace(cfg, mesh=b), mesh_b)
            back = checkpoint.restore(mngr, target)[0]
            same = all(np.array_equal(np.asarray(x), np.asarray(y))
                       for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(back)))
            moved = all(r.sharding == t.sharding for r, t in zip(jax.tree.leaves(back), jax.tree.leaves(target)))
            wq = back["params"]["blocks"][0]["attn"]["wq"][...]
            print("layout", same, moved, wq.sharding.spec)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["True", "True"], out.stdout
    assert "P(None, 'model')" in out.stdout and "{'k': 1} {'m': 2}" in out.stdout
    layouts = [line.split() for line in out.stdout.splitlines() if line.startswith("layout")]
    assert [line[1:3] for line in layouts] == [["True", "True"]] * 2, out.stdout  # FSDP -> data, data -> FSDP
    assert " ".join(layouts[0][3:]) == "P(None, None)" and " ".join(layouts[1][3:]) == "P('fsdp', 'model')", layouts


def test_resume_refuses_another_model_and_continues_under_other_execution_settings(config_file, tmp_path,
                                                                                   capsys, six_steps):
    from gattn import cli

    workdir = tmp_path / "run"
    shutil.copytree(six_steps, workdir)  # trained with --steps 6 (the config says 24)
    before = sorted(p.name for p in (workdir / "checkpoints").iterdir())
    # The refusal comes from train.py's main() in this process (an interpreter start costs more
    # than the check; the runs below are real subprocesses).
    entry = entry_point("train")
    capsys.readouterr()
    files = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    assert cli.run_cli(entry.main, train_cmd(config_file, workdir, "--config.model.d_ff=96")[2:]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "'model.d_ff' = 96" in err and "trained with 64" in err
    # (before: a refused vocab_size was already written into corpus_report.json)
    assert cli.run_cli(entry.main, train_cmd(config_file, workdir, "--config.model.vocab_size=1024")[2:]) == 2
    assert "'model.vocab_size' = 1024" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == files
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == before
    assert json.loads((workdir / "config.json").read_text())["model"]["d_ff"] == 64
    assert not (workdir / "config_history.jsonl").exists()  # a refused resume writes nothing
    # Execution settings are not the architecture: a copy of the run resumes under another kernel,
    # remat and block layout (scanned), and continues as the plain resume of the run does.
    moved = tmp_path / "moved"
    shutil.copytree(workdir, moved)
    # More steps (and a new LR) are fine: the run continues from step 6.
    subprocess.run(train_cmd(config_file, workdir, "--steps", "8"), check=True, capture_output=True,
                   timeout=300)
    assert losses(workdir)[0] == list(range(1, 9))
    def history(run):
        return [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]

    ((was_at, changed),) = [(h["replaced_at_step"], h["changed"]) for h in history(workdir)]
    assert was_at == 6 and changed == {"train.steps": {"was": 6, "now": 8}}  # the earlier config is kept
    out = subprocess.run(train_cmd(config_file, moved, "--steps", "8", "--config.exec.attention_impl=pallas",
                                   "--config.exec.remat=full", "--config.exec.scan_layers=true",
                                   "--config.exec.flash_block_q=32", "--config.exec.flash_block_k=32"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    steps, rows = losses(moved)
    assert steps == list(range(1, 9))
    expected = losses(workdir)[1]
    for step in (7, 8):  # the same weights and data; another kernel and layout may round differently
        np.testing.assert_allclose(rows[step]["loss"], expected[step]["loss"], rtol=1e-5)
    saved = json.loads((moved / "config.json").read_text())
    assert saved["exec"]["attention_impl"] == "pallas" and saved["exec"]["scan_layers"] is True
    (earlier,) = history(moved)
    assert {"train.steps", "exec.attention_impl", "exec.remat", "exec.scan_layers"} <= set(earlier["changed"])
    assert earlier["config"]["exec"]["attention_impl"] == "xla" and "config_history.jsonl" in out.stderr


def test_moe_run_logs_its_auxiliary_losses(config_file, tmp_path):
    """train.py on a MoE model: metrics.jsonl carries the MoE aux values beside the LM loss."""
    work = tmp_path / "moe"
    subprocess.run(train_cmd(config_file, work, "--steps", "4", "--config.model.moe.num_experts=4",
                             "--config.model.moe.top_k=2", "--config.model.moe.expert_width=16",
                             "--config.model.moe.z_loss_coef=0.001", "--config.train.eval_every=100"),
                   check=True, capture_output=True, timeout=300)
    steps, rows = losses(work)
    assert steps == [1, 2, 3, 4]
    for row in rows.values():
        assert 0.5 < row["moe/lbl"] < 4.0  # E * sum_e f_e p_e: 1 when balanced, E at worst
        assert row["moe/z_loss"] > 0 and row["moe/dropped"] == 0 and row["moe/max_over_mean_load"] >= 1
        assert np.isfinite(row["loss"])


def test_continued_training_starts_from_another_runs_parameters(config_file, tmp_path, six_steps):
    """The context-extension protocol: a new run with a new RoPE base and sequence length starts
    from a trained run's checkpoint, with its tokenizer; another architecture or a step that was
    never saved is refused before anything is written."""
    import jax
    from flax import nnx

    from gattn import cli
    from gattn.config import ConfigError
    from gattn.train import init_from, rundir, trainer

    base, ext = tmp_path / "base", tmp_path / "ext"
    shutil.copytree(six_steps, base)  # CONFIG trained for 6 steps
    for extra, field, names in ((["model.d_ff=96"], "model.d_ff", ("has 64",)),
                                (["model.ffn_activation=gelu"], "model.ffn_activation", ("'silu'",)),
                                (["train.init_step=4"], "train.init_step", ("6]",))):
        bad = cli.load(config_file, [f"train.init_from={base}", "train.steps=4", *extra])
        with pytest.raises(ConfigError) as e:
            trainer.train(bad, tmp_path / "bad", progress=False)
        assert e.value.field == field and all(n in e.value.allowed for n in names), e.value
        assert not (tmp_path / "bad").exists()

    subprocess.run(train_cmd(config_file, ext, "--init-from", base, "--steps", "4", "--config.model.rope_base=1e6",
                             "--config.train.seq_len=64"), check=True, capture_output=True, timeout=300)
    cfg = rundir.read_config(ext)
    assert (cfg.model.rope_base, cfg.train.seq_len, cfg.train.init_from) == (1e6, 64, str(base))
    (src_tok,) = (base / "tokenizer").glob("*.model")
    assert (ext / "tokenizer" / "init_from.model").read_bytes() == src_tok.read_bytes()
    assert [p.name for p in (ext / "tokenizer").iterdir()] == ["init_from.model"]  # none trained
    # What the run started from is the source's step-6 parameters, exactly.
    _, state = trainer.init_state(cfg)
    start = init_from.params(cfg, state["params"], init_from.check(cfg))
    src = nnx.state(rundir.load(base).model, nnx.Param)
    jax.tree.map(np.testing.assert_array_equal, start, src)
    first = losses(ext)[1][1]["loss"]
    assert first < losses(base)[1][1]["loss"]  # not a fresh start


def test_a_resume_with_more_steps_can_hold_the_lr_it_had_reached(config_file, tmp_path, six_steps, capsys):
    """Continued pretraining from a finished cosine: extend=constant keeps training at the LR the
    run ended with (the floor) instead of re-warming, says so, and config.json records where the
    continuation starts, so that a later resume keeps it."""
    from gattn import cli
    from gattn.train import rundir, trainer

    run = tmp_path / "run"
    shutil.copytree(six_steps, run)  # CONFIG's cosine over 6 steps, finished
    trainer.train(cli.load(config_file, ["train.steps=9", "train.extend=constant"]), run, progress=False)
    err = capsys.readouterr().err
    assert "the LR continues from 3e-05" in err
    assert f"resumed from step 6 ({run / 'checkpoints'})" in err.splitlines()  # the step it restored
    _, rows = losses(run)
    assert [rows[s]["lr"] for s in (7, 8, 9)] == pytest.approx([3e-5] * 3)
    assert rows[6]["lr"] == pytest.approx(3e-5) and rows[2]["lr"] > 1e-3  # what the 6-step run had
    cfg = rundir.read_config(run)
    assert (cfg.train.extend, cfg.train.continue_step, cfg.train.continue_lr) == ("constant", 6, pytest.approx(3e-5))
    # The start-up stages of this resume, timed (WORKDIR/startup.json): the checkpoint is restored
    # onto the state's shapes, with no initialisation compiled and run first.
    stages = json.loads((run / "startup.json").read_text())
    assert {"tokenizer", "dataset", "restore", "compile", "total"} <= set(stages) and "model" not in stages
    assert stages["total"] >= stages["compile"] > 0


def test_start_up_stages_are_announced_and_timed_and_the_compilation_cache_persists(tmp_path, capsys, monkeypatch):
    """Issue 34: a start is no longer silent ("compiling the train step ... 12.3 s"), and every entry
    point keeps compiled programs between runs in a persistent cache (~/.cache/gattn/jax)."""
    from gattn import cli
    from gattn.train.reports import Startup

    startup = Startup(True)
    with startup.stage("compile", "compiling the train step"):
        time.sleep(0.05)
    startup.write(tmp_path)
    assert re.fullmatch(r"compiling the train step \.\.\. \d+\.\d s\n", capsys.readouterr().err)
    assert json.loads((tmp_path / "startup.json").read_text())["compile"] >= 0.05

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cli.compilation_cache_dir() == str(tmp_path / "cache" / "gattn" / "jax")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert cli.compilation_cache_dir() == str(tmp_path / "mine")
    monkeypatch.setenv("GATTN_COMPILATION_CACHE", "0")
    assert cli.compilation_cache_dir() == ""


def test_continued_training_passes_over_an_unsealed_newest_checkpoint(config_file, tmp_path, six_steps, capfd):
    """Issue 57 item 6: the source's newest checkpoint is unsealed (preempted mid-seal, or the
    source still training). Before: --init-from failed with "no checkpoint ... can be used" while
    a sealed older step was there. Now: the newest usable step, with one warning naming both."""
    from flax import nnx

    import jax
    from gattn import cli
    from gattn.train import checkpoint, init_from, rundir, trainer

    base, ext = tmp_path / "base", tmp_path / "ext"
    shutil.copytree(six_steps, base)
    trainer.train(cli.load(config_file, ["train.steps=8", "train.checkpoint_every=4"]), base, progress=False)
    assert checkpoint.saved_steps(base) == [6, 8]
    shutil.rmtree(base / "checkpoints" / "8" / checkpoint.CHECKSUMS)  # its seal never finished
    capfd.readouterr()
    cfg = cli.load(config_file, [f"train.init_from={base}", "train.steps=2", "train.warmup_steps=1"])
    trainer.train(cfg, ext, progress=False)
    err = capfd.readouterr().err
    assert "checkpoint step 8" in err and "using step 6 instead" in err, err
    _, state = trainer.init_state(cfg)
    start = init_from.params(cfg, state["params"], init_from.check(cfg))
    jax.tree.map(np.testing.assert_array_equal, start, nnx.state(rundir.load(base, 6).model, nnx.Param))


def test_ctrl_c_is_named_as_such_and_one_as_the_run_ends_lets_it_finish(config_file, tmp_path, six_steps, capsys,
                                                                        monkeypatch):
    """Issue 57 item 10. Before: a Ctrl-C during training was reported as "SIGTERM: saved step N",
    and a Ctrl-C while a completed run finished its last save raised KeyboardInterrupt out of
    train (tracebacks, exit 130 for a run that had completed)."""
    import signal

    from gattn import cli
    from gattn.train import checkpoint, trainer

    run = tmp_path / "run"
    shutil.copytree(six_steps, run)
    real_step = trainer.make_train_step

    def make_train_step(*a, **kw):  # Ctrl-C during step 8
        step = real_step(*a, **kw)

        class Step:
            lower = step.lower

            def __call__(self, state, batch):
                if int(state["step"]) == 7:
                    os.kill(os.getpid(), signal.SIGINT)
                return step(state, batch)
        return Step()

    monkeypatch.setattr(trainer, "make_train_step", make_train_step)
    before = signal.getsignal(signal.SIGINT)  # (Python's default_int_handler; SIG_IGN in an xdist worker)
    summary = trainer.train(cli.load(config_file, ["train.steps=12"]), run, progress=False)
    out = capsys.readouterr()
    assert "Ctrl-C (SIGINT): saved step 8" in out.out and "SIGTERM" not in out.out, out.out
    assert summary["step"] == 8 and not summary["completed"]

    monkeypatch.setattr(trainer, "make_train_step", real_step)
    real_close = checkpoint.Saves.close

    def close(self):  # Ctrl-C while the completed run waits for its last save
        os.kill(os.getpid(), signal.SIGINT)
        return real_close(self)

    monkeypatch.setattr(checkpoint.Saves, "close", close)
    summary = trainer.train(cli.load(config_file, ["train.steps=10"]), run, progress=False)
    assert summary["completed"] and summary["step"] == 10
    assert "SIGINT as the run ends" in capsys.readouterr().err
    assert checkpoint.saved_steps(run)[-1] == 10
    assert signal.getsignal(signal.SIGINT) is before  # put back when train returned


def test_a_read_only_workdir_is_refused_naming_the_flag(config_file, tmp_path):
    """Issue 57 item 10. Before: `error: OSError: [Errno 30] Read-only file system ...` (exit 1)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                                                   capture_output=True).returncode == 0
    if not mounted:
        folder.chmod(0o555)
    try:
        out = subprocess.run(train_cmd(config_file, folder / "run", "--steps", "4"), capture_output=True, text=True,
                             timeout=120)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)
        else:
            folder.chmod(0o755)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "'--workdir'" in lines[0] and "a folder this process can write" in lines[0], lines
