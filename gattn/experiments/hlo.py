"""Reading XLA's after-optimizations HLO text: its computations and instructions (`parse`), the
bytes of a shape, the replica groups of a collective in every form XLA prints, and a while loop's
trip count. gattn/experiments/traffic.py counts a program's network bytes with it."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

import numpy as np

# Bytes per element. f8 / f4 / s4 / s2 types by their prefix (f8e4m3fn, f8e5m2, f4e2m1fn, ...).
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
               "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
               "s2": 0.25, "u2": 0.25, "token": 0}
_ARRAY = re.compile(r"\b(pred|token|bf16|[fsuc]\d+(?:e\d+m\d+\w*)?)\[([^\]]*)\]")

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
