"""The compute in a compiled step: FLOPs and HBM bytes per device per run, counted from XLA's HLO.

XLA's `cost_analysis()` counts a while body (a scanned layer stack, a microbatch scan) once, so
it cannot see a scan's trips nor the forward a rematerialised layer runs again. `count_flops`
reads the after-optimizations HLO text (`compiled.as_text()`, or an `--xla_dump_to` file; an SPMD
program's HLO is one device's), walks it as gattn/experiments/traffic.py does, and counts:

    dot / ragged-dot  2 x (output elements) x (product of the lhs contracting dims)
    convolution       2 x out batch x out features x rhs input features (= input features per
                      group) x, over the spatial dims, the (output position, kernel tap) pairs
                      that land on a real input element (padding, strides, lhs/rhs dilation;
                      XLA's own rule, so TPU's dot-as-convolution with its batch as a dilated
                      spatial dim counts exactly its dot)
    elementwise       1 per output element of each arithmetic op (add, multiply, compare,
                      select, ...), and n_inputs x (input - output elements) per reduce
    transcendentals   1 per output element of exp, log, tanh, logistic, sqrt, rsqrt, power, ...
                      (apart, as XLA keeps them; not in "flops")
    custom calls      Pallas TPU kernels (`tpu_custom_call`) from the `cost_estimate` that
                      `pallas_call(cost_estimate=pl.CostEstimate(...))` writes into the Mosaic
                      backend config ("cost_estimate"); a kernel named in `formulas` from that
                      formula ("formula": its FLOPs, or (FLOPs, HBM bytes) where the kernel
                      reads its operands more than once); any other is counted 0 and listed
                      ("unpriced")

Dots and elementwise ops inside fusion bodies count (a fusion's `calls=`, nested). Each while
body and condition counts times its trip count (nested loops multiply through; a loop whose
bound cannot be read counts once and is reported); a conditional counts its most expensive
branch (an upper bound: a step takes one); `call` and `async-start` count their computation.
Not counted as FLOPs: data movement (copy, convert, transpose, broadcast, slicing, gather,
scatter, sort), reduce-window, map and the reducers of collectives.

HBM bytes are an estimate in the spirit of XLA's "bytes accessed": every instruction of a
computation that runs (not inside fusion bodies, whose intermediates stay on chip) reads its
operands and writes its output, except

    no data moved   parameter, constant, get-tuple-element, tuple, bitcast, while, conditional,
                    call, async-start (its computation counts), after-all, add-dependency,
                    opt-barrier, partition-id, replica-id, domain, and every `*-done`/`*-update`
    once            other `*-start` ops (copy-start, all-gather-start, ...): their output tuple,
                    which holds the operand and the result
    slices          dynamic-slice / slice / gather read and write the slice only (gather: plus
                    its indices); dynamic-update-slice and scatter touch the update only (in place)
    fusions         a fusion operand used only by (dynamic-)slices / gathers reads those slices,
                    looking into nested fusions (a loop fusion that slices one layer out of a
                    stacked [L, ...] operand reads that layer, not the stack);
                    one only updated in place (dynamic-update-slice) reads nothing; a root
                    dynamic-update-slice writes its update, not the whole buffer
    custom calls    the estimate's bytes_accessed when priced from one
    on-chip buffers arrays in a non-default memory space (a layout's `S(n)`: TPU VMEM, host
                    memory) are not HBM traffic

Everything is per device per run (a train step); `count` gives TFLOPs and GiB for JSON.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np

from gattn.experiments.hlo import _ARRAY, Comp, Instr, _attr, parse, shape_bytes, trip_count

GIB = 2**30

_ARITH = {"add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "negate",
          "abs", "sign", "compare", "select", "clamp", "and", "or", "xor", "not", "floor", "ceil",
          "round-nearest-afz", "round-nearest-even", "shift-left", "shift-right-arithmetic",
          "shift-right-logical", "is-finite"}
_TRANSCENDENTAL = {"exponential", "exponential-minus-one", "log", "log-plus-one", "logistic", "tanh",
                   "sqrt", "rsqrt", "cbrt", "power", "sine", "cosine", "tan", "atan2", "erf"}
_NO_DATA = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
            "call", "async-start", "after-all", "add-dependency", "opt-barrier", "partition-id",
            "replica-id", "domain"}
_SLICES = {"dynamic-slice", "slice", "gather"}
_ALLOCATIONS = {"AllocateBuffer"}  # TPU custom calls that only reserve a buffer
_LAYOUT = re.compile(_ARRAY.pattern + r"(\{[^}]*\})?")


# ---- shapes ----------------------------------------------------------------------------------

def _ref(comp: Comp, op: str) -> Instr | None:
    return comp.instrs.get(op.split()[-1].lstrip("%"))


def _shape(comp: Comp, op: str) -> str:
    """The shape of operand `op`: its definition's, or the shape printed inline with it."""
    ref = _ref(comp, op)
    return ref.shape if ref else op


def _dims(shape: str) -> list[int]:
    """The dims of the first array in `shape`."""
    m = _ARRAY.search(shape)
    return [int(d) for d in filter(None, m.group(2).replace("<=", "").split(","))] if m else []


def _hbm(shape: str) -> float:
    """Bytes of `shape` held in HBM: arrays laid out in another memory space (`S(1)`) left out."""
    return sum(shape_bytes(m.group(0)) for m in _LAYOUT.finditer(shape)
               if not re.search(r"S\([1-9]\d*\)", m.group(3) or ""))


# ---- FLOPs of one instruction ----------------------------------------------------------------

def _dot_flops(comp: Comp, ins: Instr) -> float:
    lhs = _dims(_shape(comp, ins.operands[0]))
    contracting = [int(d) for d in re.findall(r"\d+", _attr(ins.attrs, "lhs_contracting_dims") or "")]
    return 2.0 * math.prod(_dims(ins.shape)) * math.prod(lhs[d] for d in contracting)


def _valid_pairs(n_in: int, n_out: int, size: int, stride: int, lo: int, lhs_dil: int, rhs_dil: int) -> int:
    """(output position, kernel tap) pairs of one spatial dim that read a real input element."""
    if n_out * size > 10**8:  # too many to enumerate: every pair
        return n_out * size
    idx = np.arange(n_out)[:, None] * stride + np.arange(size)[None, :] * rhs_dil - lo
    return int(np.count_nonzero((idx >= 0) & (idx <= (n_in - 1) * lhs_dil) & (idx % lhs_dil == 0)))


def _conv_flops(comp: Comp, ins: Instr) -> float:
    lhs_l, rhs_l, out_l = re.match(r"(\w+)_(\w+)->(\w+)", _attr(ins.attrs, "dim_labels")).groups()
    lhs, rhs, out = _dims(_shape(comp, ins.operands[0])), _dims(_shape(comp, ins.operands[1])), _dims(ins.shape)
    window = dict(re.findall(r"(\w+)=([^\s}]+)", _attr(ins.attrs, "window") or ""))
    spatial = sorted(c for c in out_l if c.isdigit())
    per_dim = lambda key: ([int(x) for x in window[key].split("x")] if key in window  # noqa: E731
                           else [1] * len(spatial))
    sizes = per_dim("size") if "size" in window else [rhs[rhs_l.index(c)] for c in spatial]
    stride, lhs_dil, rhs_dil = per_dim("stride"), per_dim("lhs_dilate"), per_dim("rhs_dilate")
    pads = [int(p.split("_")[0]) for p in window["pad"].split("x")] if "pad" in window else [0] * len(spatial)
    taps = math.prod(_valid_pairs(lhs[lhs_l.index(c)], out[out_l.index(c)], sizes[k], stride[k], pads[k],
                                  lhs_dil[k], rhs_dil[k]) for k, c in enumerate(spatial))
    return 2.0 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")] * taps


def _reduce_flops(comp: Comp, ins: Instr) -> float:
    n = len(ins.operands) // 2  # reduce(inputs..., inits...)
    return n * max(0, math.prod(_dims(_shape(comp, ins.operands[0]))) - math.prod(_dims(ins.shape)))


def _cost_estimate(attrs: str) -> dict | None:
    m = re.search(r'"cost_estimate"\s*:\s*\{([^}]*)\}', attrs)
    if not m:
        return None
    return {k: float(v) for k, v in re.findall(r'"(\w+)"\s*:\s*"?([-\d.eE+]+)"?', m.group(1))}


# ---- HBM bytes of one top-level instruction --------------------------------------------------

def _users(fused: Comp, name: str) -> list[tuple[Instr, int]]:
    """(user, operand index) of `name` in a fused computation, looking through bitcasts."""
    out = []
    for ins in fused.instrs.values():
        for i, op in enumerate(ins.operands):
            if op.split()[-1].lstrip("%") == name:
                out += _users(fused, ins.name) if ins.opcode == "bitcast" else [(ins, i)]
    return out


def _read(comps: dict, fused: Comp, name: str, full: float, depth: int = 0) -> float:
    """The bytes a fusion reads of its parameter `name` (`full` bytes): the slices its
    (dynamic-)slices and gathers take, nothing where it is only updated in place, looking into
    nested fusions (a loop fusion that slices one layer out of a stacked [L, ...] operand reads
    that layer, not the stack); `full` for any other use."""
    users = _users(fused, name)
    if not users or depth > 8:
        return full
    total = 0.0
    for user, k in users:
        if user.opcode in _SLICES and k == 0:
            total += shape_bytes(user.shape)
        elif user.opcode == "dynamic-update-slice" and k == 0:
            continue
        elif user.opcode == "fusion" and comps.get((_attr(user.attrs, "calls") or "").lstrip("%")):
            inner = comps[(_attr(user.attrs, "calls") or "").lstrip("%")]
            inner_params = {int(p.operands[0]): p.name for p in inner.instrs.values() if p.opcode == "parameter"}
            total += _read(comps, inner, inner_params.get(k, ""), full, depth + 1)
        else:
            return full
    return min(full, total)


def _fusion_bytes(comps: dict, comp: Comp, ins: Instr) -> float:
    fused = comps.get((_attr(ins.attrs, "calls") or "").lstrip("%"))
    if fused is None:
        return sum(_hbm(_shape(comp, op)) for op in ins.operands) + _hbm(ins.shape)
    params = {int(p.operands[0]): p.name for p in fused.instrs.values() if p.opcode == "parameter"}
    total = 0.0
    for i, op in enumerate(ins.operands):
        full = _hbm(_shape(comp, op))
        total += _read(comps, fused, params.get(i, ""), full) if full else 0
    root = fused.root
    roots = [_ref(fused, op) for op in root.operands] if root is not None and root.opcode == "tuple" else [root]
    if any(r is None for r in roots) or not _hbm(ins.shape):
        return total + _hbm(ins.shape)
    # each output written: a dynamic-update-slice root its update (in place), any other its shape
    return total + sum(shape_bytes(_shape(fused, r.operands[1])) if r.opcode == "dynamic-update-slice"
                       else _hbm(r.shape) for r in roots)


def _instr_bytes(comps: dict, comp: Comp, ins: Instr) -> float:
    op = ins.opcode
    if op in _NO_DATA or op.endswith("-done") or op.endswith("-update"):
        return 0.0
    if op.endswith("-start"):
        return _hbm(ins.shape)
    if op == "fusion":
        return _fusion_bytes(comps, comp, ins)
    if op in _SLICES:
        return 2 * _hbm(ins.shape) + (_hbm(_shape(comp, ins.operands[1])) if op == "gather" else 0)
    if op == "dynamic-update-slice":
        return 2 * _hbm(_shape(comp, ins.operands[1]))
    if op == "scatter":
        return _hbm(_shape(comp, ins.operands[1])) + 2 * _hbm(_shape(comp, ins.operands[-1]))
    return sum(_hbm(_shape(comp, o)) for o in ins.operands) + _hbm(ins.shape)


# ---- walking the program ---------------------------------------------------------------------

class _Tally:
    """FLOPs by kind, transcendentals, HBM bytes, custom calls {(target, name, priced_by, flops,
    bytes): runs}, loops not bounded: of one run of a computation; and where the HBM bytes go,
    {(opcode, fused computation, shape): [bytes, runs]} (`heaviest`)."""

    def __init__(self):
        self.flops, self.transcendentals, self.bytes, self.calls, self.unknown_loops = {}, 0.0, 0.0, {}, 0
        self.where: dict = {}

    def move(self, ins: Instr, nbytes: float):
        """`ins` (a top-level instruction) reads and writes `nbytes` of HBM."""
        if nbytes:
            self.bytes += nbytes
            key = (ins.opcode, (_attr(ins.attrs, "calls") or "").lstrip("%"), ins.shape[:120])
            spot = self.where.setdefault(key, [0.0, 0.0])
            spot[0], spot[1] = spot[0] + nbytes, spot[1] + 1

    def add(self, kind: str, flops: float):
        self.flops[kind] = self.flops.get(kind, 0.0) + flops

    def merge(self, other: _Tally, scale: float = 1.0):
        for kind, v in other.flops.items():
            self.add(kind, v * scale)
        self.transcendentals += other.transcendentals * scale
        self.bytes += other.bytes * scale
        for key, (nbytes, runs) in other.where.items():
            spot = self.where.setdefault(key, [0.0, 0.0])
            spot[0], spot[1] = spot[0] + nbytes * scale, spot[1] + runs * scale
        for key, runs in other.calls.items():
            self.calls[key] = self.calls.get(key, 0.0) + runs * scale
        self.unknown_loops += other.unknown_loops

    def total(self) -> float:
        return sum(self.flops.values())


def _custom_call(comp: Comp, ins: Instr, formulas: dict, tally: _Tally):
    target = (_attr(ins.attrs, "custom_call_target") or "").strip('"')
    name = re.sub(r"\.\d+$", "", ins.name)  # a Pallas kernel's name (pallas_call(name=...))
    est, formula = _cost_estimate(ins.attrs), formulas.get(name, formulas.get(target))
    nbytes = sum(_hbm(_shape(comp, o)) for o in ins.operands) + _hbm(ins.shape)
    if target in _ALLOCATIONS:  # reserves its output's memory; moves no data
        nbytes = 0.0
    if est is not None:
        flops, nbytes, priced_by = est.get("flops", 0.0), est.get("bytes_accessed", nbytes), "cost_estimate"
        tally.transcendentals += est.get("transcendentals", 0.0)
    elif formula is not None:
        priced = formula(ins.shape, [_shape(comp, o) for o in ins.operands])
        flops, nbytes = (priced if isinstance(priced, tuple) else (priced, nbytes))
        flops, nbytes, priced_by = float(flops), float(nbytes), "formula"
    else:
        flops, priced_by = 0.0, "unpriced"
    tally.add("custom_call", flops)
    key = (target, name, priced_by, flops, nbytes)
    tally.calls[key] = tally.calls.get(key, 0.0) + 1
    return nbytes


def _flops(comp: Comp, ins: Instr, tally: _Tally):
    op = ins.opcode
    if op in ("dot", "ragged-dot"):
        tally.add("dot", _dot_flops(comp, ins))
    elif op == "convolution":
        tally.add("convolution", _conv_flops(comp, ins))
    elif op in _ARITH:
        tally.add("elementwise", math.prod(_dims(ins.shape)))
    elif op == "reduce":
        tally.add("elementwise", _reduce_flops(comp, ins))
    elif op in _TRANSCENDENTAL:
        tally.transcendentals += math.prod(_dims(ins.shape))


def _walk(comps: dict, name: str, formulas: dict, memo: dict, stack=(), fused=False) -> _Tally:
    """One run of computation `name`, its callees included (`fused`: a fusion body, whose
    instructions move no HBM bytes of their own)."""
    if (name, fused) in memo:
        return memo[(name, fused)]
    tally, comp = _Tally(), comps.get(name)
    if comp is None or name in stack:
        return tally
    stack = (*stack, name)
    walk = lambda callee, inner=fused: _walk(comps, callee.lstrip("%"), formulas, memo, stack, inner)  # noqa: E731
    for ins in comp.instrs.values():
        if ins.opcode == "custom-call":
            nbytes = _custom_call(comp, ins, formulas, tally)
        else:
            _flops(comp, ins, tally)
            nbytes = 0.0 if fused else _instr_bytes(comps, comp, ins)
        if not fused:
            tally.move(ins, nbytes)
        if ins.opcode == "while":
            trips = trip_count(comps, comp, ins)
            if trips is None:
                tally.unknown_loops += 1
            for key in ("body", "condition"):
                if _attr(ins.attrs, key):
                    tally.merge(walk(_attr(ins.attrs, key)), 1 if trips is None else trips)
        elif ins.opcode == "conditional":
            names = re.findall(r"%?([\w.\-]+)", _attr(ins.attrs, "branch_computations") or "")
            names += [c for c in (_attr(ins.attrs, "true_computation"), _attr(ins.attrs, "false_computation")) if c]
            branches = [walk(b) for b in names]
            if branches:
                tally.merge(max(branches, key=lambda t: (t.total(), t.bytes)))
        elif ins.opcode == "fusion" and _attr(ins.attrs, "calls"):
            tally.merge(walk(_attr(ins.attrs, "calls"), True))
        elif ins.opcode in ("call", "async-start"):
            callee = _attr(ins.attrs, "to_apply") or _attr(ins.attrs, "calls")
            if callee:
                tally.merge(walk(callee))
    memo[(name, fused)] = tally
    return tally


def count_flops(hlo_text: str | os.PathLike, formulas: dict | None = None) -> dict:
    """FLOPs and HBM bytes of one run of the program on one device (see the module doc), exact:
    {"flops", "by_kind": {"dot", "convolution", "custom_call", "elementwise"}, "transcendentals",
    "hbm_bytes", "unknown_trip_counts", "custom_calls": [{"target", "name", "runs", "flops",
    "bytes", "priced_by"}]} (a custom call's flops and bytes summed over its runs).

    `hlo_text`: `compiled.as_text()`, or the Path of an XLA dump. `formulas`: {kernel name or
    custom_call_target: f(output shape, [operand shapes]) -> FLOPs of one run, or (FLOPs, HBM
    bytes)} for custom calls that carry no cost estimate (bytes default to operands + output)."""
    if isinstance(hlo_text, os.PathLike):
        hlo_text = Path(hlo_text).read_text()
    comps, entry, _ = parse(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    tally = _walk(comps, entry, formulas or {}, {})
    calls = [{"target": t, "name": n, "runs": int(round(r)), "flops": f * r, "bytes": b * r, "priced_by": p}
             for (t, n, p, f, b), r in tally.calls.items()]
    return {"flops": tally.total(), "by_kind": {k: v for k, v in sorted(tally.flops.items()) if v},
            "transcendentals": tally.transcendentals, "hbm_bytes": tally.bytes,
            "unknown_trip_counts": tally.unknown_loops,
            "custom_calls": sorted(calls, key=lambda c: (-c["flops"], c["name"]))}


def count(hlo_text: str | os.PathLike, formulas: dict | None = None) -> dict:
    """`count_flops` in TFLOPs and GiB per device per run (JSON-able): {"tflops", "by_kind":
    {kind: TFLOPs}, "hbm_gib", "unknown_trip_counts", "custom_calls": [{"target", "name", "runs",
    "tflops", "hbm_gib", "priced_by"}]}."""
    c = count_flops(hlo_text, formulas)
    tf, gib = (lambda x: round(x / 1e12, 4)), (lambda x: round(x / GIB, 3))  # noqa: E731
    return {"tflops": tf(c["flops"]), "by_kind": {k: tf(v) for k, v in c["by_kind"].items()},
            "hbm_gib": gib(c["hbm_bytes"]), "unknown_trip_counts": c["unknown_trip_counts"],
            "custom_calls": [{"target": x["target"], "name": x["name"], "runs": x["runs"], "tflops": tf(x["flops"]),
                              "hbm_gib": gib(x["bytes"]), "priced_by": x["priced_by"]} for x in c["custom_calls"]]}


def splash_formulas(block: int = 512, causal: bool = True) -> dict:
    """`formulas` for the splash attention kernels jax ships (jax.experimental.pallas.ops.tpu.
    splash_attention, what MaxText runs; they carry no cost estimate), priced as gattn's own flash
    kernel prices itself (gattn/kernels/flash_blocks.cost): per visible (query block, key block)
    pair of `block` x `block` scores (causal: the blocks on and below the diagonal), 4 x d FLOPs
    forward, 6 x d for dq (the scores again, dP, dq), 8 x d for dk and dv; HBM bytes: the outputs
    once, one side's inputs once and the other side's once per visible pair (forward and dq
    stream K and V past each query block; dkv streams the query side past each key block).
    Operands are read as jax passes them: q, k, v are the first three of rank 4, [B, H, S, d];
    the query side is every rank-4 operand but k and v."""
    def kernel(flops_per_score_d: int, streamed: str):
        def price(out_shape: str, operands: list[str]):
            rank4 = [o for o in operands if len(_dims(o)) == 4]
            q, k, v = rank4[:3]
            b, hq, sq, d = _dims(q)
            sk = _dims(k)[2]
            bq, bk = min(block, sq), min(block, sk)
            nq, nk = -(-sq // bq), -(-sk // bk)
            pairs = sum(min((i * bq + bq - 1) // bk, nk - 1) + 1 for i in range(nq)) if causal else nq * nk
            kv = _hbm(k) + _hbm(v)
            q_side = sum(_hbm(o) for o in rank4 if o is not k and o is not v)
            once, again = (q_side, kv * pairs / nk) if streamed == "kv" else (kv, q_side * pairs / nq)
            return flops_per_score_d * b * hq * pairs * bq * bk * d, _hbm(out_shape) + once + again
        return price
    fwd, dq, dkv = kernel(4, "kv"), kernel(6, "kv"), kernel(8, "q")
    names = {}
    for segmented in ("", "_segmented"):
        names |= {f"splash_mha_fwd{segmented}_residuals": fwd, f"splash_mha_fwd{segmented}_no_residuals": fwd,
                  f"splash_mha_dq{segmented}_no_residuals": dq, f"splash_mha_dkv{segmented}_no_residuals": dkv}
    return names


def heaviest(hlo_text: str | os.PathLike, n: int = 10, formulas: dict | None = None) -> list[dict]:
    """The `n` top-level instructions that move the most HBM bytes over a run of the program
    (their bytes times the runs of the loops they sit in, as `count_flops` counts them), to see
    what an HBM-bound step spends its time on: [{"opcode", "calls", "shape", "runs", "hbm_gib",
    "hbm_bytes"}]."""
    if isinstance(hlo_text, os.PathLike):
        hlo_text = Path(hlo_text).read_text()
    comps, entry, _ = parse(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    where = _walk(comps, entry, formulas or {}, {}).where
    top = sorted(where.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"opcode": op, "calls": calls, "shape": shape, "runs": int(round(r)), "hbm_gib": round(b / GIB, 1),
             "hbm_bytes": b} for (op, calls, shape), (b, r) in top]


def main(argv=None) -> int:
    import argparse  # noqa: PLC0415
    import json  # noqa: PLC0415

    ap = argparse.ArgumentParser(description="FLOPs and HBM bytes of a compiled program, counted from its HLO "
                                 "text (bench/fit_presets.py --hlo PATH writes a train step's).")
    ap.add_argument("hlo", help="the HLO text (compiled.as_text(), or an XLA dump's *after_optimizations.txt)")
    ap.add_argument("--top", type=int, default=10, help="list the N instructions that move the most HBM bytes")
    args = ap.parse_args(argv)
    path = Path(args.hlo)
    print(json.dumps({**count(path), "heaviest": heaviest(path, args.top)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
