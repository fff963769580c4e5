"""A local multi-process cluster for development and tests: the processes of a pod slice, on one
machine, with CPU devices and gloo collectives.

    python -m gattn.launch --processes 2 --local-devices 4 train.py --config tiny --workdir DIR
    python -m gattn.launch --processes 2 --local-devices 4 -m gattn.lm_eval ...

Each worker is `python SCRIPT ARGS...` with JAX_COORDINATOR_ADDRESS (a free port on 127.0.0.1),
JAX_NUM_PROCESSES, JAX_PROCESS_ID, JAX_PLATFORMS=cpu and
XLA_FLAGS=--xla_force_host_platform_device_count=M; gattn's entry points read them and call
`jax.distributed.initialize` (gattn.cli.start_distributed). Each output line is prefixed by its
worker's index; each worker's native (C++) log goes to WORKDIR/logs/process_N.log. When a worker
fails, the others stop by themselves with one line naming it (gattn.cluster); any still running
after --grace seconds are killed. The launcher exits with the status of the worker that failed
first: the first to print an `error (process N): ...` line or to die (a signal N as 128 + N, as a
shell reports it). SIGTERM or SIGINT to the launcher is passed on to every worker (they save a
checkpoint and exit 0); workers still running --stop-grace seconds later (300) are killed, and a
second SIGTERM or SIGINT kills them at once; a launcher that dies takes its workers with it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from gattn import cluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(index: int, processes: int, local_devices: int, port: int) -> dict:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    return {**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(processes),
            "JAX_PROCESS_ID": str(index), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
            "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={local_devices}"])}


def _pump(index: int, stream, out, failures: list) -> None:
    for line in iter(stream.readline, b""):
        if line.startswith(b"error (process "):
            failures.append(index)  # the first worker to report an error is the first to fail
        out.buffer.write(f"[{index}] ".encode() + line)
        out.flush()


def exit_status(returncode: int) -> int:
    """A worker's status as a shell reports it: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def launch(command: list[str], processes: int, local_devices: int, *, grace: float = 90.0,
           stop_grace: float = 300.0) -> int:
    """Runs `python COMMAND` as `processes` workers; their first non-zero status, else 0. After
    SIGTERM or SIGINT (passed on: the workers save and exit), workers still running `stop_grace`
    seconds later are killed, and so are all at a second signal."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *command], env=worker_env(i, processes, local_devices, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                              preexec_fn=cluster.term_with_parent)
             for i in range(processes)]
    failures: list[int] = []  # workers in the order they failed: by an error line or by dying
    pumps = [threading.Thread(target=_pump, args=(i, p.stdout, sys.stdout, failures), daemon=True)
             for i, p in enumerate(procs)]
    for t in pumps:
        t.start()

    signalled: list[float] = []  # when SIGTERM or SIGINT reached the launcher

    def forward(signum, frame):
        if signalled:  # a second one: stop at once
            print(f"[launch] {signal.Signals(signum).name} again: killing the workers", file=sys.stderr, flush=True)
            _kill(procs)
            return
        signalled.append(time.monotonic())
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    stopping = False
    try:
        while any(p.poll() is None for p in procs):
            if signalled and time.monotonic() - signalled[0] > stop_grace:  # a worker that cannot stop
                print(f"[launch] workers still running {stop_grace:.0f} s after the signal: killing them",
                      file=sys.stderr, flush=True)
                _kill(procs)
                signalled[0] = float("inf")
            failures.extend(i for i, p in enumerate(procs) if p.poll() not in (None, 0) and i not in failures)
            if failures and not stopping:
                stopping = True
                first = failures[0]
                code = procs[first].poll()
                print(f"[launch] worker {first} " + ("failed" if code is None else f"exited with {code}") +
                      "; the others stop", file=sys.stderr, flush=True)
                _stop(procs, grace)
            time.sleep(0.05)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    for t in pumps:
        t.join(timeout=5)
    failures.extend(i for i, p in enumerate(procs) if p.returncode and i not in failures)
    failed = [i for i in failures if procs[i].returncode]
    if not failed:
        return 0
    status = exit_status(procs[failed[0]].returncode)
    print(f"[launch] exit {status}: worker {failed[0]} failed first", file=sys.stderr, flush=True)
    return status


def _stop(procs, grace: float) -> None:
    """Waits `grace` seconds for the others to notice the failure and exit, then kills them. (Not
    SIGTERM: that asks for a checkpoint, which the remaining processes cannot write together.)"""
    deadline = time.time() + grace
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    _kill(procs)


def _kill(procs) -> None:
    """SIGKILL to the workers still running (each supervisor's child follows it: PR_SET_PDEATHSIG)."""
    for p in procs:
        if p.poll() is None:
            p.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--processes", type=int, required=True, help="number of worker processes (hosts)")
    ap.add_argument("--local-devices", type=int, default=1, help="CPU devices per worker")
    ap.add_argument("--grace", type=float, default=90.0, help="seconds the others get to exit by themselves "
                    "after a worker failed, before they are killed")
    ap.add_argument("--stop-grace", type=float, default=300.0, help="seconds the workers get to save and exit "
                    "after SIGTERM or Ctrl-C, before they are killed (a second signal kills them at once)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...] or -m MODULE [ARGS...]")
    argv = list(sys.argv[1:] if argv is None else argv)
    # The command starts at the first argument that is not the launcher's (argparse's REMAINDER
    # does not take one that starts with "-", such as -m MODULE).
    i = 0
    flags = ("--processes", "--local-devices", "--grace", "--stop-grace", "-h", "--help")
    while i < len(argv) and argv[i].split("=")[0] in flags:
        i += 1 if "=" in argv[i] or argv[i] in ("-h", "--help") else 2
    args = ap.parse_args(argv[:i])
    args.command = argv[i:]
    if args.processes < 1 or args.local_devices < 1:
        ap.error("--processes and --local-devices must be positive")
    if not args.command:
        ap.error("give the script to run, e.g. train.py --config tiny --workdir DIR")
    return launch(args.command, args.processes, args.local_devices, grace=args.grace, stop_grace=args.stop_grace)


if __name__ == "__main__":
    raise SystemExit(main())
