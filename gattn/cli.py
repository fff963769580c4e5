"""The command-line layer: config files and presets, `--config.FIELD=VALUE` overrides, argparse
glue, one-line errors, and the process settings entry points need before JAX starts.

    load("configs/tiny.py", ["model.num_layers=4"], variant="sdpa_elementwise")  -> Config
    load("tiny")                 a preset by name (shipped in gattn/configs, works from any install)
    run_entry_point(main)        ConfigError -> "error: ..." on stderr and exit 2

The schema itself (the dataclasses and their checks) is `gattn.config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import traceback
import types
import typing
from pathlib import Path
from typing import Any

from gattn import variants
from gattn.config import MOVED_TO_EXEC, Config, ConfigError, from_dict

PRESETS = Path(__file__).parent / "configs"


# --------------------------------------------------------------------------- overrides

def _coerce(path: str, text: str, hint: Any) -> Any:
    """Turns the text of a command-line override into the field's declared type."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if text.lower() in ("none", "null"):
            return None
        return _coerce(path, text, args[0])
    if hint is bool:
        low = text.lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise ConfigError(path, text, "expected true or false")
    if hint in (int, float):
        try:
            number = float(text)
            return int(number) if hint is int and number.is_integer() else hint(text)
        except ValueError:
            raise ConfigError(path, text, f"expected {'an integer' if hint is int else 'a number'}") from None
    if origin is tuple:  # a comma-separated list; NAME*K repeats an item K times
        items = []
        for item in (t.strip().strip("'\"") for t in text.strip("()[] ").split(",") if t.strip()):
            name, star, times = item.rpartition("*") if "*" in item else (item, "", "1")
            if not times.isdigit() or not name:
                raise ConfigError(path, text, "a comma-separated list, each item VALUE or VALUE*COUNT "
                                  "(e.g. linear_attention*3,full_attention)")
            items += [_coerce(path, name.strip(), typing.get_args(hint)[0])] * int(times)
        return tuple(items)
    if dataclasses.is_dataclass(hint):
        if text.lower() == "default":
            return hint()
        raise ConfigError(path, text, f"set its fields ({path}.FIELD=VALUE) or 'default'")
    return text


def _build(cfg: Any, tree: dict, prefix: str, replace: dict | None = None) -> Any:
    """Returns `cfg` with every override in `tree` ({field: text or subtree}) applied at once, so
    that cross-field checks see the final values whatever the order on the command line. `cfg` may
    be a dataclass type: an absent sub-config is created from its defaults and the given fields.
    `replace` ({field: value}) swaps whole fields in the same construction (a variant's model),
    the overrides of those fields applying on top of the new values."""
    cls = cfg if isinstance(cfg, type) else type(cfg)
    fields = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    changes = dict(replace or {})
    for name, value in tree.items():
        path = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            raise ConfigError(path, value if isinstance(value, str) else None,
                              f"unknown field; {cls.__name__} has {', '.join(sorted(fields))}")
        if isinstance(value, str):
            changes[name] = _coerce(path, value, hints[name])
            continue
        child = changes[name] if name in changes else None if isinstance(cfg, type) else getattr(cfg, name)
        if child is None:  # a field of an absent sub-config: built from its defaults and these fields
            child = next((a for a in (hints[name], *typing.get_args(hints[name]))
                          if dataclasses.is_dataclass(a)), None)
        if not dataclasses.is_dataclass(child):
            raise ConfigError(path, None, f"{path} is a value, not a nested config")
        changes[name] = _build(child, value, path)
    try:
        return cls(**changes) if isinstance(cfg, type) else dataclasses.replace(cfg, **changes)
    except ConfigError as e:
        raise e.under(prefix) from None


def apply_overrides(cfg: Any, overrides: list[str], replace: dict | None = None) -> Any:
    """Applies overrides like `model.num_layers=2` (a leading `--config.` is accepted too), with
    the whole fields in `replace` swapped in the same construction (see `_build`)."""
    tree: dict = {}
    seen: dict[str, str] = {}
    for item in overrides:
        item = item.removeprefix("--").removeprefix("config.")
        if "=" not in item:
            raise ConfigError(item, None, "expected FIELD=VALUE, e.g. --config.model.num_layers=2")
        path, _, text = item.partition("=")
        path = canonical(path.strip())
        if path in seen:
            raise ConfigError(path, text.strip(), f"given twice (first as {seen[path]!r}); give each field once")
        seen[path] = text.strip()
        *parents, leaf = path.split(".")
        node = tree
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if isinstance(node, str):
                raise ConfigError(".".join(parents[:i + 1]), node, "set either the value or its fields, not both")
        if isinstance(node.get(leaf), dict):
            raise ConfigError(path, text.strip(), "set either the value or its fields, not both")
        node[leaf] = text.strip()
    return _build(cfg, tree, "", replace)


def canonical(path: str) -> str:
    """`model.remat` and the other execution fields that moved to `exec` (see MOVED_TO_EXEC)."""
    head, _, leaf = path.partition(".")
    return f"exec.{leaf}" if head == "model" and leaf in MOVED_TO_EXEC else path


def override_path(override: str) -> str:
    """The field an override names, canonical: "--config.model.remat=full" -> "exec.remat"."""
    return canonical(override.removeprefix("--").removeprefix("config.").partition("=")[0].strip())


# --------------------------------------------------------------------------- config files


def call_file(path: Path, function: str, field: str, returns: str) -> Any:
    """`function()` of the Python file `path` (a config or study file); errors name `field`, and
    an error raised by the file itself names its file:line (--debug shows the traceback)."""
    spec = importlib.util.spec_from_file_location(f"gattn_{function}_{path.stem}", path)
    if spec is None:  # (a name Python does not import: config.yaml, a file without .py)
        raise ConfigError(field, str(path), f"a Python file (.py) that defines {function}() -> {returns}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, function):
            raise ConfigError(field, str(path), f"the file must define {function}() -> {returns}")
        return getattr(module, function)()
    except ConfigError:
        raise
    except SyntaxError as e:  # (--debug shows the original under the traceback of this one)
        raise ConfigError(field, f"{e.filename}:{e.lineno}", f"a Python syntax error: {e.msg}") from e
    except Exception as e:  # noqa: BLE001 (whatever the user's file raises becomes one line)
        frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
        line = f"{path}:{frames[-1].lineno}" if frames else str(path)
        raise ConfigError(field, line, f"the file raised {type(e).__name__}: {e}") from e


def presets(kind: str = "") -> list[str]:
    """The names of the presets shipped with gattn (`kind` "study": the study presets)."""
    return sorted(p.stem for p in (PRESETS / kind).glob("*.py") if not p.stem.startswith("_"))


def resolve(path: str | Path, field: str = "--config", kind: str = "") -> Path:
    """A config (or study) file: `path` itself, or a preset shipped in gattn/configs by name
    ("tiny", "configs/tiny.py" from any directory)."""
    path = Path(path)
    if path.is_file():
        return path
    preset = PRESETS / kind / f"{path.stem}.py"
    if path.suffix in ("", ".py") and preset.is_file() and path.parent.name in ("", "configs", kind):
        return preset
    names = ", ".join(presets(kind))
    raise ConfigError(field, str(path), f"expected a Python config file or a preset ({names})"
                      + ("" if kind else ", or a run's config.json"))


def load(path: str | Path, overrides: list[str] = (), variant: str | None = None) -> Config:
    """Loads `get_config()` from a Python config file or preset (or a run's config.json, e.g. a
    model converted from Hugging Face, to continue training it), applies a variant, then the
    overrides."""
    path = resolve(path)
    if path.suffix not in (".py", ".json"):
        raise ConfigError("--config", str(path), "a Python config file (.py), a preset by name "
                          f"({', '.join(presets(''))}), or a run's config.json")
    if path.suffix == ".json":
        try:
            cfg = from_dict(Config, json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError("--config", f"{path}:{e.lineno}", f"valid JSON (a run's config.json): {e.msg}") from None
    else:
        cfg = call_file(path, "get_config", "--config", "Config")
        if not isinstance(cfg, Config):
            raise ConfigError("--config", str(path), f"get_config() must return a gattn.config.Config; "
                              f"it returned {type(cfg).__name__}")
    # `--config.variant=NAME` is the same as `--variant NAME`: the variant is applied, not relabelled.
    named = [o for o in overrides if o.removeprefix("--").removeprefix("config.").startswith("variant=")]
    overrides = [o for o in overrides if o not in named]
    values = {o.partition("=")[2].strip() for o in named} | ({variant} if variant is not None else set())
    if len(values) > 1:
        raise ConfigError("--config.variant", named[-1].partition("=")[2].strip(),
                          f"the same variant as --variant {variant!r} (given both, with different names): name "
                          "the variant once" if variant is not None else "one variant (given twice with different "
                          "names): name the variant once")
    variant = named[-1].partition("=")[2].strip() if named else variant
    # The variant is built on the config's baseline (its model without the variant fields, see
    # variants.baseline_of: hybrid_tiny's gated model gives a gateless --variant baseline), and
    # every override in the same construction: the cross-field checks see the final config (a
    # variant's model with an execution override it needs, an MTP loss weight with the
    # model.mtp_layers set beside it), whatever the order.
    check_variant(cfg)
    recorded = cfg.variant
    base = variants.baseline_of(cfg.model, recorded)
    replace = None
    if variant is not None:
        if base is None and variant != recorded:
            raise ConfigError("variant", variant, f"a variant of a baseline config; this config's model is "
                              f"{recorded}, which scales its baseline's heads or experts, so that baseline is not "
                              "known: start from the config file the run was made from")
        replace = {"model": cfg.model if base is None else variants.apply(variant, base)}
    cfg = apply_overrides(cfg, list(overrides), replace)
    # The label names the final model: an override that changes what the variant is (a gate on
    # the baseline, another gate position) is part of it (variants.label).
    return dataclasses.replace(cfg, variant=variants.label(variant or recorded.partition("+")[0], cfg.model, base))


def check_variant(cfg: Config) -> None:
    """The recorded variant is a registered one (or one changed field by field: `variants.label`)."""
    if cfg.variant.partition("+")[0] not in variants.REGISTRY:
        raise ConfigError("variant", cfg.variant, f"expected one of {', '.join(map(repr, variants.REGISTRY))}")


# --------------------------------------------------------------------------- argparse glue


def parse_args(parser, argv=None, *, steps_set_train_steps: bool = False):
    """(args, overrides): the parser's own arguments and the `--config.FIELD=VALUE` overrides;
    anything else is an error. With `steps_set_train_steps`, `--steps N` becomes train.steps=N."""
    if "--debug" not in parser._option_string_actions:  # (run_cli takes it out of argv; listed for --help)
        parser.add_argument("--debug", action="store_true", help="show the traceback of an error "
                            "(or GATTN_DEBUG=1); errors are one line otherwise")
    args, rest = parser.parse_known_args(argv)
    rest, overrides = split_argv(rest)
    if rest:
        parser.error(f"unrecognised arguments: {' '.join(rest)}")
    if steps_set_train_steps and args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    return args, overrides


class HelpWithDefaults(argparse.RawTextHelpFormatter):
    """--help that keeps the description's line breaks and shows each option's default, where it
    has one (not for flags, and not for None: such options say in their help what they default to)."""

    def _get_help_string(self, action):
        text = action.help or ""
        # (by identity: 0, 0.0 and 1.0 compare equal to False and True, and are real defaults)
        if "%(default)" in text or any(action.default is v for v in (None, False, True, argparse.SUPPRESS)) \
                or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separates `--config.FIELD=VALUE` overrides from the other command-line arguments."""
    overrides = [a for a in argv if a.startswith("--config.")]
    return [a for a in argv if not a.startswith("--config.")], overrides


class Failure(RuntimeError):
    """A runtime failure a user meets (a diverged run, no readable checkpoint, a failed save): the
    entry points print its message as one line and exit 1. Usage errors are ConfigErrors (exit 2)."""


def debugging() -> bool:
    """Whether errors show their traceback: `--debug` on any entry point, or GATTN_DEBUG=1."""
    return os.environ.get("GATTN_DEBUG", "") not in ("", "0")


def run_cli(main, argv=None) -> int:
    """Runs an entry point's `main`: a ConfigError (usage) is one line on stderr and exit 2; a
    Failure or any other error one line and exit 1. `--debug` (taken out of argv here; it sets
    GATTN_DEBUG=1 for child processes too) or GATTN_DEBUG=1 prints the traceback as well."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:
        argv = [a for a in argv if a != "--debug"]
        os.environ["GATTN_DEBUG"] = "1"
    try:
        status = main(argv) or 0
    except SystemExit as e:  # argparse's usage error (its lines printed): before the join, tell the others
        if e.code not in (0, None) and (joining := _joining(argv)) is not None:
            from gattn import cluster  # noqa: PLC0415

            cluster.failed_before_joining(*joining, f"its command was refused (exit {e.code}): see its output")
        raise
    except KeyboardInterrupt:  # Ctrl-C before training began (or a second one): no traceback
        if debugging():
            traceback.print_exc()
        print(f"error{where()}: interrupted (Ctrl-C); stopped at once, the checkpoints are as they were (during "
              "training, one Ctrl-C saves the current step first and exits 0)", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (the one place where errors become one line)
        if debugging():
            traceback.print_exc()
        from gattn import cluster  # noqa: PLC0415

        message = str(e) if isinstance(e, (ConfigError, Failure, cluster.JoinError)) else one_line(e)
        code = 2 if isinstance(e, ConfigError) else 1

        if cluster.active():  # several processes: the others are told, this one exits at once
            cluster.stop(e, message, code)
        elif not isinstance(e, cluster.JoinError) and (joining := _joining(argv)) is not None:
            # before the join: the others hear it now, not after GATTN_JOIN_SECONDS
            print(f"error{where()}: {message}", file=sys.stderr, flush=True)
            cluster.failed_before_joining(*joining, message)
            return code
        print(f"error{where()}: {message}", file=sys.stderr)
        return code
    from gattn import cluster  # noqa: PLC0415

    cluster.finished()
    return status


def first_line(e: BaseException) -> str:
    """The first non-blank line of an error's message ("" if it has none)."""
    return next((line for line in str(e).splitlines() if line.strip()), "")


def one_line(e: BaseException) -> str:
    """An unexpected error as one line: its type, its message's first line, where to see more."""
    text = first_line(e)
    hint = "" if debugging() else " (rerun with --debug or GATTN_DEBUG=1 for the traceback)"
    return f"{type(e).__name__}: {text[:300]}{hint}"


# --------------------------------------------------------------------------- several processes

_process: int | None = None


def add_distributed_flags(parser) -> None:
    g = parser.add_argument_group("several processes (a pod slice; see docs/pod-slice.md)")
    g.add_argument("--distributed", action="store_true", help="join the other hosts of a Cloud TPU slice "
                   "(JAX finds them itself from the TPU metadata)")
    g.add_argument("--coordinator", help="HOST:PORT of process 0 (CPU/GPU clusters; or JAX_COORDINATOR_ADDRESS)")
    g.add_argument("--num-processes", type=int, help="processes in the run (or JAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, help="this process's index (or JAX_PROCESS_ID)")


def start_distributed(args=None) -> None:
    """Joins the run's processes when the flags of `add_distributed_flags` or the environment
    (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, as `python -m gattn.launch` sets
    them) ask for it; one process otherwise. Every process first reports to process 0 (a process
    that never comes is named), then `jax.distributed.initialize` joins them, then a watch names
    any process that fails or dies (gattn.cluster). CPU devices exchange data through gloo."""
    global _process
    get = lambda name, env: getattr(args, name, None) if getattr(args, name, None) is not None \
        else os.environ.get(env)  # noqa: E731
    coordinator, num, pid = (get("coordinator", "JAX_COORDINATOR_ADDRESS"),
                             get("num_processes", "JAX_NUM_PROCESSES"), get("process_id", "JAX_PROCESS_ID"))
    auto = getattr(args, "distributed", False)
    if not coordinator and not auto:
        return
    host, _, port = str(coordinator or "").rpartition(":")
    if coordinator and not (host and port.isdigit() and 0 < int(port) < 65536):  # (before: jax's IndexError)
        raise ConfigError("--coordinator", coordinator, "HOST:PORT of process 0, e.g. 10.0.0.2:1234 "
                          "(or JAX_COORDINATOR_ADDRESS)")
    from gattn import cluster  # noqa: PLC0415

    join_seconds, heartbeat = cluster.join_seconds(), cluster.heartbeat_seconds()
    cluster.peer_seconds()  # a bad GATTN_PEER_SECONDS is refused before any process waits
    import jax  # noqa: PLC0415

    local_devices = None
    if not coordinator:  # a Cloud TPU slice: JAX reads the hosts from the TPU metadata
        from jax._src import clusters  # noqa: PLC0415

        coordinator, num, pid, local_devices = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            None, None, None, None, None, int(join_seconds))
        if coordinator is None:
            raise ConfigError("--distributed", True, "a Cloud TPU slice or another cluster JAX detects (SLURM, "
                              "Open MPI, ...); elsewhere give --coordinator, --num-processes and --process-id")
    for flag, value in (("--num-processes", num), ("--process-id", pid)):
        if value is None or not str(value).isdigit():
            raise ConfigError(flag, value, "a non-negative integer (or its JAX_* environment variable) "
                              "when a coordinator address is given")
    num, pid = int(num), int(pid)
    if pid >= num:
        raise ConfigError("--process-id", pid, f"below --num-processes ({num})")
    _process = pid
    if num > 1:
        log = cluster.log_path(getattr(args, "workdir", None), pid)
        cluster.supervise(pid, log)  # from here on, the child: the parent only waits for it
        cluster.send_native_log_to(log)
    cluster.join(coordinator, num, pid, join_seconds)
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num, pid, local_device_ids=local_devices,
                               initialization_timeout=int(join_seconds) + 60,
                               heartbeat_timeout_seconds=heartbeat, shutdown_timeout_seconds=heartbeat)
    if num > 1:
        from jax._src import distributed  # noqa: PLC0415

        cluster.watch(distributed.global_state.client, pid, num)


def check_workdir(workdir: str) -> None:
    """A remote run directory (gs://, s3://, ...) needs its filesystem library, and TensorBoard on
    gs:// needs google-cloud-storage: a missing one is one line before any work, never a failure
    mid-run or a silent switch-off (`pip install 'gattn[gcp]'` brings both for gs://)."""
    if "://" not in str(workdir):
        return
    protocol = str(workdir).split("://", 1)[0]
    extra = " (pip install 'gattn[gcp]')" if protocol in ("gs", "gcs") else ""
    try:
        import fsspec  # noqa: PLC0415 (etils.epath reaches remote paths through it)

        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as e:
        reason = first_line(e) or type(e).__name__
        raise ConfigError("--workdir", workdir, f"a local path, or a {protocol}:// path with its filesystem "
                          f"library installed{extra}: {reason}") from None
    if protocol in ("gs", "gcs"):
        import logging  # noqa: PLC0415

        # gcsfs logs each failed request (and each bucket it cannot classify) with a whole
        # traceback; the error that ends the run, if any, is its one line (--debug shows them).
        if not debugging():
            logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
        try:
            import google.cloud.storage  # noqa: F401, PLC0415 (tensorboardX writes gs:// with it)
        except ImportError:
            raise ConfigError("--workdir", workdir, "a gs:// path with google-cloud-storage installed, which "
                              f"TensorBoard needs to write there{extra}") from None


def _joining(argv: list[str]) -> tuple[str, int, int] | None:
    """(coordinator, processes, process) of a multi-process run this command was started as
    (--coordinator/--num-processes/--process-id, or the JAX_* variables `gattn.launch` sets) while
    it has not joined yet, else None."""
    flags = {}
    for i, a in enumerate(argv):
        for flag in ("--coordinator", "--num-processes", "--process-id"):
            if a == flag and i + 1 < len(argv):
                flags[flag] = argv[i + 1]
            elif a.startswith(flag + "="):
                flags[flag] = a.split("=", 1)[1]
    coordinator = flags.get("--coordinator") or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num = flags.get("--num-processes") or os.environ.get("JAX_NUM_PROCESSES")
    pid = flags.get("--process-id") or os.environ.get("JAX_PROCESS_ID")
    if not coordinator or ":" not in coordinator or not str(num).isdigit() or not str(pid).isdigit():
        return None
    if int(num) < 2 or int(pid) >= int(num):
        return None
    from gattn import cluster  # noqa: PLC0415

    return None if cluster.active() else (coordinator, int(num), int(pid))


def where() -> str:
    """" (process N)" in a run of several processes, so that an error names its process."""
    return f" (process {_process})" if _process is not None else ""


def run_entry_point(main) -> None:
    """What every `python -m` / script entry point does: the process settings, then `main` with
    one-line config errors; exits with its status. Entry points that do not run as several
    processes refuse to (see `single_process`)."""
    keep_jax_off_absent_tpu()  # first: a re-execution below inherits its setting
    use_compilation_cache()
    ensure_malloc_tunables()
    raise SystemExit(run_cli(main))


# --------------------------------------------------------------------------- process settings

def compilation_cache_dir() -> str:
    """Where JAX keeps compiled programs between runs: JAX_COMPILATION_CACHE_DIR if set, else
    $XDG_CACHE_HOME/gattn/jax (~/.cache/gattn/jax); '' when GATTN_COMPILATION_CACHE=0."""
    if os.environ.get("GATTN_COMPILATION_CACHE") == "0":
        return ""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "gattn", "jax")


def use_compilation_cache() -> None:
    """A persistent compilation cache for every entry point (exported, so child processes share
    it): a resumed run, a rerun or another run of the same model and shapes loads its train step
    instead of compiling it again (docs/training.md, "Start-up"). GATTN_COMPILATION_CACHE=0 turns
    it off; JAX_COMPILATION_CACHE_DIR moves it."""
    path = compilation_cache_dir()
    if not path:
        return
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    if "jax" in sys.modules:  # the entry module imported JAX already, which read the variable then
        sys.modules["jax"].config.update("jax_compilation_cache_dir", path)


# glibc serves buffers over 32 MB (the logits) by mmap/munmap, costing ~220 ms of page faults per
# step on CPU (docs/performance.md). glibc reads this only at process start.
MALLOC_TUNABLES = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                   "glibc.malloc.trim_threshold=100000000000")


def ensure_malloc_tunables() -> None:
    """Re-executes the current command once with GLIBC_TUNABLES set, unless it is already set
    (by the user or by an earlier re-execution) or GATTN_NO_REEXEC=1."""
    if os.environ.get("GLIBC_TUNABLES") or os.environ.get("GATTN_NO_REEXEC") == "1":
        return
    argv = sys.orig_argv
    if len(argv) < 2 or argv[1] == "-c":
        return  # interactive or `python -c`: nothing to re-execute
    os.execve(sys.executable, [sys.executable, *argv[1:]], dict(os.environ, GLIBC_TUNABLES=MALLOC_TUNABLES))


# libtpu ships with the test extra as an ahead-of-time TPU compiler, but JAX also tries it as a
# runtime on every start: on a host without a TPU it prints initialisation errors ("could not
# determine TPU accelerator type", "unexpected worker hostname") before falling back to CPU.
# PCI device ids of TPU chips (vendor 0x1ae0), as in jax._src.hardware_utils.
_TPU_PCI_IDS = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}
_TPU_ENV = ("JAX_FORCE_TPU_INIT", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID")
_GPU_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")  # CUDA (incl. WSL), ROCm


def keep_jax_off_absent_tpu() -> None:
    """Pins JAX to CPU when libtpu is installed but this host has neither a TPU nor a GPU and the
    user has not set JAX_PLATFORMS, so a CPU user does not see libtpu's initialisation errors.
    Exported, so re-executions and child processes agree; topology descriptions for AOT compiles
    still work. `JAX_PLATFORMS=` (empty) keeps JAX's own choice of backends."""
    if "JAX_PLATFORMS" in os.environ or not _libtpu_installed() or _tpu_here() or _gpu_here():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # the entry module imported JAX already, which read the variable then
        sys.modules["jax"].config.update("jax_platforms", "cpu")


def _libtpu_installed() -> bool:
    """Whether JAX would try libtpu (the pip package, or a library named by TPU_LIBRARY_PATH)."""
    return bool(os.environ.get("TPU_LIBRARY_PATH") or importlib.util.find_spec("libtpu"))


def _tpu_here() -> bool:
    """Whether this host may have a TPU, probed without loading libtpu: the TPU variables (GKE,
    users), the device files libtpu opens (/dev/accel* on v2-v4, /dev/vfio/* on v5e and later), or
    TPU chips on the PCI bus (what JAX's cloud_tpu_init counts). Any doubt leaves JAX alone."""
    if any(os.environ.get(name) for name in _TPU_ENV):
        return True
    if any(Path("/dev").glob("accel*")) or any(Path("/dev/vfio").glob("*")):
        return True
    return any(_read(v) == "0x1ae0" and _read(v.with_name("device")) in _TPU_PCI_IDS
               for v in Path("/sys/bus/pci/devices").glob("*/vendor"))


def _gpu_here() -> bool:
    """Whether a GPU may be present (the device files JAX checks before trying CUDA or ROCm): then
    JAX keeps discovering its plugins itself."""
    return any(os.path.exists(f) for f in _GPU_FILES)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def single_process(what: str) -> None:
    """One clear line instead of a hang when a one-process tool is launched as several."""
    if int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1:
        raise ConfigError("JAX_NUM_PROCESSES", os.environ["JAX_NUM_PROCESSES"],
                          f"{what} runs as one process: run it on one host (train.py is the multi-process "
                          "entry point; its checkpoints restore on any number of devices)")
