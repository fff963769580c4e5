"""A reservation planned from a preset's modelled step: `python -m gattn.params --preset P --plan SLICE
--days D [--json]`.

The step is bench/fit_presets.py's step model (`train.roofline` in docs/fits/P.json: the compiled
train step's counted FLOPs, HBM bytes and network at the chip's peaks, perfectly overlapped), not
a measurement; the no-overlap sum of the same terms is printed beside it as the slow end. From it:
tokens/s, the steps and tokens that D days hold, the days the preset's own train.steps need, and
the train.steps (with the preset's warmup and cosine) of a run that fits D days. Once the run is
measured, `--tokens-per-sec` (metrics.jsonl's tokens_per_sec) replaces the model and gives the MFU
the run reaches.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from gattn import cli
from gattn.config import Config, ConfigError
from gattn.experiments.traffic import CHIPS

ROOT = Path(__file__).resolve().parents[2]
FITS = ROOT / "docs" / "fits"  # docs/fits/PRESET.json: bench/fit_presets.py's JSON of each preset
DAY_S = 86_400
MARGIN = 0.05  # ours, not measured: start-up, validation, saves and a restart's lost steps
# gcloud's accelerator types: v5p-N and v4-N count TensorCores (2 per chip); v5e and v6e count chips.
GENERATIONS = {"v5p": ("v5p", 2), "v4": ("v4", 2), "v5litepod": ("v5e", 1), "v5e": ("v5e", 1), "v6e": ("v6e", 1)}
# Topologies to name in a refusal's fit_presets command (any shape of the same chips is a fit of the slice).
TOPOLOGY_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "4x4x2", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
               512: "8x8x8", 1024: "8x8x16"}
TOPOLOGY_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
SLICE_FORMS = "a slice as gcloud names it (v5p-64: 32 chips; v5litepod-16, v6e-32) or a topology (v5p:4x4x2)"


@dataclass(frozen=True)
class Slice:
    name: str        # as given: v5p-64 or v5p:4x4x2
    generation: str  # v5p, v5e, v6e, v4
    chips: int

    @property
    def topology(self) -> str:
        """A topology of these chips for bench/fit_presets.py: the given one, else a usual shape."""
        if ":" in self.name:
            return self.name
        shapes = TOPOLOGY_2D if self.generation in ("v5e", "v6e") else TOPOLOGY_3D
        return f"{self.generation}:{shapes.get(self.chips, '<a shape of ' + str(self.chips) + ' chips>')}"


def parse_slice(text: str) -> Slice:
    """'v5p-64' -> v5p, 32 chips (gcloud counts TensorCores on v5p); 'v5p:4x4x2' -> v5p, 32 chips."""
    if m := re.fullmatch(r"(v5p|v4|v5litepod|v5e|v6e)-(\d+)", text):
        generation, cores = GENERATIONS[m.group(1)]
        count = int(m.group(2))
        if count and count % cores == 0:
            return Slice(text, generation, count // cores)
    if m := re.fullmatch(r"(v5p|v4|v5e|v6e):(\d+(?:x\d+){1,2})", text):
        return Slice(text, m.group(1), math.prod(int(d) for d in m.group(2).split("x")))
    raise ConfigError("--plan", text, SLICE_FORMS)


def shown(path: Path) -> str:
    """`path` as a reader of the repository writes it: relative to its root when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def fit_command(preset: str, where: Slice, variant: str, out: str) -> str:
    flag = f" --variant {variant}" if variant != "baseline" else ""
    return f"python bench/fit_presets.py --preset {preset}{flag} --topology {where.topology} > {out}"


def records(path: Path) -> list[dict]:
    """A fit file: bench/fit_presets.py's JSON object, a list of them, or one per line (--jsonl)."""
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ConfigError("--fits", shown(path), f"bench/fit_presets.py's JSON ({e})") from None
    return data if isinstance(data, list) else [data]


def _generation(fit: dict) -> str:
    return str(fit.get("topology", "")).partition(":")[0]


def find_fit(preset: str, where: Slice, variant: str = "baseline", fits: Path = FITS) -> tuple[dict, Path]:
    """The fit of `preset` (a name: FITS/NAME.json) on `where`'s chips; one refusal line naming
    the command that writes it when there is none."""
    path = fits / f"{preset}.json"
    if not path.is_file():
        raise ConfigError("--plan", where.name, f"a slice with a fit of {preset}: {shown(path)} does not exist; "
                          f"write it with {fit_command(preset, where, variant, shown(path))}")
    found = records(path)
    for fit in found:
        if (_generation(fit) == where.generation and fit.get("chips") == where.chips and fit.get("slices", 1) == 1
                and fit.get("variant", "baseline") == variant and (fit.get("train") or {}).get("roofline")):
            return fit, path
    have = ", ".join(sorted({f"{f.get('topology')} ({f.get('chips')} chips, {f.get('variant', 'baseline')})"
                             for f in found})) or "nothing"
    raise ConfigError("--plan", where.name, f"a slice with a fit of {preset} ({variant}): {shown(path)} has {have}; "
                      f"compile one with {fit_command(preset, where, variant, f'DIR/{preset}.json')} and "
                      "pass --fits DIR")


def resolved_mesh(cfg: Config, chips: int) -> dict:
    """The preset's mesh on `chips` chips, in sharding.AXES order (data=-1 or fsdp=-1 takes what the
    others leave, as sharding.mesh_shape does)."""
    axes = {a: getattr(cfg.mesh, a) for a in ("data", "fsdp", "expert", "model")}
    if cfg.mesh.context != 1:  # (listed only when used: the fits before the axis have none)
        axes["context"] = cfg.mesh.context
    known = math.prod(v for v in axes.values() if v != -1)
    return {a: (chips // known if v == -1 else v) for a, v in axes.items()}


def differences(preset: str, cfg: Config, fit: dict, variant: str | None = None) -> list[str]:
    """Where the fit no longer describes the preset as configured (`cfg`): the settings that shape
    the step (mesh, batch, microbatches, the exec fields the fit records), and every override the
    fit was compiled with that changes the preset. [] for a fit that is current."""
    ours = {"train.batch_size": cfg.train.batch_size, "train.seq_len": cfg.train.seq_len,
            "train.microbatches": cfg.train.microbatches, "exec.loss_chunk": cfg.exec.loss_chunk,
            **{f"exec.{k}": getattr(cfg.exec, k) for k in ("dtype", "remat", "attention_impl")},
            "mesh": resolved_mesh(cfg, fit["chips"])}
    ex = fit.get("exec") or {}
    theirs = {"train.batch_size": fit.get("global_batch"), "train.seq_len": fit.get("seq_len"),
              "train.microbatches": fit.get("microbatches"), "exec.loss_chunk": fit.get("loss_chunk"),
              **{f"exec.{k}": ex.get(k) for k in ("dtype", "remat", "attention_impl")}, "mesh": fit.get("mesh")}
    if cfg.model.moe is not None:  # (moe_buffer bounds the exchange only on an expert axis)
        for k in ("moe_impl", "grouped_matmul") + (("moe_buffer",) if ours["mesh"]["expert"] > 1 else ()):
            ours[f"exec.{k}"], theirs[f"exec.{k}"] = getattr(cfg.exec, k), ex.get(k)
    found = [f"{k}: the fit has {theirs[k]!r}, the preset {ours[k]!r}" for k in ours if theirs[k] != ours[k]]
    base = cli.load(preset, [], variant=variant)
    for override in fit.get("overrides") or []:
        field = cli.override_path(override)
        try:
            changed = cli.load(preset, [override], variant=variant) != base
        except ConfigError as e:
            found.append(f"the fit's override {override} no longer applies ({e})")
            continue
        if changed:
            found.append(f"the fit was compiled with {override}; the preset has {field}="
                         f"{_field(base, field)!r}")
    return found


def _field(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def plan(cfg: Config, fit: dict, days: float, *, margin: float = MARGIN, tokens_per_sec: float | None = None) -> dict:
    """The numbers of a reservation of `days` on the fit's slice (see the module docstring)."""
    t, roof = cfg.train, fit["train"]["roofline"]
    tokens_per_step = fit["global_batch"] * fit["seq_len"]
    step_s = roof["step_s"] if tokens_per_sec is None else tokens_per_step / tokens_per_sec
    peak = CHIPS[roof["chip"]]["bf16_tflops"]
    budget_s = days * DAY_S
    steps_in_days = math.floor(budget_s / step_s)
    usable = math.floor(budget_s * (1 - margin) / step_s)
    every = t.checkpoint_every
    train_steps = min(t.steps, usable - usable % every if usable >= every else usable)
    peak_lr, final_lr, warmup = t.schedule
    if train_steps <= warmup:
        raise ConfigError("--days", days, f"more than {warmup * step_s / DAY_S / (1 - margin):.3g}: {days} days "
                          f"hold {usable} steps of {step_s:.2f} s, not more than the warmup ({warmup} steps)")
    return {
        "preset": fit.get("preset"), "variant": fit.get("variant", "baseline"), "topology": fit["topology"],
        "chips": fit["chips"], "mesh": fit.get("mesh"), "days": days,
        "step_s": round(step_s, 4), "step": "measured" if tokens_per_sec else "modelled",
        "modelled_step_s": roof["step_s"], "bound": roof.get("bound"),
        "no_overlap_step_s": roof.get("no_overlap_step_s"),
        "mfu": round(fit["model_tflops_per_chip"] / (step_s * peak), 4), "modelled_mfu": roof.get("mfu"),
        "no_overlap_mfu": roof.get("no_overlap_mfu"), "model_tflops_per_chip": fit["model_tflops_per_chip"],
        "peak_tflops": peak, "tokens_per_step": tokens_per_step, "tokens_per_s": round(tokens_per_step / step_s),
        "tokens_per_s_per_chip": round(tokens_per_step / step_s / fit["chips"]),
        "steps_in_days": steps_in_days, "tokens_in_days": steps_in_days * tokens_per_step,
        "preset_steps": t.steps, "preset_days": round(t.steps * step_s / DAY_S, 3),
        "preset_tokens": t.steps * tokens_per_step,
        "preset_no_overlap_days": round(t.steps * roof["no_overlap_step_s"] / DAY_S, 3)
        if tokens_per_sec is None and roof.get("no_overlap_step_s") else None,
        "margin": margin, "train_steps": train_steps, "train_tokens": train_steps * tokens_per_step,
        "train_days": round(train_steps * step_s / DAY_S, 3),
        "schedule": {"warmup_steps": warmup, "peak_lr": peak_lr, "final_lr": final_lr, "decay": "cosine",
                     "decay_until_step": train_steps, "lr_preset": t.lr_preset or None},
        "overrides": [] if train_steps == t.steps else [f"--config.train.steps={train_steps}"],
        "checkpoint_every": every,
    }


def _big(n: float) -> str:
    return f"{n / 1e9:,.1f}B" if n >= 1e9 else f"{n / 1e6:,.1f}M"


def render(p: dict, slice_name: str) -> str:
    s, mesh = p["schedule"], ", ".join(f"{a} {n}" for a, n in (p["mesh"] or {}).items())
    lines = [f"{p['preset']} on {slice_name} ({p['chips']} chips, {p['topology']}; mesh {mesh}), {p['days']:g} days"]
    if p["step"] == "modelled":
        lines += [f"  step {p['step_s']:.2f} s MODELLED, not measured: bench/fit_presets.py's step model, "
                  f"{p['bound']}-bound", f"    ({p['no_overlap_step_s']:.2f} s if nothing overlaps); MFU "
                  f"{p['mfu']:.1%} ({p['no_overlap_mfu']:.1%}) of {p['peak_tflops']:g} TFLOP/s bf16 a chip"]
    else:
        lines += [f"  step {p['step_s']:.2f} s MEASURED (--tokens-per-sec; modelled {p['modelled_step_s']:.2f} s): "
                  f"MFU {p['mfu']:.1%}", f"    (modelled {p['modelled_mfu']:.1%}) of {p['peak_tflops']:g} TFLOP/s "
                  "bf16 a chip"]
    lines += [f"  {p['tokens_per_step']:,} tokens a step: {p['tokens_per_s']:,} tokens/s "
              f"({p['tokens_per_s_per_chip']:,} a chip)",
              f"  in {p['days']:g} days: {p['steps_in_days']:,} steps, {_big(p['tokens_in_days'])} tokens",
              f"  the preset's train.steps={p['preset_steps']:,} ({_big(p['preset_tokens'])} tokens) take "
              f"{p['preset_days']:.2f} days" + (f" ({p['preset_no_overlap_days']:.2f} if nothing overlaps)"
                                                 if p["preset_no_overlap_days"] else "")]
    if p["overrides"]:
        lines += [f"  to fit {p['days']:g} days: {' '.join(p['overrides'])} ({_big(p['train_tokens'])} tokens in "
                  f"{p['train_days']:.2f} days; {p['margin']:.0%} of the days kept for",
                  f"    start-up, validation, saves and a restart, rounded down to train.checkpoint_every="
                  f"{p['checkpoint_every']:,})"]
    else:
        lines.append(f"  the preset's train.steps fit {p['days']:g} days with {p['margin']:.0%} of them kept")
    lr = f"lr_preset {s['lr_preset']}; " if s["lr_preset"] else ""
    lines += [f"  schedule: warmup {s['warmup_steps']:,} steps to {s['peak_lr']:g}, cosine to {s['final_lr']:g} at "
              f"step {s['decay_until_step']:,} ({lr}the", "    cosine ends at train.steps, so setting it refits the "
              "decay)"]
    lines += [f"  note: the fit is stale, refit it: {n}" for n in p["notes"]]
    lines.append(f"  from {p['fit']}" + ("" if p["notes"] else " (the preset as configured)"))
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(prog="python -m gattn.params --plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, help="a preset by name (moe_15a2b, dense_1p7b, ...)")
    ap.add_argument("--plan", required=True, metavar="SLICE", help=SLICE_FORMS)
    ap.add_argument("--days", type=float, required=True, help="the reservation, in days")
    ap.add_argument("--variant", default=None, help="the variant the fit was compiled for (default: the preset's "
                    "own, as bench/fit_presets.py compiles it)")
    ap.add_argument("--margin", type=float, default=MARGIN, help="share of the days kept for start-up, "
                    "validation, saves and a restart (ours, not measured)")
    ap.add_argument("--tokens-per-sec", type=float, help="the run's measured rate (metrics.jsonl's tokens_per_sec) "
                    "in place of the modelled step")
    ap.add_argument("--fits", type=Path, default=FITS, help="the folder of PRESET.json fits")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args, overrides = cli.parse_args(ap, argv)
    if not args.days > 0:
        raise ConfigError("--days", args.days, "a positive number of days")
    if not 0 <= args.margin < 1:
        raise ConfigError("--margin", args.margin, "a share of the days in [0, 1)")
    if args.tokens_per_sec is not None and not args.tokens_per_sec > 0:
        raise ConfigError("--tokens-per-sec", args.tokens_per_sec, "a positive rate")
    where = parse_slice(args.plan)
    variant = None if args.variant in (None, "baseline") else args.variant
    cfg = cli.load(args.preset, overrides, variant=variant)
    name = Path(args.preset).stem
    args.variant = cfg.variant  # the preset's own unless --variant named one (qwen3_5_2b's is sdpa_elementwise)
    fit, path = find_fit(name, where, args.variant, args.fits)
    if (fit["global_batch"], fit["seq_len"]) != (cfg.train.batch_size, cfg.train.seq_len):
        raise ConfigError("--preset", name, f"a preset its fit describes: {shown(path)} was compiled at a batch of "
                          f"{fit['global_batch']} x {fit['seq_len']}, the preset runs {cfg.train.batch_size} x "
                          f"{cfg.train.seq_len}; refit with {fit_command(name, where, args.variant, shown(path))}")
    if fit.get("fits") is False:
        raise ConfigError("--plan", where.name, f"a slice {name} fits: {shown(path)} says its step does not fit the "
                          f"chips' HBM (train {fit['train'].get('total_gib')} GiB a chip)")
    result = plan(cfg, fit, args.days, margin=args.margin, tokens_per_sec=args.tokens_per_sec)
    result.update(fit=shown(path), slice=where.name, notes=differences(name, cfg, fit, variant))
    print(json.dumps(result, indent=2) if args.json else render(result, where.name))
