"""The processes of one run as a user meets them: they all join or the missing ones are named,
and any failure stops every process with one line that names the process at fault.

`cli.start_distributed` calls `join` before `jax.distributed.initialize` and `watch` after it;
`cli.run_cli` hands a multi-process error to `stop`. What each does:

- **Joining** (`join`). Process 0 listens on the coordinator's port + 1 (GATTN_JOIN_PORT), every
  other process reports there with its index. When all have come, JAX joins them. If one has
  not come after GATTN_JOIN_SECONDS (default 300, JAX's own initialisation timeout), every
  process that did come stops with `error (process N): process 3 did not join within 300 s`.
  Without this, JAX aborts after that time, saying only that "another task died".
- **Watching** (`Watch`). A thread in every process writes a beat to JAX's key-value store every
  BEAT seconds and reads the others' beats and errors:
  - a peer that published an error stops this process with `error (process N): process K
    failed: <its line>`;
  - a peer whose beat has not changed for GATTN_PEER_SECONDS (default 40) stops it with
    `process K stopped responding`.
  After a collective fails on this process (gloo's "connection closed by peer"), the watch
  names the silent peer within a few beats instead of the full timeout.
- **Stopping** (`stop`). A process's own error is published before it exits, so the others
  quote it. An error whose words are those a peer's failure causes here (PEER_ERROR: gloo's
  "connection closed", "unavailable", "barrier", ...) may still be this process's own (a GCS
  "503 Service Unavailable", a ValueError about a barrier), so the words only make it look for
  evidence, a few beats at most. Its line goes first under gattn/suspect/N, which the others
  quote only if this process then vanishes. A peer's error or a process named lost is quoted;
  a peer silent for 3 beats is named; once every other process has beaten since the error (all
  alive), the line is this process's own: it goes under gattn/error/N and the process stops
  with it, as with any other error.
  The process exits at once (`os._exit`), skipping JAX's shutdown barrier, which would
  otherwise wait for the dead and end in a C++ abort.
- **Logs.** Native (C++) messages of each process go to a log file, not to the terminal:
  gloo's connection lines, the coordination service's errors, an abort's stack trace. The file
  is WORKDIR/logs/process_N.log, or GATTN_LOG_DIR/process_N.log, or under the temp directory
  for a gs:// workdir. Python's own output (progress, the one-line errors) stays on the terminal.

JAX's heartbeat (GATTN_HEARTBEAT_SECONDS, default 100 s as in JAX) stays as the last resort: it
aborts a process only if the watch itself is stuck.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

BEAT = 2.0  # seconds between a watch's beats
PEER_ERROR = ("gloo", "connection closed", "connection reset", "broken pipe", "unavailable", "deadline_exceeded",
              "barrier", "heartbeat", "coordination")  # an error that a peer's failure causes here


def seconds_from_env(name: str, default: float) -> float:
    """A positive number of seconds from environment variable `name`; a bad value is a ConfigError."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        from gattn.config import ConfigError  # noqa: PLC0415

        raise ConfigError(name, raw, "a positive number of seconds")
    return value


def join_seconds() -> float:
    return seconds_from_env("GATTN_JOIN_SECONDS", 300)


def heartbeat_seconds() -> int:
    return max(1, int(seconds_from_env("GATTN_HEARTBEAT_SECONDS", 100)))


def peer_seconds() -> float:
    return seconds_from_env("GATTN_PEER_SECONDS", 40)


class JoinError(RuntimeError):
    """Not every process of the run joined it (cli.run_cli: one line, exit 1)."""


# --------------------------------------------------------------------------- logs

_terminal = None  # the real stderr (a file object) once native messages go to a log file
_log_path: Path | None = None


def log_path(workdir: str | None, process: int) -> Path:
    """Where process `process` writes its native log (see the module docstring)."""
    if os.environ.get("GATTN_LOG_DIR"):
        root = Path(os.environ["GATTN_LOG_DIR"])
    elif workdir and "://" not in str(workdir):
        root = Path(workdir) / "logs"
    else:
        name = str(workdir or "run").rstrip("/").rsplit("/", 1)[-1]
        root = Path(tempfile.gettempdir()) / "gattn-logs" / name
    return root / f"process_{process}.log"


def send_native_log_to(path: Path) -> None:
    """Points file descriptors 1 and 2 (what C++ writes to: gloo's "connected to peer ranks"
    lines go to 1, the coordination service's errors to 2) at `path`; Python's sys.stdout and
    sys.stderr keep the terminal."""
    global _terminal, _log_path
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    out_fd, terminal_fd = os.dup(1), os.dup(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(log_fd, f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: native messages of "
                     f"this process\n".encode())
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout = os.fdopen(out_fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    _terminal = os.fdopen(terminal_fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    sys.stderr = _terminal
    _log_path = path


# --------------------------------------------------------------------------- the supervisor

def term_with_parent(sig: int = signal.SIGTERM) -> None:
    """Signal `sig` to this process when its parent dies, however it dies (Linux's
    PR_SET_PDEATHSIG). A launcher's workers get SIGTERM: they save and exit instead of running on.
    A supervisor's child gets SIGKILL: a supervisor dies only when killed (SIGTERM and SIGINT it
    passes on), and killing the process a user started kills its work."""
    if sys.platform.startswith("linux"):
        import ctypes  # noqa: PLC0415

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # 1 = PR_SET_PDEATHSIG


def supervise(process: int, log: Path) -> None:
    """Splits this process in two before JAX starts: the child returns and does the work; the
    parent stays on the terminal, passes SIGTERM and SIGINT on to the child, and exits with its
    status. A child killed by a signal (JAX's coordination service aborts a process when it learns
    of a failure first) becomes one line, with the reason read from the child's native log."""
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        os.setpgid(0, 0)  # Ctrl-C on a terminal reaches the parent alone, which passes it on once
        term_with_parent(signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: os.kill(child, signum))
    _, status = os.waitpid(child, 0)
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    name = signal.Signals(os.WTERMSIG(status)).name
    print(f"error (process {process}): {native_reason(log) or 'stopped by ' + name}; this host's log: {log}",
          file=sys.stderr, flush=True)
    os._exit(1)


def native_reason(log: Path) -> str | None:
    """Why JAX's coordination service ended this process, from the end of its native log."""
    try:
        text = log.read_text(errors="replace")[-20_000:]
    except OSError:
        return None
    if "Terminating process because" not in text and "Check failure" not in text:
        return None
    if "stopped sending heartbeats" in text:
        after = text.rsplit("stopped sending heartbeats", 1)[1].splitlines()
        lost = [line.strip() for line in after[1:4] if line.strip().replace(",", "").isdigit()]
        if lost:
            return f"process {lost[0]} stopped responding (JAX's heartbeat timeout, GATTN_HEARTBEAT_SECONDS)"
    if "PollForError" in text or "Failed to send RPC to coordination service" in text:
        return "process 0 (the coordinator) is gone: it failed or was stopped, see its own output"
    fatal = [line for line in text.splitlines() if line.startswith("F") and "] " in line]
    return f"JAX stopped this process: {fatal[-1].split('] ', 1)[1][:300]}" if fatal else None


# --------------------------------------------------------------------------- joining

def join(coordinator: str, processes: int, process: int, timeout: float) -> None:
    """Every process reports to process 0 before JAX joins them; raises JoinError naming the
    processes that did not come within `timeout` seconds (or process 0, if it never answered)."""
    if processes == 1:
        return
    host, port = _join_address(coordinator)
    deadline = time.monotonic() + timeout
    if process == 0:
        _gather(port, processes, deadline, timeout)
    else:
        _report(host, port, process, deadline, timeout)


def _join_address(coordinator: str) -> tuple[str, int]:
    """(host, port) where process 0 takes the others' reports: the coordinator's port + 1, or
    GATTN_JOIN_PORT."""
    host, port = coordinator.rsplit(":", 1)
    return host.strip("[]"), int(os.environ.get("GATTN_JOIN_PORT", int(port) + 1))


def _listener(port: int, processes: int) -> socket.socket:
    """Process 0's socket on the join port."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("", port))
    server.listen(processes)
    return server


def _gather(port: int, processes: int, deadline: float, timeout: float) -> None:
    came: dict[int, socket.socket] = {}
    failed: tuple[int, str] | None = None
    with _listener(port, processes) as server:
        while len(came) < processes - 1 and time.monotonic() < deadline:
            server.settimeout(max(0.01, min(1.0, deadline - time.monotonic())))
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            conn.settimeout(10)
            try:
                line = conn.makefile().readline().strip()
                if line.startswith("fail "):  # a process that failed before joining: its own line
                    _, index, message = (line.split(" ", 2) + [""])[:3]
                    conn.close()
                    failed = (int(index), message)
                    break
                index = int(line)
            except (OSError, ValueError):
                conn.close()
                continue
            if index in came or not 0 < index < processes:
                conn.sendall(f"error two processes say they are process {index}\n".encode()
                             if index in came else f"error process index {index} is not below {processes}\n".encode())
                conn.close()
                continue
            came[index] = conn
        missing = sorted(set(range(1, processes)) - set(came))
        reply = ("ok" if not missing else "error " + _missing(missing, timeout)) if failed is None else \
            f"error process {failed[0]} failed before joining: {failed[1]}"
        for conn in came.values():
            try:
                conn.sendall(f"{reply}\n".encode())
            except OSError:
                pass
            conn.close()
    if failed is not None:
        raise JoinError(f"process {failed[0]} failed before joining: {failed[1]}")
    if missing:
        raise JoinError(_missing(missing, timeout))


def failed_before_joining(coordinator: str, processes: int, process: int, message: str,
                          seconds: float = 10.0) -> None:
    """This process failed before it joined (a usage error in its command, a bad config on its
    host): the others hear it within seconds, not after GATTN_JOIN_SECONDS. Process K > 0 sends
    its line to process 0, which stops quoting it; process 0 answers the others that come within
    `seconds` with it. Best effort: a process that cannot be told is named by the join's timeout."""
    if processes <= 1:
        return
    host, port = _join_address(coordinator)
    deadline = time.monotonic() + seconds
    line = " ".join(message.split())[:1000]
    if process > 0:
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((host, port), timeout=1) as conn:
                    conn.sendall(f"fail {process} {line}\n".encode())
                return
            except OSError:
                time.sleep(0.25)
        return
    try:
        with _listener(port, processes) as server:
            told: set = set()
            while time.monotonic() < deadline and len(told) < processes - 1:
                server.settimeout(max(0.01, min(0.5, deadline - time.monotonic())))
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                with conn:
                    conn.settimeout(2)
                    try:
                        told.add(conn.makefile().readline().strip())
                        conn.sendall(f"error process 0 failed before joining: {line}\n".encode())
                    except OSError:
                        pass
    except OSError:  # the port is taken: the others wait for the join's timeout
        pass


def _missing(missing: list[int], timeout: float) -> str:
    names = ", ".join(map(str, missing))
    return (f"process{'es' if len(missing) > 1 else ''} {names} did not join the run within {timeout:.0f} s "
            "(GATTN_JOIN_SECONDS): start it, or check its host and the coordinator address")


def _report(host: str, port: int, process: int, deadline: float, timeout: float) -> None:
    while True:
        try:
            with socket.create_connection((host, port), timeout=2) as conn:
                conn.sendall(f"{process}\n".encode())
                conn.settimeout(max(1.0, deadline - time.monotonic() + 30))
                reply = conn.makefile().readline().strip()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise JoinError(f"process 0 (the coordinator, {host}:{port}) did not answer within {timeout:.0f} s "
                                "(GATTN_JOIN_SECONDS): start it, or check the coordinator address") from None
            time.sleep(0.25)
    if reply != "ok":
        raise JoinError(reply.removeprefix("error ") or "process 0 stopped while the processes joined")


# --------------------------------------------------------------------------- watching

class Watch(threading.Thread):
    """Beats for this process and watches the others' beats and errors (module docstring)."""

    def __init__(self, client, process: int, processes: int, limit: float):
        super().__init__(name="gattn-watch", daemon=True)
        self.client, self.process, self.processes, self.limit = client, process, processes, limit
        self.stopped = threading.Event()
        self.suspicious = False  # a collective failed here: a silent peer is named after a few beats

    def peers(self, kind: str) -> dict[int, str]:
        """The values other processes wrote under gattn/KIND/, by process index."""
        return {int(key.rsplit("/", 1)[-1]): value for key, value in self.client.key_value_dir_get(f"gattn/{kind}/")}

    def heed(self, errors: dict[int, str], lost: dict[int, str], *, pause: float = 0.5) -> None:
        """Ends this process if another published its error (quoted) or a process was named lost."""
        for peer, message in sorted(errors.items()):
            if peer != self.process:
                time.sleep(pause)  # if this process fails at the same time (the same bad input), its own line wins
                leave(f"process {peer} failed: {message}", 1, lost=set(lost), log=False)
        for peer, message in sorted(lost.items()):  # another process named it first
            leave(message if peer != self.process else f"the others lost contact with this process: {message}",
                  1, lost=set(lost))

    def run(self) -> None:
        beat, start = 0, time.monotonic()
        last = {p: (None, start) for p in range(self.processes) if p != self.process}
        answered = start
        while not self.stopped.wait(0 if beat == 0 else BEAT):
            beat += 1
            now = time.monotonic()
            try:
                self.client.key_value_set(f"gattn/beat/{self.process}", str(beat), allow_overwrite=True)
                beats, errors, lost, done = (self.peers(kind) for kind in ("beat", "error", "lost", "done"))
                answered = now
            except Exception as e:  # noqa: BLE001 (the store lives in process 0)
                if now - answered > (3 * BEAT if self.suspicious else self.limit):
                    _exit(f"process 0 (the coordinator) stopped answering: {str(e).splitlines()[0][:200]}", 1)
                continue
            if self.stopped.is_set():
                return
            self.heed(errors, lost)
            limit = 3 * BEAT + 1 if self.suspicious else self.limit
            for peer, (value, since) in sorted(last.items()):
                if peer in done:
                    continue
                if beats.get(peer) != value:
                    last[peer] = (beats.get(peer), now)
                elif now - since > limit:
                    message = f"process {peer} stopped responding (no sign of life for {now - since:.0f} s)"
                    try:
                        if suspect := self.peers("suspect").get(peer):  # its line while it looked for a cause
                            message += f"; its last error: {suspect}"
                        self.client.key_value_set(f"gattn/lost/{peer}", message, allow_overwrite=True)
                    except Exception:  # noqa: BLE001
                        pass
                    leave(message, 1, lost={*lost, peer})


_watch: Watch | None = None
_leaving = threading.Lock()  # held by the one thread that ends this process
_process: int | None = None


def watch(client, process: int, processes: int) -> None:
    """Starts this process's Watch (after `jax.distributed.initialize`)."""
    global _watch, _process
    _process = process
    _watch = Watch(client, process, processes, peer_seconds())
    _watch.start()


def active() -> bool:
    return _watch is not None


def finished() -> None:
    """This process ends normally: the others stop watching it. Returns once the watch thread
    has left its last call into the coordination client: a daemon thread still inside that C++
    call when the interpreter (and JAX's atexit shutdown of the client) ends it aborts the whole
    process ("FATAL: exception not rethrown", SIGABRT) after a run that succeeded."""
    if _watch is not None:
        _watch.stopped.set()
        try:
            _watch.client.key_value_set(f"gattn/done/{_process}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001
            pass
        if _watch is not threading.current_thread():
            _watch.join(timeout=2 * BEAT + 10)  # one call in flight at most; the store answers or fails


def stop(error: BaseException, message: str, code: int) -> None:
    """Ends this process after `error` (one line `message`, exit `code`); never returns.

    The line is published first, so the others can quote it. An error in the words of a peer's
    failure (PEER_ERROR) is published as a suspect, not an error: if a peer's death caused it,
    the others should name that peer, not quote this line. Evidence decides (`_look_for_cause`,
    a few beats at most): a peer's error or a lost process is quoted, a silent peer is named by
    the watch; if every other process is alive, the line is this process's own after all and is
    published as its error, which the others quote."""
    if any(word in str(error).lower() for word in PEER_ERROR):
        _publish("suspect", message)  # quoted by the others only if this process vanishes now
        _watch.suspicious = True  # the watch names a peer silent for 3 beats, and ends this process
        _look_for_cause(_watch, 5 * BEAT + 3)
    _watch.stopped.set()
    _publish("error", message)
    leave(message, code, log=False)


def _look_for_cause(watch: Watch, timeout: float) -> None:
    """Returns once every other process still running has beaten since this call began (they are
    alive: the error is this process's own), or after `timeout` seconds without evidence either
    way (the store unreachable). Ends this process quoting a peer's error or a lost process."""
    deadline, before = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            beats, errors, lost, done = (watch.peers(kind) for kind in ("beat", "error", "lost", "done"))
        except Exception:  # noqa: BLE001 (gone with process 0: the watch or JAX ends this process)
            time.sleep(BEAT / 8)
            continue
        watch.heed(errors, lost, pause=0)
        if before is None:
            before = beats  # read after the error: a beat that differs was written after it
        elif all(beats.get(p) != before.get(p) for p in range(watch.processes) if p != watch.process and p not in done):
            return
        time.sleep(BEAT / 8)


def _publish(kind: str, message: str) -> None:
    """Writes this process's line under gattn/KIND/N for the others."""
    try:
        _watch.client.key_value_set(f"gattn/{kind}/{_process}", message, allow_overwrite=True)
    except Exception:  # noqa: BLE001 (the store may be gone with process 0)
        pass


def leave(message: str, code: int, *, lost=frozenset(), log: bool = True) -> None:
    """This process's one error line, then its exit. The others (but the `lost`) are told first:
    process 0 holds JAX's coordination service, and the others' JAX aborts them when it goes, so
    it waits (a few beats at most) until each has given its own line and left."""
    if not _leaving.acquire(blocking=False):  # another thread of this process is already leaving
        threading.Event().wait()
    where = f"; this host's log: {_log_path}" if _log_path and log else ""
    print(f"error (process {_process}): {message}{where}", file=sys.stderr, flush=True)
    if _watch is not None:
        _watch.stopped.set()
        try:
            _watch.client.key_value_set(f"gattn/seen/{_process}", "1", allow_overwrite=True)
            if _process == 0:
                others = set(range(1, _watch.processes)) - set(lost)
                deadline = time.monotonic() + 3 * BEAT + 2
                while time.monotonic() < deadline and not others <= {
                        *_watch.peers("seen"), *_watch.peers("error"), *_watch.peers("done")}:
                    time.sleep(0.2)
                time.sleep(0.5)  # their exits, after their acknowledgements
        except Exception:  # noqa: BLE001 (the store is gone with process 0)
            pass
    _exit(None, code)


def _exit(message: str | None, code: int, *, log: bool = True) -> None:
    """Prints `message` as this process's one error line (with where its native log is, if `log`)
    and ends the process at once with `code`."""
    if message is not None:
        where = f"; this host's log: {_log_path}" if _log_path and log else ""
        print(f"error (process {_process}): {message}{where}", file=sys.stderr, flush=True)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
