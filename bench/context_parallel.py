"""Context parallelism against none, one Qwen3.5 period at 64k: per chip memory, bytes sent and
the modelled step of the train step, AOT-compiled by libtpu for a v5p slice on this CPU.

    python bench/context_parallel.py [--topology v5p:2x2x4] [--seq-len 65536] [--contexts 1,2,4,8,16]

The model is qwen3_5_2b's (its widths, vocabulary, exec settings: the fused attention, the GDN
kernel, bf16) cut to one period of its layer pattern (3 Gated DeltaNet layers and 1 gated attention
layer) and without the MTP layer, so that one compile takes a minute or two. Each chip holds one
row's share: rows = chips / context (FSDP over the rest), one microbatch, no remat; so tokens per
chip are seq_len / context. Per context size: the train step's memory per chip (GiB), the bytes
each chip sends per step by mesh axes, the counted TFLOPs and HBM bytes, and the step model's
time (gattn/experiments/traffic.py). JSON lines on stdout, one per context size.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fit_presets", ROOT / "bench" / "fit_presets.py")
fit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fit)

from gattn import cli  # noqa: E402
from gattn.config import MeshConfig, hybrid_layer_types  # noqa: E402


def config(seq_len: int, chips: int, context: int):
    cfg = cli.load("qwen3_5_2b")
    model = dataclasses.replace(cfg.model, num_layers=4, layer_types=hybrid_layer_types(4, 4), mtp_layers=0)
    rows = chips // context
    train = dataclasses.replace(cfg.train, seq_len=seq_len, batch_size=rows, microbatches=1, mtp_loss_weight=0.0)
    return dataclasses.replace(cfg, model=model, train=train, mesh=MeshConfig(data=1, fsdp=-1, context=context),
                               exec=dataclasses.replace(cfg.exec, remat="none", accumulate="sharded"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="v5p:2x2x4")
    ap.add_argument("--seq-len", type=int, default=65_536)
    ap.add_argument("--contexts", default="1,2,4,8,16")
    args = ap.parse_args(argv)
    n = len(fit.topology_devices(args.topology))
    for context in (int(c) for c in args.contexts.split(",")):
        cfg = config(args.seq_len, n, context)
        try:
            out = fit.fit(cfg, args.topology, eval_step=False)
        except Exception as e:  # noqa: BLE001 (a step that does not fit HBM: libtpu refuses to compile it)
            out = {"error": str(e).splitlines()[0][:300]}
        tr = out.get("train", {})
        row = {"context": context, "seq_len": args.seq_len, "rows": cfg.train.batch_size,
               "tokens_per_chip": args.seq_len // context, "mesh": out.get("mesh"),
               "train_gib": tr.get("total_gib"), "fits": tr.get("fits"),
               "sent_gib": (tr.get("network") or {}).get("total_gib"),
               "sent_by_axes": (tr.get("network") or {}).get("by_axes"),
               "counted_tflops_per_chip": tr.get("counted_tflops_per_chip"),
               "hbm_gib_per_step": tr.get("hbm_gib_per_step"),
               "step_s": (tr.get("roofline") or {}).get("step_s"), "bound": (tr.get("roofline") or {}).get("bound"),
               **({"error": out["error"]} if "error" in out else {})}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
