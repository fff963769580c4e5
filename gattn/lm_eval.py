"""`python -m gattn.lm_eval`: lm-evaluation-harness's own command line, with gattn's model class
`gattn` registered (gattn/interop/harness.py) and the paper's benchmarks on local files.

    python -m gattn.lm_eval --model_args workdir=RUN --tasks paper_table4 --data-dir DATA
    python -m gattn.lm_eval --model gattn --model_args workdir=RUN,step=2000 --tasks local_gsm8k \\
        --data-dir DATA --num_fewshot 5 --batch_size 16 --output_path RUN/eval/lm_eval --log_samples
    python -m gattn.launch --processes 2 --local-devices 4 -m gattn.lm_eval --model_args workdir=RUN ...

Every argument but gattn's own is lm-eval's (`lm-eval run --help`); `--model gattn` is the default,
and so is `--batch_size 8` (rows per forward pass, each packed with requests; lm-eval's own is 1).
gattn's own:
  --data-dir DIR            the benchmark files of the local_* tasks (gattn/eval/lm_tasks.py,
                            docs/evaluation.md); their task YAMLs are written for --include_path,
                            and nothing is fetched from the network (HF_DATASETS_OFFLINE=1)
  --allow-code-execution    let local_humaneval run the model's code (a subprocess per completion,
                            with a timeout); also passes lm-eval's --confirm_run_unsafe_code
  --distributed / --coordinator / --num-processes / --process-id   several hosts: process 0 runs
                            the harness, the others follow it (gattn/interop/harness.py)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from gattn import cli
from gattn.config import ConfigError


def require() -> None:
    """lm-eval is installed, else one line saying how to install it."""
    import importlib.util  # noqa: PLC0415

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("lm-eval", "not installed", "installed: pip install 'gattn[lm-eval]' (lm-evaluation-harness)")


def _value(args: list[str], flag: str) -> str | None:
    """The value of lm-eval flag `flag` in `args` (`--flag v` or `--flag=v`)."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--data-dir")
    ap.add_argument("--allow-code-execution", action="store_true")
    cli.add_distributed_flags(ap)
    ours, rest = ap.parse_known_args(argv)
    if not rest or rest[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if _value(rest, "--model") not in (None, "gattn"):
        raise ConfigError("--model", _value(rest, "--model"), "gattn (this command runs gattn runs; "
                          "use lm-eval's own command for its other backends)")
    if _value(rest, "--model_args") is None:
        raise ConfigError("--model_args", None, "workdir=RUN (a gattn run directory or a Hugging Face folder), "
                          "optionally ,step=N,batch_size=B,max_length=L,max_gen_toks=T")
    require()
    cli.start_distributed(ours)
    import jax  # noqa: PLC0415
    from lm_eval.utils import simple_parse_args_string  # noqa: PLC0415

    from gattn.eval import code_eval, lm_tasks  # noqa: PLC0415
    from gattn.interop import harness  # noqa: PLC0415 (registers the model "gattn")

    args = ["--model", "gattn", *rest] if _value(rest, "--model") is None else rest
    if _value(rest, "--batch_size") is None:  # lm-eval's default is 1 row per forward pass; gattn packs rows
        args += ["--batch_size", "8"]
    if ours.data_dir:
        if _value(rest, "--include_path"):
            raise ConfigError("--include_path", _value(rest, "--include_path"), "absent with --data-dir (gattn "
                              "writes the local tasks' folder itself; copy your YAMLs next to them instead)")
        tasks = (_value(rest, "--tasks") or "").split(",")
        lm_tasks.check_files([t for t in tasks if t], ours.data_dir)
        folder = lm_tasks.write(ours.data_dir, tempfile.mkdtemp(prefix="gattn-tasks-"))
        args += ["--include_path", str(folder)]
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if ours.allow_code_execution:
        os.environ[code_eval.ENV] = "1"
        args.append("--confirm_run_unsafe_code")
    if jax.process_index() != 0:  # a follower: the same model, the work process 0 sends
        harness.GattnLM(**simple_parse_args_string(_value(rest, "--model_args"))).follow()
        return 0
    from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

    sys.argv = ["lm-eval", "run", *args]
    try:
        cli_evaluate()
    finally:
        harness.release_all()
    return 0


if __name__ == "__main__":
    cli.run_entry_point(main)
