"""`python -m gattn.params`: parameter counts of any config or preset, and the paper's Table 1
and Table 6 "Added Param" columns computed from the built models at the paper's dimensions.

    python -m gattn.params --table1 --json
    python -m gattn.params --preset moe_15a2b [--variant sdpa_elementwise] --json
"""

from __future__ import annotations

import argparse
import json

from gattn import cli, variants
from gattn.config import ModelConfig, MoESpec
from gattn.model.params import activated_params, count_params

# The paper's MoE 15A2B (Sec. 3.1): 24 layers, d_model 2048, GQA q=32 k=4, d_k=128, 128 experts
# top-8. The paper does not print the expert width; 679 is what Table 1 row 4 implies (4 experts
# x 24 layers x 3 x 2048 x 679 = 400.5M). The vocabulary cancels out of every difference.
PAPER_MOE_DIMS = ModelConfig(vocab_size=151_936, d_model=2048, num_layers=24, q_heads=32,
                             kv_heads=4, head_dim=128, d_ff=1024, qk_norm=True,
                             moe=MoESpec(num_experts=128, top_k=8, expert_width=679))

# Table 1 "Added Param" (millions) as printed, keyed by row.
TABLE1 = {1: ("baseline", "0"), 2: ("more_kv_heads", "50"), 3: ("more_q_heads", "201"),
          4: ("more_experts", "400"),
          5: ("sdpa_elementwise", "201"), 6: ("v_elementwise", "25"), 7: ("k_elementwise", "25"),
          8: ("q_elementwise", "201"), 9: ("dense_output", "100"), 10: ("sdpa_headwise", "1.6"),
          11: ("v_headwise", "0.2"), 12: ("sdpa_head_shared", "201"), 13: ("v_head_shared", "25"),
          14: ("sdpa_additive_silu", "201"), 15: ("sdpa_elementwise_silu", "201")}
TABLE6 = {2: ("switch_kv_8top8", "38"), 3: ("switch_kv_4top4", "13"), 4: ("switch_v_4top4", "13"),
          5: ("switch_v_8top2", "25"), 6: ("switch_v_1top1", "3")}


def paper_rounding(millions: float) -> str:
    """The paper's rounding of 'Added Param': whole millions (truncated) from 10M up, one decimal
    below (201.3 -> 201, 100.7 -> 100, 1.57 -> 1.6, 0.197 -> 0.2)."""
    if millions >= 10:
        return str(int(millions))
    return "0" if millions == 0 else f"{millions:.1f}"


def added_params_table(rows: dict, base: ModelConfig = PAPER_MOE_DIMS) -> list[dict]:
    """For each (row -> (variant, paper value)): added parameters relative to the baseline."""
    baseline = count_params(base)
    out = []
    for row, (name, paper) in rows.items():
        added = count_params(variants.apply(name, base)) - baseline
        ours = paper_rounding(added / 1e6)
        out.append({"row": row, "variant": name, "added_params": added,
                    "added_params_m": round(added / 1e6, 4), "rounded": ours, "paper": paper,
                    "match": ours == paper})
    return out


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
    ap.add_argument("--json", action="store_true", help="print JSON")
    args, overrides = cli.parse_args(ap, argv)
    if not (args.table1 or args.table6 or args.config or args.preset):
        ap.error("give --table1, --table6, --config or --preset")

    result = {}
    for flag, key, rows in ((args.table1, "table1", TABLE1), (args.table6, "table6", TABLE6)):
        if flag:
            result[key] = {"dims": _dims(PAPER_MOE_DIMS), "rows": added_params_table(rows)}
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
                mark = "ok" if r["match"] else "differs"
                print(f"  ({r['row']:>2}) {r['variant']:<24} {r['added_params_m']:>10.3f}"
                      f"  rounded {r['rounded']:>5}  paper {r['paper']:>5}  {mark}")
    if "config" in result:
        c = result["config"]
        print(f"{c['config']} ({c['variant']}): {c['params']:,} parameters, "
              f"{c['activated']:,} activated per token")


