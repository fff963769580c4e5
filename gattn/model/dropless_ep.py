"""Dropless expert parallelism (exec.moe_impl = "ragged"): only the routed rows cross the mesh.

With an expert axis of 1 (pure FSDP, as MaxText's FSDP MoE configs run) nothing is exchanged:
every device gathers every expert's weights (their FSDP shards, as any weight) and runs its own
tokens through them with the grouped matmul, dropless.

Each device holds the tokens of its (data, fsdp, expert, context) shard and the E / n experts of its expert
shard (each expert's width split over `model`). Per device, with M = N_local * k routed rows:

    route, permute     its own tokens, sorted by expert: rows [M, D], group sizes [E]
    sizes              all_to_all over `expert` of the group sizes: each device learns how many
                       rows every source sends to each of its E/n experts
    ragged_all_to_all  each expert's rows, exactly, into the expert's device, laid out expert-major
                       (expert 0's rows from source 0, 1, ..., then expert 1's ...) in a buffer
                       of B rows, so the grouped matmul needs no further sort
    experts            grouped matmuls over the E/n local experts (exec.grouped_matmul:
                       `jax.lax.ragged_dot` or megablox, gattn/kernels/grouped_matmul.py); psum
                       over `model`
    ragged_all_to_all  back: every source receives its own M rows, in its own order
    unpermute          each token's k outputs summed with its router weights

The receive buffer B is the only size to choose (`exec.moe_buffer`): the worst case, every row
of every shard of the expert group to one device, is B = n * M, and nothing is ever dropped (the
default). A buffer of b * M rows (b >= 1; the mean load is exactly M) fills expert by expert and
source by source; rows that do not fit are not sent, give zero expert output and are counted in
aux["dropped"] (the trainer logs moe/dropped). Without drops the result equals the single-device
dropless model to float error (tests/test_dropless_ep.py).

XLA:CPU (jax 0.10.2) has no ragged-all-to-all ("UNIMPLEMENTED: HLO opcode ragged-all-to-all is
not supported by XLA:CPU ThunkEmitter"), so on CPU meshes `ragged_all_to_all` is the emulation
below, with the same interface and semantics, built from all_gather; the real collective is what
TPU (and GPU) programs contain, proven by AOT compiles for TPU (tests/test_dropless_ep.py,
bench/aot_train_step.py). The platform of the mesh that is set decides which.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gattn.kernels.grouped_matmul import grouped_dot, padded_rows
from gattn.model.expert_parallel import micro_groups_per_shard, shard_aux
from gattn.model.moe_ops import permute, route, router_logits, unpermute
from gattn.model.sharding import token_axes


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """`jax.lax.ragged_all_to_all`'s semantics from all_gather (for backends without the
    collective): every device gathers every operand and slice table and copies the slices sent to
    it. Moves n x the data, so it is for CPU tests and benchmarks only. `recv_sizes` is implied by
    the senders' `send_sizes` (the collective's contract) and is not read."""
    del recv_sizes
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    per_dest = input_offsets.shape[0] // n

    def to_me(table):  # [K] on every source -> [src * per_dest]: the slices each source sends me
        return jax.lax.all_gather(table, axis_name).reshape(n, n, per_dest)[:, me].reshape(-1)

    start, size, src_start = to_me(output_offsets), to_me(send_sizes), to_me(input_offsets)
    operands = jax.lax.all_gather(operand, axis_name)                  # [n, R, ...]
    r = jnp.arange(output.shape[0])[:, None]
    hit_RxK = (r >= start) & (r < start + size)
    k = jnp.argmax(hit_RxK, axis=1)
    row = src_start[k] + r[:, 0] - start[k]
    picked = operands[k // per_dest, jnp.clip(row, 0, operand.shape[0] - 1)]
    mask = jnp.any(hit_RxK, axis=1).reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(mask, picked, output)


def ragged_all_to_all(platform: str, *args, axis_name):
    """The collective on TPU/GPU, the emulation on CPU (where XLA has none)."""
    fn = emulated_ragged_all_to_all if platform == "cpu" else jax.lax.ragged_all_to_all
    return fn(*args, axis_name=axis_name)


def context_mesh(spec):
    """The mesh set with `jax.set_mesh`, checked for this path: an expert axis dividing the
    experts (1: every device holds every expert, gathered by FSDP; no exchange), and a dropless MoE."""
    mesh = jax.sharding.get_abstract_mesh()
    n = 0 if mesh.empty or "expert" not in mesh.axis_names else mesh.shape["expert"]
    if n < 1 or spec.num_experts % n or spec.capacity_factor is not None:
        raise ValueError(f"exec.moe_impl='ragged' runs under a mesh (jax.set_mesh) whose expert axis "
                         f"(here {n or 'none'}) divides the {spec.num_experts} experts, for a dropless MoE "
                         "(capacity_factor None); use exec.moe_impl='partitioned' otherwise")
    return mesh


def buffer_rows(rows: int, n_exp: int, moe_buffer: float | None) -> int:
    """Rows each device's experts can receive: n * rows (the worst case) or ceil(b * rows)."""
    worst = n_exp * rows
    return worst if moe_buffer is None else min(worst, math.ceil(moe_buffer * rows))


def grouped_swiglu(act, dtype, x_BxD, w1, w3, w2, sizes_L, dot=jax.lax.ragged_dot):
    """The local experts' SwiGLU on their contiguous blocks of rows (rows past sum(sizes) are
    padding: never read back); `dot` is the grouped matmul (gattn.kernels.grouped_matmul)."""
    h = act(dot(x_BxD, w1, sizes_L)) * dot(x_BxD, w3, sizes_L)
    return dot(h.astype(dtype), w2, sizes_L)


def exchange_plan(sizes_E: jax.Array, n_exp: int, rows_in: int):
    """Where every row goes, from this device's group sizes [E] (experts in shard-major order).
    Returns the forward collective's (input_offsets, send_sizes, output_offsets, recv_sizes), the
    backward one's, and the accepted rows per local expert [E/n]."""
    e = sizes_E.shape[0]
    per = e // n_exp
    a2a = lambda t: jax.lax.all_to_all(t, "expert", 0, 0)               # noqa: E731  [n, ...] swap
    recv_SxL = a2a(sizes_E.reshape(n_exp, per))                         # rows source s sends my expert l
    # receiver layout: expert-major, then source; fill in that order until the buffer is full
    want_LxS = recv_SxL.T.reshape(-1)
    end = jnp.cumsum(want_LxS)
    start = end - want_LxS
    take_LxS = jnp.clip(rows_in - start, 0, want_LxS)
    take_SxL = take_LxS.reshape(per, n_exp).T
    at_SxL = jnp.minimum(start, rows_in - 1).reshape(per, n_exp).T     # (size-0 slices stay in range)
    in_off_E = (jnp.cumsum(sizes_E) - sizes_E).astype(jnp.int32)       # where each expert's rows start here
    send_E = a2a(take_SxL).reshape(e)                                   # how many of mine each expert takes
    out_off_E = a2a(at_SxL).reshape(e)                                  # and where they land there
    src_off_SxL = a2a(in_off_E.reshape(n_exp, per))                     # where they came from, per source
    forward = (in_off_E, send_E, out_off_E, take_SxL.reshape(e))
    backward = (at_SxL.reshape(e), take_SxL.reshape(e), src_off_SxL.reshape(e), send_E)
    return forward, backward, jnp.sum(take_SxL, axis=0)


def moe_forward(weights: dict, spec, act, dtype, x_NxD: jax.Array, mesh, moe_buffer: float | None = None,
                grouped_matmul: str = "ragged_dot"):
    """(out [N, D], aux) of the dropless MoE with `weights` (gattn.model.moe.MoE.weights()) and
    experts split over the mesh's `expert` axis; same contract as `MoE.__call__`. `grouped_matmul`
    (exec.grouped_matmul) names the local experts' kernel; megablox rounds the buffer up to whole
    row tiles and turns off shard_map's check_vma, which its pallas_call cannot satisfy."""
    n_exp = mesh.shape["expert"]
    device = getattr(getattr(mesh, "abstract_mesh", mesh), "abstract_device", None)
    platform = getattr(device, "platform", None) or jax.default_backend()  # TPU in an AOT compile
    model = "model" if mesh.shape.get("model", 1) > 1 else None
    batch = token_axes(mesh)  # includes "expert" and "context": each device its own tokens
    groups_per_shard = micro_groups_per_shard(spec, mesh)
    mlp_ok = model is not None and spec.expert_width % mesh.shape["model"] == 0
    experts_over = "expert" if n_exp > 1 else None  # (a size-1 axis would make the output vary over it)
    w13_spec = P(experts_over, None, "model" if mlp_ok else None)
    w2_spec = P(experts_over, "model" if mlp_ok else None, None)
    dot = grouped_dot(grouped_matmul, platform)
    megablox = grouped_matmul == "megablox"

    def local(x, router, w1, w3, w2):  # expert axis 1: every expert here, nothing exchanged
        logits = router_logits(x, router)
        weights, experts, probs = route(logits, spec)
        rows_MxD, order, sizes_E = permute(x.astype(dtype), experts, spec.num_experts)
        m = rows_MxD.shape[0]
        b = padded_rows(m) if megablox else m
        y_BxD = grouped_swiglu(act, dtype, jnp.pad(rows_MxD, ((0, b - m), (0, 0))), w1, w3, w2, sizes_E, dot)
        if mlp_ok:
            y_BxD = jax.lax.psum(y_BxD, "model")
        out = unpermute(y_BxD[:m], order, weights)
        dropped = m - jnp.sum(sizes_E)  # 0: every routed row has its expert here (varying, as psum wants)
        return out, shard_aux(spec, logits, probs, experts, sizes_E, dropped, batch,
                              groups_per_shard)

    def body(x, router, w1, w3, w2):
        if n_exp == 1:
            return local(x, router, w1, w3, w2)
        e = spec.num_experts
        logits = router_logits(x, router)
        weights, experts, probs = route(logits, spec)
        rows_MxD, order, sizes_E = permute(x.astype(dtype), experts, e)
        m = rows_MxD.shape[0]
        b = buffer_rows(m, n_exp, moe_buffer)
        b = padded_rows(b) if megablox else b
        forward, backward, local_sizes = exchange_plan(sizes_E, n_exp, b)
        recv_BxD = ragged_all_to_all(platform, rows_MxD, jnp.zeros((b, x.shape[1]), dtype), *forward,
                                     axis_name="expert")
        y_BxD = grouped_swiglu(act, dtype, recv_BxD, w1, w3, w2, local_sizes, dot)
        if mlp_ok:
            y_BxD = jax.lax.psum(y_BxD, "model")
        back_MxD = ragged_all_to_all(platform, y_BxD, jnp.zeros_like(rows_MxD, y_BxD.dtype), *backward,
                                     axis_name="expert")
        out = unpermute(back_MxD, order, weights)
        dropped = m - jnp.sum(forward[1])  # rows past the buffer (0 with the worst-case one)
        return out, shard_aux(spec, logits, probs, experts, sizes_E, dropped, batch, groups_per_shard)

    aux_specs = {"lbl": P(), "z_loss": P(), "load": P(), "dropped": P()}
    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(P(batch, None), P(None, None), w13_spec, w13_spec, w2_spec),
                       out_specs=(P(batch, None), aux_specs), check_vma=not megablox)
    return fn(x_NxD, weights["router"], weights["w1"], weights["w3"], weights["w2"])
