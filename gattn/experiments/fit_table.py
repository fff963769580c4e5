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
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

from gattn import cli
from gattn.config import ConfigError
from gattn.experiments import plan

PRESETS = ("dense_1p7b", "dense_1p7b_48l", "extend_1p7b_32k", "moe_15a2b", "qwen3_5_2b", "qwen3_next_80b")
ROOT = plan.ROOT
BENCH = ROOT / "bench" / "fit_presets.py"
PAGES = ("docs/presets.md", "docs/pod-slice.md", "docs/moe-and-mesh.md", "README.md")
BLOCK = re.compile(r"<!-- begin fit_table:(?P<name>[^>]*?) \(.*?\) -->\n(?P<body>.*?)"
                   r"<!-- end fit_table:(?P=name) -->\n", re.S)
# The presets that continue another run (train.init_from), and what from.
STARTS = {"extend_1p7b_32k": "`--init-from $BUCKET/runs/dense_1p7b` (a finished `dense_1p7b` run)",
          "qwen3_5_2b": "`--init-from` the released model converted (`python -m gattn.convert from-hf`)",
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
        return ", ".join(str(v) for v in self.mesh.values())

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


def plan_block(spec: str, fits: Path = plan.FITS) -> str:
    """`plan PRESET SLICE DAYS`: the planner's command and its output, as a code block."""
    preset, slice_name, days = spec.split()[1:]
    cfg = cli.load(preset)
    fit, path = plan.find_fit(preset, plan.parse_slice(slice_name), fits=fits)
    result = plan.plan(cfg, fit, float(days))
    result.update(fit=plan.shown(path), slice=slice_name, notes=plan.differences(preset, cfg, fit))
    return (f"```\n$ python -m gattn.params --preset {preset} --plan {slice_name} --days {days}\n"
            f"{plan.render(result, slice_name)}\n```\n")


BLOCKS = {"presets": presets_table, "slices": slices_table}


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

