"""A live run stays live while a library holds the GIL (gattn.train.lease, gattn.cluster): the
tokenizer trains in a process of its own, so a run keeps its lease through a training longer than
the stale window (a second run on this host or another is refused), and process 0 of several is
not declared lost while it trains; the lease's lateness is measured on the monotonic clock, so a
step of the wall clock stops no run."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gattn import cli, launch
from gattn.data.tokenizer import train_tokenizer
from gattn.train import lease

ROOT = Path(__file__).resolve().parents[1]
PEER = str(ROOT / "tests" / "programs" / "tokenizer_peer.py")

# Another train.py on the same directory, trying again and again until `done` exists; with a host
# name, it takes this host for another (only the renewals keep the lease from it).
PROBE = """
import socket, sys, time
from pathlib import Path
from gattn.config import ConfigError
from gattn.train import lease
workdir, done, host = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
if host:
    socket.gethostname = lambda: host
print("ready", flush=True)
tries = 0
while not done.exists():
    tries += 1
    try:
        lease.Lease(workdir).acquire()
    except ConfigError:
        time.sleep(0.02)
        continue
    print("took", flush=True)
    sys.exit(0)
print("refused", tries, flush=True)
"""


def slow_corpus(folder: Path, files: int) -> Path:
    """Random letters and spaces: many distinct words, so SentencePiece's BPE trains for seconds
    (~0.15 s a file at 8000 pieces on a 2-core machine) on little text."""
    rng = random.Random(0)
    folder.mkdir(parents=True)
    for i in range(files):
        (folder / f"{i}.txt").write_text("".join(rng.choices("abcdefghij     \n", k=50_000)))
    return folder


@pytest.mark.parametrize("host", ["", "another-host"], ids=["this_host", "another_host"])
def test_a_run_keeps_its_lease_while_its_tokenizer_trains_longer_than_the_stale_window(tmp_path, monkeypatch, host):
    """A second run keeps trying to take the lease while the first trains its tokenizer for 3x the
    stale window: on this host, and as from another host (where only the renewals keep it)."""
    monkeypatch.setattr(lease, "STALE_SECONDS", 1.0)  # renewed every 0.25 s
    corpus, workdir, done = slow_corpus(tmp_path / "corpus", 25), tmp_path / "run", tmp_path / "done"
    with lease.hold(workdir) as held:
        probe = subprocess.Popen([sys.executable, "-c", PROBE, str(workdir), str(done), host], cwd=ROOT,
                                 env={**os.environ, "GATTN_LOCK_STALE_SECONDS": "1"}, stdout=subprocess.PIPE, text=True)
        assert probe.stdout.readline() == "ready\n"
        start = time.monotonic()
        train_tokenizer(str(corpus), 0, 8000, tmp_path / "spm.model")
        took = time.monotonic() - start
        done.touch()
        said = probe.communicate(timeout=30)[0]
        assert took > 2 * lease.STALE_SECONDS, took  # (else this proves nothing)
        assert said.startswith("refused"), said
        lease.check()
        assert json.loads((workdir / lease.LOCK).read_text())["token"] == held.me["token"]


def test_a_step_of_the_wall_clock_does_not_stop_a_run_that_holds_its_lease(tmp_path, monkeypatch):
    with lease.hold(tmp_path) as held:
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 100)
        lease.check()
        held.renew()  # lock.json, for the other hosts, has the wall clock's time
        lease.check()
        assert json.loads((tmp_path / lease.LOCK).read_text())["renewed"] > real() + 50


def test_process_0_training_a_tokenizer_longer_than_the_peer_timeout_is_not_declared_lost(tmp_path):
    """2 processes on gloo, GATTN_PEER_SECONDS=4: process 0 trains a tokenizer for longer than
    that (as train.py's prepare does) while process 1 waits at a barrier; both finish."""
    corpus, port = slow_corpus(tmp_path / "corpus", 60), launch.free_port()
    procs = [subprocess.Popen([sys.executable, PEER, str(corpus), str(tmp_path / "spm.model")], cwd=ROOT, text=True,
                              env={**launch.worker_env(i, 2, 1, port), "GATTN_LOG_DIR": str(tmp_path / "logs"),
                                   "GATTN_PEER_SECONDS": "4"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(2)]
    outs = [p.communicate(timeout=150) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    trained = float(outs[0][0].split("trained in ")[1].split()[0])
    assert trained > 4, outs[0]  # (else this proves nothing; ~7 s on 2 cores, where the old code lost process 0)
    assert all(f"done {i}" in out for i, (out, _) in enumerate(outs)), outs


def test_the_tokenizers_training_process_reports_its_errors_in_one_line(tmp_path, monkeypatch):
    """Too many pieces for the corpus: model.vocab_size, as before; unreadable text: the file, raised
    while reading (the child is stopped); a child killed (out of memory): one line that says so."""
    from gattn.config import ConfigError
    from gattn.data import tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the gate is a sigmoid of the input\n" * 50)
    with pytest.raises(ConfigError, match=r"'model.vocab_size' = 50000 .*at most \d+ to train a tokenizer"):
        train_tokenizer(str(corpus), 0, 50_000, tmp_path / "spm.model")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "b.txt").write_bytes(b"bad \xff byte\n")
    with pytest.raises(ConfigError, match="b.txt"):
        train_tokenizer(str(tmp_path / "bad"), 0, 300, tmp_path / "spm.model")
    monkeypatch.setattr(tokenizer, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(cli.Failure, match=r"^the process training the tokenizer ended without a result \(killed by "
                                          r"SIGKILL; out of memory\?\)$"):
        train_tokenizer(str(corpus), 0, 300, tmp_path / "spm.model")
    assert not (tmp_path / "spm.model").exists()
