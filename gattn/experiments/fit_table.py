"""The tables of the presets as configured, generated so they cannot go stale:

    python -m gattn.experiments.fit_table            # prints every block
    python -m gattn.experiments.fit_table --write    # rewrites the blocks in the pages
    python -m gattn.experiments.fit_table --check    # exit 1, one line each, where a page or a fit is stale

Each preset's settings (mesh on its slice, microbatches, MoE path, remat, loss chunk) are read from
the preset itself; its memory, bytes, counted FLOPs and modelled step from bench/fit_presets.py's
JSON of it, docs/fits/PRESET.json (a row says so where there is none yet). A fit compiled with
other settings than the preset now has is stale: its row says what differs instead of its numbers
(`plan.differences`), and --check fails. A page holds a block between
`<!-- begin fit_table:NAME ... -->` and `<!-- end fit_table:NAME -->`; NAME is one of BLOCKS or
`plan PRESET SLICE DAYS` (the planner's output, gattn/experiments/plan.py).

The `maxtext` block sets each preset as configured beside MaxText's fastest fitting variant for it
in bench/maxtext_side.py's JSON files, docs/maxtext-side/*.json (issue 58), on the same counters.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

from gattn import cli
from gattn.config import ConfigError
from gattn.experiments import plan

PRESETS = ("dense_1p7b", "dense_1p7b_48l", "extend_1p7b_32k", "moe_15a2b", "qwen3_5_2b", "qwen3_5_2b_64k",
           "qwen3_5_2b_256k", "qwen3_next_80b")
ROOT = plan.ROOT
BENCH = ROOT / "bench" / "fit_presets.py"
MAXTEXT_BENCH = ROOT / "bench" / "maxtext_side.py"
# bench/maxtext_side.py --json FILE's lists of variant objects, named DATE[-WHAT].json: ordered by
# name (a suffixed file after its bare date), a variant in several files is the last file's
MAXTEXT_SIDE = ROOT / "docs" / "maxtext-side"
# presets no MaxText config can express, and why
NO_MAXTEXT = {"qwen3_5_2b": "MaxText 0.2.5 has no dense Qwen3.5 config (its qwen3.5 models are the 35B-A3B and "
                            "397B-A17B MoE)"}
NO_MAXTEXT["qwen3_5_2b_64k"] = NO_MAXTEXT["qwen3_5_2b_256k"] = NO_MAXTEXT["qwen3_5_2b"]
PAGES = ("docs/presets.md", "docs/pod-slice.md", "docs/moe-and-mesh.md", "README.md")
BLOCK = re.compile(r"<!-- begin fit_table:(?P<name>[^>]*?) \(.*?\) -->\n(?P<body>.*?)"
                   r"<!-- end fit_table:(?P=name) -->\n", re.S)
# The presets that continue another run (train.init_from), and what from.
STARTS = {"extend_1p7b_32k": "`--init-from $BUCKET/runs/dense_1p7b` (a finished `dense_1p7b` run)",
          "qwen3_5_2b": "`--init-from` the released model converted (`python -m gattn.convert from-hf`)",
          "qwen3_5_2b_64k": "`--init-from` the released model converted, or a `qwen3_5_2b` run",
          "qwen3_5_2b_256k": "`--init-from $BUCKET/runs/qwen3_5_2b_64k` (a finished `qwen3_5_2b_64k` run)",
          "qwen3_next_80b": "`--init-from` the released model converted (`python -m gattn.convert from-hf`)"}


def configured_slices(bench: Path = BENCH) -> dict[str, str]:
    """Each preset's topology in bench/fit_presets.py's ROWS["configured"], read from its source
    (importing it loads libtpu)."""
    for node in ast.walk(ast.parse(bench.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ROWS" for t in node.targets):
            for key, value in zip(node.value.keys, node.value.values):
                if ast.literal_eval(key) == "configured":
                    return {row[0]: row[1] for row in ast.literal_eval(value)}
    raise ConfigError("bench/fit_presets.py", "ROWS", "a dict with a 'configured' list of (preset, topology, ...)")


def maxtext_preset_of(bench: Path = MAXTEXT_BENCH) -> dict[str, str]:
    """bench/maxtext_side.py's PRESET_OF (variant -> the gattn preset it stands beside), from its source:
    it places the variants whose objects were written before they carried "preset"."""
    for node in ast.walk(ast.parse(bench.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PRESET_OF" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ConfigError(plan.shown(bench), "PRESET_OF", "a dict literal of variant -> preset")


def gcloud_name(where: plan.Slice) -> str:
    """The accelerator type gcloud creates for these chips: v5p-N and v4-N count TensorCores."""
    prefix = {"v5e": "v5litepod"}.get(where.generation, where.generation)
    return f"{prefix}-{where.chips * dict(plan.GENERATIONS.values()).get(where.generation, 1)}"


class Row:
    """One preset: its config, the slice it is fitted on, its fit (or None) and what is stale."""

    def __init__(self, preset: str, topology: str, fits: Path = plan.FITS):
        self.preset, self.cfg = preset, cli.load(preset)
        self.where = plan.parse_slice(topology)
        self.path = fits / f"{preset}.json"
        found = plan.records(self.path) if self.path.is_file() else []
        self.fit = next((f for f in found if f.get("topology") == topology and f.get("variant", "baseline")
                         == "baseline" and f.get("slices", 1) == 1), None)
        if found and self.fit is None:  # a fit on another slice than bench's ROWS names
            self.fit = found[0]
            self.where = plan.parse_slice(self.fit["topology"])
        self.stale = plan.differences(preset, self.cfg, self.fit) if self.fit else []
        self.mesh = plan.resolved_mesh(self.cfg, self.where.chips)

    @property
    def hosts(self) -> int:
        return self.fit["hosts"] if self.fit and self.fit.get("hosts") else max(self.where.chips // 4, 1)

    def slice_cell(self) -> str:
        return f"{gcloud_name(self.where)} ({self.where.topology}), {self.where.chips} chips, {self.hosts} hosts"

    def mesh_cell(self) -> str:
        cell = ", ".join(str(self.mesh[a]) for a in ("data", "fsdp", "expert", "model"))
        return cell + (f" (context {self.mesh['context']})" if "context" in self.mesh else "")

    def microbatch_cell(self) -> str:
        t, shards = self.cfg.train, self.mesh["data"] * self.mesh["fsdp"] * self.mesh["expert"]
        rows = t.batch_size // shards // t.microbatches if t.batch_size % (shards * t.microbatches) == 0 else "?"
        gathered = ", `exec.accumulate=gathered`" if t.microbatches > 1 and self.cfg.exec.accumulate == "gathered" \
            else ""
        return f"{t.microbatches} ({rows}){gathered}"

    def moe_cell(self) -> str:
        moe, ex = self.cfg.model.moe, self.cfg.exec
        if moe is None:
            return "dense"
        if moe.capacity_factor is not None:
            return f"`{ex.moe_impl}`, capacity {moe.capacity_factor:g}: rows past it dropped (`moe/dropped`)"
        path = f"`{ex.moe_impl}` + `{ex.grouped_matmul}`"
        if ex.moe_impl != "ragged":
            return path + ", dropless"
        if self.mesh["expert"] == 1:
            return path + ", dropless: each chip runs every expert on its own rows, nothing exchanged"
        if ex.moe_impl == "ragged" and ex.moe_buffer is not None:
            return path + (f": the routed rows exchanged over expert into buffers of {ex.moe_buffer:g}x an even "
                           "routing, rows past them dropped (`moe/dropped`)")
        return path + ", dropless: the routed rows exchanged over expert into worst-case buffers"

    def measured(self) -> list[str]:
        """The fit's cells: train GiB (heap peak), eval GiB with the moments, sent GiB, counted and
        model TFLOP, HBM GiB, the modelled step, MFU."""
        if self.fit is None:
            return [f"no fit yet: `python bench/fit_presets.py --preset {self.preset} --topology "
                    f"{self.where.topology} > docs/fits/{self.preset}.json`"] + ["-"] * 6
        if self.stale:
            return [f"stale fit ({plan.shown(self.path)}), refit: " + "; ".join(self.stale)] + ["-"] * 6
        f, tr = self.fit, self.fit["train"]
        roof, ev = tr.get("roofline") or {}, f.get("eval") or {}
        fits = "" if tr.get("fits", True) else ": does not fit"
        step = (f"**{roof['step_s']:.2f}** ({roof['bound']}; {roof['no_overlap_step_s']:.2f} if nothing overlaps)"
                if roof else "-")
        return [f"{tr['total_gib']:.1f} of {f['hbm_gib']} ({tr['peak_gib']:.1f}){fits}",
                f"{ev['resident_gib']:.1f}" if ev.get("resident_gib") is not None else "not compiled",
                f"{tr['network']['total_gib']:,.1f}",
                f"{tr['counted_tflops_per_chip']:,.0f} ({f['model_tflops_per_chip']:,.0f})"
                if tr.get("counted_tflops_per_chip") is not None else f"- ({f['model_tflops_per_chip']:,.0f})",
                f"{tr['hbm_gib_per_step']:,.0f}" if tr.get("hbm_gib_per_step") is not None else "-",
                step, f"{roof['mfu']:.1%}" if roof else "-"]


def rows(fits: Path = plan.FITS) -> list[Row]:
    slices = configured_slices()
    return [Row(p, slices[p], fits) for p in PRESETS]


def _table(header: list[str], body: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(r) + " |" for r in body)]) + "\n"


def presets_table(found: list[Row]) -> str:
    """docs/presets.md: every preset as configured, its settings and its fit's numbers."""
    header = ["preset", "slice", "mesh (data, fsdp, expert, model)", "microbatches (rows / chip each)", "MoE path",
              "`exec.remat`, `loss_chunk`", "train GiB/chip (heap peak)", "eval GiB/chip with the AdamW moments",
              "sent GiB/chip/step", "counted TFLOP/chip/step (model)", "HBM GiB/step", "modelled step s", "MFU"]
    body = [[f"`{r.preset}`", r.slice_cell(), r.mesh_cell(), r.microbatch_cell(), r.moe_cell(),
             f"{r.cfg.exec.remat}, {r.cfg.exec.loss_chunk}", *r.measured()] for r in found]
    return _table(header, body)


def slices_table(found: list[Row]) -> str:
    """docs/pod-slice.md: what the recipe needs of each preset (its variables), with its settings."""
    header = ["preset", "`ACCEL` (gcloud)", "`HOSTS`", "rehearsal", "mesh (data, fsdp, expert, model)",
              "microbatches (rows / chip each)", "MoE path", "modelled step s", "starts from"]
    body = []
    for r in found:
        step = (f"{r.fit['train']['roofline']['step_s']:.2f}" if r.fit and not r.stale
                and r.fit["train"].get("roofline") else "stale fit" if r.stale else "no fit yet")
        per_host = r.where.chips // r.hosts
        body.append([f"`{r.preset}`", f"`{gcloud_name(r.where)}` ({r.where.chips} chips)", str(r.hosts),
                     f"`--processes {r.hosts} --local-devices {per_host}`", r.mesh_cell(), r.microbatch_cell(),
                     r.moe_cell(), step, STARTS.get(r.preset, "a new run")])
    return _table(header, body)


def maxtext_variants(side: Path | None = None) -> list[dict]:
    """Every variant object in side/*.json (MAXTEXT_SIDE), the last file's where several files hold
    one, each with "file" (its file's name) added."""
    side, found = side or MAXTEXT_SIDE, {}
    for path in sorted(side.glob("*.json"), key=lambda p: p.stem):
        try:
            objs = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(plan.shown(path), str(e), "bench/maxtext_side.py --json's list of variant objects")
        if not isinstance(objs, list) or not all(isinstance(o, dict) and isinstance(o.get("variant"), str)
                                                 for o in objs):
            raise ConfigError(plan.shown(path), str(objs)[:80], "a list of objects, each with a 'variant' name")
        found.update({o["variant"]: {**o, "file": path.name} for o in objs})
    return list(found.values())


def unpriced_mosaic(v: dict) -> list[str]:
    """The Mosaic kernels (tpu_custom_call) a variant's count left unpriced: a step without them
    is not the step the chip runs."""
    step = v.get("step") or {}
    kernels = step.get("kernels") or {}
    return sorted({k for k in step.get("unpriced_kernels", []) if k == "tpu_custom_call" or k in kernels}
                  | {k for k, x in kernels.items() if x.get("priced_by") == "unpriced"})


def not_comparable(v: dict, row: Row | None) -> list[str]:
    """Why a variant's step cannot stand beside its preset's: [] where it can."""
    why = []
    if v.get("fits") is False:
        m = re.search(r"required for HLO temporaries \((\S+)G\) exceeds available HBM \((\S+)G\)", v.get("error", ""))
        why.append(f"does not fit: {m[1]}G of temporaries, {m[2]}G available" if m
                   else f"does not fit: {v.get('error', '')[:120]}")
    elif not (v.get("step") or {}).get("roofline"):
        why.append("no step counted")
    if "preset" not in v:
        why.append("its object names no preset (written before PRESET_OF)")
    if mosaic := unpriced_mosaic(v):
        why.append("its Mosaic kernels unpriced (" + ", ".join(mosaic) + ")")
    if row is None:
        why.append("no gattn preset of that name")
    elif v.get("topology") != gcloud_name(row.where):
        why.append(f"on {v.get('topology')}, the preset's fit on {gcloud_name(row.where)}")
    return why


def maxtext_settings(v: dict) -> str:
    """remat_policy, microbatches (gradient_accumulation_steps), vocabulary tiling and mesh, from the
    compiled config or, for a variant that did not compile, its overrides (else bench's defaults)."""
    given = dict(o.split("=", 1) for o in v.get("overrides", []) if "=" in o)
    remat = re.search(r"remat_policy=(\S+)", v.get("remat", "")) if v.get("remat") else None
    remat = remat[1] if remat else given.get("remat_policy", "full")
    steps = v.get("gradient_accumulation_steps", given.get("gradient_accumulation_steps", 1))
    tiling = v.get("num_vocab_tiling", given.get("num_vocab_tiling", 1))
    mesh = v.get("mesh") or {k[4:-12]: n for k, n in given.items() if k.startswith("ici_") and
                             k.endswith("_parallelism")}
    return ", ".join([f"remat {remat}", f"microbatches {steps}", f"vocabulary tiled {tiling}"]
                     + [" x ".join(f"{k} {n}" for k, n in mesh.items())] * bool(mesh))


def gattn_numbers(row: Row) -> dict | None:
    if row.fit is None or row.stale or not row.fit["train"].get("roofline"):
        return None
    tr = row.fit["train"]
    return {"step_s": tr["roofline"]["step_s"], "bound": tr["roofline"]["bound"], "gib": tr["total_gib"],
            "peak": tr["peak_gib"], "sent": tr["network"]["total_gib"], "tflop": tr.get("counted_tflops_per_chip"),
            "hbm": tr.get("hbm_gib_per_step")}


def maxtext_numbers(v: dict) -> dict | None:
    step = v.get("step") or {}
    if v.get("fits") is False or not step.get("roofline"):
        return None
    return {"step_s": step["roofline"]["step_s"], "bound": step["roofline"]["bound"],
            "gib": v["memory_gib_per_chip"], "peak": v.get("peak_gib_per_chip"), "sent": v["traffic"]["total_gib"],
            "tflop": step.get("counted_tflops_per_chip"), "hbm": step.get("hbm_gib_per_step")}


def number_cells(n: dict | None) -> list[str]:
    """modelled step s (bound), GiB/chip (heap peak), sent GiB/chip/step, counted TFLOP, HBM GiB."""
    if n is None:
        return ["-"] * 5
    return [f"{n['step_s']:.2f} ({n['bound']})",
            f"{n['gib']:.1f} ({n['peak']:.1f})" if n["peak"] is not None else f"{n['gib']:.1f}",
            f"{n['sent']:,.1f}", "-" if n["tflop"] is None else f"{n['tflop']:,.0f}",
            "-" if n["hbm"] is None else f"{n['hbm']:,.0f}"]


def maxtext_table(found: list[Row], side: Path | None = None) -> str:
    """docs/presets.md: each preset as configured beside MaxText's fastest fitting comparable
    variant (same counters, same slice), then every other MaxText variant and why it is not it."""
    side = side or MAXTEXT_SIDE
    variants, of, by_name = maxtext_variants(side), maxtext_preset_of(), {r.preset: r for r in found}
    placed = {r.preset: [] for r in found}
    others = []
    for v in sorted(variants, key=lambda v: v["variant"]):
        preset = v.get("preset") or of.get(v["variant"])
        why = not_comparable(v, by_name.get(preset))
        entry = (v, why, maxtext_numbers(v))
        (placed[preset] if preset in placed else others).append(entry)
    header = ["preset", "MaxText's fastest fitting variant (file)", "its settings",
              "modelled step s (bound): gattn as configured / MaxText", "step ratio gattn / MaxText",
              "GiB/chip (heap peak): gattn / MaxText", "sent GiB/chip/step: gattn / MaxText",
              "counted TFLOP/chip/step: gattn / MaxText", "HBM GiB/step: gattn / MaxText"]
    body, rest = [], []
    for r in found:
        ours = gattn_numbers(r)
        mine = number_cells(ours)
        if ours is None:
            mine[0] = "stale fit" if r.stale else "no fit yet"
        candidates = sorted((e for e in placed[r.preset] if not e[1]), key=lambda e: e[2]["step_s"])
        best = candidates[0] if candidates else None
        if best is None:
            what = NO_MAXTEXT.get(r.preset) or ("no comparable MaxText variant (below)" if placed[r.preset]
                                                else "no MaxText variant run")
            cells, ratio, settings = ["-"] * 5, "-", "-"
        else:
            v, _, theirs = best
            what, settings = f"`{v['variant']}` (`{v.get('model')}`, {v['file']})", maxtext_settings(v)
            cells = number_cells(theirs)
            x = ours["step_s"] / theirs["step_s"] if ours else None  # (4 places where 3 round to 1: which side)
            ratio = "-" if x is None else f"**{x:.4f}**" if f"{x:.3f}" == "1.000" and x != 1 else f"**{x:.3f}**"
        pairs = ["-" if a == b == "-" else f"{a} / {b}" for a, b in zip(mine, cells)]
        body.append([f"`{r.preset}`", what, settings, pairs[0], ratio, *pairs[1:]])
        order = sorted(placed[r.preset], key=lambda e: (bool(e[1]), e[2] is None,
                                                         e[2]["step_s"] if e[2] else 0, e[0]["variant"]))
        rest += [(f"`{r.preset}`", e) for e in order if e is not best]
    rest += [("-", e) for e in others]
    files = sorted(side.glob("*.json"), key=lambda p: p.stem)
    intro = (f"From {', '.join(p.name for p in files) or 'no files'} in docs/maxtext-side/ (in this order: a "
             "variant in several files is the last one's). A MaxText variant is comparable where its object names "
             "its preset, every Mosaic kernel (tpu_custom_call) in its step is priced, and it ran on the preset's "
             "slice; gattn from docs/fits/PRESET.json. gattn / MaxText is the modelled steps' ratio.\n\n")
    other_header = ["preset", "MaxText's other variants (file)", "settings", "modelled step s (bound)",
                    "GiB/chip (heap peak)", "sent GiB/chip/step", "counted TFLOP/chip/step", "HBM GiB/step",
                    "comparable"]
    other_body = [[preset, f"`{v['variant']}` (`{v.get('model')}`, {v['file']})", maxtext_settings(v),
                   *number_cells(n), "no: " + "; ".join(why) if why else "yes, slower"]
                  for preset, (v, why, n) in rest]
    return intro + _table(header, body) + ("\n" + _table(other_header, other_body) if other_body else "")


def plan_block(spec: str, fits: Path = plan.FITS) -> str:
    """`plan PRESET SLICE DAYS`: the planner's command and its output, as a code block."""
    preset, slice_name, days = spec.split()[1:]
    cfg = cli.load(preset)
    fit, path = plan.find_fit(preset, plan.parse_slice(slice_name), fits=fits)
    result = plan.plan(cfg, fit, float(days))
    result.update(fit=plan.shown(path), slice=slice_name, notes=plan.differences(preset, cfg, fit))
    return (f"```\n$ python -m gattn.params --preset {preset} --plan {slice_name} --days {days}\n"
            f"{plan.render(result, slice_name)}\n```\n")


BLOCKS = {"presets": presets_table, "slices": slices_table, "maxtext": maxtext_table}


def generate(name: str, found: list[Row], fits: Path = plan.FITS) -> str:
    if name in BLOCKS:
        return BLOCKS[name](found)
    if name.startswith("plan "):
        return plan_block(name, fits)
    raise ConfigError("fit_table block", name, f"one of {', '.join(BLOCKS)} or 'plan PRESET SLICE DAYS'")


def rewrite(text: str, found: list[Row], fits: Path = plan.FITS) -> str:
    """`text` with every block regenerated."""
    def one(m: re.Match) -> str:
        whole, start = m.group(0), m.start("body") - m.start()
        return whole[:start] + generate(m.group("name"), found, fits) + whole[start + len(m.group("body")):]

    return BLOCK.sub(one, text)


def stale_pages(found: list[Row], root: Path = ROOT) -> list[str]:
    """One line per page whose blocks differ from what the presets and their fits give now."""
    out = []
    for page in PAGES:
        text = (root / page).read_text()
        for m in BLOCK.finditer(text):
            if m.group("body") != generate(m.group("name"), found):
                out.append(f"{page}: the block fit_table:{m.group('name')} is stale: run python -m "
                           "gattn.experiments.fit_table --write")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help=f"rewrite the blocks in {', '.join(PAGES)}")
    ap.add_argument("--check", action="store_true", help="exit 1 if a page's block or a fit is stale")
    args = ap.parse_args(argv)
    found = rows()
    if args.write:
        for page in PAGES:
            path = ROOT / page
            text = path.read_text()
            if (new := rewrite(text, found)) != text:
                path.write_text(new)
                print(f"wrote {page}")
    elif not args.check:
        for name in BLOCKS:
            print(f"<!-- {name} -->\n{generate(name, found)}")
    problems = [f"docs/fits/{r.preset}.json is stale: {'; '.join(r.stale)}" for r in found if r.stale]
    problems += stale_pages(found)
    for line in problems if args.check or args.write else []:
        print(line, file=sys.stderr)
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    cli.run_entry_point(main)

