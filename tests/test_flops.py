"""gattn/experiments/flops.py: FLOPs and HBM bytes per device per run, counted from compiled HLO.

Every count is compared exactly with the number worked out by hand: a dot is 2 x its output
elements x its contracting dims, a scan's body counts once per trip, and a rematerialised layer
costs one more forward. The compiled cases are CPU programs (M = 64 rows, K = 32 features, N = 48
outputs); the literal HLO cases pin the byte rules (slices, in-place updates, async copies) and
the custom-call pricing; one TPU program (compiled ahead of time by libtpu on this CPU) prices a
Pallas kernel from its CostEstimate.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl, topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gattn.experiments import flops

M, K, N, F32 = 64, 32, 48, 4


def compiled(f, *shapes, **static):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return jax.jit(f, static_argnames=tuple(static)).lower(*args, **static).compile()


# ---- compiled CPU programs -------------------------------------------------------------------

def test_a_matmul_is_2mnk_and_reads_and_writes_its_arrays():
    c = compiled(lambda x, w: x @ w, (M, K), (K, N))
    out = flops.count_flops(c.as_text())
    assert out["by_kind"] == {"dot": 2 * M * N * K} and out["flops"] == 2 * M * N * K
    assert out["hbm_bytes"] == (M * K + K * N + M * N) * F32  # 26624
    assert out["unknown_trip_counts"] == 0 and out["custom_calls"] == []
    assert c.cost_analysis()["flops"] == out["flops"]


def test_a_batched_einsum():
    c = compiled(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), (4, M, K), (4, K, N))
    assert flops.count_flops(c.as_text())["by_kind"] == {"dot": 2 * 4 * M * N * K}


def test_a_convolution_counts_only_the_taps_that_read_the_input():
    # x [2, 3, 16, 16] (NCHW), kernel [8, 3, 3, 3], SAME padding: per spatial dim, 16 outputs x 3
    # taps less the 2 that fall on the padding = 46 pairs; 2 x batch 2 x out 8 x in 3 x 46 x 46
    c = compiled(lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME"), (2, 3, 16, 16), (8, 3, 3, 3))
    out = flops.count_flops(c.as_text())
    assert out["by_kind"] == {"convolution": 2 * 2 * 8 * 3 * 46 * 46}  # 203136 (221184 with the padding)
    assert c.cost_analysis()["flops"] == out["flops"]


def test_a_loop_free_program_agrees_with_xla():
    def mlp(x, w1, w2):
        return jnp.tanh(jax.nn.relu(x @ w1) @ w2)

    c = compiled(mlp, (M, K), (K, N), (N, K))
    out, xla = flops.count_flops(c.as_text()), c.cost_analysis()
    assert out["by_kind"]["dot"] == 2 * M * N * K * 2
    assert out["flops"] == pytest.approx(xla["flops"], rel=0.01)
    assert out["transcendentals"] == xla["transcendentals"] == M * K
    assert out["hbm_bytes"] == pytest.approx(xla["bytes accessed"], rel=0.05)


def _scan(h_MxK, ws_LxKxK):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h_MxK, ws_LxKxK)[0]


def test_a_scan_counts_its_body_once_per_trip_where_xla_counts_it_once():
    c = compiled(_scan, (M, K), (7, K, K))
    out = flops.count_flops(c.as_text())
    assert out["by_kind"]["dot"] == 7 * 2 * M * K * K
    assert out["transcendentals"] == 7 * M * K
    assert c.cost_analysis()["flops"] == pytest.approx(2 * M * K * K, rel=0.01)
    # each trip reads its [K, K] slice of the weights, not all 7
    assert out["hbm_bytes"] < 7 * (2 * M * K + 2 * K * K + 7 * K * K) * F32


def test_nested_scans_multiply():
    def nested(h, ws):
        return jax.lax.scan(lambda h, w5: (_scan(h, w5), None), h, ws)[0]

    out = flops.count_flops(compiled(nested, (M, K), (3, 5, K, K)).as_text())
    assert out["by_kind"]["dot"] == 3 * 5 * 2 * M * K * K and out["transcendentals"] == 15 * M * K


@pytest.fixture(scope="module")
def gradients():
    """Dot FLOPs of the gradient of a 5-layer scan of tanh(h @ w), without and with remat."""
    def loss(ws, h, remat):
        layer = lambda h, w: jnp.tanh(h @ w)  # noqa: E731
        if remat:
            layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
        return jnp.sum(jax.lax.scan(lambda h, w: (layer(h, w), None), h, ws)[0])

    return {remat: flops.count_flops(compiled(jax.grad(loss), (5, K, K), (M, K), remat=remat).as_text())
            for remat in (False, True)}


def test_rematerialisation_shows_as_one_more_forward(gradients):
    forward = 5 * 2 * M * K * K  # 655360: one matmul per layer
    # without remat: the forward, then dW = h^T dY and dH = dY W^T per layer
    assert gradients[False]["by_kind"]["dot"] == 3 * forward
    # with remat the backward runs each layer's forward again
    assert gradients[True]["by_kind"]["dot"] == 4 * forward
    assert gradients[True]["transcendentals"] == 2 * gradients[False]["transcendentals"] == 2 * 5 * M * K


# ---- literal HLO: the byte rules and custom calls -----------------------------------------------

LOOP = """HloModule loop, num_partitions=1

%slice_fusion (p0: f32[7,32,32], p1: s32[]) -> f32[32,32] {
  %p0 = f32[7,32,32]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,32,32]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,32,32}
  ROOT %b = f32[32,32]{1,0} bitcast(%ds)
}

%dot_fusion (r0: f32[64,32], r1: f32[32,32]) -> f32[64,32] {
  %r0 = f32[64,32]{1,0} parameter(0)
  %r1 = f32[32,32]{1,0} parameter(1)
  %d = f32[64,32]{1,0} dot(%r0, %r1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = f32[64,32]{1,0} tanh(%d)
}

%dus_fusion (q0: f32[7,64,32], q1: f32[64,32], q2: s32[]) -> f32[7,64,32] {
  %q0 = f32[7,64,32]{2,1,0} parameter(0)
  %q1 = f32[64,32]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z1 = s32[] constant(0)
  %bc = f32[1,64,32]{2,1,0} bitcast(%q1)
  ROOT %dus = f32[7,64,32]{2,1,0} dynamic-update-slice(%q0, %bc, %q2, %z1, %z1)
}

%body (arg: (s32[], f32[64,32], f32[7,32,32], f32[7,64,32])) -> (s32[], f32[64,32], f32[7,32,32], f32[7,64,32]) {
  %arg = (s32[], f32[64,32]{1,0}, f32[7,32,32]{2,1,0}, f32[7,64,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %h = f32[64,32]{1,0} get-tuple-element(%arg), index=1
  %ws = f32[7,32,32]{2,1,0} get-tuple-element(%arg), index=2
  %ys = f32[7,64,32]{2,1,0} get-tuple-element(%arg), index=3
  %w = f32[32,32]{1,0} fusion(%ws, %i), kind=kLoop, calls=%slice_fusion
  %h2 = f32[64,32]{1,0} fusion(%h, %w), kind=kOutput, calls=%dot_fusion
  %ys2 = f32[7,64,32]{2,1,0} fusion(%ys, %h2, %i), kind=kLoop, calls=%dus_fusion
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[64,32]{1,0}, f32[7,32,32]{2,1,0}, f32[7,64,32]{2,1,0}) tuple(%i2, %h2, %ws, %ys2)
}

%cond (c: (s32[], f32[64,32], f32[7,32,32], f32[7,64,32])) -> pred[] {
  %c = (s32[], f32[64,32]{1,0}, f32[7,32,32]{2,1,0}, f32[7,64,32]{2,1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (x: f32[64,32], ws0: f32[7,32,32]) -> f32[7,64,32] {
  %x = f32[64,32]{1,0} parameter(0)
  %ws0 = f32[7,32,32]{2,1,0} parameter(1)
  %zero = s32[] constant(0)
  %fz = f32[] constant(0)
  %buf = f32[7,64,32]{2,1,0} broadcast(%fz), dimensions={}
  %init = (s32[], f32[64,32]{1,0}, f32[7,32,32]{2,1,0}, f32[7,64,32]{2,1,0}) tuple(%zero, %x, %ws0, %buf)
  %loop = (s32[], f32[64,32]{1,0}, f32[7,32,32]{2,1,0}, f32[7,64,32]{2,1,0}) while(%init), condition=%cond, body=%body
  %ys = f32[7,64,32]{2,1,0} get-tuple-element(%loop), index=3
  %cs = (f32[7,64,32]{2,1,0:S(5)}, f32[7,64,32]{2,1,0}, u32[]) copy-start(%ys)
  ROOT %cd = f32[7,64,32]{2,1,0:S(5)} copy-done(%cs)
}
"""


def test_a_loop_reads_its_slices_and_updates_in_place():
    out = flops.count_flops(LOOP)
    # per trip: the weight slice read and written (4096 + 4096) and the index (4); the dot reads
    # h and w and writes h2 (8192 + 4096 + 8192); the in-place update reads h2 and the index and
    # writes its [1, 64, 32] row, not the [7, 64, 32] buffer (8192 + 4 + 8192); the add (12); the
    # condition's compare (4 + 4 + 1)
    trip = (4096 + 4 + 4096) + (8192 + 4096 + 8192) + (8192 + 4 + 8192) + 12 + 9
    # the entry: the broadcast (4 + 57344); the copy to host memory (S(5)) counts its HBM side once
    entry = (4 + 57344) + (57344 + 4)
    assert out["hbm_bytes"] == 7 * trip + entry
    assert out["by_kind"] == {"dot": 7 * 2 * 64 * 32 * 32, "elementwise": 7 * 2}  # the add, the compare
    assert out["transcendentals"] == 7 * 64 * 32 and out["unknown_trip_counts"] == 0


CALLS = """HloModule calls

%heavy (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  ROOT %d = f32[8,8]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%light (b: f32[8,8]) -> f32[8,8] {
  %b = f32[8,8]{1,0} parameter(0)
  ROOT %s = f32[8,8]{1,0} add(%b, %b)
}

ENTRY %main (x: f32[8,8], k: s32[]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %k = s32[] parameter(1)
  %c = f32[8,8]{1,0} conditional(%k, %x, %x), branch_computations={%light, %heavy}
  %attn.3 = f32[8,8]{1,0} custom-call(%c), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"TUzv","cost_estimate":{"flops":"1000","transcendentals":"10","bytes_accessed":"512","remote_bytes_transferred":"0"},"needs_layout_passes":true}}
  %mine.1 = f32[8,8]{1,0} custom-call(%attn.3), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"TUzv"}}
  ROOT %other = f32[8,8]{1,0} custom-call(%mine.1), custom_call_target="mystery"
}
"""


def test_custom_calls_are_priced_from_their_estimate_a_formula_or_listed():
    formula = {"mine": lambda out, operands: 2 * 8 * 8 * 8}
    out = flops.count_flops(CALLS, formula)
    # the conditional's heavier branch (a dot: 1024), the estimate (1000), the formula (1024)
    assert out["by_kind"] == {"dot": 1024, "custom_call": 2024} and out["flops"] == 3048
    assert out["transcendentals"] == 10
    assert out["hbm_bytes"] == 3 * 256 + 512 + 2 * 256 + 2 * 256  # dot; estimate; operand + output x 2
    assert [(c["name"], c["priced_by"], c["flops"], c["bytes"]) for c in out["custom_calls"]] == [
        ("mine", "formula", 1024, 512), ("attn", "cost_estimate", 1000, 512), ("other", "unpriced", 0, 512)]
    # a formula may price the bytes too (a kernel that reads its operands several times)
    again = flops.count_flops(CALLS, {"mine": lambda out, operands: (1024, 4096)})
    assert again["hbm_bytes"] == out["hbm_bytes"] - 512 + 4096 and again["flops"] == out["flops"]
    short = flops.count(CALLS)
    assert short["custom_calls"][-1]["priced_by"] == "unpriced" and short["hbm_gib"] == 0.0
    assert set(short) == {"tflops", "by_kind", "hbm_gib", "unknown_trip_counts", "custom_calls"}


# ---- a Pallas kernel compiled for TPU ------------------------------------------------------------

def test_a_pallas_kernel_in_a_loop_is_priced_from_its_cost_estimate():
    device = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices[0]
    mesh = Mesh(np.asarray([device]), ("x",))  # one chip: a Mosaic call needs no partitioning

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    def step(x):
        kernel = pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name="double",
                                cost_estimate=pl.CostEstimate(flops=12345, transcendentals=7, bytes_accessed=999))
        return jax.lax.fori_loop(0, 3, lambda i, h: kernel(h) @ h, x)

    x = jax.ShapeDtypeStruct((128, 128), jnp.float32, sharding=NamedSharding(mesh, P()))
    out = flops.count_flops(jax.jit(step).lower(x).compile().as_text())
    assert out["custom_calls"] == [{"target": "tpu_custom_call", "name": "double", "runs": 3,
                                    "flops": 3 * 12345, "bytes": 3 * 999, "priced_by": "cost_estimate"}]
    # the matmul: TPU emits it as a convolution
    assert out["by_kind"]["custom_call"] == 3 * 12345
    assert out["by_kind"].get("dot", 0) + out["by_kind"].get("convolution", 0) == 3 * 2 * 128**3


def test_gattn_flash_kernels_carry_their_cost_estimates():
    from gattn.kernels import attention_pallas, shard_attention

    devices = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices
    mesh = Mesh(np.asarray(devices), ("model",))
    attn = shard_attention(attention_pallas, mesh, batch_axes=(), head_axis="model")
    x = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, None, "model")))
    loss = lambda q, k, v, g: jnp.sum(attn(q, k, v, g, interpret=False).astype(jnp.float32))  # noqa: E731
    out = flops.count_flops(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, x, x, x).compile().as_text())
    calls = {c["name"]: c for c in out["custom_calls"]}
    assert set(calls) == {"gated_flash_fwd", "gated_flash_bwd_prep", "flash_bwd_dkv", "flash_bwd_dq"}
    assert {c["priced_by"] for c in calls.values()} == {"cost_estimate"}
    # per chip 2 heads; causal 512 x 512 blocks: 3 of the 4 (query, key) block pairs computed;
    # the forward's 4 FLOPs per score per head dim (QK^T and PV)
    assert calls["gated_flash_fwd"]["flops"] == 4 * 2 * 3 * 512 * 512 * 128


NESTED = """HloModule nested, num_partitions=1

%inner_slice (s0: f32[7,64,32], s1: s32[]) -> f32[64,32] {
  %s0 = f32[7,64,32]{2,1,0} parameter(0)
  %s1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,64,32]{2,1,0} dynamic-slice(%s0, %s1, %z, %z), dynamic_slice_sizes={1,64,32}
  ROOT %b = f32[64,32]{1,0} bitcast(%ds)
}

%outer (o0: f32[7,64,32], o1: s32[], o2: f32[32,32], o3: f32[7,64,32]) -> (f32[7,64,32], f32[64,32]) {
  %o0 = f32[7,64,32]{2,1,0} parameter(0)
  %o1 = s32[] parameter(1)
  %o2 = f32[32,32]{1,0} parameter(2)
  %o3 = f32[7,64,32]{2,1,0} parameter(3)
  %x = f32[64,32]{1,0} fusion(%o0, %o1), kind=kLoop, calls=%inner_slice
  %d = f32[64,32]{1,0} dot(%x, %o2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %z = s32[] constant(0)
  %bc = f32[1,64,32]{2,1,0} bitcast(%d)
  %u = f32[7,64,32]{2,1,0} dynamic-update-slice(%o3, %bc, %o1, %z, %z)
  ROOT %t = (f32[7,64,32]{2,1,0}, f32[64,32]{1,0}) tuple(%u, %d)
}

ENTRY %main (a: f32[7,64,32], i: s32[], w: f32[32,32], buf: f32[7,64,32]) -> (f32[7,64,32], f32[64,32]) {
  %a = f32[7,64,32]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %w = f32[32,32]{1,0} parameter(2)
  %buf = f32[7,64,32]{2,1,0} parameter(3)
  ROOT %f = (f32[7,64,32]{2,1,0}, f32[64,32]{1,0}) fusion(%a, %i, %w, %buf), kind=kOutput, calls=%outer
}
"""


def test_a_layer_sliced_in_a_nested_fusion_and_a_tuple_roots_update_count_their_slices():
    """What a scanned layer stack's backward pass does on TPU: a fusion slices one layer out of a
    stacked [L, ...] activation through a nested loop fusion, and writes a tuple of an in-place
    update of another stack and a plain output. Before: the whole stack was read (57,344 bytes)
    and the whole tuple written (65,536): dense_1p7b's remat=none step counted 16,458 GiB of HBM
    traffic per chip, 5,663 after."""
    out = flops.count_flops(NESTED)
    # reads: a's layer (8192), the index (4), w (4096), nothing of buf (updated in place);
    # writes: the update (8192) and the dot's output (8192)
    assert out["hbm_bytes"] == 8192 + 4 + 4096 + 8192 + 8192
    assert out["by_kind"] == {"dot": 2 * 64 * 32 * 32}


def test_the_heaviest_instructions_are_listed_by_the_bytes_they_move():
    """`heaviest` (python -m gattn.experiments.flops HLO --top N): LOOP's dot fusion runs 7 times
    and moves 20,480 bytes a run, the most of any instruction."""
    top = flops.heaviest(LOOP, 2)
    assert top[0]["calls"] == "dot_fusion" and top[0]["runs"] == 7
    assert top[0]["hbm_bytes"] == 7 * (8192 + 4096 + 8192)  # h and w read, h2 written, 7 times
    assert len(top) == 2 and top[1]["hbm_bytes"] <= top[0]["hbm_bytes"]


SPLASH = """HloModule splash

ENTRY %main (q: bf16[2,4,1024,128], k: bf16[2,2,1024,128], v: bf16[2,2,1024,128]) -> bf16[2,4,1024,128] {
  %q = bf16[2,4,1024,128]{3,2,1,0} parameter(0)
  %k = bf16[2,2,1024,128]{3,2,1,0} parameter(1)
  %v = bf16[2,2,1024,128]{3,2,1,0} parameter(2)
  %splash_mha_fwd_segmented_residuals.3 = (bf16[2,4,1024,128]{3,2,1,0}, f32[2,4,1024,128]{3,2,1,0}) custom-call(%q, %k, %v), custom_call_target="tpu_custom_call"
  %out = bf16[2,4,1024,128]{3,2,1,0} get-tuple-element(%splash_mha_fwd_segmented_residuals.3), index=0
  ROOT %splash_mha_dkv_segmented_no_residuals.1 = bf16[2,4,1024,128]{3,2,1,0} custom-call(%q, %k, %v, %out), custom_call_target="tpu_custom_call"
}
"""


def test_splash_attention_is_priced_as_the_flash_kernel_prices_itself():
    """MaxText's splash kernels (no cost estimate) by flops.splash_formulas: causal 512-blocks of
    a 1024-token sequence are 3 visible (query, key) block pairs of 4; forward 4 x d FLOPs a
    score, dkv 8; bytes: outputs once, one side once, the other once per visible pair."""
    out = flops.count_flops(SPLASH, flops.splash_formulas(block=512))
    scores = 2 * 4 * 3 * 512 * 512  # batch x query heads x visible pairs x block x block
    calls = {c["name"]: c for c in out["custom_calls"]}
    fwd, dkv = calls["splash_mha_fwd_segmented_residuals"], calls["splash_mha_dkv_segmented_no_residuals"]
    assert (fwd["priced_by"], fwd["flops"], dkv["flops"]) == ("formula", 4 * 128 * scores, 8 * 128 * scores)
    q = 2 * 4 * 1024 * 128 * 2  # bytes of q (bf16); k and v are half of it each
    # forward: out (bf16) + lse (f32, 128 lanes) once, q once, k and v once per visible pair of a key block
    assert fwd["bytes"] == q + 2 * q + q + q * 3 / 2
    # dkv: its output once, k and v once, the query side (q and the forward's out) per visible pair of a query block
    assert dkv["bytes"] == q + q + 2 * q * 3 / 2
    assert flops.count_flops(SPLASH)["custom_calls"][0]["priced_by"] == "unpriced"
