"""docs/pod-slice.md's recipe as written: its variables and commands read out of the page. The
default set parses every command by its own command line for every preset of the recipe's table
and checks the launch's data (the shards the prepare step writes; the embedded corpus refused in
one line). The slow test runs it at tiny scale: a local folder for the bucket, a small byte-level
BPE tokenizer.json and corpus, the rehearsal's overrides (the preset shrunk in size, CPU devices);
prepare, the launch as 2 processes, SIGTERM after the first checkpoint, the same command resuming."""

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from string import Template

import pytest
from conftest import entry_point

from gattn import cli
from gattn.config import ConfigError
from gattn.data import corpus
from gattn.experiments import fit_table, plan, rehearse

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "pod-slice.md"


def recipe_block() -> str:
    text = PAGE.read_text()
    after = text[text.index("## The recipe"):]
    return re.search(r"```\n(.*?)```", after, re.S).group(1)


def assignments(block: str) -> dict[str, str]:
    """NAME=VALUE words of the block's assignment lines, in order (as bash reads them: quotes
    removed, `# ...` a comment), not yet expanded."""
    out = {}
    for line in block.splitlines():
        if re.match(r"[A-Z_]+=", line):
            for word in shlex.split(line, comments=True):
                name, _, value = word.partition("=")
                out[name] = value
    return out


def commands(block: str) -> dict[str, str]:
    """The block's `python -m gattn.X ...` commands by module, continuation lines joined."""
    joined = block.replace("\\\n", " ")
    return {m.group(1): m.group(0) for m in re.finditer(r"^python -m gattn\.(\w+) .*$", joined, re.M)}


def expand(values: dict[str, str], given: dict[str, str]) -> dict[str, str]:
    """The variables as bash leaves them after the assignment lines, with `given` in place of the
    block's own values (a local bucket, this test's tokenizer), as if written in its place."""
    out: dict[str, str] = {}
    for name, value in values.items():
        out[name] = Template(given.get(name, value)).substitute(out)
    return out


def args_of(command: str, env: dict[str, str]) -> list[str]:
    return shlex.split(Template(command).substitute(env))[3:]  # after "python -m gattn.X"


BLOCK = recipe_block()
VALUES, COMMANDS = assignments(BLOCK), commands(BLOCK)
ROWS = {r.preset: r for r in fit_table.rows()}


def test_the_recipe_names_its_variables_and_commands():
    assert {"PRESET", "ACCEL", "HOSTS", "BUCKET", "RUN", "TOKENIZER", "CORPUS", "SHARDS", "START", "TRAIN"} \
        <= VALUES.keys()
    assert {"prepare", "rehearse", "params"} <= COMMANDS.keys()
    assert "$TRAIN --distributed" in BLOCK  # the launch runs TRAIN on every host
    used = set(re.findall(r"\$([A-Z_]+)", " ".join([*COMMANDS.values(), *VALUES.values()])))
    assert used <= VALUES.keys()
    # the defaults are the recipe table's row for the default preset
    row = ROWS[VALUES["PRESET"]]
    assert (VALUES["ACCEL"], VALUES["HOSTS"]) == (fit_table.gcloud_name(row.where), str(row.hosts))


def start_of(preset: str) -> str:
    """The table's "starts from" as flags (a converted model's folder for the from-hf presets)."""
    cell = fit_table.STARTS.get(preset, "")
    return cell.split("`")[1] if "$BUCKET" in cell else "--init-from converted/hf_run" if cell else ""


@pytest.fixture(scope="module")
def train_py():
    return entry_point("train")


@pytest.mark.parametrize("preset", fit_table.PRESETS)
def test_each_command_parses_for_every_preset(preset, monkeypatch, train_py, capsys):
    row = ROWS[preset]
    env = expand(VALUES, {"PRESET": preset, "ACCEL": fit_table.gcloud_name(row.where), "HOSTS": str(row.hosts),
                          "START": start_of(preset)})
    seen = {}
    from gattn.data import prepare

    monkeypatch.setattr(prepare, "prepare", lambda source, tok, out, **kw: seen.update(prepare=(source, tok, out)))
    prepare.main(args_of(COMMANDS["prepare"], env))
    assert seen["prepare"] == (env["CORPUS"], env["TOKENIZER"], env["SHARDS"])

    monkeypatch.setattr(rehearse, "rehearse", lambda p, n, d, **kw: seen.update(rehearse=(p, n, d)) or {})
    rehearse.main(args_of(COMMANDS["rehearse"], env))
    assert seen["rehearse"] == (preset, row.hosts, row.where.chips // row.hosts)

    if row.fit is not None:  # the planner reads its fit (one without says which command writes it)
        plan.main(args_of(COMMANDS["params"], env))
        assert f"{preset} on {env['ACCEL']} ({row.where.chips} chips" in capsys.readouterr().out
    else:
        with pytest.raises(ConfigError, match=f"bench/fit_presets.py --preset {preset} "):
            plan.main(args_of(COMMANDS["params"], env))

    from gattn.train import trainer

    monkeypatch.setattr(cli, "start_distributed", lambda args: seen.update(distributed=args.distributed))
    monkeypatch.setattr(trainer, "train", lambda cfg, workdir, **kw: seen.update(cfg=cfg, workdir=workdir) or {})
    train_py.main(shlex.split(env["TRAIN"])[1:] + ["--distributed"])
    cfg = seen["cfg"]
    assert seen["distributed"] and seen["workdir"] == f"{env['BUCKET']}/{env['RUN']}"
    assert cfg.data.source == f"shards:{env['SHARDS']}" and cfg.train.init_from == (
        "" if not start_of(preset) else start_of(preset).split()[1].replace("$BUCKET", env["BUCKET"]))
    corpus.check_embedded_suffices(cfg)  # the shards: no refusal
    with pytest.raises(ConfigError, match="'data.source' = 'embedded'"):  # the preset as shipped
        corpus.check_embedded_suffices(cli.load(preset))


def test_a_paper_preset_on_the_embedded_corpus_is_refused_in_one_line(tmp_path, train_py, capsys):
    """Before: it went on to train a 303,104-piece SentencePiece model on 2 MB of text."""
    assert cli.run_cli(train_py.main, ["--config", "moe_15a2b", "--workdir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert re.fullmatch(r"error: config field 'data.source' = 'embedded' is not allowed: a corpus as large as the "
                        r"run: .* = 419.4B tokens would read the embedded corpus \(at most [\d.]+M tokens\) [\d,]+ "
                        r"times over; pass --config.data.source=shards:DIR .*, or --steps \d+ or fewer to try it on "
                        r"the embedded one", err), err
    assert not (tmp_path / "run").exists()


def test_the_embedded_corpus_takes_up_to_its_limit_of_steps():
    cfg = cli.load("moe_15a2b")
    bound = corpus.embedded_tokens_at_most(cfg.data.code_max_bytes)
    most = corpus.EMBEDDED_PASSES_MAX * bound // (cfg.train.batch_size * cfg.train.seq_len)
    def steps(n):  # (train.py's --steps scales the preset's warmup with them)
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=n, lr_preset="", warmup_steps=10))

    corpus.check_embedded_suffices(steps(most))
    with pytest.raises(ConfigError, match=f"--steps {most} or fewer"):
        corpus.check_embedded_suffices(steps(most + 1))
    for small in ("tiny", "small", "demo", "extend_tiny", "hybrid_tiny", "instability_lab"):
        corpus.check_embedded_suffices(cli.load(small))


# --------------------------------------------------------------------------- the recipe at tiny scale

WORDS = "the gate attention sink sparse head value query key model layer token".split()


def small_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer.json (Qwen's kind) of 300 ids, its tokenizer_config.json naming EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder / "tokenizer.json"


def small_corpus(folder: Path) -> None:
    """Two domains of 60 .txt documents each."""
    for domain in ("law", "code"):
        (folder / domain).mkdir(parents=True)
        for i in range(60):
            words = [WORDS[(i * 7 + j * j) % len(WORDS)] for j in range(30 + i % 50)]
            (folder / domain / f"{i}.txt").write_text(" ".join(words) + "\n")


def launch(train: list[str], log: Path, env: dict, stop_after_checkpoint: Path | None = None) -> str:
    """`python -m gattn.launch --processes 2 --local-devices 2 TRAIN --distributed`; with
    `stop_after_checkpoint`, SIGTERM to the launcher once that folder holds a checkpoint."""
    command = [sys.executable, "-m", "gattn.launch", "--processes", "2", "--local-devices", "2", *train]
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline, sent = time.time() + 900, False
        while proc.poll() is None and time.time() < deadline:
            if stop_after_checkpoint is not None and not sent and stop_after_checkpoint.is_dir() and any(
                    p.name.isdigit() for p in stop_after_checkpoint.iterdir()):
                time.sleep(1.0)  # (the save is asynchronous)
                proc.send_signal(signal.SIGTERM)
                sent = True
            time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    return text


@pytest.mark.slow
def test_the_recipe_runs_end_to_end_at_tiny_scale(tmp_path):
    """~4 minutes on 2 shared cores: Beam, then two 2-process runs of a 2-layer MoE."""
    bucket = tmp_path / "bucket"
    tok = small_tokenizer(tmp_path / "qwen3")
    env = expand(VALUES, {"BUCKET": str(bucket), "TOKENIZER": str(tok)})
    small_corpus(Path(env["CORPUS"]))
    run_env = {**os.environ, "JAX_PLATFORMS": "cpu", "GATTN_PALLAS_STANDIN": "1"}

    prepared = subprocess.run([sys.executable, "-m", "gattn.prepare", *args_of(COMMANDS["prepare"], env)],
                              cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=900)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    manifest = json.loads((Path(env["SHARDS"]) / "manifest.json").read_text())
    assert manifest["files"]

    small, _ = rehearse.shrink(env["PRESET"], None, [f"data.source=shards:{env['SHARDS']}"], chips=4)
    tiny = ["train.batch_size=16", "data.eval_batch_size=4"]  # (tiny scale: the preset's 1024 rows take minutes)
    train = shlex.split(env["TRAIN"]) + ["--distributed", *(f"--config.{o}" for o in small + tiny)]
    run = Path(env["BUCKET"]) / env["RUN"]
    first = launch(train, tmp_path / "first.log", run_env, stop_after_checkpoint=run / "checkpoints")
    assert "SIGTERM: saved step" in first
    saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and saved[-1] < rehearse.STEPS

    second = launch(train, tmp_path / "second.log", run_env)  # the same command: it resumes
    assert f"resumed from step {saved[-1]}" in second
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["step"] == rehearse.STEPS
    data = json.loads((run / "data.json").read_text())
    assert data["manifest_sha256"] and data["data_source"] == f"shards:{env['SHARDS']}"
    losses = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss/law" in r for r in losses) and all(r.get("loss", 0) == r.get("loss", 0) for r in losses)
