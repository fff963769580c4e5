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
CPU cores (about 40 short runs of train.py / eval.py); `--only trust` runs issue 43's cases alone.
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


GROUPS = {"round1": cases, "trust": trust_cases}


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
