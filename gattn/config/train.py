"""How a run trains: `TrainConfig` (optimisation, checkpointing, logging, continued training)
and the paper's learning-rate presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gattn.config.checks import ConfigError, _choice, _integer, _positive


# The paper's learning-rate recipes (Sec. 3.2): name -> (max LR, final LR, warmup steps). The
# paper gives the floor only for the MoE recipe; the dense presets decay to 1% of their peak.
LR_PRESETS = {
    "moe_15a2b": (2e-3, 3e-5, 1000),          # Table 1: 1k warmup, 2e-3 -> 3e-5, bsz 1024
    "dense_400b": (4e-3, 4e-5, 1000),         # Table 2 rows 1-2, 5, 8-9 (bsz 1024)
    "dense_3.5t": (4.5e-3, 4.5e-5, 1000),     # Table 2 rows 3-4 (bsz 2048)
    "dense_1t": (5.3e-3, 5.3e-5, 1000),       # Table 2 rows 11, 13 (bsz 4096)
    "dense_high_lr": (8e-3, 8e-5, 1000),      # Table 2 rows 6-7, 10, 12, 14: the baseline diverges
}
EXTEND = ("recompute", "constant", "decay")  # what a resume with another `steps` does to the LR
_SCHEDULE = ("learning_rate", "min_learning_rate", "warmup_steps")  # the order of a preset's values


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, checkpointing and logging of a run (gattn/train/optim.py, gattn/train/trainer.py)."""

    seed: int = 0
    batch_size: int = 8             # global batch (sequences)
    microbatches: int = 1           # gradient accumulation: the batch runs in this many sequential parts
    #                                 (exact for the cross-entropy; a MoE's LBL loads and capacity are per part)
    seq_len: int = 128
    steps: int = 200                # total training steps
    learning_rate: float = 3e-3     # max LR, after linear warmup
    min_learning_rate: float = 3e-5  # cosine floor at the last step
    warmup_steps: int = 20
    lr_preset: str = ""             # a key of LR_PRESETS; sets the three values above (leave them default)
    weight_decay: float = 0.01      # AdamW's defaults otherwise (the paper keeps them)
    grad_clip: float = 1.0          # global-norm clipping (0 = off)
    log_every: int = 10
    eval_every: int = 100
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    max_bad_steps: int = 10         # consecutive non-finite steps before the run stops
    spike_window: int = 50          # loss spike: loss > median of the last `window` + margin
    spike_margin: float = 0.5
    # Continued training (e.g. the paper's context extension: a new RoPE base and seq_len): a new
    # run starts from the parameters of run directory `init_from` (its latest checkpoint, or step
    # `init_step`) with a fresh optimizer and schedule. Ignored once this run has a checkpoint.
    init_from: str = ""
    init_step: int | None = None
    # A resume that changes `steps` (gattn/train/optim.py `continued`): "recompute" fits the warmup
    # + cosine to the new total, so the LR moves (the trainer says from what to what); "constant"
    # keeps the LR the run had reached; "decay" takes it down to min_learning_rate by a cosine over
    # the new steps. The trainer records where such a continuation starts (the optimizer's update
    # count) and its LR in continue_step / continue_lr; set them by hand to continue from any update.
    extend: str = "recompute"
    continue_step: int = 0
    continue_lr: float = 0.0
    # The multi-token-prediction loss (model.mtp_layers = 1): loss = CE + mtp_loss_weight * the MTP
    # layer's CE of token t+2 at position t (gattn/train/loss.py). 0: the MTP layer is not run in
    # training (its weights then get no gradient, only AdamW's weight decay).
    mtp_loss_weight: float = 0.0

    def __post_init__(self):
        _integer("seed", self.seed, zero_ok=True)
        if self.seed > 2**32 - 1:  # the data pipeline's and NumPy's seeds are unsigned 32-bit
            raise ConfigError("seed", self.seed, f"expected an integer in 0..{2**32 - 1}")
        for name in ("batch_size", "microbatches", "seq_len", "steps", "log_every", "eval_every", "checkpoint_every",
                     "keep_checkpoints", "max_bad_steps", "spike_window"):
            _integer(name, getattr(self, name))
        _integer("warmup_steps", self.warmup_steps, zero_ok=True)
        if self.batch_size % self.microbatches:
            raise ConfigError("microbatches", self.microbatches,
                              f"a divisor of batch_size ({self.batch_size}): each microbatch is whole rows")
        for name in ("learning_rate", "spike_margin"):
            _positive(name, getattr(self, name))
        for name in ("min_learning_rate", "weight_decay", "grad_clip"):
            _positive(name, getattr(self, name), zero_ok=True)
        if not isinstance(self.init_from, str):
            raise ConfigError("init_from", self.init_from, "expected a run directory or ''")
        if self.init_step is not None:
            _integer("init_step", self.init_step)
            if not self.init_from:
                raise ConfigError("init_step", self.init_step, "only with init_from (a run directory)")
        _choice("extend", self.extend, EXTEND)
        _integer("continue_step", self.continue_step, zero_ok=True)
        _positive("continue_lr", self.continue_lr, zero_ok=True)
        _positive("mtp_loss_weight", self.mtp_loss_weight, zero_ok=True)
        if self.continue_step and self.extend == "recompute":
            raise ConfigError("continue_step", self.continue_step, "0 with extend='recompute' (a continuation "
                              "is extend='constant' or 'decay' from that update)")
        if self.continue_step >= self.steps:
            raise ConfigError("continue_step", self.continue_step, f"expected < train.steps ({self.steps})")
        if self.lr_preset:
            _choice("lr_preset", self.lr_preset, tuple(LR_PRESETS))
            # The preset sets the schedule: a value given beside it would be ignored silently.
            defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
            for name in ("learning_rate", "min_learning_rate", "warmup_steps"):
                if getattr(self, name) != defaults[name]:
                    raise ConfigError(name, getattr(self, name), f"set by lr_preset={self.lr_preset!r} "
                                      f"({name} {LR_PRESETS[self.lr_preset][_SCHEDULE.index(name)]}); "
                                      "use lr_preset='' to choose your own")
        peak, floor, warmup = self.schedule
        if floor > peak:
            raise ConfigError("min_learning_rate", floor, f"expected <= the max LR ({peak})")
        if warmup >= self.steps:
            fix = ("lr_preset sets it; choose your own with --config.train.lr_preset='' "
                   "--config.train.warmup_steps=N") if self.lr_preset else "--config.train.warmup_steps=N sets it"
            raise ConfigError("warmup_steps", warmup, f"expected fewer warmup steps than train.steps ({self.steps}): "
                              f"{fix}, or raise --steps (train.steps)")

    @property
    def schedule(self) -> tuple[float, float, int]:
        """(max LR, final LR, warmup steps), from the preset when one is named."""
        if self.lr_preset:
            return LR_PRESETS[self.lr_preset]
        return self.learning_rate, self.min_learning_rate, self.warmup_steps


def fit_warmup(train: TrainConfig, overrides: list[str]) -> tuple[list[str], str]:
    """For a run given fewer steps (`--steps N`, train.steps=N) than its config's warmup: the
    overrides that scale the warmup with the steps (the config's share of its own steps; a
    preset's LR values spelled out) and a one-line note. ([], "") when the warmup fits, or the
    command line sets the schedule itself (warmup_steps, lr_preset or the whole train section)."""
    given = {o.removeprefix("--").removeprefix("config.").partition("=")[0].strip(): o.partition("=")[2].strip()
             for o in overrides}
    if given.keys() & {"train", "train.warmup_steps", "train.lr_preset"}:
        return [], ""
    try:
        steps = int(given["train.steps"])
    except (KeyError, ValueError):  # (a bad value is the override's own error)
        return [], ""
    peak, floor, warmup = train.schedule
    if warmup < steps or steps < 1:
        return [], ""
    fitted = min(steps - 1, max(1, warmup * steps // train.steps))
    out, how = [f"train.warmup_steps={fitted}"], f"the config's {warmup} of {train.steps}, scaled"
    if train.lr_preset:
        values = (("learning_rate", peak), ("min_learning_rate", floor))
        out = ["train.lr_preset=", *(f"train.{k}={v!r}" for k, v in values if f"train.{k}" not in given), *out]
        how += f"; lr_preset {train.lr_preset!r} spelled out: max LR {peak:g}, final {floor:g}"
    return out, (f"note: train.warmup_steps {warmup} -> {fitted} for {steps} steps ({how}); "
                 "--config.train.warmup_steps=N sets it")
