"""`python -m gattn.params`: parameter counts of any config or preset, the paper's Table 1 and
Table 6 "Added Param" columns computed from the built models at the paper's dimensions, and the
provenance of every setting of the paper-scale presets (gattn/experiments/provenance.py).

    python -m gattn.params --table1 --json
    python -m gattn.params --table6
    python -m gattn.params --preset moe_15a2b [--variant sdpa_elementwise] --json
    python -m gattn.params --provenance [PRESET ...] [--json]
    python -m gattn.params --plan SLICE --preset PRESET --days D [--tokens-per-sec N] [--json]
        (a reservation planned from the preset's modelled step: `--plan --help` lists its options)
"""

from __future__ import annotations

import argparse
import json
import math

from gattn import cli, variants
from gattn.config import ModelConfig
from gattn.experiments import provenance
from gattn.model.params import activated_params, count_params

# The paper's MoE 15A2B as `configs/moe_15a2b.py` builds it (Sec. 3.1: 24 layers, d_model 2048,
# GQA q=32 k=4, d_k=128, 128 experts top-8). Row 4 (+4 experts) uses the preset's own expert
# width (704, fitted to 15B/2.54B): 415.4M. The paper's 400M implies a width of 679
# (4 x 24 x (3 x 2048 x 679 + 2048) = 400.7M) and a 14.5B/2.50B model; it prints neither.
# The vocabulary cancels out of every difference.
PAPER_MOE_DIMS = cli.load("moe_15a2b").model

# Table 1 "Added Param" (millions) as printed, keyed by row.
TABLE1 = {1: ("baseline", "0"), 2: ("more_kv_heads", "50"), 3: ("more_q_heads", "201"),
          4: ("more_experts", "400"),
          5: ("sdpa_elementwise", "201"), 6: ("v_elementwise", "25"), 7: ("k_elementwise", "25"),
          8: ("q_elementwise", "201"), 9: ("dense_output", "100"), 10: ("sdpa_headwise", "1.6"),
          11: ("v_headwise", "0.2"), 12: ("sdpa_head_shared", "201"), 13: ("v_head_shared", "25"),
          14: ("sdpa_additive_silu", "201"), 15: ("sdpa_elementwise_silu", "201")}
TABLE6 = {2: ("switch_kv_8top8", "38"), 3: ("switch_kv_4top4", "13"), 4: ("switch_v_4top4", "13"),
          5: ("switch_v_8top2", "25"), 6: ("switch_v_1top1", "3")}
# Why a row differs from the paper's column (printed beside it).
NOTES = {
    ("table1", 4): "the preset's expert width 704; the paper's 400M implies 679",
    ("table1", 9): "24 x 2048 x 2048 = 100.66M: the paper printed it truncated",
    ("table6", 6): "Table 1 row 11 prints 0.2 for the same model (the paper: 'equivalent')",
    ("table6", 0): "full-width experts (d_model x kv_heads x head_dim each); no expert width "
                   "reproduces the paper's column (switch_width_fit)",
}


def rounded(millions: float) -> str:
    """Ordinary rounding (half up) at the precision of the paper's column: whole millions from
    10M up, one decimal below (201.33 -> 201, 100.66 -> 101, 1.573 -> 1.6, 0.197 -> 0.2)."""
    if millions >= 10:
        return str(math.floor(millions + 0.5))
    return "0" if millions == 0 else f"{math.floor(millions * 10 + 0.5) / 10:.1f}"


def added_params_table(rows: dict, base: ModelConfig = PAPER_MOE_DIMS, table: str = "table1") -> list[dict]:
    """For each (row -> (variant, paper value)): added parameters relative to the baseline, our
    rounding beside the paper's, and why they differ where they do."""
    baseline = count_params(base)
    out = []
    for row, (name, paper) in rows.items():
        added = count_params(variants.apply(name, base)) - baseline
        ours = rounded(added / 1e6)
        note = NOTES.get((table, row), NOTES.get((table, 0), "")) if ours != paper else ""
        out.append({"row": row, "variant": name, "added_params": added,
                    "added_params_m": round(added / 1e6, 4), "rounded": ours, "paper": paper,
                    "match": ours == paper, "note": note})
    return out


def _prints_as(millions: float, paper: str) -> bool:
    """Whether `millions`, rounded half up to the decimals `paper` shows, is `paper` ("3": 2.5-3.5)."""
    decimals = len(paper.partition(".")[2])
    return math.floor(millions * 10**decimals + 0.5) == round(float(paper) * 10**decimals)


def switch_added(name: str, width: int, base: ModelConfig = PAPER_MOE_DIMS, *, replace: bool = True) -> int:
    """Added parameters of Switch Heads variant `name` if each expert projected to `width` per kv
    head instead of head_dim, counted by formula: router (d_model x kv_heads x E) plus the expert
    projections, which either replace W_V (and W_K) (`replace`, gattn's Switch Heads: at width
    head_dim this is the built count, tested) or come beside them."""
    sw = variants.apply(name, base).switch_heads
    n = 2 if sw.targets == "kv" else 1
    experts = n * base.kv_heads * sw.num_experts * width - (n * base.kv_heads * base.head_dim if replace else 0)
    return base.num_layers * base.d_model * (experts + base.kv_heads * sw.num_experts)


def switch_width_fit(replace: bool = True, widths=range(1, 1025)) -> dict:
    """Table 6's derivation: for each row, the expert widths whose added parameters round to
    the paper's number, and the widths every row accepts (empty: none reproduces the column)."""
    fits = {row: [w for w in widths if _prints_as(switch_added(name, w, replace=replace) / 1e6, paper)]
            for row, (name, paper) in TABLE6.items()}
    return {"replace": replace, "rows": fits, "common": sorted(set.intersection(*map(set, fits.values())))}


def _span(widths: list[int]) -> str:
    if not widths:
        return "none"
    return str(widths[0]) if len(widths) == 1 else f"{widths[0]}-{widths[-1]}"


def _dims(cfg: ModelConfig) -> dict:
    keys = ("num_layers", "d_model", "q_heads", "kv_heads", "head_dim")
    return {k: getattr(cfg, k) for k in keys}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--table1", action="store_true", help="Table 1 'Added Param' at the paper's dims")
    ap.add_argument("--table6", action="store_true", help="Table 6 (Switch Heads) at the paper's dims")
    ap.add_argument("--config", help="a config file: count its model's parameters")
    ap.add_argument("--preset", help="a preset by name (e.g. moe_15a2b, dense_1p7b): "
                    "total and activated parameters")
    ap.add_argument("--variant", help="a registered variant applied to the config's model")
    ap.add_argument("--provenance", nargs="*", metavar="PRESET",
                    help="each setting of the paper-scale presets (default: all four) and its "
                         "source: a paper section or table, or 'ours' with the reason")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args, overrides = cli.parse_args(ap, argv)
    if not (args.table1 or args.table6 or args.config or args.preset or args.provenance is not None):
        ap.error("give --table1, --table6, --config, --preset or --provenance")

    result = {}
    for flag, key, rows in ((args.table1, "table1", TABLE1), (args.table6, "table6", TABLE6)):
        if flag:
            result[key] = {"dims": _dims(PAPER_MOE_DIMS), "rows": added_params_table(rows, table=key)}
    if args.table6:
        result["table6"]["width_fit"] = [switch_width_fit(replace) for replace in (True, False)]
    if args.provenance is not None:
        names = args.provenance or list(provenance.PAPER_PRESETS)
        if not args.json:
            print(provenance.markdown(names))
            return
        result["provenance"] = {name: provenance.table(name) for name in names}
    if args.config or args.preset:
        path = cli.resolve(args.config or args.preset, "--config" if args.config else "--preset")
        cfg = cli.load(path, overrides, variant=args.variant)
        result["config"] = {"config": str(path), "variant": cfg.variant, **_dims(cfg.model),
                            "params": count_params(cfg.model), "activated": activated_params(cfg.model)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for key in ("table1", "table6"):
        if key in result:
            print(f"{key}: added parameters (M) at {result[key]['dims']}")
            for r in result[key]["rows"]:
                mark = "ok" if r["match"] else f"differs: {r['note']}"
                print(f"  ({r['row']:>2}) {r['variant']:<24} {r['added_params_m']:>10.3f}"
                      f"  rounded {r['rounded']:>5}  paper {r['paper']:>5}  {mark}")
    for fit in result.get("table6", {}).get("width_fit", []):
        how = "replacing W_V (and W_K)" if fit["replace"] else "beside W_V (and W_K)"
        rows = ", ".join(f"({row}) {_span(ws)}" for row, ws in fit["rows"].items())
        print(f"  expert widths that reproduce each row, experts {how}: {rows}; "
              f"every row: {_span(fit['common'])}")
    if "config" in result:
        c = result["config"]
        print(f"{c['config']} ({c['variant']}): {c['params']:,} parameters, "
              f"{c['activated']:,} activated per token")


