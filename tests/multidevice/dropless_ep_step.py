"""Dropless expert parallelism (gattn/model/dropless_ep.py, exec.moe_impl="ragged"): on meshes
with an expert axis, a dropless MoE's loss, per-expert load, LBL, z-loss and every gradient equal
the single-device dropless model's (same parameters), with the router as initialised and with a
skewed one (all-zero router weights: every token's top-k are experts 0..k-1, so one expert shard
receives every row of its group, the worst case the default buffer is sized for). A buffer of 1 x
the mean load (exec.moe_buffer=1) under the skewed router overflows, and the MoE layer counts the
overflow exactly (on the first mesh). On CPU the ragged_all_to_all is the emulation (XLA:CPU has
none); the real collective is checked by the TPU AOT compiles (tests/test_dropless_ep.py,
tests/test_aot.py).

    python -m multidevice.dropless_ep_step [--meshes 1,4,2 2,2,2 1,8,1 1,8,1,1] [--grouped-matmul megablox]

(a 4-number mesh is data, fsdp, expert, model: 1,8,1,1 is pure FSDP, the experts gathered.)

With --grouped-matmul megablox the local experts run the megablox kernel (interpret mode on CPU)
in a shard_map without check_vma, and the same equalities must hold.

Prints "ok MESH" per mesh (tests/test_dropless_ep.py counts them)."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gattn.config import Config, ExecConfig, MeshConfig, MoESpec
from gattn.model import dropless_ep, sharding
from gattn.model.transformer import Transformer
from gattn.train.loss import aux_loss, lm_loss_and_aux

from conftest import tiny_model
from multidevice import expert_meshes

BATCH, SEQ = 8, 16


def skewed(params):
    """The same parameters with every router's weights zero (ties: top-k = experts 0..k-1)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: np.zeros(x.shape, x.dtype) if "router" in jax.tree_util.keystr(path) else x, params)


def graph(cfg, ex):
    """The graphdef of the model computed as `ex` says (same parameter layout: unscanned)."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, ex, rngs=nnx.Rngs(0))), nnx.Param)[0]


def step_fn(cfg, graphdef):
    def loss(params, tokens):
        ce, aux = lm_loss_and_aux(nnx.merge(graphdef, params), tokens)
        return ce + aux_loss(cfg.moe, aux), aux
    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def check_equal(got, want):
    (l, aux), g = got
    (ref_loss, ref_aux), ref_grads = want
    assert int(aux["dropped"].sum()) == 0, aux["dropped"]
    np.testing.assert_allclose(l, ref_loss, rtol=1e-5)
    for name in ("lbl", "z_loss"):
        np.testing.assert_allclose(aux[name], ref_aux[name], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(aux["load"], ref_aux["load"])
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_grads), strict=True):
        a, b = np.asarray(a), np.asarray(b)  # numpy: no op-by-op compiles
        np.testing.assert_allclose(a, b, atol=1e-5 * float(np.max(np.abs(b))) + 1e-9)


def check_overflow(moe, spec, mesh, mesh_shape, grouped_matmul):
    """A buffer of the mean load (exec.moe_buffer=1) under the all-zero router (the MoE layer
    alone, forward): the shard(s) holding experts 0 and 1 of each data group take that many rows
    each; the rest overflow and every one of them is counted."""
    x_NxD = jax.random.normal(jax.random.key(1), (BATCH * SEQ, moe.router.shape[0]))
    forward = jax.jit(lambda w, x: dropless_ep.moe_forward(w, spec, moe.act, jnp.float32, x, mesh, 1.0,
                                                          grouped_matmul)[1])
    dropped = int(forward(moe.weights(), x_NxD)["dropped"])
    data, n_exp, _ = mesh_shape
    group_tokens = BATCH * SEQ // data
    per_expert = np.zeros(spec.num_experts, int)
    per_expert[:spec.top_k] = group_tokens
    incoming = per_expert.reshape(n_exp, -1).sum(1)
    expected = data * int(np.maximum(incoming - group_tokens * spec.top_k // n_exp, 0).sum())
    assert expected > 0 and dropped == expected, (dropped, expected)


def main(argv=None):
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--grouped-matmul", default="ragged_dot")
    known, rest = ap.parse_known_args(argv)
    meshes = expert_meshes(__doc__, rest)
    spec = MoESpec(num_experts=8, top_k=2, expert_width=16, z_loss_coef=1e-3)  # dropless
    cfg = tiny_model(vocab_size=64, num_layers=1, moe=spec)  # one layer: compiles fast
    ragged = ExecConfig(moe_impl="ragged", grouped_matmul=known.grouped_matmul)
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 0, 64)  # SEQ predicted
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    reference = step_fn(cfg, graphdef)
    cases = {"init": params, "skewed": skewed(params)}
    want = {name: reference(p, tokens) for name, p in cases.items()}
    load = want["skewed"][0][1]["load"]  # [layers, E]
    assert int(load[:, 2:].sum()) == 0 and int(load[:, 0].min()) == BATCH * SEQ, load
    step = step_fn(cfg, graph(cfg, ragged))
    skewed_moe = nnx.merge(graphdef, cases["skewed"]).blocks[0].ffn
    for mesh_shape in meshes:
        # (data, expert, model), or (data, fsdp, expert, model): expert 1 is pure FSDP, every
        # expert on every device (gathered), nothing exchanged
        mesh_cfg = (MeshConfig(*mesh_shape) if len(mesh_shape) == 3 else
                    MeshConfig(**dict(zip(("data", "fsdp", "expert", "model"), mesh_shape))))
        Config(model=cfg, mesh=mesh_cfg, exec=ragged)  # a valid run config
        mesh = sharding.make_mesh(mesh_cfg)
        t = jax.device_put(tokens, sharding.batch_sharding(mesh))
        with jax.set_mesh(mesh):
            for name, p in cases.items():
                p = jax.device_put(p, sharding.param_shardings(p, mesh))
                check_equal(step(p, t), want[name])
            kernels = str(jax.make_jaxpr(step)(p, t)).count("pallas_call")  # megablox's gmm and tgmm
            assert (kernels >= 3) == (known.grouped_matmul == "megablox"), kernels
            if mesh_shape == meshes[0]:  # the overflow count on one mesh (compile time)
                check_overflow(skewed_moe, spec, mesh, mesh_shape, known.grouped_matmul)
        print("ok", mesh_shape, flush=True)


if __name__ == "__main__":
    main()
