"""What each device computes under context parallelism (mesh.context), read from the compiled
step of a one-layer MoE model on 8 simulated CPU devices, with the sequence split over context 4:

    moe     the expert-parallel MoE (exec.moe_impl "ragged", with and without an expert axis, and
            "all_to_all" with a capacity) routes only the device's own tokens: its routing sort
            holds N * top_k / 8 assignments, as on a mesh of data 8 (not context x as many: every
            context device repeating its batch shard's MoE). The loss, the MoE's aux values and
            every gradient equal one device's.

    rows    with 4 rows per batch shard (fsdp 2 x context 4), the residual stream's token order
            (gattn/model/sharding.py `stream`) gives each device its rows' pieces of the sequence,
            the context shard_maps' layout: the step's all-to-alls do not grow with the layers
            (the attention and Gated DeltaNet layers do not reshard), for a dense model and a
            hybrid with MTP.

    python -m multidevice.context_layout [--quick]

Prints "ok moe IMPL MESH" per case and "ok rows MODEL" (tests/test_context_layout.py counts them)."""

from __future__ import annotations

import argparse
import re

import jax
import numpy as np
from flax import nnx

from gattn.config import ExecConfig, GateSpec, LinearAttentionSpec, MeshConfig, MoESpec, hybrid_layer_types
from gattn.model import sharding
from gattn.model.transformer import Transformer
from gattn.train.loss import aux_loss, lm_and_mtp_loss, lm_loss_and_aux

from conftest import tiny_model
from multidevice import check_devices
from multidevice.context_step import packed_batch

ROWS, LENGTH, DEVICES = 8, 64, 8  # packed_batch's rows: 8 x 64 input positions


def sort_sizes(hlo: str) -> set[int]:
    """The per-device element counts of the 1-D sorts in compiled HLO (the MoE's routing sort)."""
    return {int(n) for n in re.findall(r"\[(\d+)\]\{0\}\) sort\(", hlo)}


def check_moe(quick: bool = False) -> None:
    dropless = MoESpec(num_experts=4, top_k=2, expert_width=16, z_loss_coef=1e-3)
    capped = MoESpec(num_experts=4, top_k=2, expert_width=16, z_loss_coef=1e-3, capacity_factor=2.0)  # cap = tokens
    cases = [("ragged", dropless, MeshConfig(data=2, context=4)),  # expert axis 1: no exchange
             ("ragged", dropless, MeshConfig(data=1, context=4, expert=2)),
             ("all_to_all", capped, MeshConfig(data=1, context=4, expert=2))][:1 if quick else None]
    tokens, seg, pos = packed_batch()
    for impl, spec, mesh_cfg in cases:
        cfg = tiny_model(vocab_size=64, num_layers=1, moe=spec)
        graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        ep_graph = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, ExecConfig(moe_impl=impl), rngs=nnx.Rngs(0))),
                             nnx.Param)[0]

        def loss(p, t, s, q, g):
            ce, aux = lm_loss_and_aux(nnx.merge(g, p), t, s, q)
            return ce + aux_loss(cfg.moe, aux), aux

        (ref_loss, ref_aux), ref_grads = jax.jit(jax.value_and_grad(lambda *a: loss(*a, graphdef), has_aux=True))(
            params, tokens, seg, pos)
        mesh = sharding.make_mesh(mesh_cfg)
        with jax.set_mesh(mesh):
            p = jax.device_put(params, sharding.param_shardings(params, mesh))
            b = [jax.device_put(x, sharding.batch_sharding(mesh)) for x in (tokens, seg, pos)]
            compiled = jax.jit(jax.value_and_grad(lambda *a: loss(*a, ep_graph), has_aux=True)).lower(p, *b).compile()
            (l, aux), g = compiled(p, *b)
        own = ROWS * LENGTH * spec.top_k // DEVICES  # this device's tokens' assignments
        assert sort_sizes(compiled.as_text()) == {own}, (impl, mesh_cfg, sort_sizes(compiled.as_text()), own)
        assert int(np.sum(aux["dropped"])) == 0, aux["dropped"]
        np.testing.assert_allclose(l, ref_loss, rtol=2e-5)
        for name in ("lbl", "z_loss"):
            np.testing.assert_allclose(aux[name], ref_aux[name], rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(aux["load"], ref_aux["load"])
        for a, r in zip(jax.tree.leaves(g), jax.tree.leaves(ref_grads), strict=True):
            a, r = np.asarray(a), np.asarray(r)
            np.testing.assert_allclose(a, r, atol=2e-5 * float(np.max(np.abs(r))) + 1e-9)
        print("ok moe", impl, (mesh_cfg.data, mesh_cfg.context, mesh_cfg.expert), flush=True)


def all_to_alls(cfg, mesh) -> int:
    """The all-to-alls in the compiled loss-and-gradient step of `cfg` on `mesh` (packed_batch)."""
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)

    def loss(p, t, s, q):
        model = nnx.merge(graphdef, p)
        if cfg.mtp_layers:
            ce, mtp, _ = lm_and_mtp_loss(model, t, s, q)
            return ce + 0.3 * mtp
        return lm_loss_and_aux(model, t, s, q)[0]

    with jax.set_mesh(mesh):
        p = jax.device_put(params, sharding.param_shardings(params, mesh))
        b = [jax.device_put(x, sharding.batch_sharding(mesh)) for x in packed_batch()]
        hlo = jax.jit(jax.grad(loss)).lower(p, *b).compile().as_text()
    return len(re.findall(r" all-to-all(?:-start)?\(", hlo))


def check_rows(quick: bool = False) -> None:
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=2, context=4))  # 8 rows: 4 per fsdp shard
    gdn = LinearAttentionSpec(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
    models = {"dense": lambda n: tiny_model(vocab_size=64, num_layers=n, gate=GateSpec(), qk_norm=True),
              "hybrid": lambda n: tiny_model(vocab_size=64, num_layers=n, layer_types=hybrid_layer_types(n),
                                             gate=GateSpec(), linear_attention=gdn, mtp_layers=1)}
    for name, make in list(models.items())[:1 if quick else None]:
        layers = (2, 4) if quick else (4, 8)
        counts = [all_to_alls(make(n), mesh) for n in layers]
        assert counts[0] == counts[1], (name, f"all-to-alls with {layers} layers", counts)
        print("ok rows", name, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the dense model at 2 and 4 layers and the ragged MoE "
                    "on data 2 x context 4 only (the default set's cousin of the whole check)")
    args = ap.parse_args(argv)
    check_devices()
    check_rows(args.quick)
    check_moe(args.quick)


if __name__ == "__main__":
    main()
