"""The paper at small scale, in one command: train a grid of variants x learning rates x seeds
with identical data and token budget, measure each, and write the paper's tables and figures.

    python -m gattn.study configs/study/NAME.py --workdir DIR [--steps N] [--config.FIELD=VALUE ...]
    python -m gattn.study --variants baseline,sdpa_headwise --seeds 0,1 --lrs 1e-3,3e-3 --steps 200 \\
        [--config tiny] [--config.FIELD=VALUE ...] --workdir DIR

A study file (or a preset's name: table4_tiny) defines `get_study() -> Study`; without one, the
flags and a base config (--config, default tiny) define the study. Given both, the flags replace
the file's fields (--config its base). `--config.FIELD=VALUE` overrides apply to the base config.
Each cell (variant, learning rate, seed) trains in DIR/runs/VARIANT/lr_LR/seed_SEED
(`Study.cell_dir`) and is then measured (eval.py's perplexity and measurements, and F-Attn at each
saved checkpoint); DIR/runs/.../cell.json marks it finished. Rerunning the command skips finished
cells, resumes the unfinished one from its checkpoint, and goes on. All cells share one tokenizer
and one prepared dataset (DIR/shared). The report: DIR/report.json, DIR/report.md and PNG figures
in DIR/figures, with mean and sample standard deviation over seeds, and a verdict per claim of the
paper computed from the numbers (`claims`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from gattn import cli, variants
from gattn.config import ConfigError
from gattn.experiments.study.report import markdown
from gattn.experiments.study.runner import run
from gattn.experiments.study.spec import Study, load

BASE = "tiny"  # the base config of a study without a study file
FLAGS = {"variants": "--variants", "seeds": "--seeds", "learning_rates": "--lrs", "gated": "--gated",
         "reference": "--reference"}  # the Study fields the flags set


def arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m gattn.study", description=__doc__,
                                 formatter_class=cli.HelpWithDefaults)
    ap.add_argument("study", nargs="?", help="a study file (configs/study/NAME.py) or a preset "
                    f"({', '.join(cli.presets('study'))}); without one, the flags below define the study")
    ap.add_argument("--workdir", required=True, help="study directory (created; resumed if it exists)")
    ap.add_argument("--config", help=f"the base config: a config file or preset (default: the study file's base, "
                    f"else {BASE})")
    ap.add_argument("--variants", help="comma-separated registered variants (python -m gattn.variants) (default: "
                    f"the study file's, else {','.join(Study.variants)})")
    ap.add_argument("--seeds", help="comma-separated integers >= 0 (default: the study file's, else "
                    f"{','.join(map(str, Study.seeds))})")
    ap.add_argument("--lrs", help="comma-separated peak learning rates (default: the study file's, else the base "
                    "config's)")
    ap.add_argument("--steps", help="training steps per cell, >= 1 (sets train.steps; default: the base config's)")
    ap.add_argument("--gated", help="the variant the claims about gating test, one of the study's (default: the "
                    "study file's, else sdpa_elementwise if the study runs it, else its only gated variant)")
    ap.add_argument("--reference", help="the variant they compare it with (default: the study file's, else "
                    "baseline if the study runs it, else its only ungated variant)")
    ap.add_argument("--progress", action="store_true", help="a progress bar per cell")
    return ap


def _items(flag: str, text: str, parse, allowed: str) -> tuple:
    """The comma-separated values of `flag`, each read by `parse` (None: not allowed), distinct."""
    values = []
    for item in text.split(","):
        try:
            value = parse(item.strip())
        except ValueError:
            value = None
        if value is None:
            raise ConfigError(flag, item.strip(), f"expected {allowed}")
        values.append(value)
    if len(set(values)) != len(values):
        raise ConfigError(flag, text, f"expected {allowed}, each once")
    return tuple(values)


def _variant(name: str) -> str | None:
    return name if name in variants.REGISTRY else None


def _seed(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def _lr(text: str) -> float | None:
    lr = float(text)
    return lr if math.isfinite(lr) and lr > 0 else None


def fields(args: argparse.Namespace) -> dict:
    """The Study fields the flags set (those given), checked: errors name the flag."""
    out = {}
    if args.variants is not None:
        out["variants"] = _items("--variants", args.variants, _variant,
                                 f"comma-separated registered variants ({', '.join(variants.REGISTRY)})")
    if args.seeds is not None:
        out["seeds"] = _items("--seeds", args.seeds, _seed, "comma-separated integers >= 0, e.g. 0,1,2")
    if args.lrs is not None:
        out["learning_rates"] = _items("--lrs", args.lrs, _lr, "comma-separated numbers > 0, e.g. 1e-3,3e-3")
    for flag in ("gated", "reference"):
        name = getattr(args, flag)
        if name is not None and name not in variants.REGISTRY:
            raise ConfigError(f"--{flag}", name, f"expected a registered variant ({', '.join(variants.REGISTRY)})")
        if name is not None:
            out[flag] = name
    if args.gated is not None and args.gated == args.reference:
        raise ConfigError("--gated", args.gated, "expected a variant other than --reference")
    return out


def steps(text: str | None) -> list[str]:
    """--steps as an override of train.steps (none if not given)."""
    if text is None:
        return []
    if not text.strip().isdigit() or int(text) < 1:
        raise ConfigError("--steps", text, "expected an integer >= 1 (training steps per cell)")
    return [f"train.steps={int(text)}"]


def study_from(args: argparse.Namespace, overrides: list[str]) -> Study:
    """The study the command line asks for: the study file's (if given) with the flags' fields
    replacing its own, or one of the flags on the base config; overrides apply to the base."""
    if any(cli.override_path(o) == "variant" for o in overrides):
        raise ConfigError("--config.variant", None, "choose the variants with --variants a,b")
    overrides = overrides + steps(args.steps)
    given = fields(args)
    try:
        if args.study is None:
            base = cli.load(args.config or BASE, overrides)
            study = Study(base=base, sink_points=min(Study.sink_points, base.train.steps), **given)
        else:
            study = load(args.study, [] if args.config else overrides)
            for role in ("gated", "reference"):  # the file's choice of a variant --variants leaves out: the default
                if "variants" in given and role not in given and getattr(study, role) not in given["variants"]:
                    given[role] = ""
            if args.config:
                given["base"] = cli.load(args.config, overrides)
            study = dataclasses.replace(study, **given) if given else study
    except ConfigError as e:  # (a field a flag sets: the error names the flag too)
        if e.field not in FLAGS:
            raise
        raise ConfigError(f"{e.field} ({FLAGS[e.field]})", e.value, e.allowed) from None
    for flag in ("gated", "reference"):
        name = getattr(args, flag)
        if name is not None and name not in study.variants:
            raise ConfigError(f"--{flag}", name, f"expected one of the study's variants ({', '.join(study.variants)})")
    return study


def parse(argv=None) -> tuple[Study, argparse.Namespace]:
    """(the study, the parsed flags) of a command line; nothing trains."""
    args, overrides = cli.parse_args(arguments(), argv)
    return study_from(args, overrides), args


def main(argv=None):
    cli.single_process("python -m gattn.study")
    study, args = parse(argv)
    report = run(study, args.workdir, progress=args.progress)
    if report is None:
        return 1
    print(markdown(report))
    return 0


if __name__ == "__main__":
    cli.run_entry_point(main)
