"""Fits a paper preset to a TPU slice: the trainer's real train step AND its eval step, compiled
ahead of time by libtpu on this CPU machine at the preset's real global batch (train.batch_size
rows of train.seq_len + 1 tokens), with its exec settings, train.microbatches and exec.loss_chunk.

    python bench/fit_presets.py --preset dense_1p7b --topology v5p:4x4x2 [--mesh 8,1,4]
        [--variant sdpa_elementwise] [--config.train.microbatches=4 --config.exec.loss_chunk=1024 ...]
    python bench/fit_presets.py --all [--rows smallest] [--jsonl out.jsonl]   # the table (ROWS below)

Prints JSON per chip: the train step's and the eval step's bytes (memory_analysis: arguments,
outputs, aliased, temporaries, their total, in GiB) against the chip's HBM, FLOPs (XLA's
cost_analysis: a scan's body counts once, so with scanned layers or microbatches it is a lower
bound; `model_tflops_per_chip` is the 6 N T + attention count), and compile seconds. The train
step's network (`train.network`, gattn/experiments/traffic.py): the bytes each chip sends per step,
counted from the compiled HLO with ring costs and loop trip counts, by collective and by the mesh
axes it runs over, ICI and DCN apart; `train.hbm_gib_per_step`, the bytes the step reads and
writes in HBM (the same counter); and `train.roofline`, the step model: the counted FLOPs at the
bf16 peak, the HBM bytes at the HBM bandwidth, ICI and DCN bytes at theirs; the step is their
max (the no-overlap sum beside it), MFU the model's FLOPs over that step.

The eval step is `trainer.make_eval_step` under the mesh, on data.eval_batch_size rows padded to a
multiple of the batch shards, data x fsdp x expert (as `trainer.validate` pads them). During
validation the optimizer state stays in HBM beside the eval step's own buffers, so the eval
step's fit counts it too (`eval.resident_gib`: the eval step's total + the AdamW moments per chip).

--mesh is (data, expert, model), (data, fsdp, expert, model) or (data, fsdp, context, expert, model), and must
multiply to the topology's chip count; without it the preset's own mesh (data = -1 takes what the
others leave). Note gcloud's accelerator types count TensorCores for v5p (2 per chip): v5p-32 is
16 chips (v5p:2x2x4 / 4x4x1), v5p-64 is 32 chips (v5p:4x4x2), v5p-128 is 64 chips (v5p:4x4x4);
v5e / v6e count chips (v5litepod-16 = v5e:4x4).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu is only a compiler here
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies

from gattn import cli
from gattn.config import ConfigError, MeshConfig
from gattn.experiments import flops as flop_count, traffic
from gattn.model import params as param_counts
from gattn.model import sharding
from gattn.train import trainer

_spec = importlib.util.spec_from_file_location("aot_train_step", Path(__file__).with_name("aot_train_step.py"))
aot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(aot)

GIB = 2**30

# The measured table (docs/presets.md "Which slice each preset fits"): (preset, topology, mesh,
# overrides). "configured": each preset as shipped (its mesh, train.microbatches, exec.loss_chunk,
# exec settings) on the slice it is configured for; "smallest": the smallest slice it fits at all,
# with the overrides it needs there.
ROWS = {
    "configured": [
        ("dense_1p7b", "v5p:4x4x2", None, ()),
        ("moe_15a2b", "v5p:4x4x2", None, ()),
        ("extend_1p7b_32k", "v5p:4x4x2", None, ()),
        ("dense_1p7b_48l", "v5p:4x4x2", None, ()),
        ("qwen3_5_2b", "v5p:2x2x4", None, ()),
        ("qwen3_5_2b_64k", "v5p:2x2x4", None, ()),
        ("qwen3_5_2b_256k", "v5p:2x2x4", None, ()),
        ("qwen3_next_80b", "v5p:4x4x4", None, ()),
    ],
    # The meshes and microbatches tried for dense_1p7b, moe_15a2b and qwen3_next_80b on their slice
    # (4 numbers: data, fsdp, expert, model); each preset takes the one with the shortest roofline
    # step within HBM, then the fewest bytes sent; dense_1p7b the one within MaxText's memory too (docs/presets.md).
    "candidates": [
        ("dense_1p7b", "v5p:4x4x2", (8, 1, 1, 4), ("train.microbatches=4", "exec.accumulate=sharded")),  # before FSDP
        ("dense_1p7b", "v5p:4x4x2", (32, 1, 1, 1), ("train.microbatches=4", "exec.accumulate=sharded")),
        ("dense_1p7b", "v5p:4x4x2", (1, 32, 1, 1), ("train.microbatches=1", "exec.accumulate=sharded")),
        ("dense_1p7b", "v5p:4x4x2", (1, 32, 1, 1), ("train.microbatches=2", "exec.accumulate=sharded")),
        ("dense_1p7b", "v5p:4x4x2", (1, 32, 1, 1), ("train.microbatches=8", "exec.accumulate=sharded")),
        *[("dense_1p7b", "v5p:4x4x2", (1, 32, 1, 1), (f"train.microbatches={m}", "exec.accumulate=gathered"))
          for m in (2, 4, 8, 16)],  # (16: as configured)
        # rematerialisation and the loss chunk as a fit dimension (issue 58; the step model's clock
        # is the counted FLOPs): as configured is remat none with the loss in one piece
        *[("dense_1p7b", "v5p:4x4x2", (1, 32, 1, 1), ("train.microbatches=16", "exec.accumulate=gathered",
                                                      f"exec.remat={r}", f"exec.loss_chunk={c}", *blocks))
          for r, c, blocks in (("full", 512, ()), ("full", 512, ("exec.flash_block_q=256", "exec.flash_block_k=256")),
                               ("none", 512, ()), ("dots", 0, ()), ("none", 0, ()),
                               ("none", 0, ("exec.flash_block_q=256", "exec.flash_block_k=256")))],
        ("dense_1p7b", "v5p:4x4x2", (1, 16, 1, 2), ("train.microbatches=1", "exec.accumulate=sharded")),
        ("dense_1p7b", "v5p:4x4x2", (1, 8, 1, 4), ("train.microbatches=1", "exec.accumulate=sharded")),
        # dense_1p7b_48l and extend_1p7b_32k by the step model (issue 58; 48l as configured: none, 0)
        *[("dense_1p7b_48l", "v5p:4x4x2", (1, 32, 1, 1), ("train.microbatches=16", "exec.accumulate=gathered",
                                                          f"exec.remat={r}", "exec.loss_chunk=0"))
          for r in ("none", "dots")],
        ("dense_1p7b_48l", "v5p:4x4x2", (1, 32, 1, 1), ("train.microbatches=1", "exec.accumulate=sharded",
                                                       "exec.remat=full", "exec.loss_chunk=512")),  # before
        ("extend_1p7b_32k", "v5p:4x4x2", (1, 32, 1, 1), ("exec.remat=minimal", "train.microbatches=1",
                                                        "exec.accumulate=sharded")),  # (none: 270 GiB, no fit)
        ("extend_1p7b_32k", "v5p:4x4x2", (1, 32, 1, 1), ("exec.remat=full", "train.microbatches=1",
                                                        "exec.accumulate=sharded")),  # before
        # moe_15a2b: expert parallelism with model 4 as before FSDP, then FSDP x expert
        ("moe_15a2b", "v5p:4x4x2", (1, 1, 8, 4), ("train.microbatches=8", "exec.moe_buffer=1.25")),
        ("moe_15a2b", "v5p:4x4x2", (1, 8, 4, 1), ("train.microbatches=8", "exec.moe_buffer=1.25")),
        ("moe_15a2b", "v5p:4x4x2", (1, 2, 16, 1), ("train.microbatches=8", "exec.moe_buffer=1.25")),
        ("moe_15a2b", "v5p:4x4x2", (1, 4, 8, 1), ("train.microbatches=8", "exec.moe_buffer=1.25")),
        ("moe_15a2b", "v5p:4x4x2", (1, 4, 8, 1), ("train.microbatches=4", "exec.moe_buffer=1.25")),
        ("moe_15a2b", "v5p:4x4x2", (1, 4, 8, 1), ("train.microbatches=2", "exec.moe_buffer=1.25")),
        # pure FSDP (issue 58): the experts gathered, nothing exchanged (as configured: 1 microbatch)
        ("moe_15a2b", "v5p:4x4x2", (1, 32, 1, 1), ("train.microbatches=2",)),
        ("moe_15a2b", "v5p:4x4x2", (1, 32, 1, 1), ("train.microbatches=1",)),
        # qwen3_next_80b on v5p-128, scanned layers (as configured: 1, 2, 32, 1 with 8)
        *[("qwen3_next_80b", "v5p:4x4x4", mesh, (f"train.microbatches={m}",))
          for mesh, m in (((1, 4, 16, 1), 8), ((1, 4, 16, 1), 4), ((1, 8, 8, 1), 8), ((1, 2, 32, 1), 8),
                          ((1, 1, 64, 1), 8))],
    ],
    # (measured before the step model refit the presets: their remat and loss chunk pinned)
    "smallest": [
        ("dense_1p7b", "v5p:2x2x1", (1, 1, 4), ("train.microbatches=32", "exec.remat=full", "exec.loss_chunk=512")),
        ("moe_15a2b", "v5p:2x2x2", (1, 2, 4), ("train.microbatches=32", "exec.moe_buffer=1.25")),
        ("extend_1p7b_32k", "v5p:2x2x1", (1, 1, 4),
         ("train.microbatches=16", "exec.remat=full", "exec.accumulate=sharded")),
        ("dense_1p7b_48l", "v5p:2x2x1", (1, 1, 4), ("train.microbatches=32", "exec.remat=full", "exec.loss_chunk=512")),
        ("dense_1p7b", "v5e:2x2", (1, 1, 4), ("train.microbatches=256", "exec.remat=full", "exec.loss_chunk=512")),
    ],
}


def topology_devices(topology: str, slices: int = 1):
    """The chips of `slices` slices of `topology` (several: joined by DCN, each device's slice_index)."""
    return topologies.get_topology_desc(topology_name=topology, platform="tpu", num_slices=slices).devices


def resolve_mesh(cfg, n: int, mesh_shape=None) -> tuple[int, ...]:
    """The mesh's axis sizes in sharding.AXES order on `n` chips: `mesh_shape` if given, as
    (data, expert, model), (data, fsdp, expert, model) or in AXES order (data, fsdp, context,
    expert, model), else the preset's mesh."""
    if mesh_shape:
        shape = tuple(mesh_shape)
        named = {3: ("data", "expert", "model"), 4: ("data", "fsdp", "expert", "model"), 5: sharding.AXES}
        if len(shape) not in named:
            raise ConfigError("mesh", mesh_shape, f"data,expert,model or data,fsdp,expert,model or {','.join(sharding.AXES)}")
        sizes = dict(zip(named[len(shape)], shape))
        shape = tuple(sizes.get(a, 1) for a in sharding.AXES)
    else:
        shape = tuple(sharding.mesh_shape(cfg.mesh, n))
    if math.prod(shape) != n:
        raise ConfigError("mesh", shape, f"the mesh must multiply to the topology's {n} chips")
    return shape


def _bytes(tree) -> int:
    """Per-chip bytes of a tree of sharded ShapeDtypeStructs (the largest shard of each array)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape)
        total += math.prod(shard) * np.dtype(x.dtype).itemsize
    return total


def memory(compiled, kind: str) -> dict:
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis() or {}
    used = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    hbm = aot.HBM_GIB.get(kind)
    gib = lambda b: round(b / GIB, 2)  # noqa: E731
    return {"arguments_gib": gib(mem.argument_size_in_bytes), "outputs_gib": gib(mem.output_size_in_bytes),
            "aliased_gib": gib(mem.alias_size_in_bytes), "temp_gib": gib(mem.temp_size_in_bytes),
            "total_gib": gib(used), "total_bytes": used,
            "peak_gib": gib(getattr(mem, "peak_memory_in_bytes", 0)),
            "fits": None if hbm is None else used < hbm * GIB,
            "xla_tflops_per_chip": None if cost.get("flops") is None else round(cost["flops"] / 1e12, 3)}


def model_tflops(cfg, chips: int) -> float:
    """Training FLOPs per chip of one step, the usual count: 6 x activated parameters (less the
    input embedding, a lookup) x tokens, plus causal attention's 6 x 2 x H x d x S / 2 per token
    and attention layer (forward 2 matmuls of 2 FLOPs, backward twice that), plus a hybrid's Gated
    DeltaNet rule, 3 x (6 C K + 4 C V + 6 K V) per token and value head of each such layer (the
    chunked form's forward: scores, solve products and the state's three K x V products, C =
    exec.gdn_chunk; backward twice that); remat's recomputation not counted. (Before 2026-12-06
    every layer of a hybrid was counted as attention: 4x the attention term of Qwen3.5's 3:1
    pattern, an MFU above 1 at 64k.)"""
    m, t = cfg.model, cfg.train
    n = param_counts.activated_params(m) - (m.vocab_size * m.d_model if not m.tie_embeddings else 0)
    tokens = t.batch_size * t.seq_len
    full = sum(m.layer_type(i) == "full_attention" for i in range(m.num_layers))
    attn = 6 * 2 * full * m.q_heads * m.head_dim * t.seq_len / 2
    if m.hybrid:
        la, c = m.linear_attention, cfg.exec.gdn_chunk
        k, v = la.head_k_dim, la.head_v_dim
        attn += 3 * (6 * c * k + 4 * c * v + 6 * k * v) * la.num_v_heads * (m.num_layers - full)
    return round((6 * n + attn) * tokens / chips / 1e12, 2)


def flash_pairs(cfg) -> int:
    """The (query block, key block) pairs the causal Pallas kernel computes per head and row: the
    blocks on the diagonal are computed whole (gattn/kernels/flash_blocks.py `cost`)."""
    s, bq, bk = cfg.train.seq_len, cfg.exec.flash_block_q, cfg.exec.flash_block_k
    nq, nk = -(-s // bq), -(-s // bk)
    return sum(min((i * bq + bq - 1) // bk, nk - 1) + 1 for i in range(nq))


def implied_tflops(cfg, chips: int) -> float | None:
    """The model's FLOPs plus the recompute its settings imply, per chip per step:
    - `exec.remat` `full` runs each block's forward again in the backward pass (2 x the blocks'
      activated parameters x tokens, and attention's forward); `none` and `dots` (dots saved:
      only element-wise work is recomputed) add no matmul FLOPs;
    - the chunked loss (`exec.loss_chunk`) recomputes each chunk's logits (2 x V x d per token);
    - the Pallas flash kernel computes whole blocks on the causal diagonal and recomputes the
      scores in both backward kernels: 4 (forward) + 6 (dq) + 8 (dkv) x d per score it computes,
      where the model counts 12 x d per causal score.
    None for the named policies (what they recompute depends on the activations they save)."""
    m, t = cfg.model, cfg.train
    if cfg.exec.remat not in ("none", "dots", "full"):
        return None
    tokens = t.batch_size * t.seq_len
    per_row = m.num_layers * m.q_heads * m.head_dim  # x d per score, summed over layers and heads
    ideal = t.seq_len * t.seq_len / 2  # the causal scores of one row of one head
    scores = (flash_pairs(cfg) * cfg.exec.flash_block_q * cfg.exec.flash_block_k
              if cfg.exec.attention_impl == "pallas" else ideal)
    attn = (18 if cfg.exec.attention_impl == "pallas" else 12) * scores * per_row * t.batch_size
    extra = attn - 12 * ideal * per_row * t.batch_size
    if cfg.exec.loss_chunk:
        extra += 2 * m.vocab_size * m.d_model * tokens
    if cfg.exec.remat == "full":
        blocks = param_counts.activated_params(m) - m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
        extra += 2 * blocks * tokens + 4 * scores * per_row * t.batch_size
    return round(model_tflops(cfg, chips) + extra / chips / 1e12, 2)


def fit(cfg, topology: str, mesh_shape=None, *, eval_step: bool = True, train_step: bool = True,
        slices: int = 1, hlo_out: str | None = None) -> dict:
    """Compiles the train step (and the eval step) of `cfg` at its global batch on `topology`
    (`slices` of it, joined by DCN: the data axis spans them); returns the JSON-able report.
    `train_step=False`: the eval step (the forward pass) only."""
    devices = topology_devices(topology, slices)
    shape = resolve_mesh(cfg, len(devices), mesh_shape)
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(**dict(zip(sharding.AXES, shape))))
    t = cfg.train
    mesh = sharding.make_mesh(cfg.mesh, devices)
    shards = sharding.batch_shards(mesh)
    if t.batch_size % (shards * t.microbatches):
        raise ConfigError("train.batch_size", t.batch_size,
                          f"a multiple of the {shards} batch shards (data x fsdp x expert) times "
                          f"train.microbatches ({t.microbatches})")
    kind = devices[0].device_kind
    graphdef, state = trainer.abstract_train_state(cfg, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, state)

    def batch(rows):
        row = jax.ShapeDtypeStruct((rows, t.seq_len + 1), jnp.int32, sharding=sharding.batch_sharding(mesh))
        return {"tokens": row, "segment_ids": row, "positions": row}

    out = {"preset": None, "variant": cfg.variant, "topology": topology, "slices": slices, "device": kind,
           "chips": len(devices),
           "hbm_gib": aot.HBM_GIB.get(kind), "mesh": {a: v for a, v in zip(sharding.AXES, shape) if a != "context" or v > 1},
           "global_batch": t.batch_size, "seq_len": t.seq_len, "microbatches": t.microbatches,
           "rows_per_shard_per_microbatch": t.batch_size // shards // t.microbatches,
           "loss_chunk": cfg.exec.loss_chunk,
           "exec": {k: v for k, v in dataclasses.asdict(cfg.exec).items()
                    if k in ("dtype", "remat", "attention_impl", "moe_impl", "moe_buffer", "grouped_matmul")},
           "hosts": len({d.process_index for d in devices}),
           "params": param_counts.count_params(cfg.model),
           "activated_params": param_counts.activated_params(cfg.model),
           "model_tflops_per_chip": model_tflops(cfg, len(devices))}
    if train_step:
        step = trainer.make_train_step(cfg, graphdef, shardings, mesh)
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = step.lower(state, batch(t.batch_size)).compile()
        compile_s = round(time.perf_counter() - t0, 1)
        hlo = compiled.as_text()
        if hlo_out:  # the compiled train step, for reading what the counters count
            Path(hlo_out).write_text(hlo)
        network = traffic.count(hlo, mesh)
        counted = flop_count.count_flops(hlo)
        mxu = sum(counted["by_kind"].get(k, 0) for k in ("dot", "convolution", "custom_call"))
        out["train"] = {**memory(compiled, kind), "compile_s": compile_s,
                        "ragged_all_to_all": hlo.count("ragged-all-to-all("), "network": network,
                        # what the compiled step runs per chip, recompute included: the matrix
                        # units' FLOPs (dots, convolutions, priced kernels) and the rest apart
                        "counted_tflops_per_chip": round(mxu / 1e12, 2),
                        "counted_other_tflops_per_chip": round((counted["flops"] - mxu) / 1e12, 2),
                        "implied_tflops_per_chip": implied_tflops(cfg, len(devices)),
                        "hbm_gib_per_step": round(counted["hbm_bytes"] / GIB, 1),
                        "unknown_trip_counts": counted["unknown_trip_counts"],
                        "unpriced_kernels": sorted({c["target"] for c in counted["custom_calls"]
                                                    if c["priced_by"] == "unpriced" and c["runs"]}),
                        "roofline": traffic.roofline(out["model_tflops_per_chip"] * 1e12, network, kind,
                                                     counted_flops=mxu, hbm_bytes=counted["hbm_bytes"])
                        if traffic.DEVICE_KINDS.get(kind) else None}
        del compiled, hlo
    if eval_step:
        rows = cfg.data.eval_batch_size
        rows += -rows % shards  # trainer.validate pads to a multiple of the shards
        opt_bytes = _bytes(state["opt_state"])
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = trainer.make_eval_step(graphdef).lower(state["params"], batch(rows)).compile()
        ev = memory(compiled, kind)
        resident = ev["total_bytes"] + opt_bytes
        ev.update({"rows": rows, "opt_state_gib": round(opt_bytes / GIB, 2),
                   "resident_gib": round(resident / GIB, 2),
                   "fits": None if out["hbm_gib"] is None else resident < out["hbm_gib"] * GIB,
                   "compile_s": round(time.perf_counter() - t0, 1)})
        out["eval"] = ev
    out["fits"] = (not train_step or out["train"]["fits"]) and (not eval_step or out["eval"]["fits"])
    return out


def run_row(preset, topology, mesh_shape, overrides=(), variant=None, eval_step=True, train_step=True,
            slices: int = 1, hlo_out: str | None = None) -> dict:
    cfg = cli.load(preset, list(overrides), variant=variant)
    out = fit(cfg, topology, mesh_shape, eval_step=eval_step, train_step=train_step, slices=slices,
              hlo_out=hlo_out)
    out["preset"], out["overrides"] = preset, list(overrides)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="dense_1p7b", help=f"a preset ({', '.join(cli.presets())}) or a config file")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--topology", default="v5p:4x4x2")
    ap.add_argument("--slices", type=int, default=1, help="slices of the topology, joined by DCN (the data axis "
                    "spans them: --config.mesh.data=SLICES)")
    ap.add_argument("--mesh", default=None,
                    help=f"data,expert,model or data,fsdp,expert,model or {','.join(sharding.AXES)} (default: the preset's mesh)")
    ap.add_argument("--no-eval", action="store_true", help="compile the train step only")
    ap.add_argument("--eval-only", action="store_true", help="compile the eval step (the forward pass) only")
    ap.add_argument("--all", action="store_true", help="every row of the table (ROWS)")
    ap.add_argument("--rows", default="configured,smallest", help="with --all: which parts of ROWS (configured, "
                    "candidates, smallest)")
    ap.add_argument("--jsonl", default=None, help="with --all: also append each row to this file")
    ap.add_argument("--hlo", default=None, metavar="PATH", help="write the compiled train step's HLO text here "
                    "(what gattn.experiments.flops and traffic count: python -m gattn.experiments.flops PATH)")
    args, overrides = cli.parse_args(ap, argv)
    if args.all:
        for part in args.rows.split(","):
            for preset, topology, mesh_shape, extra in ROWS[part]:
                out = {"row": part, **run_row(preset, topology, mesh_shape, [*extra, *overrides],
                                              args.variant, not args.no_eval)}
                print(json.dumps(out), flush=True)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps(out) + "\n")
        return
    mesh_shape = tuple(int(x) for x in args.mesh.split(",")) if args.mesh else None
    print(json.dumps(run_row(args.preset, args.topology, mesh_shape, overrides, args.variant, not args.no_eval,
                             not args.eval_only, args.slices, args.hlo), indent=1))


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
