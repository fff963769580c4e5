"""Ahead-of-time compile of the full training step of a paper-scale preset for a TPU pod slice.

On this CPU machine libtpu compiles (nothing runs) the trainer's own step, forward + backward +
AdamW, with the preset's shardings on a mesh of the topology's chips, and prints per-device HBM
use (`memory_analysis`: parameters + optimizer state + batch, outputs, temporaries) and FLOPs
(`cost_analysis`) as JSON, with whether it fits the chip's HBM.

    python bench/aot_train_step.py --preset moe_15a2b --topology v5p:4x4x2 --mesh 4,8,1 --batch-per-device 1
        [--config.model.moe.capacity_factor=1.25 --config.exec.moe_impl=all_to_all]
        [--config.exec.moe_impl=ragged [--config.exec.moe_buffer=1.25]   # dropless expert parallel
         [--config.exec.grouped_matmul=megablox]]                         # Pallas gmm, not ragged_dot
    python bench/aot_train_step.py --preset dense_1p7b --topology v5e:4x4 --mesh 4,1,4 [--variant sdpa_elementwise]
    python bench/aot_train_step.py --preset moe_15a2b --topology v5p:4x4x4 --mesh 2,8,4   # 16 hosts x 4 chips

--mesh is (data, expert, model[, fsdp]) and must multiply to the topology's chip count; it replaces the
preset's mesh (so exec.moe_impl=all_to_all or ragged is checked against it); "ragged_all_to_all"
counts that collective in the executable. The global batch is
batch-per-device x data x expert sequences of the preset's seq_len. On a multi-host topology the
JSON also gives the hosts and the process-local batch each host feeds (its contiguous rows, the
shape `train.py` assembles with jax.make_array_from_process_local_data on a real slice).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu is only a compiler here
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies

from gattn import cli
from gattn.config import MeshConfig
from gattn.model import params, sharding
from gattn.train import trainer

HBM_GIB = {"TPU v5 lite": 16, "TPU v5": 95, "TPU v5p": 95, "TPU v6 lite": 32, "TPU v4": 32}


def compile_step(cfg, topology: str, mesh_shape: tuple[int, ...], batch_per_device: int):
    """(compiled step, device kind, global batch rows, compile seconds) of `cfg` on `mesh_shape`
    (data, expert, model[, fsdp]: MeshConfig's fields) chips of `topology`; the mesh replaces
    cfg.mesh (and is checked with it). The preset's train.microbatches is kept where
    batch_per_device splits into it, else 1 (the real global batch and its microbatches:
    bench/fit_presets.py)."""
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    if np.prod(mesh_shape) != len(devices):
        raise SystemExit(f"--mesh {mesh_shape} must multiply to the {len(devices)} chips of {topology}")
    mesh = sharding.make_mesh(MeshConfig(*mesh_shape), devices)
    rows = batch_per_device * sharding.batch_shards(mesh)
    m = cfg.train.microbatches if batch_per_device % cfg.train.microbatches == 0 else 1
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(*mesh_shape),
                              train=dataclasses.replace(cfg.train, batch_size=rows, microbatches=m))
    graphdef, state = trainer.abstract_train_state(cfg, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    row = jax.ShapeDtypeStruct((rows, cfg.train.seq_len + 1), jnp.int32,
                               sharding=sharding.batch_sharding(mesh))
    batch = {"tokens": row, "segment_ids": row, "positions": row}
    step = trainer.make_train_step(cfg, graphdef, shardings, mesh)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = step.lower(state, batch).compile()
    return compiled, devices[0].device_kind, rows, time.perf_counter() - t0, host_rows(mesh, rows, row.shape[1])


def host_rows(mesh, rows: int, seq: int) -> dict[int, list[int]]:
    """{host: [first row, end row)} of the global batch each host of the topology feeds (the rows
    its chips hold, as `trainer.local_rows` finds them on a real slice); each must be contiguous."""
    held = {}
    for device, index in sharding.batch_sharding(mesh).devices_indices_map((rows, seq)).items():
        held.setdefault(device.process_index, set()).update(range(rows)[index[0]])
    out = {}
    for host, r in sorted(held.items()):
        if len(r) != max(r) + 1 - min(r):
            raise SystemExit(f"host {host} holds rows {sorted(r)}: not contiguous")
        out[host] = [min(r), max(r) + 1]
    return out


def report(compiled, kind: str) -> dict:
    mem, cost = compiled.memory_analysis(), compiled.cost_analysis() or {}
    used = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
    hbm = HBM_GIB.get(kind)
    return {"per_device_bytes": {"arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
                                 "aliased": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes,
                                 "total": used},
            "per_device_gib": round(used / 2**30, 2), "hbm_gib": hbm,
            "fits": None if hbm is None else used < hbm * 2**30,
            "flops_per_device": cost.get("flops"),
            "mosaic_kernels": compiled.as_text().count("tpu_custom_call"),
            "ragged_all_to_all": compiled.as_text().count("ragged-all-to-all(")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="moe_15a2b",
                    help=f"a preset ({', '.join(cli.presets())}) or a config file")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--topology", default="v5p:4x4x2")
    ap.add_argument("--mesh", default="4,8,1", help="data,expert,model")
    ap.add_argument("--batch-per-device", type=int, default=1)
    args, overrides = cli.parse_args(ap, argv)
    cfg = cli.load(args.preset, overrides, variant=args.variant)
    mesh_shape = tuple(int(x) for x in args.mesh.split(","))
    compiled, kind, rows, seconds, hosts = compile_step(cfg, args.topology, mesh_shape, args.batch_per_device)
    local = {b - a for a, b in hosts.values()}
    out = {"preset": args.preset, "variant": cfg.variant, "topology": args.topology, "device": kind,
           "mesh": dict(zip(sharding.AXES, mesh_shape)), "global_batch": rows, "hosts": len(hosts),
           "process_local_batch": [sorted(local), cfg.train.seq_len + 1] if len(local) > 1 else
           [local.pop(), cfg.train.seq_len + 1],
           "seq_len": cfg.train.seq_len, "params": params.count_params(cfg.model),
           "activated_params": params.activated_params(cfg.model), "compile_s": round(seconds, 1),
           **report(compiled, kind)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    raise SystemExit(cli.run_cli(main))
