"""Checkpoint faults on several processes, for tests/test_faults.py: the processes save steps 1
and 2 of a state sharded over all of them (checkpoint.Saves: each seals its own files), then for
each scenario work on a copy of that run, spoil step 2 as the scenario says, and restore with
checkpoint.first_readable. Each process prints `result SCENARIO STEP` (the step restored, or
`failed` and CheckpointFailure's line); warnings go to stderr.

Scenarios (all spoil step 2, on process 1's side):
- flip: a changed byte in a file that process 1 wrote and verifies (its share of the sealed files);
- unseal: process 1's seal is missing (it stopped between the end of the save and its seal);
- read_error: process 1's read fails with a data error, past the seal (its own shards);
- transient: process 1's first read fails with an HTTP 503, then the store answers again;
- unavailable: every read of process 1 fails with an HTTP 503.

    python tests/programs/checkpoint_hosts.py --workdir DIR   (JAX_* variables as gattn.launch sets them)
"""

import argparse
import shutil
import sys

from gattn import cli

SCENARIOS = ("flip", "unseal", "read_error", "transient", "unavailable")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args(argv)
    cli.start_distributed(args)
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from etils.epath import Path  # noqa: PLC0415
    from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415
    from orbax.checkpoint._src.checkpointers import checkpointer  # noqa: PLC0415

    from gattn.train import checkpoint, hosts  # noqa: PLC0415

    checkpoint.RETRY_SECONDS = 0.05
    mesh = jax.make_mesh((jax.device_count(),), ("data",), devices=jax.devices())
    sharded = NamedSharding(mesh, P("data"))
    base = Path(args.workdir) / "base"

    def state(step):
        w = jax.make_array_from_callback((8 * jax.device_count(), 64), sharded,
                                         lambda i: np.full((8, 64), float(step), np.float32) + np.arange(64.0))
        return {"step": jax.device_put(jnp.asarray(step), NamedSharding(mesh, P())), "params": {"w": w}}

    mngr = checkpoint.manager(base, 3, 1)
    saves = checkpoint.Saves(mngr, None)
    for step in (1, 2):
        saves.save(step, state(step), {"k": step}, {"m": step})
    saves.close()
    hosts.barrier("saved")

    target = checkpoint.abstract(state(0))
    real_restore = checkpointer.Checkpointer._restore
    for scenario in SCENARIOS:
        work = Path(args.workdir) / scenario
        two = work / "checkpoints" / "2"
        if hosts.primary():
            shutil.copytree(base, work)
            if scenario == "flip":
                share = sorted(checkpoint.sealed(two))[1::jax.process_count()]  # what process 1 verifies
                # process 1's own OCDBT files (its shards' data and index, which process 0 never reads) are
                # the last two in sorted order, so one of them is in its share
                victim = next(name for name in share if name.startswith("state/ocdbt.process_1/"))
                data = bytearray((two / victim).read_bytes())
                data[len(data) // 2] ^= 0xFF
                (two / victim).write_bytes(bytes(data))
            if scenario == "unseal":
                (two / checkpoint.CHECKSUMS / "process_1.json").unlink()
        hosts.barrier(f"spoiled {scenario}")
        tries = []

        def failing_restore(self, directory, *a, scenario=scenario, tries=tries, **kw):
            if jax.process_index() == 1 and Path(directory).name == "2":
                tries.append(1)
                if scenario == "read_error":
                    raise ValueError("DATA_LOSS: Error reading 'state/ocdbt.process_1/d/0': checksum mismatch")
                if scenario == "unavailable" or (scenario == "transient" and len(tries) == 1):
                    raise OSError("503 Service Unavailable: GET storage.googleapis.com")
            return real_restore(self, directory, *a, **kw)

        checkpointer.Checkpointer._restore = failing_restore
        mngr = checkpoint.manager(work, 3, 1)
        try:
            found = checkpoint.first_readable(mngr, lambda s: checkpoint.restore(mngr, target, s))
            print(f"result {scenario} {found[0]}", flush=True)
            restored = np.asarray(jax.experimental.multihost_utils.process_allgather(found[1][0]["params"]["w"],
                                                                                      tiled=True))
            assert np.array_equal(restored, np.asarray(
                jax.experimental.multihost_utils.process_allgather(state(found[0])["params"]["w"], tiled=True)))
        except checkpoint.CheckpointFailure as e:
            print(f"result {scenario} failed {e}", flush=True)
        finally:
            checkpointer.Checkpointer._restore = real_restore
            mngr.close()
        print(f"end {scenario}", file=sys.stderr, flush=True)
    hosts.barrier("done")
    from gattn import cluster  # noqa: PLC0415
    cluster.finished()


if __name__ == "__main__":
    main()
