"""What sealing a checkpoint costs a training run (issue 43, item 10): a loop of steps that saves
every K steps through checkpoint.Saves, run three ways on the same state and steps. A step
updates the state (jitted) and then waits --step-ms with the host idle, as a host does while its
accelerator runs the step (on this CPU machine a real step would keep both cores busy, and
nothing could run beside it):

- unsealed: Orbax's asynchronous save alone (the seal skipped);
- on the training thread: the seal as it ran before, in the step loop once the write finished;
- beside training: as gattn seals now, on a thread of its own, the files hashed HASH_THREADS at
  a time; the next save (or the end of the run) waits for it.

For each: the loop's wall time, the time the training thread spent in save and check calls
(blocked), and the overhead against unsealed. Also the hashing rate with 1 thread and with
HASH_THREADS. Prints one JSON object.

    python bench/seal.py [--mb 512] [--steps 36] [--every 6] [--step-ms 150] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from etils.epath import Path as EPath

from gattn.train import checkpoint
from gattn.train import seal as seal_files


class OnTrainingThread(checkpoint.Saves):
    """Saves as they sealed before: in check(), on the caller's thread, once the write finished."""

    sealed = True

    def check(self, wait: bool = False) -> None:
        if self.pending is None or (not wait and self.mngr.is_saving_in_progress()):
            return
        self.mngr.wait_until_finished()
        if self.sealed:
            checkpoint.seal(EPath(self.mngr.directory) / str(self.pending))
        self.good, self.pending = self.pending, None


class Unsealed(OnTrainingThread):
    """The same saves, never sealed: what an unsealed save costs."""

    sealed = False


def run(kind, saves_class, state, args, root: Path) -> dict:
    work = root / kind
    step_fn = jax.jit(lambda s: jax.tree.map(lambda a: a * 1.0000001, s))
    state = jax.block_until_ready(step_fn(state))  # compiled before the clock starts
    saves = saves_class(checkpoint.manager(EPath(work), 2, args.every), None)
    blocked, t0 = 0.0, time.perf_counter()
    for step in range(1, args.steps + 1):
        state = jax.block_until_ready(step_fn(state))
        time.sleep(args.step_ms / 1000)  # the accelerator's step: the host waits, its cores idle
        t = time.perf_counter()
        saves.check()
        if step % args.every == 0:
            saves.save(step, state, {}, {})
        blocked += time.perf_counter() - t
    t = time.perf_counter()
    saves.close()
    end = time.perf_counter()
    blocked += end - t
    shutil.rmtree(work, ignore_errors=True)
    return {"wall_s": round(end - t0, 3), "blocked_s": round(blocked, 3), "saves": args.steps // args.every}


def hash_rate(root: Path, mb: int) -> dict:
    files = [root / "hash" / f"f{i}" for i in range(8)]
    files[0].parent.mkdir(parents=True)
    for f in files:
        f.write_bytes(os.urandom(mb * (1 << 20) // 8))
    names = [f.name for f in files]
    out = {}
    for threads in sorted({1, seal_files.HASH_THREADS}):
        seal_files.HASH_THREADS = threads
        t = time.perf_counter()
        seal_files._digests(EPath(files[0].parent), names)  # noqa: SLF001 (what seal and verify call)
        out[f"GB_per_s_{threads}_threads"] = round(mb / 1024 / (time.perf_counter() - t), 2)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512, help="state size (float32 MB)")
    ap.add_argument("--steps", type=int, default=36)
    ap.add_argument("--every", type=int, default=6, help="save every K steps")
    ap.add_argument("--step-ms", type=float, default=150, help="the device step the host waits for")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    per = args.mb * (1 << 20) // 4 // 8
    keys = jax.random.split(jax.random.key(0), 8)  # random: Orbax's zstd would shrink constant arrays to nothing
    state = {f"w{i}": jax.random.normal(k, (per,), jnp.float32) for i, k in enumerate(keys)}
    threads = seal_files.HASH_THREADS
    root = Path(tempfile.mkdtemp(prefix="gattn-seal-"))
    try:
        out = {"state_mb": args.mb, "steps": args.steps, "save_every": args.every, "hash_threads": threads}
        kinds = (("unsealed", Unsealed), ("training_thread", OnTrainingThread), ("beside_training", checkpoint.Saves))
        run("warm-up", Unsealed, state, args, root)
        rows = {}
        for _ in range(args.repeats):  # interleaved, the best of each kept: the disk's speed drifts
            for kind, cls in kinds:
                row = run(kind, cls, state, args, root)
                if kind not in rows or row["wall_s"] < rows[kind]["wall_s"]:
                    rows[kind] = row
        base = rows["unsealed"]
        for kind, row in rows.items():
            row["overhead_s"] = round(row["wall_s"] - base["wall_s"], 3)
            row["blocked_per_save_s"] = round(row["blocked_s"] / row["saves"], 3)
        out.update(rows)
        out["hash"] = hash_rate(root, args.mb)
        seal_files.HASH_THREADS = threads
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
