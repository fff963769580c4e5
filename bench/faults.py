"""The fault rerun of issue 32: 30 things a careful user does wrong, or that go wrong under them,
each run through the real train.py / eval.py on a tiny model, and judged on three counts:

- silent wrong result: exit 0 with a wrong answer (a corrupt checkpoint evaluated or resumed, a
  ruined run reported "completed", a refused value recorded anyway);
- good checkpoints lost: the newest checkpoint that was intact before the fault (the one a user
  needs to go on) is in neither checkpoints/ nor checkpoints_set_aside/ after it (older ones
  leave by the keep-K rotation, as they should);
- one line per failure: a failing command prints exactly one `error:` line and no traceback.

    python bench/faults.py [--only round1,trust] [--keep DIR]

Prints one JSON object per case, then a JSON summary (the counts above). Takes ~15 minutes on 2
CPU cores (about 40 short runs of train.py / eval.py) for round1 and trust; `--only trust` runs
issue 43's cases alone. Issue 57's groups: round3 (a full disk under 2 processes, a damaged
checkpoint at step 500, --init-from an unsealed checkpoint, a usage error before the join, Ctrl-C,
a read-only workdir), labels, convert (needs gattn[test]), cache, liveness.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import run_config_file  # noqa: E402 (the tests' tiny model on the embedded corpus)
from gattn import launch  # noqa: E402
from gattn.train import lease  # noqa: E402

CONFIG = run_config_file(steps=6, warmup_steps=1, eval_every=100, checkpoint_every=2, keep_checkpoints=3)
FULL_DISK = """
import errno, runpy, sys
from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler
real = handler.JsonCheckpointHandler._save_fn
async def full(self, x, directory):
    if "/8." in str(directory):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))
    return await real(self, x, directory)
handler.JsonCheckpointHandler._save_fn = full
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("%s/train.py", run_name="__main__")
"""


FLAKY_STORE = """
import runpy, sys
from orbax.checkpoint._src.checkpointers import checkpointer
real, tries = checkpointer.Checkpointer._restore, []
def flaky(self, directory, *a, **kw):  # the store answers 503 to the first %s reads of step 6
    if str(directory).rstrip("/").endswith("/6") and len(tries) < %s:
        tries.append(1)
        raise OSError("503 Service Unavailable: GET https://storage.googleapis.com/bucket/run/checkpoints/6")
    return real(self, directory, *a, **kw)
checkpointer.Checkpointer._restore = flaky
from gattn.train import checkpoint
checkpoint.RETRY_SECONDS = 0.2
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(script, *args, timeout=600, wait=True):
    cmd = [sys.executable, str(ROOT / script), *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def steps_in(work: Path) -> set[int]:
    found = set()
    for folder in ("checkpoints", "checkpoints_set_aside"):
        if (work / folder).is_dir():
            found |= {int(p.name.split(".")[0]) for p in (work / folder).iterdir() if p.name.split(".")[0].isdigit()}
    return found


def lost(good: set[int], work: Path) -> list[int]:
    """The good checkpoints that are gone: neither kept (in checkpoints/ or set aside) nor
    superseded by a newer checkpoint the run saved after it (the keep-K rotation drops old ones)."""
    live = {int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit()} \
        if (work / "checkpoints").is_dir() else set()
    return sorted(g for g in good if g not in steps_in(work) and not any(s > g for s in live))


def largest(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip(path: Path, n: int = 256) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    path.write_bytes(bytes(data))


CORRUPT = {
    "flip": lambda c: flip(largest(c)),
    "truncate": lambda c: largest(c).write_bytes(largest(c).read_bytes()[:largest(c).stat().st_size // 2]),
    "delete": lambda c: largest(c).unlink(),
    "no_manifest": lambda c: (c / "state" / "manifest.ocdbt").unlink(),
    "empty_metadata": lambda c: (c / "state" / "_METADATA").write_text(""),
    "seal_deleted": lambda c: shutil.rmtree(c / "checksums"),  # intact but unsealed: not trusted (issue 43)
    "bad_seal": lambda c: (c / "checksums" / "process_0.json").write_text("{"),
}


class Bench:
    def __init__(self, root: Path):
        self.root, self.config = root, root / "small.py"
        self.config.write_text(CONFIG)
        self.base = root / "base"
        out = run("train.py", "--config", self.config, "--workdir", self.base, "--quiet")
        assert out.returncode == 0, out.stderr

    def copy(self, name: str) -> Path:
        work = self.root / name
        shutil.copytree(self.base, work)
        return work

    def train(self, work, *args, **kw):
        return run("train.py", "--config", self.config, "--workdir", work, "--quiet", *args, **kw)


def verdict(name, out, *, expect_fail: bool, wrong: bool, good_before: set, work: Path | None, **extra) -> dict:
    err = out.stderr if out is not None else ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    failed = out is not None and out.returncode != 0
    one_line = (not failed) or (len(errors) == 1 and "Traceback" not in err
                                and all(line.startswith(("error:", "warning:", "note:", "preparing", "SIGTERM"))
                                        or not line.strip() for line in err.splitlines()))
    gone = lost(good_before, work) if work is not None else []
    return {"case": name, "exit": None if out is None else out.returncode, "expected_failure": expect_fail,
            "silent_wrong": bool(wrong), "good_checkpoints_lost": gone, "one_line": one_line,
            "error": errors[0][:200] if errors else None, **extra,
            **({} if one_line else {"stderr_tail": err.splitlines()[-8:]})}


def cases(b: Bench):
    good = {6}  # the newest intact checkpoint of the base run (it keeps 2, 4 and 6)

    # 1-14: a corrupt newest (or every) checkpoint, read by eval.py and resumed by train.py.
    for kind, corrupt in CORRUPT.items():
        work = b.copy(f"eval_{kind}")
        corrupt(work / "checkpoints" / "6")
        out = run("eval.py", "--workdir", work, "--no-figures", "--max-batches", "1")
        res = json.loads((work / "eval" / "results.json").read_text()) if out.returncode == 0 else {}
        wrong = out.returncode == 0 and res.get("step") != 4
        yield verdict(f"eval: newest checkpoint {kind}", out, expect_fail=False, wrong=wrong,
                      good_before={4}, work=work, evaluated_step=res.get("step"))
        work = b.copy(f"train_{kind}")
        corrupt(work / "checkpoints" / "6")
        out = b.train(work, "--steps", "8")
        summary = json.loads((work / "summary.json").read_text())
        resumed_corrupt = not (work / "checkpoints_set_aside" / "6").is_dir()
        wrong = out.returncode == 0 and (resumed_corrupt or summary.get("final_loss") is None)
        yield verdict(f"train: resume past newest checkpoint {kind}", out, expect_fail=False, wrong=wrong,
                      good_before={4}, work=work)

    # 15-16: every checkpoint corrupt.
    for script in ("eval.py", "train.py"):
        work = b.copy(f"all_bad_{script}")
        for s in (2, 4, 6):
            CORRUPT["flip"](work / "checkpoints" / str(s))
        out = run(script, *(["--config", b.config, "--quiet"] if script == "train.py" else ["--no-figures"]),
                  "--workdir", work)
        yield verdict(f"{script}: every checkpoint flipped", out, expect_fail=True, wrong=out.returncode == 0,
                      good_before=set(), work=work, lists_each_step=all(f"step {s}:" in out.stderr for s in (2, 4, 6)))

    # 17: divergence (LR 1e6), then a plain rerun.
    work = b.copy("diverge")
    first = b.train(work, "--steps", "40", "--config.train.learning_rate=1e6", "--config.train.checkpoint_every=1",
                    "--config.train.keep_checkpoints=1")
    out = b.train(work, "--steps", "40", "--config.train.learning_rate=1e6", "--config.train.checkpoint_every=1",
                  "--config.train.keep_checkpoints=1")
    summary = json.loads((work / "summary.json").read_text())
    yield verdict("train: LR 1e6, then a plain rerun", out, expect_fail=True,
                  wrong=first.returncode == 0 or out.returncode == 0 or summary.get("completed"),
                  good_before={6}, work=work, first_exit=first.returncode)

    # 18: two writers.
    work = b.copy("two_writers")
    a = b.train(work, "--steps", "400", wait=False)
    time.sleep(15)
    out = b.train(work, "--steps", "400")
    a.send_signal(signal.SIGTERM)
    a.communicate(timeout=300)
    rows = [json.loads(line)["step"] for line in (work / "metrics.jsonl").read_text().splitlines()]
    yield verdict("train: a second train.py on the same workdir", out, expect_fail=True,
                  wrong=out.returncode == 0 or len(rows) != len(set(rows)), good_before=good, work=work)

    # 19-20: SIGINT and SIGTERM, one process.
    for sig in (signal.SIGINT, signal.SIGTERM):
        work = b.copy(f"signal_{sig.name}")
        p = b.train(work, "--steps", "400", wait=False)
        time.sleep(25)
        p.send_signal(sig)
        stdout, stderr = p.communicate(timeout=300)
        out = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
        summary = json.loads((work / "summary.json").read_text())
        saved = max(steps_in(work))
        yield verdict(f"train: {sig.name} (one process)", out, expect_fail=False,
                      wrong=out.returncode != 0 or summary["completed"] or summary["step"] != saved,
                      good_before=good, work=work, saved_step=saved)

    # 21: full disk at the save of step 8.
    work = b.copy("full_disk")
    script = b.root / "full_disk.py"
    script.write_text(FULL_DISK % ROOT)
    out = subprocess.run([sys.executable, str(script), "--config", str(b.config), "--workdir", str(work), "--quiet",
                          "--steps", "12"], capture_output=True, text=True, timeout=600)
    yield verdict("train: the disk fills at a save", out, expect_fail=True, wrong=out.returncode == 0,
                  good_before=good, work=work, stderr_lines=len(out.stderr.splitlines()))

    # 22: --compare with a missing folder.
    work = b.copy("compare")
    run("eval.py", "--workdir", work, "--no-figures", "--max-batches", "1")
    before = (work / "eval" / "results.json").stat().st_mtime_ns
    out = run("eval.py", "--compare", work, b.root / "missing", "--no-figures", "--max-batches", "1")
    yield verdict("eval: --compare RUN missing_dir", out, expect_fail=True,
                  wrong=(work / "eval" / "results.json").stat().st_mtime_ns != before, good_before=good, work=work)

    # 23: --steps below the step reached.
    work = b.copy("steps_back")
    out = b.train(work, "--steps", "3")
    yield verdict("train: --steps below the step reached", out, expect_fail=True,
                  wrong=json.loads((work / "config.json").read_text())["train"]["steps"] != 6,
                  good_before=good, work=work)

    # 24-30: bad input, refused before anything is written.
    text = b.root / "tokenizer.txt"
    text.write_text("not a model")
    small = b.root / "small_corpus"
    small.mkdir()
    for i in range(30):
        (small / f"{i}.txt").write_text(f"hello world {i} " * 5)
    task = b.root / "task.jsonl"
    task.write_text('{"context": "2+2=", "choices": ["4"], "answer": 0}\n')
    bad = [
        ("train: data.tokenizer is a text file", ["train.py", "--config", b.config, f"--config.data.tokenizer={text}"]),
        ("train: model.vocab_size too large for the corpus",
         ["train.py", "--config", b.config, f"--config.data.source={small}", "--config.model.vocab_size=4096"]),
        ("eval: --tasks with a bad example", ["eval.py", "--workdir", b.base, "--tasks", task, "--no-figures"]),
        ("train: --variant A --config.variant=B",
         ["train.py", "--config", b.config, "--variant", "sdpa_elementwise", "--config.variant=sdpa_headwise"]),
        ("train: --resume-step of no saved step", ["train.py", "--config", b.config, "--resume-step", "5"]),
        ("train: another model in the workdir", ["train.py", "--config", b.config, "--config.model.d_model=64"]),
        ("train: a config field that does not exist", ["train.py", "--config", b.config, "--config.train.stepz=3"]),
    ]
    for name, (script, *args) in bad:
        work = b.copy("bad_" + name.split(": ")[1].replace(" ", "_")[:30])
        fresh = "data." in " ".join(map(str, args))
        if fresh:  # a new run (the base run's own record would refuse it first)
            shutil.rmtree(work)
            work.mkdir()
        marker = sorted(p.name for p in work.rglob("*"))
        if script == "train.py":
            args = [*args, "--workdir", work, "--quiet"]
        out = run(script, *args)
        changed = sorted(p.name for p in work.rglob("*")) != marker
        yield verdict(name, out, expect_fail=True, wrong=out.returncode == 0, good_before=set() if fresh else good,
                      work=work,
                      exit_2=out.returncode == 2, wrote_nothing=not changed)


def trust_cases(b: Bench):
    """Issue 43's faults: unsealed checkpoints, transient storage errors, several processes
    deciding together, one writer, generation on gattn's own tokenizer."""
    # An unsealed newest checkpoint (its process stopped before the seal) whose arrays then changed.
    for script in ("eval.py", "train.py"):
        work = b.copy(f"unsealed_changed_{script}")
        six = work / "checkpoints" / "6"
        shutil.rmtree(six / "checksums")
        shutil.rmtree(six / "state")
        shutil.copytree(work / "checkpoints" / "2" / "state", six / "state")  # valid arrays, the wrong ones
        out = (run("eval.py", "--workdir", work, "--no-figures", "--max-batches", "1") if script == "eval.py"
               else b.train(work, "--steps", "8"))
        used = (json.loads((work / "eval" / "results.json").read_text()).get("step") if script == "eval.py"
                else None)
        wrong = out.returncode == 0 and (used != 4 if script == "eval.py"
                                         else not (work / "checkpoints_set_aside" / "6").is_dir())
        yield verdict(f"{script}: newest checkpoint unsealed, its arrays changed", out, expect_fail=False,
                      wrong=wrong, good_before={4}, work=work, evaluated_step=used)

    # A storage service's 503 while reading the newest checkpoint: once (retried), and for good.
    for fails, name in ((1, "once"), (99, "on every try")):
        work = b.copy(f"store_503_{fails}")
        script = b.root / "flaky_store.py"
        script.write_text(FLAKY_STORE % (fails, fails))
        out = subprocess.run([sys.executable, str(script), str(ROOT / "train.py"), "--config", str(b.config),
                              "--workdir", str(work), "--quiet", "--steps", "8"], capture_output=True, text=True,
                             timeout=600)
        set_aside = (work / "checkpoints_set_aside").is_dir()
        resumed = json.loads((work / "summary.json").read_text())["step"] if out.returncode == 0 else None
        yield verdict(f"train: the store answers 503 {name} while the newest checkpoint is read", out,
                      expect_fail=fails > 1, wrong=set_aside or (out.returncode == 0 and fails > 1),
                      good_before=good_of(work), work=work, set_aside=set_aside, resumed_to=resumed)

    # Two processes on gloo: one process's bad share, missing seal, read error, or 503.
    port = launch.free_port()
    hosts_dir = b.root / "two_hosts"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "programs" / "checkpoint_hosts.py"),
                               "--workdir", str(hosts_dir)], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**launch.worker_env(i, 2, 2, port),
                                                           "GATTN_HEARTBEAT_SECONDS": "10"}) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    expected = {"flip": "1", "unseal": "1", "read_error": "1", "transient": "2", "unavailable": "failed"}
    for scenario, want in expected.items():
        got = [next((line.split(" ", 2)[2] for line in out.splitlines() if line.startswith(f"result {scenario} ")),
                    None) for out, _ in outs]
        warned = [warnings_before(err, scenario) for _, err in outs]
        yield {"case": f"2 processes: step 2 {scenario} on process 1", "exit": max(p.returncode for p in procs),
               "expected_failure": False, "silent_wrong": any(g is None or not g.startswith(want) for g in got),
               "good_checkpoints_lost": [], "one_line": warned == [int(want == "1")] * 2, "error": None,
               "restored": got, "warnings_per_host": warned}


    # One writer: simultaneous starts and takeovers; a run whose lease is taken; a restarted container.
    for name, kw in (("1000 simultaneous starts", {"n": 1000}),
                     ("300 simultaneous takeovers of a stale lease", {"n": 300, "stale_holder": True})):
        got = lease.trials(b.root / f"lease_{kw['n']}", **kw)
        yield {"case": f"lease: {name}, 4 racers each", "exit": 0, "expected_failure": False,
               "silent_wrong": got["double_holders"] > 0 or got["no_holder"] > 0, "good_checkpoints_lost": [],
               "one_line": True, "error": None, **got}
    work = b.copy("lease_taken")
    env = {**os.environ, "GATTN_LOCK_STALE_SECONDS": "8"}  # a renewal every 2 s
    a = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--config", str(b.config), "--workdir", str(work),
                          "--quiet", "--steps", "4000"], env=env, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    while a.poll() is None and not (work / "metrics.jsonl").read_text().count("\n") > 8:
        time.sleep(0.5)
    (work / "lock.json").write_text(json.dumps({"host": "another-host", "pid": 4242, "token": "theirs",
                                                "since": "now", "renewed": time.time() + 3600}))
    taken = time.time()
    try:
        stdout, stderr = a.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        a.kill()
        stdout, stderr = a.communicate()
    out = subprocess.CompletedProcess(a.args, a.returncode, stdout, stderr)
    yield verdict("train: another run takes the lease of a running train.py", out, expect_fail=True,
                  wrong=out.returncode == 0 or "another-host pid 4242" not in stderr, good_before={6}, work=work,
                  stopped_after_s=round(time.time() - taken, 1))
    work = b.copy("lease_restart")
    (work / "lock.json").write_text(json.dumps({"host": socket.gethostname(), "pid": 1, "token": "before",
                                                "since": "yesterday", "renewed": time.time() - 86400}))
    out = b.train(work, "--steps", "8")
    yield verdict("train: relaunch on the same host after a container restart (pid 1 alive, lease a day old)",
                  out, expect_fail=False, wrong=False, good_before={6}, work=work)


    # lm-eval's generate_until on gattn's own run (its SentencePiece EOS decodes to '').
    from lm_eval.api.instance import Instance  # noqa: PLC0415 (gattn[lm-eval])

    from gattn.eval import decode  # noqa: PLC0415
    from gattn.interop.harness import GattnLM  # noqa: PLC0415

    lm = GattnLM(str(b.base))
    prompts = ["The gate is", "Attention", "In the beginning"]
    got = lm.generate_until([Instance("generate_until", {}, (p, {"until": ["\n\n"], "do_sample": False,
                                                                  "max_gen_toks": 16}), i) for i, p in enumerate(prompts)])
    greedy = [lm.tok_decode(t) for t in decode.generate(lm.scorer.model, [lm.tok_encode(p) for p in prompts],
                                                         max_new_tokens=16, eos_id=lm.eot_token_id)]
    cut = [g[:min([g.index(s) for s in ["\n\n"] if s in g], default=len(g))] for g in greedy]
    yield {"case": "lm-eval: generate_until on a run with gattn's SentencePiece tokenizer", "exit": 0,
           "expected_failure": False, "silent_wrong": got != cut, "good_checkpoints_lost": [], "one_line": True,
           "error": None, "eos_decodes_to": lm.tok_decode(lm.eot_token_id),
           "generated_tokens": [len(lm.tok_encode(g)) if g else 0 for g in got]}

    # Shards of long documents vs the text path, with gattn's default tokenizer.
    from gattn.data import corpus, pipeline, prepare, shards, tokenizer  # noqa: PLC0415

    source = b.root / "long_corpus" / "long"
    source.mkdir(parents=True)
    text = "\n\n".join(d.text for d in corpus.documents(corpus.EMBEDDED, 0))
    for i in range(6):  # the embedded corpus's prose, cut into documents of 10k-22k characters
        (source / f"{i}.txt").write_text(text[i * 30_000:i * 30_000 + 10_000 + 2_400 * i])
    spm = tokenizer.train_tokenizer(str(source.parent), 0, 512, b.root / "long_spm.model")
    prepare.prepare(str(source.parent), str(spm), str(b.root / "long_shards"), num_shards=2, quiet=True)
    sp = tokenizer.read_tokenizer(spm)
    folder = shards.open_shards(f"shards:{b.root / 'long_shards'}")
    stored = sorted(shards.decode_record(r)[1].tolist() for split in ("train",) for r in folder.source(split))
    stored += sorted(shards.decode_record(r)[1].tolist() for d in folder.held_out_domains()
                     for r in folder.source("validation", d))
    whole = [sp.encode(d.text) for d in corpus.documents(str(source.parent), 0)]
    text_path = [pipeline._tokenize(sp)({"text": d.text})["tokens"][:-1].tolist()  # noqa: SLF001
                 for d in corpus.documents(str(source.parent), 0)]
    differ = sum(ids not in stored for ids in whole) + sum(a != w for a, w in zip(text_path, whole))
    yield {"case": "prepare: 6 documents of 10k-22k characters, gattn's SentencePiece tokenizer", "exit": 0,
           "expected_failure": False, "silent_wrong": differ > 0 or len(stored) != len(whole),
           "good_checkpoints_lost": [], "one_line": True, "error": None, "documents_differing": differ,
           "characters": [len(d.text) for d in corpus.documents(str(source.parent), 0)]}


def round3_cases(b: Bench):
    """Issue 57's faults of the run itself: a full disk under 2 processes, a damaged checkpoint at
    step 500, --init-from an unsealed newest checkpoint, a usage error before the join, a Ctrl-C,
    a read-only workdir."""
    # A full disk while 2 processes save step 8: process 1's share cannot be written (the case
    # that hung: process 0's write succeeds and it waits for process 1 at Orbax's write barrier).
    work = b.root / "full_disk"
    out = subprocess.run([sys.executable, "-m", "gattn.launch", "--processes", "2", str(ROOT / "train.py"),
                          "--config", str(b.config), "--workdir", str(work), "--quiet", "--steps", "4"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    start = time.monotonic()
    try:
        full = subprocess.run([sys.executable, "-m", "gattn.launch", "--processes", "2",
                               str(ROOT / "tests" / "programs" / "full_disk_train.py"), "--config", str(b.config),
                               "--workdir", str(work), "--quiet", "--steps", "12"], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "GATTN_TEST_FULL_PROCESS": "1",
                                                           "GATTN_TEST_FULL_AT": "8"})
        seconds, hung = round(time.monotonic() - start, 1), False
    except subprocess.TimeoutExpired:
        full, seconds, hung = None, None, True
    lines = [] if hung else [line for line in full.stdout.splitlines() if "] error" in line]
    named = (len(lines) == 2 and {x[1] for x in lines} == {"0", "1"}
             and all("checkpoint step 8 failed" in x and "the last good checkpoint is step 6" in x for x in lines))
    again = subprocess.run([sys.executable, "-m", "gattn.launch", "--processes", "2", str(ROOT / "train.py"),
                            "--config", str(b.config), "--workdir", str(work), "--quiet", "--steps", "12"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    yield {"case": "2 processes: process 1's disk is full while step 8 is saved", "exit": None if hung else
           full.returncode, "expected_failure": True, "silent_wrong": hung or again.returncode != 0,
           "good_checkpoints_lost": [] if (work / "checkpoints" / "4").is_dir() or again.returncode == 0 else [4],
           "one_line": named, "error": lines[0][:200] if lines else None, "stopped_after_s": seconds,
           "hung": hung, "relaunch_exit": again.returncode}

    # A damaged checkpoint at step 500 (a preset's first save): the read error names .../500/...
    work = b.copy("damaged_500")
    for old, new in (("6", "500"), ("4", "400")):
        (work / "checkpoints" / old).rename(work / "checkpoints" / new)
    for stale in ("2",):
        shutil.rmtree(work / "checkpoints" / stale, ignore_errors=True)
    big = largest(work / "checkpoints" / "500")
    big.write_bytes(big.read_bytes()[:big.stat().st_size // 2])
    shutil.rmtree(work / "checkpoints" / "500" / "checksums")
    shutil.rmtree(work / "checkpoints" / "400" / "checksums")  # both unsealed: only the read can tell
    out = run("eval.py", "--workdir", work, "--no-figures", "--max-batches", "1")
    used = json.loads((work / "eval" / "results.json").read_text()).get("step") if out.returncode == 0 else None
    yield verdict("eval.py: the newest checkpoint, step 500, cut in half", out, expect_fail=False,
                  wrong=out.returncode == 0 and used != 400, good_before=set(), work=None, evaluated_step=used)

    # --init-from a run whose newest checkpoint is unsealed (preempted mid-seal, or still training).
    src = b.copy("init_from_source")
    shutil.rmtree(src / "checkpoints" / "6" / "checksums")
    out = b.train(b.root / "init_from_unsealed", "--init-from", src, "--steps", "2",
                  "--config.train.warmup_steps=1")
    yield verdict("train.py --init-from a run whose newest checkpoint is unsealed", out, expect_fail=False,
                  wrong=out.returncode == 0 and "using step 4 instead" not in out.stderr, good_before=set(),
                  work=None)

    # A usage error on process 1 before the join: process 0 quotes it within seconds.
    port = launch.free_port()
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--config", str(b.config), "--workdir",
                               str(b.root / "before_join"), "--quiet", *(["--config.train.steps=many"] if i else [])],
                              cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=launch.worker_env(i, 2, 1, port)) for i in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
        seconds = round(time.monotonic() - start, 1)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs, seconds = [p.communicate() for p in procs], None
    errors = [[line for line in err.splitlines() if line.startswith("error")] for _, err in outs]
    yield {"case": "2 processes: a usage error on process 1 before the join", "exit": procs[0].returncode,
           "expected_failure": True, "silent_wrong": seconds is None or seconds > 15, "good_checkpoints_lost": [],
           "one_line": [len(e) for e in errors] == [1, 1] and "process 1 failed before joining" in errors[0][0],
           "error": errors[0][0][:200] if errors[0] else None, "process_0_stopped_after_s": seconds}

    # Ctrl-C during training is named as such; a read-only workdir names --workdir.
    work = b.copy("ctrl_c")
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--config", str(b.config), "--workdir",
                             str(work), "--quiet", "--steps", "4000"], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    while proc.poll() is None and (work / "metrics.jsonl").read_text().count("\n") < 9:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    yield verdict("train.py: Ctrl-C during training", out, expect_fail=False,
                  wrong=out.returncode != 0 or "Ctrl-C (SIGINT): saved step" not in stdout, good_before={6}, work=work)
    folder = b.root / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs",
                                                    str(folder)], capture_output=True).returncode == 0
    try:
        out = b.train(folder / "run", "--steps", "4")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)
        folder.chmod(0o755)
    yield verdict("train.py: a read-only --workdir", out, expect_fail=True,
                  wrong=out.returncode == 0 or "'--workdir'" not in out.stderr, good_before=set(), work=None)


def label_cases(b: Bench):
    """Issue 57: a run's variant label is the model it trained, through train.py, gattn.params,
    the main job and eval.py --compare; --compare's training rows are those of the checkpoint it
    measured."""
    # A baseline given a gate by an override: recorded, and listed by --compare, as what it is.
    work = b.root / "label_gated_baseline"
    out = b.train(work, "--steps", "2", "--variant", "baseline", "--config.model.gate.granularity=headwise",
                  "--config.data.tokenizer=" + str(next((b.base / "tokenizer").glob("*.model"))))
    recorded = json.loads((work / "config.json").read_text())["variant"] if out.returncode == 0 else None
    honest = 'baseline+gate.granularity="headwise"'
    yield verdict("train: --variant baseline --config.model.gate.granularity=headwise", out, expect_fail=False,
                  wrong=recorded != honest, good_before=set(), work=None, recorded=recorded)
    plain = b.copy("label_plain")  # (a copy: --compare writes its eval/results.json)
    cmp = run("eval.py", "--compare", plain, work, "--no-figures", "--max-batches", "1", "--out", b.root / "label_cmp")
    rows = {c[0]: c[1] for c in ([x.strip() for x in line.strip("|").split("|")]
                                 for line in cmp.stdout.splitlines()[2:]) if len(c) > 1}
    yield verdict("eval: --compare a plain run and a baseline given a gate", cmp, expect_fail=False,
                  wrong=rows.get(work.name) != honest or rows.get(plain.name) != "baseline", good_before=set(),
                  work=None, listed=rows)
    # Without --variant, and a gate on a variant that has none (gattn.params prints the label, no training).
    for args, want in ((["--config.model.gate.granularity=headwise"], 'baseline+gate.granularity="headwise"'),
                       (["--variant", "sdpa_rmsnorm", "--config.model.gate.position=value"],
                        'sdpa_rmsnorm+gate.position="value"')):
        out = subprocess.run([sys.executable, "-m", "gattn.params", "--config", str(b.config), *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        got = out.stdout.partition("(")[2].partition(")")[0] if out.returncode == 0 else None
        yield verdict(f"params: {' '.join(args)}", out, expect_fail=False, wrong=got != want, good_before=set(),
                      work=None, recorded=got)
    # The main job (a study) with the same override: its baseline cell would be gated: refused.
    out = subprocess.run([sys.executable, "-m", "gattn.main_job", "--config", str(b.config), "--workdir",
                          str(b.root / "label_main"), "--steps", "2", "--config.model.gate.granularity=headwise"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    yield verdict("main_job: --config.model.gate.granularity=headwise (a gated 'baseline' cell)", out,
                  expect_fail=True, wrong=out.returncode == 0, good_before=set(), work=None)
    # A run whose newest checkpoints (4 and 6) are unreadable: --compare measures step 2, and its
    # training rows (train loss, spikes, tokens/s) are step 2's, not step 6's.
    work = b.copy("label_killed")
    shutil.rmtree(work / "eval", ignore_errors=True)
    for step in ("4", "6"):
        CORRUPT["flip"](work / "checkpoints" / step)
    cmp = run("eval.py", "--compare", work, "--no-figures", "--max-batches", "1", "--out", b.root / "label_cmp2")
    cells = next(([x.strip() for x in line.strip("|").split("|")] for line in cmp.stdout.splitlines()[2:]), [])
    metrics = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    at = {r["step"]: r["loss"] for r in metrics if "loss" in r}
    shown = float(cells[-3]) if len(cells) > 3 and cells[-3] != "-" else None
    yield verdict("eval: --compare a run whose checkpoints 4 and 6 are unreadable", cmp, expect_fail=False,
                  wrong=cells[2:3] != ["2"] or shown is None or abs(shown - at[2]) > 5e-4, good_before={2},
                  work=work, measured_step=cells[2] if len(cells) > 2 else None, train_loss_shown=shown,
                  train_loss_at={k: round(v, 3) for k, v in at.items()})


def convert_cases(b):
    """Issue 57's conversion faults (items 3 and 9), each through `python -m gattn.convert` on a
    tiny random transformers model saved here: what must be refused in one line, and what must
    convert and keep what it was."""
    import numpy as np  # noqa: PLC0415
    import transformers  # noqa: PLC0415 (gattn[test])
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: PLC0415

    from gattn.config import Config  # noqa: PLC0415
    from gattn.train import rundir  # noqa: PLC0415
    from test_convert import gattn_logits, hf_logits, randomize, save  # noqa: PLC0415
    from test_convert_qwen35 import TEXT, VISION  # noqa: PLC0415
    from test_convert_strict import qwen3_next_model, with_remembering_gdn  # noqa: PLC0415
    from test_hybrid import tiny_hybrid  # noqa: PLC0415

    root = b.root / "convert"
    root.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 50, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))

    def convert(*args):
        return subprocess.run([sys.executable, "-m", "gattn.convert", *map(str, args)], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)

    def edited(src, name, change):
        """A copy of folder `src` whose config.json has `change` applied."""
        dst = root / name
        shutil.copytree(src, dst)
        cfg = json.loads((dst / "config.json").read_text())
        change(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
        return dst

    # Item 3: a GDN whose conv transformers runs with hidden_act relu / gelu.
    for act in ("relu", "gelu_pytorch_tanh"):
        src = save(with_remembering_gdn(qwen3_next_model(act, ["linear_attention", "full_attention"])),
                   root / f"next_{act}", root / "tokenizer.json")
        out = convert("from-hf", src, "--workdir", root / f"next_{act}_run")
        yield verdict(f"from-hf: Qwen3-Next with Gated DeltaNet layers, hidden_act {act}", out, expect_fail=True,
                      wrong=out.returncode == 0, good_before=set(), work=None)
    hybrid_relu = root / "hybrid_relu_run"
    hybrid_relu.mkdir()
    rundir.write_config(hybrid_relu, Config(model=tiny_hybrid(ffn_activation="relu")))
    out = convert("to-hf", hybrid_relu, "--out", root / "hybrid_relu_hf")
    yield verdict("to-hf: a hybrid gattn run with ffn_activation relu", out, expect_fail=True,
                  wrong=out.returncode == 0, good_before=set(), work=None)
    # Item 3: Qwen3-Next's config.json as strict as Qwen3.5's; item 9 (d): full_attention_interval 0.
    silu = save(qwen3_next_model("silu", ["linear_attention", "full_attention"]), root / "next_silu",
                root / "tokenizer.json")
    changes = {"quantization_config": lambda c: c.update(quantization_config={"bits": 4}),
               "rope_parameters.foo": lambda c: c["rope_parameters"].update(foo=1),
               "attention_dropout 0.1": lambda c: c.update(attention_dropout=0.1),
               "full_attention_interval 0": lambda c: (c.pop("layer_types"), c.update(full_attention_interval=0))}
    for i, (name, change) in enumerate(changes.items()):
        out = convert("from-hf", edited(silu, f"next_bad_{i}", change), "--workdir", root / f"next_bad_{i}_run")
        yield verdict(f"from-hf: Qwen3-Next config.json with {name}", out, expect_fail=True,
                      wrong=out.returncode == 0, good_before=set(), work=None)

    # Item 9 (a): a tied Qwen3_5ForConditionalGeneration as save_pretrained writes it.
    vl = with_remembering_gdn(randomize(transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION, tie_word_embeddings=True)), norm_center=0.0))
    out = convert("from-hf", save(vl, root / "vl_tied", root / "tokenizer.json"), "--workdir", root / "vl_tied_run")
    diff = float(np.abs(gattn_logits(root / "vl_tied_run") - hf_logits(vl)).max()) if out.returncode == 0 else None
    yield verdict("from-hf: tied Qwen3_5ForConditionalGeneration (outer true, text_config false)", out,
                  expect_fail=False, wrong=out.returncode == 0 and not diff < 1e-3, good_before=set(), work=None,
                  max_logit_difference=diff)

    # Item 9 (b, c): a folder as transformers saves a released one (262,144 positions, its own
    # mrope_section, an MTP layer declared, no mtp.* tensors), then back.
    text = {**TEXT, "max_position_embeddings": 262_144,
            "rope_parameters": {**TEXT["rope_parameters"], "mrope_section": [4, 2, 2]}}
    dense = randomize(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text)), norm_center=0.0)
    released = save(dense, root / "released", root / "tokenizer.json", {"mtp_num_hidden_layers": 1})
    out = convert("from-hf", released, "--workdir", root / "released_run")
    warned = [line for line in out.stderr.splitlines() if line.startswith("warning:") and "mtp.*" in line]
    yield verdict("from-hf: MTP layer declared, no mtp.* tensors", out, expect_fail=False,
                  wrong=out.returncode != 0 or len(warned) != 1, good_before=set(), work=None, warning=warned[:1])
    out = convert("to-hf", root / "released_run", "--out", root / "released_back")
    back = json.loads((root / "released_back" / "config.json").read_text()) if out.returncode == 0 else {}
    kept = (back.get("max_position_embeddings"), back.get("rope_parameters", {}).get("mrope_section"))
    yield verdict("to-hf: round trip of max_position_embeddings 262144 and mrope_section [4, 2, 2]", out,
                  expect_fail=False, wrong=kept != (262_144, [4, 2, 2]), good_before=set(), work=None,
                  written=list(kept))

    # Item 9 (e): a tokenizer.json the tokenizers library cannot load.
    broken = root / "broken_tokenizer"
    shutil.copytree(released, broken)
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    out = convert("from-hf", broken, "--workdir", root / "broken_tokenizer_run")
    yield verdict("from-hf: a tokenizer.json that does not load", out, expect_fail=True,
                  wrong=out.returncode == 0 or str(broken / "tokenizer.json") not in out.stderr, good_before=set(),
                  work=None)


def cache_cases(b):
    """Issue 57 item 8: a scanned hybrid's empty cache and its decoding copy no weights."""
    import jax  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415

    from gattn.config import (ExecConfig, GateSpec, LinearAttentionSpec, ModelConfig,  # noqa: PLC0415
                              hybrid_layer_types)
    from gattn.eval import decode  # noqa: PLC0415
    from gattn.model.transformer import Transformer, with_exec  # noqa: PLC0415

    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=8, q_heads=4, kv_heads=2, head_dim=8, d_ff=64,
                      gate=GateSpec(), layer_types=hybrid_layer_types(8),
                      linear_attention=LinearAttentionSpec(2, 4, 8, 8, 4))
    loop = Transformer(cfg, ExecConfig(gdn_chunk=4), rngs=nnx.Rngs(0))
    scanned = with_exec(loop, ExecConfig(gdn_chunk=4, scan_layers=True))
    jaxpr = jax.make_jaxpr(lambda: scanned.init_cache(2, 16))()
    made = sum(v.aval.size * v.aval.dtype.itemsize for e in jaxpr.eqns for v in e.outvars)
    shapes = jax.tree.leaves(jax.eval_shape(lambda: scanned.init_cache(2, 16)))
    cache = sum(a.size * a.dtype.itemsize for a in shapes)
    yield {"case": "init_cache of a scanned 8-layer hybrid (2 groups of 3 GDN + 1 attention)", "exit": 0,
           "expected_failure": False, "silent_wrong": bool(jaxpr.consts) or made > cache,
           "good_checkpoints_lost": [], "one_line": True, "error": None, "weights_read": len(jaxpr.consts),
           "bytes_made": made, "cache_bytes": cache}
    prompts = [[5, 17, 3, 40, 2, 9], [12, 1, 44]]
    states, step = [], decode._step
    decode._step = lambda graphdef, state, *a: states.append(state) or step(graphdef, state, *a)
    try:
        got = decode.generate(scanned, prompts, max_new_tokens=3, max_len=16)
    finally:
        decode._step = step
    stacked = any(p[:2] == ("blocks", "layers") for p, _ in nnx.to_flat_state(states[0]))
    want = decode.generate(loop, prompts, max_new_tokens=3, max_len=16)
    yield {"case": "generate on a scanned hybrid: the step reads per-layer weights, the loop's tokens", "exit": 0,
           "expected_failure": False, "silent_wrong": stacked or got != want,
           "good_checkpoints_lost": [], "one_line": True, "error": None, "step_slices_stacked_groups": stacked}


SLOW_CORPUS = """
import random, sys
from pathlib import Path
rng, folder = random.Random(0), Path(sys.argv[1])
folder.mkdir(parents=True, exist_ok=True)
for i in range(int(sys.argv[2])):  # random letters and spaces: many distinct words, a slow BPE
    (folder / f"{i}.txt").write_text("".join(rng.choices("abcdefghij     \\n", k=50_000)))
"""


def liveness_cases(b: Bench):
    """Issue 57 item 5: a live run keeps its lease, and process 0 of several stays alive, while
    gattn trains a SentencePiece tokenizer (which holds the GIL throughout) for longer than the
    stale window; a step of the wall clock stops no run."""
    corpus = b.root / "slow_corpus"
    subprocess.run([sys.executable, "-c", SLOW_CORPUS, str(corpus), "60"], check=True)  # ~8 s at 8000 pieces
    # One host: a second train.py, started while the first trains its tokenizer, with a 2 s stale window.
    work, env = b.root / "lease_tokenizer", {**os.environ, "GATTN_LOCK_STALE_SECONDS": "2"}
    args = [sys.executable, str(ROOT / "train.py"), "--config", str(b.config), "--workdir", str(work), "--quiet",
            "--steps", "2", f"--config.data.source={corpus}", "--config.model.vocab_size=8000"]
    first = subprocess.Popen(args, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while first.poll() is None and not (work / "lock.json").exists():
        time.sleep(0.1)
    time.sleep(3)  # into the tokenizer's training, past the stale window
    trained_before = any((work / "tokenizer").glob("*.model"))
    second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    still_training = not any((work / "tokenizer").glob("*.model"))
    out = subprocess.CompletedProcess(first.args, first.wait(timeout=600), *first.communicate())
    refused = second.returncode == 2 and f"pid {first.pid} has held it" in second.stderr
    yield verdict("train: a second train.py while the first trains its tokenizer past the stale window", out,
                  expect_fail=False, wrong=out.returncode != 0 or not refused, good_before=set(), work=work,
                  second_exit=second.returncode, second_error=second.stderr.strip().splitlines()[-1:],
                  second_started_during_training=not trained_before, refused_during_training=still_training)
    # Two processes: process 0 trains the tokenizer for longer than GATTN_PEER_SECONDS.
    port = launch.free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "programs" / "tokenizer_peer.py"), str(corpus),
                               str(b.root / "peer_spm.model")], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**launch.worker_env(i, 2, 1, port),
                                                           "GATTN_LOG_DIR": str(b.root / "peer_logs"),
                                                           "GATTN_PEER_SECONDS": "4"}) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    trained = next((line.split()[2] for line in outs[0][0].splitlines() if line.startswith("trained in ")), None)
    errors = [line for _, err in outs for line in err.splitlines() if "error" in line]
    yield {"case": "2 processes: process 0 trains its tokenizer past GATTN_PEER_SECONDS=4", "exit":
           max(p.returncode for p in procs), "expected_failure": False,
           "silent_wrong": False, "good_checkpoints_lost": [], "one_line": len(errors) <= len(procs),
           "error": errors[0][:200] if errors else None, "trained_s": trained}
    # The wall clock steps 100 s forward under a run that holds its lease.
    with lease.hold(b.root / "clock_step") as held:
        real = time.time
        try:
            time.time = lambda: real() + 100
            lease.check()
            held.renew()
            lease.check()
            lost = None
        except lease.LeaseLost as e:
            lost = str(e)
        finally:
            time.time = real
    yield {"case": "lease: the wall clock steps 100 s forward under a run that holds its lease",
           "exit": 0 if lost is None else 1, "expected_failure": False,
           "silent_wrong": False, "good_checkpoints_lost": [], "one_line": True, "error": lost}


def warnings_before(err: str, scenario: str) -> int:
    """The warning lines a host printed for `scenario` (after the previous scenario's end line)."""
    count = 0
    for line in err.splitlines():
        if line == f"end {scenario}":
            return count
        count = 0 if line.startswith("end ") else count + line.startswith("warning:")
    return -1


def good_of(work: Path) -> set[int]:
    return {6} if (work / "checkpoints" / "6").is_dir() else set()


GROUPS = {"round1": cases, "trust": trust_cases, "round3": round3_cases, "labels": label_cases,
          "convert": convert_cases, "cache": cache_cases, "liveness": liveness_cases}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default=",".join(GROUPS), help=f"groups of cases, of {', '.join(GROUPS)}")
    ap.add_argument("--keep", help="keep the runs in this folder (default: a temporary one, removed)")
    args = ap.parse_args(argv)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gattn-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results = []
    try:
        bench = Bench(root)
        for group in args.only.split(","):
            if group not in GROUPS:
                raise SystemExit(f"--only: {group!r} is not one of {', '.join(GROUPS)}")
            for result in GROUPS[group](bench):
                results.append(result)
                print(json.dumps(result), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    summary = {"cases": len(results), "silent_wrong_results": sum(r["silent_wrong"] for r in results),
               "good_checkpoints_lost": sum(len(r["good_checkpoints_lost"]) for r in results),
               "failures_not_one_line": sum(not r["one_line"] for r in results),
               "unexpected_exit": [r["case"] for r in results if (r["exit"] != 0) != r["expected_failure"]],
               "seconds": round(time.time() - t0)}
    print(json.dumps(summary))
    return 0 if not (summary["silent_wrong_results"] or summary["good_checkpoints_lost"]
                     or summary["failures_not_one_line"]) else 1


if __name__ == "__main__":
    sys.exit(main())
