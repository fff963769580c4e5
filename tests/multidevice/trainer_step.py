"""The trainer's own step and validation on a mesh:

- gradient accumulation: the train step with train.microbatches = 4 gives the loss, grad norm and
  updated parameters of the plain step, every shard holding rows of every microbatch (the MoE
  case runs on one device, tests/test_train_step.py);
- validation with data.eval_batch_size not a multiple of the data x expert shards (3 rows over 8
  data shards, the Pallas kernel in shard_map over the batch) runs and equals one device's.

    python -m multidevice.trainer_step [--mesh 2,2,2]

Prints "ok ..." lines (tests/test_train_step.py counts them)."""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np

from gattn.config import Config, DataConfig, ExecConfig, MeshConfig, TrainConfig
from gattn.model import sharding
from gattn.train import trainer

from conftest import tiny_model
from multidevice import check_devices, shape


def packed_batch(rows: int, length: int, vocab: int, seed: int) -> dict:
    """Rows of two documents each and some padding at the end (segment id 0), positions restarting."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (rows, length), dtype=np.int32)
    seg = np.zeros((rows, length), np.int32)
    pos = np.zeros((rows, length), np.int32)
    for r in range(rows):
        cut, end = rng.integers(2, length // 2), rng.integers(length - 4, length + 1)
        seg[r, :cut], seg[r, cut:end] = 1, 2
        pos[r, :cut], pos[r, cut:end] = np.arange(cut), np.arange(end - cut)
    return {"tokens": tokens, "segment_ids": seg, "positions": pos}


def one_step(cfg: Config, mesh, batch: dict):
    """(state, report) after one trainer step on `batch` from the seed's initial state."""
    graphdef, state = trainer.init_state(cfg, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step = trainer.make_train_step(cfg, graphdef, shardings, mesh)
    b = {k: trainer.global_array(v, sharding.batch_sharding(mesh)) for k, v in batch.items()}
    with jax.set_mesh(mesh):
        state, report = step(state, b)
    return state, report


def check_microbatches(mesh_shape, model=None, counts=(4,), accumulate="sharded") -> None:
    """With exec.accumulate = "gathered" the plain step it is compared with runs on one device."""
    mesh = sharding.make_mesh(MeshConfig(*mesh_shape))
    model = model or tiny_model(vocab_size=64, num_layers=1)
    base = Config(model=model, train=TrainConfig(batch_size=16, seq_len=16, steps=10, warmup_steps=2,
                                                 learning_rate=1e-2), mesh=MeshConfig(*mesh_shape))
    batch = packed_batch(16, 17, 64, seed=1)
    if accumulate == "sharded":
        ref_state, ref = one_step(base, mesh, batch)
    else:
        one = dataclasses.replace(base, mesh=MeshConfig(data=1))
        ref_state, ref = one_step(one, sharding.make_mesh(one.mesh, jax.devices()[:1]), batch)
    for m in counts:
        cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, microbatches=m),
                                  exec=dataclasses.replace(base.exec, accumulate=accumulate))
        state, report = one_step(cfg, mesh, batch)
        np.testing.assert_allclose(report["loss"], ref["loss"], rtol=1e-5)
        np.testing.assert_allclose(report["grad_norm"], ref["grad_norm"], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"])):
            # (Adam divides by the gradient's own size: a near-zero gradient's rounding moves its first
            # update by up to ~1e-6 while a wrong gradient would move it by ~lr = 5e-3)
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
        print("ok microbatches", m, mesh_shape, accumulate, flush=True)


def check_validation() -> None:
    """3 held-out rows over 8 data shards; the Pallas kernel (interpret mode) in shard_map."""
    model = tiny_model(vocab_size=64, num_layers=1)
    ex = ExecConfig(attention_impl="pallas", flash_block_q=8, flash_block_k=8)
    cfg = Config(model=model, train=TrainConfig(batch_size=8, seq_len=16, steps=10, warmup_steps=2),
                 data=DataConfig(eval_batch_size=3), mesh=MeshConfig(data=8), exec=ex)
    mesh = sharding.make_mesh(cfg.mesh)
    graphdef, state = trainer.init_state(cfg, mesh)
    batches = {"held_out": [packed_batch(3, 17, 64, seed=2)]}
    sharded = trainer.validate(trainer.make_eval_step(graphdef), state["params"], batches, mesh)
    params = jax.device_get(state["params"])
    plain_graph, _ = trainer.init_state(dataclasses.replace(cfg, exec=ExecConfig(), mesh=MeshConfig(data=1)),
                                        sharding.make_mesh(MeshConfig(data=1), jax.devices()[:1]))
    single = trainer.validate(trainer.make_eval_step(plain_graph), params, batches)
    np.testing.assert_allclose(sharded["val_loss/held_out"], single["val_loss/held_out"], rtol=1e-5)
    print("ok validation 3 rows over 8 data shards", flush=True)


def check_fsdp_state(mesh_shape) -> None:
    """The train state built on an fsdp mesh: each device holds ~1/fsdp of the parameter and
    AdamW bytes (measured on the arrays), and the moments are laid out as their parameters."""
    cfg = Config(model=tiny_model(vocab_size=64, num_layers=2), mesh=MeshConfig(*mesh_shape))
    mesh = sharding.make_mesh(cfg.mesh)
    _, state = trainer.init_state(cfg, mesh)
    device = jax.devices()[0]
    for part in ("params", "opt_state"):
        leaves = [x for x in jax.tree.leaves(state[part]) if x.ndim]
        total = sum(x.nbytes for x in leaves)
        here = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)
        share, fsdp = here / total, mesh.shape["fsdp"] * mesh.shape["model"]
        assert 0.9 / fsdp <= share <= 1.1 / fsdp, (part, share, fsdp)
        print(f"ok fsdp state {part} {mesh_shape} {share:.4f} of {total} bytes on one device", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", type=shape, default=(2, 2, 2), help="data,expert,model[,fsdp] of the microbatch check")
    ap.add_argument("--fsdp-mesh", type=shape, default=None, help="also: the state's share per device on this mesh")
    ap.add_argument("--gathered", type=shape, nargs="*", default=[],
                    help="also: microbatches with exec.accumulate='gathered' on these meshes, against one device")
    args = ap.parse_args(argv)
    check_devices()
    check_microbatches(args.mesh)
    for mesh_shape in args.gathered:  # (2 and 4 microbatches where the 16 rows split into them on every shard)
        shards = sharding.batch_shards(sharding.make_mesh(MeshConfig(*mesh_shape)))
        check_microbatches(mesh_shape, counts=tuple(m for m in (2, 4) if 16 % (shards * m) == 0),
                           accumulate="gathered")
    if args.fsdp_mesh:
        check_fsdp_state(args.fsdp_mesh)
    check_validation()


if __name__ == "__main__":
    main()
