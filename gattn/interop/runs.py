"""Any run as a model to use: a gattn run directory or a Hugging Face model folder (converted in
memory; its config and tokenizer written to a temporary run folder), with its tokenizer. Used by
lm-eval's model class (gattn.interop.harness) and `python -m gattn.generate`; it imports neither
lm-eval nor torch."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import jax

from gattn.config import ConfigError


def load(workdir: str | Path, step: int | None = None, overrides: list[str] = ()):
    """(cfg, model, tokenizer, step) of a gattn run directory, or of a Hugging Face model folder
    (converted in memory, step 0)."""
    from gattn.data.tokenizer import load_tokenizer  # noqa: PLC0415
    from gattn.train import rundir  # noqa: PLC0415

    workdir = Path(workdir)
    if not (workdir / "config.json").is_file():
        raise ConfigError("workdir", str(workdir), "a gattn run directory or a Hugging Face model folder "
                          "(no config.json there)")
    if "architectures" in json.loads((workdir / "config.json").read_text()):  # a Hugging Face folder
        from gattn.interop import convert  # noqa: PLC0415

        if step is not None:  # (before: dropped, and the folder's weights used as step 0)
            raise ConfigError("--step", step, f"no step for a Hugging Face model folder ({workdir} holds one set "
                              "of weights); --step selects a checkpoint of a gattn run directory")
        if jax.process_count() > 1:
            raise ConfigError("workdir", str(workdir), "a gattn run directory when several processes run: "
                              f"convert it once first (python -m gattn.convert from-hf {workdir} --workdir RUN)")
        hf_run = convert.read_run(workdir)  # in memory: the run folder gets no checkpoint
        run = Path(tempfile.mkdtemp(prefix="gattn-run-")) / "run"
        convert.write_run(hf_run, workdir, run, checkpoint_too=False)
        workdir, params = run, hf_run.params
    else:
        params = None
    cfg, model, step = rundir.load(workdir, step, list(overrides), params=params)
    return cfg, model, load_tokenizer(cfg, workdir), step
