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

`roofline` turns the count into a step-time bound: max(FLOPs at the chip's bf16 peak, ICI bytes at
its ICI bandwidth, DCN bytes at its DCN bandwidth), the MFU that implies, and the no-overlap sum.
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GIB = 2**30

# Bytes per element. f8 / f4 / s4 / s2 types by their prefix (f8e4m3fn, f8e5m2, f4e2m1fn, ...).
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
               "s2": 0.25, "u2": 0.25, "token": 0}
_ARRAY = re.compile(r"\b(pred|token|bf16|[fsuc]\d+(?:e\d+m\d+\w*)?)\[([^\]]*)\]")

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
    "v5p": {"bf16_tflops": 459, "hbm_gib": 95, "ici_gbps": 4800, "dcn_gbps": 50},
    # cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16, 16 GB HBM, ICI 1600 Gbps ("400 GBps bidirectional");
    # DCN: "Per-host NIC configuration 2 x 100 Gbps" for 8 chips a host (= 6.4 Tbps per 256-chip Pod): 25 Gbps.
    "v5e": {"bf16_tflops": 197, "hbm_gib": 16, "ici_gbps": 1600, "dcn_gbps": 25},
    # cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, 32 GB HBM, "Bidirectional ICI bandwidth (per chip)
    # 800 GBps" (= 3200 Gbps one way; an older page said 3584 Gbps). DCN: not in the table read here;
    # ASSUMED 100 Gbps per chip (4 x 200 Gbps NICs for 8 chips a host); pass dcn_gbps= to roofline.
    "v6e": {"bf16_tflops": 918, "hbm_gib": 32, "ici_gbps": 3200, "dcn_gbps": 100},
}
DEVICE_KINDS = {"TPU v5": "v5p", "TPU v5p": "v5p", "TPU v5 lite": "v5e", "TPU v5e": "v5e",
                "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


# ---- HLO text -> computations of instructions -------------------------------------------------

@dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False


@dataclass
class Comp:
    name: str
    instrs: dict[str, Instr] = field(default_factory=dict)
    root: Instr | None = None


_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(%]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def _balanced(s: str, i: int) -> int:
    """The index just past the bracket group opening at s[i]."""
    pairs, depth = {"(": ")", "{": "}", "[": "]"}, []
    for j in range(i, len(s)):
        c = s[j]
        if c in pairs:
            depth.append(pairs[c])
        elif depth and c == depth[-1]:
            depth.pop()
            if not depth:
                return j + 1
    return len(s)


def _split_top(s: str) -> list[str]:
    """`s` split at the commas outside any brackets."""
    out, depth, start = [], 0, 0
    for j, c in enumerate(s):
        depth += c in "([{"
        depth -= c in ")]}"
        if c == "," and depth == 0:
            out.append(s[start:j])
            start = j + 1
    return [p.strip() for p in [*out, s[start:]] if p.strip()]


def _instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        sm = re.match(r"[\w]+\[[^\]]*\](\{[^}]*\})?", rest)
        end = sm.end() if sm else 0
    shape, rest = rest[:end], rest[end:]
    om = re.match(r"\s*([a-z][\w\-]*)\(", rest)
    if not om:
        return None
    close = _balanced(rest, om.end() - 1)
    operands = re.sub(r"/\*.*?\*/", "", rest[om.end():close - 1])  # long lists carry /*index=5*/
    return Instr(name, shape, om.group(1), _split_top(operands), rest[close:], root)


def parse(hlo_text: str) -> tuple[dict[str, Comp], str | None, dict]:
    """({name: computation}, the entry's name, module attributes). A computation ends only at a
    line that is exactly `}` (custom calls carry multi-line configs); a line that does not open an
    instruction continues the previous one."""
    comps, entry, comp, last = {}, None, None, None
    module = {}
    for line in hlo_text.splitlines():
        if comp is None:
            if line.startswith("HloModule"):
                for key in ("num_partitions", "replica_count"):
                    m = re.search(rf"\b{key}=(\d+)", line)
                    if m:
                        module[key] = int(m.group(1))
            m = _HEADER.match(line)
            if m:
                comp, last = Comp(m.group(2)), None
                entry = comp.name if m.group(1) else entry
            continue
        if line.rstrip("\r") == "}":
            comps[comp.name], comp = comp, None
            continue
        ins = _instr(line)
        if ins is None:
            if last is not None:  # a continuation line (a multi-line config)
                last.attrs += "\n" + line
            continue
        comp.instrs[ins.name] = last = ins
        if ins.root:
            comp.root = ins
    return comps, entry, module


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape: `bf16[8,128]{1,0}`, `f32[]`, a tuple of them, dynamic `<=` dims."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        size = DTYPE_BYTES.get(dtype)
        if size is None:
            bits = re.match(r"[fsuc](\d+)", dtype)
            size = int(bits.group(1)) / 8 if bits else 0
        n = 1
        for d in filter(None, dims.replace("<=", "").split(",")):
            n *= int(d)
        total += n * size
    return total


def _operand_bytes(comp: Comp, ins: Instr, which=None) -> float:
    """Bytes of the operands (all, or the indices `which`), by their definitions in `comp`, or by a
    shape printed inline with the operand."""
    total = 0.0
    for i, op in enumerate(ins.operands):
        if which is not None and i not in which:
            continue
        ref = comp.instrs.get(op.split()[-1].lstrip("%"))
        total += shape_bytes(ref.shape if ref else op)
    return total


# ---- replica groups --------------------------------------------------------------------------

def _iota(text: str) -> np.ndarray:
    """`[n,g]<=[d...]T(p...)`: arange(prod d) reshaped to d, transposed by p, reshaped to [n, g]."""
    m = re.fullmatch(r"\s*\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
    out, dims = [int(x) for x in m.group(1).split(",")], [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(out)


def _mesh_groups(text: str, n: int) -> np.ndarray:
    """`mesh['a'=2,'b'=4] {'b'}`, `mesh[a=2,b=4], device_ids=([4,2]T(1,0)) {a:(1)2}`: the groups of
    the mesh-axes form (XLA's MeshAxesReplicaGroupList): the device array reshaped to the axes
    (sub-axes `x:(pre)size` split their axis), the grouped axes moved last, one group per row."""
    m = re.match(r"\s*mesh\[([^\]]*)\](?:,\s*device_ids=\((.*)\))?\s*\{([^}]*)\}\s*$", text, re.S)
    axes = [(a.strip().strip("'\""), int(s)) for a, s in (p.split("=") for p in _split_top(m.group(1)))]
    sizes = [s for _, s in axes]
    dev = (m.group(2) or "").strip()
    short = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", dev)  # [8,4]T(1,0): an iota, transposed
    if not dev:
        ids = np.arange(math.prod(sizes))
    elif "<=" in dev:
        ids = _iota(dev).reshape(-1)
    elif short:
        ids = np.arange(math.prod(sizes)).reshape([int(x) for x in short.group(1).split(",")])
        ids = (ids.transpose([int(x) for x in short.group(2).split(",")]) if short.group(2) else ids).reshape(-1)
    else:  # an explicit list
        ids = np.asarray([int(x) for x in re.findall(r"\d+", dev)])
    refs = []  # (mesh axis index, pre, size)
    for ref in _split_top(m.group(3)):
        rm = re.fullmatch(r"['\"]?([^:'\"]+)['\"]?(?::\((\d+)\)(\d+))?", ref.strip())
        i = [a for a, _ in axes].index(rm.group(1))
        refs.append((i, int(rm.group(2)), int(rm.group(3))) if rm.group(2) else (i, 1, sizes[i]))
    dims, grouped = [], []
    for i, size in enumerate(sizes):  # split each axis at its sub-axes' bounds, major to minor
        bounds = sorted({1, size, *(b for j, p, s in refs if j == i for b in (p, p * s))})
        for lo, hi in zip(bounds, bounds[1:]):
            if (i, lo, hi // lo) in refs:
                grouped.append((refs.index((i, lo, hi // lo)), len(dims)))
            dims.append(hi // lo)
    grouped = [d for _, d in sorted(grouped)]
    rest = [d for d in range(len(dims)) if d not in grouped]
    g = math.prod(dims[d] for d in grouped)
    return ids.reshape(dims).transpose(rest + grouped).reshape(-1, g)


@functools.lru_cache(maxsize=4096)
def replica_groups(text: str, n: int) -> tuple[tuple[int, ...], ...]:
    """The groups of a `replica_groups=` value, in any form XLA prints: `{{0,1},{2,3}}`, `{}` (all
    `n` devices), the iota form `[2,4]<=[8]` / `[4,8]<=[8,4]T(1,0)`, the mesh-axes form."""
    text = text.strip()
    if text.startswith("mesh"):
        rows = _mesh_groups(text, n)
    elif text.startswith("maximal_mesh"):
        return ((0,),)
    elif text.startswith("["):
        rows = _iota(text)
    else:
        rows = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]
        if not rows:
            rows = [list(range(n))]
    return tuple(tuple(int(x) for x in r) for r in rows)


def _attr(attrs: str, key: str) -> str | None:
    """The raw text of `key=` in an instruction's attributes (braces/brackets/mesh form balanced)."""
    m = re.search(rf"\b{key}=", attrs)
    if not m:
        return None
    i = m.end()
    if attrs.startswith("mesh[", i):  # mesh[...] [, device_ids=(...)] {axes}
        end = _balanced(attrs, i + 4)
        d = re.match(r",\s*device_ids=", attrs[end:])
        if d:
            end = _balanced(attrs, end + d.end())
        b = re.match(r"\s*\{", attrs[end:])
        return attrs[i:_balanced(attrs, end + b.end() - 1) if b else end]
    if attrs.startswith("maximal_mesh[", i):
        return attrs[i:_balanced(attrs, i + 12)]
    if attrs[i] == '"':
        return attrs[i:attrs.index('"', i + 1) + 1]
    if attrs[i] in "{[":
        end = _balanced(attrs, i)
        if attrs[i] == "[":  # the iota form: [n,g]<=[d...] and an optional T(...)
            t = re.match(r"<=\[[\d,]+\](T\([\d,]+\))?", attrs[end:])
            end += t.end() if t else 0
        return attrs[i:end]
    return re.match(r"[^,\s]*", attrs[i:]).group(0)


# ---- loops -----------------------------------------------------------------------------------

def _resolve(comps: dict, comp: Comp, name: str, depth: int = 0):
    """('const', v) / ('iv', tuple index) / None: what `name` in `comp` is, through copies,
    converts, bitcasts and fusion parameters."""
    ins = comp.instrs.get(name.split()[-1].lstrip("%"))
    if ins is None or depth > 20:
        return None
    if ins.opcode == "constant":
        m = re.match(r"\s*(-?\d+)", ins.operands[0] if ins.operands else "")
        return ("const", int(m.group(1))) if m else None
    if ins.opcode == "get-tuple-element":
        m = re.search(r"index=(\d+)", ins.attrs)
        src = comp.instrs.get(ins.operands[0].split()[-1].lstrip("%"))
        return ("iv", int(m.group(1))) if m and src is not None and src.opcode == "parameter" else None
    if ins.opcode in ("copy", "convert", "bitcast", "reshape") and ins.operands:
        return _resolve(comps, comp, ins.operands[0], depth + 1)
    return None


_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}


def _compare(comps: dict, cond: Comp):
    """(direction, bound, induction variable's tuple index) of a loop condition, or None: its ROOT
    `compare(iv, constant)` (either order), or a fusion whose fused ROOT is that compare."""
    root = cond.root
    if root is None:
        return None
    if root.opcode == "fusion":
        fused = comps.get((_attr(root.attrs, "calls") or "").lstrip("%"))
        cmp = fused.root if fused else None
        if cmp is None or cmp.opcode != "compare":
            return None

        def side(op):
            ins = fused.instrs.get(op.split()[-1].lstrip("%"))
            if ins is not None and ins.opcode == "parameter":
                return _resolve(comps, cond, root.operands[int(ins.operands[0])])
            return _resolve(comps, fused, op)
    elif root.opcode == "compare":
        cmp, side = root, (lambda op: _resolve(comps, cond, op))
    else:
        return None
    direction = re.search(r"direction=(\w+)", cmp.attrs)
    if direction is None or len(cmp.operands) != 2:
        return None
    direction = direction.group(1)
    a, b = side(cmp.operands[0]), side(cmp.operands[1])
    if a and b and a[0] == "const" and b[0] == "iv":
        a, b, direction = b, a, _FLIP[direction]
    if not (a and b and a[0] == "iv" and b[0] == "const"):
        return None
    return direction, b[1], a[1]


def trip_count(comps: dict, caller: Comp, loop: Instr) -> int | None:
    """A while loop's trip count: `known_trip_count` in its backend_config when XLA wrote one, else
    read from its condition (`iv < bound`, LT/LE/GT/GE/NE) with the induction variable's start (the
    constant it is initialized from, else 0) and step (the constant the body adds, else 1)."""
    m = re.search(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)', loop.attrs)
    if m:
        return int(m.group(1))
    cond = comps.get((_attr(loop.attrs, "condition") or "").lstrip("%"))
    body = comps.get((_attr(loop.attrs, "body") or "").lstrip("%"))
    found = cond and _compare(comps, cond)
    if not found:
        return None
    direction, bound, k = found
    start, step = 0, 1
    init = caller.instrs.get(loop.operands[0].split()[-1].lstrip("%")) if loop.operands else None
    if init is not None and init.opcode == "tuple" and k < len(init.operands):
        v = _resolve(comps, caller, init.operands[k])
        start = v[1] if v and v[0] == "const" else 0
    if body is not None and body.root is not None and body.root.opcode == "tuple" and k < len(body.root.operands):
        nxt = body.instrs.get(body.root.operands[k].split()[-1].lstrip("%"))
        if nxt is not None and nxt.opcode in ("add", "subtract"):
            ops = [_resolve(comps, body, o) for o in nxt.operands]
            consts = [v[1] for v in ops if v and v[0] == "const"]
            if consts and any(v and v == ("iv", k) for v in ops):
                step = consts[0] if nxt.opcode == "add" else -consts[0]
    if step == 0:
        return None
    span = {"LT": bound - start, "LE": bound - start + (1 if step > 0 else -1),
            "GT": bound - start, "GE": bound - start + (1 if step > 0 else -1), "NE": bound - start}.get(direction)
    if span is None:
        return None
    return max(0, -(-span // step) if (span > 0) == (step > 0) else 0)


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


def roofline(model_flops_per_chip: float, traffic: dict, chip: str, *, ici_gbps=None, dcn_gbps=None) -> dict:
    """A step-time bound from FLOPs and network bytes per chip: each term at the chip's peak
    (bf16 FLOPs, ICI and DCN bytes sent; CHIPS), the step = their max (perfect overlap: a lower
    bound), the MFU it implies (FLOPs time / step), and the no-overlap sum with its MFU.
    `traffic`: `count`'s or `count_bytes`' dict; `chip`: "v5p" or a device_kind ("TPU v5")."""
    key = DEVICE_KINDS.get(chip, chip)
    spec = CHIPS[key]
    ici = traffic["ici_gib"] * GIB if "ici_gib" in traffic else traffic["ici"]
    dcn = traffic["dcn_gib"] * GIB if "dcn_gib" in traffic else traffic["dcn"]
    terms = {"compute_s": model_flops_per_chip / (spec["bf16_tflops"] * 1e12),
             "ici_s": ici / ((ici_gbps or spec["ici_gbps"]) * 1e9 / 8),
             "dcn_s": dcn / ((dcn_gbps or spec["dcn_gbps"]) * 1e9 / 8)}
    step, serial = max(terms.values()), sum(terms.values())
    return {"chip": key, **{k: round(v, 4) for k, v in terms.items()},
            "step_s": round(step, 4), "bound": max(terms, key=terms.get)[:-2],
            "mfu": round(terms["compute_s"] / step, 4) if step else None,
            "no_overlap_step_s": round(serial, 4),
            "no_overlap_mfu": round(terms["compute_s"] / serial, 4) if serial else None}
