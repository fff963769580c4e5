"""The network in a compiled step: the bytes each chip sends per step, counted from XLA's HLO.

XLA's `cost_analysis()` has no network term and counts a while body (a scanned layer stack, a
microbatch scan) once. `count` reads the after-optimizations HLO text of a compiled program
(`compiled.as_text()`, or an `--xla_dump_to` file), finds every collective, prices it with the
usual ring costs per chip (g = the size of the chip's replica group, `bytes` = its operands):

    all-gather          bytes x (g - 1)          (= output x (g - 1) / g)
    reduce-scatter      bytes x (g - 1) / g      (= output x (g - 1))
    all-reduce          2 x bytes x (g - 1) / g  (a reduce-scatter, then an all-gather)
    all-to-all          bytes x (g - 1) / g      (ragged-all-to-all: its input buffer, as if routed evenly)
    collective-permute  bytes, once per pair the chip is the source of

and multiplies each while body by its trip count (nested loops multiply through). Async forms
(`all-gather-start`, `async-start` wrapping a collective) count once; `-done` counts nothing. A
conditional counts its most expensive branch (an upper bound; a step takes one).

Every number is per chip per step, for the chip that sends the most (the max is what bounds a
step; the breakdowns are that chip's, so they add up). With `devices` (the jax Mesh) each
collective's bytes go to the mesh axes its group spans. DCN: libtpu compiles a multi-slice program
per slice, its collectives over slices turned into `send`s to the megascale runtime (typed
ALL_REDUCE, ALL_GATHER, ...; priced as above with g = the slices in the group), all DCN; in a
program over several slices (`slice_of`, or the devices' `slice_index`), a group spanning more
than one slice is DCN traffic, all of its bytes (simple and conservative: a hierarchical
all-reduce would send only part of them across slices).

`roofline` is the step model: max(FLOPs at the chip's bf16 peak, HBM bytes at its HBM bandwidth,
ICI bytes at its ICI bandwidth, DCN bytes at its DCN bandwidth), the no-overlap sum, and MFU as
the model's FLOPs over the modelled step; with `counted_flops` / `hbm_bytes` from
gattn.experiments.flops the compute term is what the compiled step runs (recompute included).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gattn.experiments.hlo import (Comp, Instr, _attr, _operand_bytes, _split_top, parse, replica_groups,  # noqa: F401
                                   shape_bytes, trip_count)

GIB = 2**30

# The ring cost per chip of each collective, as a multiple of its operands' bytes, for a group of g.
RING = {"all-gather": lambda g: g - 1, "reduce-scatter": lambda g: (g - 1) / g,
        "all-reduce": lambda g: 2 * (g - 1) / g, "all-to-all": lambda g: (g - 1) / g,
        "ragged-all-to-all": lambda g: (g - 1) / g}
KINDS = (*RING, "collective-permute")
_OPCODES = {k: k for k in KINDS} | {f"{k}-start": k for k in KINDS}  # -done / -update: nothing

# Chip constants. Bandwidths are what one chip can SEND: Google's "bidirectional ... per chip"
# figure halved (its Gbps figure is the one-way rate); bytes/s = Gbps / 8 x 1e9. The ICI figure is
# the chip's whole egress, all links busy: a ring over one torus axis uses fewer, so the ICI time
# here is a lower bound.
CHIPS = {
    # cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16, 95 GiB HBM, "Interchip Interconnect BW 4800 Gbps"
    # (the newer table: "Bidirectional ICI bandwidth per chip 1200 GBps"), "DCN bandwidth per chip 50 Gbps".
    # HBM: "HBM bandwidth 2765 GBps" (the same page), in GB/s (hbm_gbps is bytes, not bits).
    "v5p": {"bf16_tflops": 459, "hbm_gib": 95, "hbm_gbps": 2765, "ici_gbps": 4800, "dcn_gbps": 50},
    # cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16, 16 GB HBM, ICI 1600 Gbps ("400 GBps bidirectional");
    # DCN: "Per-host NIC configuration 2 x 100 Gbps" for 8 chips a host (= 6.4 Tbps per 256-chip Pod): 25 Gbps.
    # HBM: "HBM2 ... 819 GBps".
    "v5e": {"bf16_tflops": 197, "hbm_gib": 16, "hbm_gbps": 819, "ici_gbps": 1600, "dcn_gbps": 25},
    # cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, 32 GB HBM, "Bidirectional ICI bandwidth (per chip)
    # 800 GBps" (= 3200 Gbps one way; an older page said 3584 Gbps). DCN: not in the table read here;
    # ASSUMED 100 Gbps per chip (4 x 200 Gbps NICs for 8 chips a host); pass dcn_gbps= to roofline.
    # HBM: "HBM bandwidth 1640 GBps".
    "v6e": {"bf16_tflops": 918, "hbm_gib": 32, "hbm_gbps": 1640, "ici_gbps": 3200, "dcn_gbps": 100},
}
DEVICE_KINDS = {"TPU v5": "v5p", "TPU v5p": "v5p", "TPU v5 lite": "v5e", "TPU v5e": "v5e",
                "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


# ---- counting --------------------------------------------------------------------------------

class _Tally:
    """Per-chip bytes by (kind, axes, link), the number of collectives run, loops not bounded."""

    def __init__(self, n):
        self.n, self.bytes, self.ops, self.unknown_loops = n, {}, 0.0, 0

    def add(self, key, per_chip, scale=1.0):
        self.bytes[key] = self.bytes.get(key, np.zeros(self.n)) + per_chip * scale

    def merge(self, other, scale=1.0):
        for key, v in other.bytes.items():
            self.add(key, v, scale)
        self.ops += other.ops * scale
        self.unknown_loops += other.unknown_loops

    def per_chip(self):
        return sum(self.bytes.values(), np.zeros(self.n))


@dataclass
class _Layout:
    """The program's devices: its ids 0..n-1 (one slice's chips in a multi-slice TPU program, which
    is compiled per slice) -> positions in the mesh, device ids -> positions, slices."""
    n: int
    shape: tuple | None = None  # the mesh
    names: tuple | None = None
    positions: np.ndarray | None = None  # program id -> flat mesh position
    by_id: dict | None = None  # device id -> flat mesh position
    slices: np.ndarray | None = None  # flat mesh position -> slice
    slice_ids: list | None = None  # the slices, sorted

    def key(self, group, device_ids=False) -> tuple[str, str]:
        """(the mesh axes `group` spans, "ici" or "dcn") of a group of program ids (or device ids)."""
        if self.shape is None:
            return "", "ici"
        pos = [self.by_id[int(i)] for i in group] if device_ids else list(self.positions[list(group)])
        coords = np.asarray(np.unravel_index(pos, self.shape))
        axes = ",".join(a for a, c in zip(self.names, coords) if len(set(c)) > 1)
        return axes, ("dcn" if self.slices is not None and len(set(self.slices[pos])) > 1 else "ici")

    def slice_group(self, slices, local: int) -> list[int]:
        """Device ids of the program's chip `local` in each of `slices` (indices into slice_ids)."""
        flat = np.arange(math.prod(self.shape))
        ids = {v: k for k, v in self.by_id.items()}
        return [ids[int(flat[self.slices == self.slice_ids[s]][local])] for s in slices]


def _layout(devices, slice_of, n: int) -> _Layout:
    if devices is None:
        if slice_of is None:
            return _Layout(n)
        devices = (np.arange(n), ("devices",))
    if hasattr(devices, "devices") and hasattr(devices, "axis_names"):  # a jax Mesh
        shape, names = devices.devices.shape, tuple(devices.axis_names)
        ids = np.asarray(devices.device_ids).reshape(-1)
        if slice_of is None and any(getattr(d, "slice_index", None) is not None for d in devices.devices.flat):
            slice_of = {d.id: d.slice_index or 0 for d in devices.devices.flat}
    else:  # (device id array, axis names)
        arr, names = np.asarray(devices[0]), tuple(devices[1])
        shape, ids = arr.shape, arr.reshape(-1)
    get = (slice_of if callable(slice_of) else slice_of.__getitem__) if slice_of is not None else (lambda i: 0)
    slices = np.asarray([get(int(i)) for i in ids])
    slice_ids = sorted(set(slices.tolist()))
    if n == len(ids):  # one program for the whole mesh
        positions = np.arange(n)
    elif n * len(slice_ids) == len(ids):  # a program per slice: slice 0's chips, in mesh order
        positions = np.flatnonzero(slices == slice_ids[0])
    else:
        raise ValueError(f"the program runs on {n} devices, the mesh has {len(ids)} in {len(slice_ids)} slices")
    return _Layout(n, shape, names, positions, {int(i): k for k, i in enumerate(ids)},
                   slices if slice_of is not None else None, slice_ids)


# DCN collectives of a multi-slice TPU program: `send`s to the megascale runtime, typed by
# `_xla_megascale_transfer_type`, over the devices in `_xla_megascale_target`.
_MEGASCALE = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
              "ALL_TO_ALL": "all-to-all", "ONE_TO_ONE": "collective-permute"}


def _megascale(comp: Comp, ins: Instr, layout: _Layout, tally: _Tally):
    """A megascale send, as its collective over slices would send. `_xla_megascale_target` is
    `"{1,2}x{0:3}"` (slices 1 and 2, 1-based, x the program's chips 0-3: each chip with its
    counterparts), groups of device ids `{{100000,200000},...}`, or pairs `{{100000->200000},...}`.
    Every chip of the program sends (an SPMD program): the bytes go to all of them."""
    transfer = re.search(r'_xla_megascale_transfer_type="?(\w+)', ins.attrs).group(1)
    kind = _MEGASCALE.get(transfer, "collective-permute")
    target = (_attr(ins.attrs, "_xla_megascale_target") or "").strip('"')
    size = _operand_bytes(comp, ins, {0})
    cross = re.fullmatch(r"\{([\d,]+)\}x\{(\d+):(\d+)\}", target)
    if cross:
        slices = [int(x) - 1 for x in cross.group(1).split(",")]
        group = layout.slice_group(slices, int(cross.group(2))) if layout.slice_ids and layout.shape else None
        g, ids = len(slices), group
    elif "->" in target:
        pairs = re.findall(r"(\d+)\s*->\s*(\d+)", target)
        sources = [a for a, _ in pairs]
        g, ids = 2, [int(x) for x in pairs[0]] if pairs else None
        size *= max((sources.count(a) for a in set(sources)), default=0)
    else:
        groups = [[int(x) for x in grp.split(",")] for grp in re.findall(r"\{([\d,]+)\}", target)]
        g, ids = max(map(len, groups), default=1), (groups[0] if groups else None)
    if g > 1:
        axes = layout.key(ids, device_ids=True)[0] if ids and layout.shape else ""
        cost = 1 if kind == "collective-permute" else RING[kind](g)
        tally.add((kind, axes, "dcn"), np.full(layout.n, size * cost))
    tally.ops += 1


def _collective(comp: Comp, ins: Instr, kind: str, layout: _Layout, tally: _Tally):
    n = layout.n
    if kind == "collective-permute":  # the in-place form (slice_sizes=) sends its operand 0 only
        size = _operand_bytes(comp, ins, {0} if "slice_sizes=" in ins.attrs else None)
        pairs = re.findall(r"\{(\d+),(\d+)\}", _attr(ins.attrs, "source_target_pairs") or "")
        for s, t in ((int(s), int(t)) for s, t in pairs):
            if s != t:
                per_chip = np.zeros(n)
                per_chip[s] = size
                tally.add((kind, *layout.key((s, t))), per_chip)
    else:
        size = _operand_bytes(comp, ins, {0} if kind == "ragged-all-to-all" else None)
        for group in replica_groups(_attr(ins.attrs, "replica_groups") or "{}", n):
            if len(group) > 1:
                per_chip = np.zeros(n)
                per_chip[list(group)] = size * RING[kind](len(group))
                tally.add((kind, *layout.key(group)), per_chip)
    tally.ops += 1


def _reduce_scatter_fusion(ins: Instr) -> bool:
    """TPU's all-reduce-scatter fusion: an all-reduce and a dynamic-slice of its shard, fused and
    emitted as a reduce-scatter (`kind=kCustom, calls=%all-reduce-scatter...`)."""
    callee = _attr(ins.attrs, "calls") or ""
    return ins.opcode == "fusion" and ("all-reduce-scatter" in callee or "AllReduceScatter" in ins.attrs)


def _walk(comps: dict, name: str, layout: _Layout, memo: dict, stack=(), scatter=False) -> _Tally:
    """The traffic of one run of computation `name`, its callees included (`scatter`: the body of
    an all-reduce-scatter fusion, whose all-reduce sends what a reduce-scatter sends)."""
    if (name, scatter) in memo:
        return memo[(name, scatter)]
    tally = _Tally(layout.n)
    comp = comps.get(name)
    if comp is None or name in stack:
        return tally
    stack = (*stack, name)
    for ins in comp.instrs.values():
        kind = _OPCODES.get(ins.opcode)
        if kind:
            _collective(comp, ins, "reduce-scatter" if scatter and kind == "all-reduce" else kind, layout, tally)
        elif ins.opcode == "send" and "_xla_megascale_transfer_type" in ins.attrs:
            _megascale(comp, ins, layout, tally)
        if ins.opcode == "while":
            trips = trip_count(comps, comp, ins)
            if trips is None:
                tally.unknown_loops += 1
                trips = 1
            for key in ("body", "condition"):
                callee = _attr(ins.attrs, key)
                if callee:
                    tally.merge(_walk(comps, callee.lstrip("%"), layout, memo, stack, scatter), trips)
        elif ins.opcode == "conditional":
            names = re.findall(r"%?([\w.\-]+)", _attr(ins.attrs, "branch_computations") or "")
            names += [c.lstrip("%") for c in (_attr(ins.attrs, "true_computation"),
                                              _attr(ins.attrs, "false_computation")) if c]
            branches = [_walk(comps, b, layout, memo, stack, scatter) for b in names]
            if branches:  # the most expensive branch: an upper bound on the one taken
                tally.merge(max(branches, key=lambda t: t.per_chip().max(initial=0)))
        elif ins.opcode not in ("async-done", "async-update"):  # async-start, call, fusion, ...
            for key in ("calls", "to_apply"):
                callee = _attr(ins.attrs, key)
                if callee and callee.lstrip("%") in comps:
                    tally.merge(_walk(comps, callee.lstrip("%"), layout, memo, stack,
                                      scatter or _reduce_scatter_fusion(ins)))
    memo[(name, scatter)] = tally
    return tally


def count_bytes(hlo_text: str | os.PathLike, devices=None, slice_of=None) -> dict:
    """The bytes each chip sends per step (see the module doc), exact: {"total", "ici", "dcn",
    "by_kind", "by_axes", "collectives", "chip", "mean_total", "unknown_trip_counts"}.

    `hlo_text`: `compiled.as_text()`, or the Path of an XLA dump (`--xla_dump_to=DIR
    --xla_dump_hlo_as_text`: DIR/*.after_optimizations.txt).
    `devices`: a jax Mesh, or (device id array, axis names): the mesh the program was compiled
    for (program id i is its i-th device, flat; a multi-slice TPU program, compiled per slice,
    runs on slice 0's chips in mesh order); without it "by_axes" is empty. `slice_of`: device id
    -> slice (a dict or a function); by default the Mesh devices' `slice_index`, else one slice."""
    if isinstance(hlo_text, os.PathLike):  # an XLA dump file (*after_optimizations.txt)
        hlo_text = Path(hlo_text).read_text()
    comps, entry, module = parse(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    n = module.get("num_partitions", 1) * module.get("replica_count", 1)
    if devices is not None and "num_partitions" not in module:  # a dump without the module's header
        n = int(np.asarray(devices.devices if hasattr(devices, "devices") else devices[0]).size)
    layout = _layout(devices, slice_of, n)
    tally = _walk(comps, entry, layout, {})
    chip = int(np.argmax(tally.per_chip())) if tally.bytes else 0
    by_kind, by_axes, by_link = {}, {}, {"ici": 0.0, "dcn": 0.0}
    for (kind, axes, link), v in sorted(tally.bytes.items()):
        b = float(v[chip])
        by_kind[kind] = by_kind.get(kind, 0.0) + b
        if devices is not None:
            by_axes[axes] = by_axes.get(axes, 0.0) + b
        by_link[link] += b
    return {"total": by_link["ici"] + by_link["dcn"], **by_link,
            "by_kind": {k: v for k, v in by_kind.items() if v},
            "by_axes": {k: v for k, v in by_axes.items() if v},
            "collectives": int(round(tally.ops)), "chip": chip,
            "mean_total": float(tally.per_chip().mean()) if tally.bytes else 0.0,
            "unknown_trip_counts": tally.unknown_loops}


def count(hlo_text: str | os.PathLike, devices=None, slice_of=None) -> dict:
    """`count_bytes` in GiB per chip per step (JSON-able): {"total_gib", "ici_gib", "dcn_gib",
    "by_kind": {kind: GiB}, "by_axes": {"data,model": GiB}, "collectives", "chip",
    "mean_total_gib", "unknown_trip_counts"} (loops whose bound could not be read count once)."""
    b = count_bytes(hlo_text, devices, slice_of)
    gib = lambda x: round(x / GIB, 3)  # noqa: E731
    return {"total_gib": gib(b["total"]), "ici_gib": gib(b["ici"]), "dcn_gib": gib(b["dcn"]),
            "by_kind": {k: gib(v) for k, v in b["by_kind"].items() if gib(v)},
            "by_axes": {k: gib(v) for k, v in b["by_axes"].items() if gib(v)},
            "collectives": b["collectives"], "chip": b["chip"], "mean_total_gib": gib(b["mean_total"]),
            "unknown_trip_counts": b["unknown_trip_counts"]}


def roofline(model_flops_per_chip: float, traffic: dict, chip: str, *, ici_gbps=None, dcn_gbps=None,
             counted_flops=None, hbm_bytes=None) -> dict:
    """The step model: a step-time bound from what each chip computes, reads and sends per step,
    each term at the chip's peak (CHIPS): FLOPs at the bf16 peak, HBM bytes at the HBM bandwidth,
    ICI and DCN bytes sent at theirs. The step is their max (perfect overlap: a lower bound), the
    no-overlap sum beside it; MFU is the model's FLOPs (6 N T + attention, no recompute) at the
    peak over the modelled step, so recomputation and memory traffic lower it.
    `counted_flops`: the FLOPs the compiled step runs per chip (gattn.experiments.flops: every dot
    and convolution, loop bodies times their trips, recompute included); without it the compute
    term is the model's FLOPs, blind to rematerialisation. `hbm_bytes`: the bytes the step reads
    and writes in HBM (the same counter); without it no memory term.
    `traffic`: `count`'s or `count_bytes`' dict; `chip`: "v5p" or a device_kind ("TPU v5")."""
    key = DEVICE_KINDS.get(chip, chip)
    spec = CHIPS[key]
    ici = traffic["ici_gib"] * GIB if "ici_gib" in traffic else traffic["ici"]
    dcn = traffic["dcn_gib"] * GIB if "dcn_gib" in traffic else traffic["dcn"]
    peak = spec["bf16_tflops"] * 1e12
    flops = model_flops_per_chip if counted_flops is None else counted_flops
    terms = {"compute_s": flops / peak}
    if hbm_bytes is not None:
        terms["hbm_s"] = hbm_bytes / (spec["hbm_gbps"] * 1e9)
    terms.update({"ici_s": ici / ((ici_gbps or spec["ici_gbps"]) * 1e9 / 8),
                  "dcn_s": dcn / ((dcn_gbps or spec["dcn_gbps"]) * 1e9 / 8)})
    step, serial = max(terms.values()), sum(terms.values())
    model_s = model_flops_per_chip / peak
    return {"chip": key, **{k: round(v, 4) for k, v in terms.items()},
            "step_s": round(step, 4), "bound": max(terms, key=terms.get)[:-2],
            "mfu": round(model_s / step, 4) if step else None,
            "no_overlap_step_s": round(serial, 4),
            "no_overlap_mfu": round(model_s / serial, 4) if serial else None,
            "compute_counts": "counted" if counted_flops is not None else "model"}
