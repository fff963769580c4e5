"""What a study is: the `Study` grid, its cells and their configs, and the study file that defines
it (`get_study() -> Study`, a path or a preset name under gattn/configs/study/)."""

from __future__ import annotations

import dataclasses
import json
import math
import string
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gattn import cli, variants
from gattn.config import Config, ConfigError, to_dict
from gattn.eval.verdict import SinkRule
from gattn.experiments.study.claims import CLAIMS, PAPER_GATED, PAPER_REFERENCE, Claim
from gattn.experiments.study.stability_rule import StabilityRule

CELL_FIELDS = ("variant", "lr", "seed", "clip")  # the names a `cell_dir` template may use
# What a study directory holds besides its cells (a cell directory may not start with these).
STUDY_FILES = ("shared", "figures", "study.json", "report.json", "report.md", "results.json")


@dataclass(frozen=True)
class Study:
    """A grid of runs. `base` sets the model size, data and token budget (train.steps x
    batch_size x seq_len); each cell applies a variant, a learning rate and a seed to it."""

    base: Config
    variants: tuple[str, ...] = ("baseline", "sdpa_elementwise")
    seeds: tuple[int, ...] = (0, 1, 2)
    learning_rates: tuple[float, ...] = ()  # () = the base's max LR only (its lr_preset's, if any)
    grad_clips: tuple[float, ...] = ()      # train.grad_clip settings (0 = off); () = base's only
    # A run diverged if training stopped on non-finite losses, or if its final training loss is
    # above this (0: ln(vocab_size), the loss of a uniform guess; inf: only a stop counts).
    diverged_loss: float = 0.0
    sink_points: int = 4                     # checkpoints at which F-Attn is measured (0: none)
    measure_batches: int = 2                 # held-out batches per domain for the measurements
    description: str = ""
    # Where each cell trains, under the study directory: a template of {variant}, {lr} and {seed}
    # ({lr} and {seed} required when the study has several of them).
    cell_dir: str = "runs/{variant}/lr_{lr:g}/seed_{seed}"
    # The claims and their verdicts (claims.py): a table of claims whose pairs name variants, or
    # the roles GATED and REFERENCE, which are these two variants ("": the study's own, see
    # `gated_variant` and `reference_variant`).
    claims: tuple[Claim, ...] = CLAIMS
    gated: str = ""
    reference: str = ""
    # `--config.FIELD=VALUE` overrides applied to each cell after its variant (sizes, anything that
    # leaves each variant what it is; one that changes a variant is refused, see `cell_config`). A
    # study file's command-line overrides apply to `base` instead (see `load`).
    overrides: tuple[str, ...] = ()
    # The sink verdict's rule (gattn/eval/verdict.py), fixed with the study before its runs: the
    # report then judges each gated variant against the reference by it (None: no such section).
    sink_rule: SinkRule | None = None
    # The stability verdict's rule (stability_rule.py), likewise fixed before the runs: the report
    # judges each variant against the reference at every learning rate by it (None: no such section).
    stability_rule: StabilityRule | None = None

    def __post_init__(self):
        if not isinstance(self.base, Config):
            raise ConfigError("base", self.base, "expected a gattn.config.Config")
        if not self.variants or len(set(self.variants)) != len(self.variants):
            raise ConfigError("variants", self.variants, "expected distinct registered variant names")
        named = [("variants", v) for v in self.variants] + [(f, getattr(self, f)) for f in ("gated", "reference")
                                                            if getattr(self, f)]  # ("": the study's own)
        for field, v in named:
            if v not in variants.REGISTRY:
                raise ConfigError(field, v, f"expected registered names ({', '.join(variants.REGISTRY)})")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or \
                any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in self.seeds):
            raise ConfigError("seeds", self.seeds, "expected distinct integers >= 0")
        if any(not isinstance(lr, (int, float)) or not lr > 0 for lr in self.learning_rates) or \
                len(set(self.learning_rates)) != len(self.learning_rates):
            raise ConfigError("learning_rates", self.learning_rates, "expected distinct numbers > 0, or ()")
        if any(not isinstance(c, (int, float)) or isinstance(c, bool) or not c >= 0 for c in self.grad_clips) or \
                len(set(self.grad_clips)) != len(self.grad_clips):
            raise ConfigError("grad_clips", self.grad_clips, "expected distinct numbers >= 0 (0: no clipping), or ()")
        if not isinstance(self.diverged_loss, (int, float)) or not self.diverged_loss >= 0:
            raise ConfigError("diverged_loss", self.diverged_loss, "expected a number >= 0 (0: ln(vocab_size))")
        steps = self.base.train.steps
        if not isinstance(self.sink_points, int) or not 0 <= self.sink_points <= steps:
            raise ConfigError("sink_points", self.sink_points,
                              f"expected an integer in [1, train.steps={steps}], or 0 (no F-Attn curve)")
        if not isinstance(self.measure_batches, int) or self.measure_batches < 1:
            raise ConfigError("measure_batches", self.measure_batches, "expected an integer >= 1")
        if not isinstance(self.claims, tuple) or not all(isinstance(c, Claim) for c in self.claims) or \
                len({c.key for c in self.claims}) != len(self.claims):
            raise ConfigError("claims", self.claims, "expected a tuple of Claims with distinct keys")
        if not isinstance(self.overrides, tuple) or not all(isinstance(o, str) for o in self.overrides):
            raise ConfigError("overrides", self.overrides, "expected a tuple of 'FIELD=VALUE' strings")
        if self.sink_rule is not None and not isinstance(self.sink_rule, SinkRule):
            raise ConfigError("sink_rule", self.sink_rule, "expected a gattn.eval.verdict.SinkRule, or None")
        if self.stability_rule is not None and not isinstance(self.stability_rule, StabilityRule):
            raise ConfigError("stability_rule", self.stability_rule,
                              "expected a gattn.experiments.study.stability_rule.StabilityRule, or None")
        _check_cell_dir(self)
        for o in self.overrides:  # (before: train.seed=5 trained every "seed" alike, filed under its own)
            if cli.override_path(o) in PER_CELL:
                raise ConfigError("overrides", o, "fields other than those each cell sets (" + ", ".join(PER_CELL)
                                  + "): the seeds, learning rates and clip settings are the study's seeds, "
                                  "learning_rates and grad_clips; the schedule's warmup is its base config's")
        for cell in cells(self):  # every cell's config is checked before anything trains
            cell_config(self, cell)
        name = self.base.variant.partition("+")[0]
        made = variants.label(name, self.base.model) if name in variants.REGISTRY else name
        if made != self.base.variant or "+" in made:  # (before: dropped from every cell, yet in study.json)
            raise ConfigError("base.variant", made, "a base whose model is its variant: the study builds "
                              f"each variant on the base's baseline, resetting {', '.join(variants.AXES)}; set "
                              "such a field in the study file's `overrides` (applied to each cell after its "
                              "variant), or register a variant in gattn/variants.py")
        if self.sink_rule is not None and self.reference_variant not in self.variants:
            # (before: accepted, and the report failed with a KeyError once every cell had trained)
            raise ConfigError("variants", self.variants, f"the sink verdict judges each gated variant against "
                              f"the reference, {self.reference_variant}: include it (or set `reference`)")
        if self.gated_variant == self.reference_variant:
            if self.gated and self.reference:
                raise ConfigError("gated", self.gated, "expected a variant other than `reference`")
            chosen, unset = ("gated", "reference") if self.gated else ("reference", "gated")
            raise ConfigError(unset, "", f"its default, {self.gated_variant}, is also `{chosen}`: "
                              f"set `{unset}` to another variant")
        if self.gated and variants.apply(self.gated, self.baseline).gate is None:
            raise ConfigError("gated", self.gated, "a variant with a gate (the claims about gating compare it "
                              "with the reference)")

    @property
    def baseline(self):
        """The model every cell's variant is built on: the base's without its variant's fields
        (`variants.baseline_of`; a gated preset's model without its gate)."""
        model = variants.baseline_of(self.base.model, self.base.variant)
        if model is None:
            raise ConfigError("base.variant", self.base.variant, "a baseline, or a variant that sets only the "
                              f"fields {', '.join(variants.AXES)}: the study builds each variant on the base's "
                              "baseline, and this one scales its heads or experts")
        return model

    @property
    def gated_variant(self) -> str:
        """What the role GATED stands for: `gated` if set; else sdpa_elementwise when the study
        runs it, else the study's only gated variant (other than the reference), else
        sdpa_elementwise (and the claims that need it say how to choose)."""
        return self.gated or _default_role(self, PAPER_GATED, gated=True, other=self.reference)

    @property
    def reference_variant(self) -> str:
        """What the role REFERENCE stands for: `reference` if set; else baseline when the study
        runs it, else the study's only ungated variant (other than the gated one), else baseline."""
        return self.reference or _default_role(self, PAPER_REFERENCE, gated=False, other=self.gated)

    @property
    def lrs(self) -> tuple[float, ...]:
        return tuple(float(x) for x in self.learning_rates) or (self.base.train.schedule[0],)

    @property
    def clips(self) -> tuple[float, ...]:
        return tuple(float(x) for x in self.grad_clips) or (float(self.base.train.grad_clip),)

    @property
    def reference_lr(self) -> float:
        """The learning rate of the tables and the per-variant claims: the base config's when it
        is in the sweep (its lr_preset's, if it names one), else the sweep's first."""
        peak = self.base.train.schedule[0]
        return peak if peak in self.lrs else self.lrs[0]

    @property
    def divergence_threshold(self) -> float:
        return self.diverged_loss or math.log(self.base.model.vocab_size)

    @property
    def tokens(self) -> int:
        t = self.base.train
        return t.steps * t.batch_size * t.seq_len


def _default_role(study: Study, paper: str, *, gated: bool, other: str) -> str:
    """The paper's variant for a role if the study runs it, else the study's only variant that is
    (or is not) gated apart from `other` (the other role, if set), else the paper's."""
    if paper in study.variants and paper != other:
        return paper
    fits = [v for v in study.variants
            if v != other and (variants.apply(v, study.baseline).gate is not None) == gated]
    return fits[0] if len(fits) == 1 else paper


@dataclass(frozen=True)
class Cell:
    variant: str
    lr: float
    seed: int
    path: Path  # relative to the study directory (`Study.cell_dir`)
    clip: float | None = None  # train.grad_clip (None: the base config's)


def _cell_path(template: str, variant: str, lr: float, seed: int, clip: float) -> Path:
    return Path(template.format(variant=variant, lr=lr, seed=seed, clip=clip))


def cells(study: Study) -> list[Cell]:
    """In training order: gradient clipping, learning rate, then variant, then seed."""
    return [Cell(v, lr, s, _cell_path(study.cell_dir, v, lr, s, c), c)
            for c in study.clips for lr in study.lrs for v in study.variants for s in study.seeds]


def _check_cell_dir(study: Study) -> None:
    """A relative template naming each cell's own directory (none shared, none outside)."""
    template = study.cell_dir

    def bad(why):
        return ConfigError("cell_dir", template, why)

    if not isinstance(template, str) or not template:
        raise bad("expected a path template such as 'runs/{variant}/lr_{lr:g}/seed_{seed}'")
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise bad(f"expected a format string ({e})") from None
    if names - set(CELL_FIELDS):
        raise bad(f"expected only the fields {{variant}}, {{lr}}, {{seed}} and {{clip}}, "
                  f"not {sorted(names - set(CELL_FIELDS))}")
    for name, several in (("variant", True), ("lr", len(study.lrs) > 1), ("seed", len(study.seeds) > 1),
                          ("clip", len(study.clips) > 1)):
        if several and name not in names:
            raise bad(f"expected {{{name}}} in it" + {"variant": "", "lr": " (the study has several learning rates)",
                                                      "seed": " (the study has several seeds)",
                                                      "clip": " (the study has several grad_clips)"}[name])
    try:
        paths = [c.path for c in cells(study)]
    except (ValueError, KeyError, IndexError, AttributeError) as e:
        raise bad(f"could not format it ({e})") from None
    for p in paths:
        pure = PurePosixPath(p.as_posix())
        if pure.is_absolute() or ".." in pure.parts or not pure.parts or pure.parts[0] in STUDY_FILES:
            raise bad(f"gives {str(p)!r}: expected a relative directory inside the study's, "
                      f"apart from {', '.join(STUDY_FILES)}")
    if len(set(paths)) != len(paths):
        raise bad("gives two cells the same directory (use {lr} with a format that tells the rates apart)")


# What `cell_config` sets for each cell: Study.overrides may not change them.
PER_CELL = ("train.seed", "train.lr_preset", "train.learning_rate", "train.min_learning_rate",
            "train.warmup_steps", "train.grad_clip", "train.log_every", "train.checkpoint_every",
            "train.keep_checkpoints", "train.eval_every")


def cell_config(study: Study, cell: Cell) -> Config:
    base = study.base
    t = base.train
    every = max(1, t.steps // max(study.sink_points, 1))
    # The cell's own schedule: the base's (or its lr_preset's) warmup and floor / peak ratio at the
    # cell's peak LR; the preset is unpacked, as it would set the schedule instead.
    peak, floor, warmup = t.schedule
    train = dataclasses.replace(
        t, seed=cell.seed, lr_preset="", learning_rate=cell.lr, min_learning_rate=floor * cell.lr / peak,
        warmup_steps=warmup, grad_clip=t.grad_clip if cell.clip is None else cell.clip,
        log_every=1, checkpoint_every=every, keep_checkpoints=study.sink_points + 6,  # (+ SIGTERM saves)
        eval_every=t.steps)  # (validated once at the end; the cell's measurements follow)
    cfg = dataclasses.replace(base, model=variants.apply(cell.variant, study.baseline), train=train,
                              variant=cell.variant)
    cfg = cli.apply_overrides(cfg, list(study.overrides)) if study.overrides else cfg
    # A study's rows are named for their variants: an override that makes a cell's model another
    # one (a gate on the baseline, another gate position) is refused, not listed under the name.
    made = variants.label(cell.variant, cfg.model, study.baseline)
    if made != cell.variant:
        raise ConfigError("overrides", study.overrides, f"overrides that keep each variant what it is: with them "
                          f"the {cell.variant} cell would train {made} (a study's rows are named for their "
                          f"variants); train that model alone (train.py --variant {cell.variant} with the "
                          "overrides records it as such) or register it in gattn/variants.py")
    return cfg


def load(path: str | Path, overrides: list[str] = ()) -> Study:
    """`get_study()` of a study file (or a preset's, by name: `table4_tiny`), with
    `--config.FIELD=VALUE` overrides applied to its base config (sizes, steps, data) and checked."""
    path = cli.resolve(path, "study", kind="study")
    study = cli.call_file(path, "get_study", "study", "Study")
    if not isinstance(study, Study):
        raise ConfigError("study", str(path), "get_study() must return a gattn.experiments.study.Study")
    if overrides:
        study = dataclasses.replace(study, base=cli.apply_overrides(study.base, list(overrides)))
    return study


def comparison(config: str | Path, names: list[str], overrides: list[str] = (), *, sink_points: int = 1,
               **fields) -> Study:
    """A one-seed study of variants side by side (the main job, the demo): `config` (a config
    file or preset) with the overrides is the base; each variant is applied to the config file's
    model and then the model overrides, as train.py's --variant does; each cell trains in
    DIR/VARIANT; a run counts as diverged only when training stopped on non-finite losses; F-Attn
    is measured at `sink_points` checkpoints (fewer if there are fewer steps). `fields`: other
    Study fields."""
    paths = [cli.override_path(o) for o in overrides]
    if "variant" in paths:
        raise ConfigError("--config.variant", None, "choose the variants with --variants a,b")
    base = cli.load(config, overrides)
    model = tuple(o for o, p in zip(overrides, paths) if p.startswith("model."))
    return Study(**{"base": base, "variants": tuple(names), "seeds": (base.train.seed,), "cell_dir": "{variant}",
                    "diverged_loss": math.inf, "overrides": model,
                    "sink_points": min(sink_points, base.train.steps), **fields})


def describe(study: Study) -> dict:
    """The study as study.json (and report.json) hold it: what a continued run must share."""
    t = study.base.train
    out = {"description": study.description, "variants": list(study.variants), "seeds": list(study.seeds),
           "learning_rates": list(study.lrs), "reference_lr": study.reference_lr,
           "steps": t.steps, "batch_size": t.batch_size, "seq_len": t.seq_len, "tokens": study.tokens,
           "diverged_loss": study.divergence_threshold, "base": to_dict(study.base)}
    if study.overrides:
        out["overrides"] = list(study.overrides)
    # What the cells' measurements and checkpoints depend on (recorded since session 9; a
    # study.json written before lacks them and still matches, see runner._check_same_study)
    out.update(sink_points=study.sink_points, measure_batches=study.measure_batches, cell_dir=study.cell_dir)
    if study.grad_clips:  # (absent otherwise: a study.json written before the axis still matches)
        out["grad_clips"] = list(study.clips)
    if study.sink_rule is not None:  # (likewise; a resumed study keeps the rule it started with)
        out["sink_rule"] = study.sink_rule.as_dict()
    if study.stability_rule is not None:
        out["stability_rule"] = study.stability_rule.as_dict()
    return json.loads(json.dumps(out))


def planned_steps(cfg: Config) -> list[int]:
    """The checkpoints the F-Attn curve is measured at: the first step, every checkpoint_every
    steps, the last (a SIGTERM's extra checkpoint is left out, so seeds share their steps)."""
    t = cfg.train
    return sorted({1, t.steps, *range(t.checkpoint_every, t.steps + 1, t.checkpoint_every)})
