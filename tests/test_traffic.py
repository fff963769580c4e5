"""gattn/experiments/traffic.py: the bytes each chip sends per step, counted from compiled HLO.

Each count is compared, in bytes and exactly, with the value worked out by hand from the ring
costs (g = the group size; B = the operand's bytes): all-gather B (g - 1), reduce-scatter
B (g - 1) / g, all-reduce 2 B (g - 1) / g, all-to-all B (g - 1) / g, collective-permute B per
pair. The compiled cases are TPU programs, compiled ahead of time by libtpu on this CPU for
v5p:2x2x2 (8 chips, no devices needed; a fraction of a second each); the literal HLO cases pin
the parser on forms a small program does not produce (loop bounds, async wrappers, conditionals,
multi-line custom-call configs, every replica-group form).
"""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gattn.experiments import traffic

F32 = 4


@pytest.fixture(scope="module")
def mesh():
    devices = topologies.get_topology_desc(topology_name="v5p:2x2x2", platform="tpu").devices
    return Mesh(np.asarray(devices).reshape(2, 4), ("a", "b"))


def compiled_hlo(mesh, f, shape, in_spec, out_spec=P()):
    """The after-optimizations HLO of shard_map(f) on a float32 array of `shape`, for TPU."""
    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, in_spec))
    g = jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False)
    return jax.jit(g).lower(x).compile().as_text()


# ---- compiled programs -----------------------------------------------------------------------

def test_an_all_gather_over_an_axis_of_4(mesh):
    # a [2, 1024] f32 shard (8192 B) gathered from 4 chips: each sends its shard to 3 others
    hlo = compiled_hlo(mesh, lambda x: jax.lax.all_gather(x, "b", tiled=True), (8, 1024), P("b"))
    out = traffic.count_bytes(hlo, mesh)
    assert out["total"] == out["ici"] == 8192 * 3 and out["dcn"] == 0
    assert out["by_kind"] == {"all-gather": 8192 * 3} and out["by_axes"] == {"b": 8192 * 3}
    assert out["collectives"] == 1 and out["mean_total"] == 8192 * 3


def test_a_collective_over_one_axis_of_two_goes_to_that_axis(mesh):
    # the other axis of the (a=2, b=4) mesh: [4, 1024] f32 shards (16384 B) from 2 chips
    hlo = compiled_hlo(mesh, lambda x: jax.lax.all_gather(x, "a", tiled=True), (8, 1024), P("a"))
    assert traffic.count_bytes(hlo, mesh)["by_axes"] == {"a": 16384}


def test_a_reduce_scatter(mesh):
    # psum_scatter of a [512, 1024] f32 shard (2 MiB) over 4 chips: XLA keeps it a reduce-scatter
    hlo = compiled_hlo(mesh, lambda x: jax.lax.psum_scatter(x, "b", tiled=True), (1024, 1024), P("a"), P("a"))
    out = traffic.count_bytes(hlo, mesh)
    assert out["by_kind"] == {"reduce-scatter": 2**21 * 3 / 4} and out["by_axes"] == {"b": 2**21 * 3 / 4}


def test_an_all_reduce_over_both_axes(mesh):
    hlo = compiled_hlo(mesh, lambda x: jax.lax.psum(x, ("a", "b")), (8, 1024), P("b"))
    out = traffic.count_bytes(hlo, mesh)  # 8192 B over all 8 chips
    assert out["by_kind"] == {"all-reduce": 2 * 8192 * 7 / 8} and out["by_axes"] == {"a,b": 2 * 8192 * 7 / 8}


def _gather_sum(x, c):
    """An all-gather that depends on the loop carry (XLA hoists a loop-invariant one)."""
    return c + jax.lax.all_gather(x + c, "b", tiled=True).sum()


def test_a_scan_counts_its_body_once_per_step(mesh):
    def scan5(x):
        return jax.lax.scan(lambda c, _: (_gather_sum(x, c), None), jnp.zeros(()), None, length=5)[0]

    out = traffic.count_bytes(compiled_hlo(mesh, scan5, (8, 1024), P("b")), mesh)
    assert out["total"] == 5 * 8192 * 3 and out["collectives"] == 5 and out["unknown_trip_counts"] == 0


def test_nested_scans_multiply_through(mesh):
    def nested(x):
        def outer(c, _):
            return jax.lax.scan(lambda c, _: (_gather_sum(x, c), None), c, None, length=4)[0] * 0.5, None
        return jax.lax.scan(outer, jnp.zeros(()), None, length=3)[0]

    hlo = compiled_hlo(mesh, nested, (8, 1024), P("b"))
    assert hlo.count(" while(") == 2  # the loops are there (not unrolled), their bounds read
    out = traffic.count_bytes(hlo, mesh)
    assert out["total"] == 3 * 4 * 8192 * 3 and out["collectives"] == 12
    assert traffic.count(hlo, mesh)["total_gib"] == round(12 * 8192 * 3 / 2**30, 3)


def test_a_multi_slice_program_sends_its_cross_slice_collectives_over_dcn():
    # 2 slices of v5p:2x2x1: libtpu compiles one program per slice (4 partitions); a psum over the
    # slice axis is a megascale send of the [2, 1024] f32 shard (8192 B) to the other slice
    devices = topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu", num_slices=2).devices
    mesh = Mesh(np.asarray(devices).reshape(2, 4), ("slice", "chip"))
    hlo = compiled_hlo(mesh, lambda x: jax.lax.psum(x, "slice"), (8, 1024), P("chip"), P("chip"))
    out = traffic.count_bytes(hlo, mesh)
    assert (out["ici"], out["dcn"], out["by_axes"]) == (0, 2 * 8192 / 2, {"slice": 8192})
    assert out["mean_total"] == out["total"]  # every chip of the slice sends it
    hlo = compiled_hlo(mesh, lambda x: jax.lax.psum(x, "chip"), (8, 1024), P("chip"), P("chip"))
    out = traffic.count_bytes(hlo, mesh)
    assert (out["ici"], out["dcn"], out["by_axes"]) == (2 * 8192 * 3 / 4, 0, {"chip": 2 * 8192 * 3 / 4})


# ---- the parser on literal HLO ---------------------------------------------------------------

def test_shape_bytes():
    assert traffic.shape_bytes("bf16[8,128]{1,0}") == 2048
    assert traffic.shape_bytes("f32[]") == traffic.shape_bytes("s32[]{:T(128)}") == 4
    assert traffic.shape_bytes("(s32[]{:T(128)}, f32[2,2]{1,0:T(2,128)S(1)})") == 20  # a tuple
    assert traffic.shape_bytes("f16[4]") == traffic.shape_bytes("u32[2]") == traffic.shape_bytes("s64[1]") == 8
    assert traffic.shape_bytes("f64[2]") == 16 and traffic.shape_bytes("pred[3]") == traffic.shape_bytes("u8[3]") == 3
    assert traffic.shape_bytes("f8e4m3fn[16]") == traffic.shape_bytes("f8e5m2[16]") == 16
    assert traffic.shape_bytes("s8[16]") == 16
    assert traffic.shape_bytes("bf16[<=8,4]") == 64 and traffic.shape_bytes("token[]") == 0


@pytest.mark.parametrize("text, n, groups", [
    ("{{0,2},{1,3}}", 4, ((0, 2), (1, 3))),
    ("{}", 4, ((0, 1, 2, 3),)),
    ("[2,4]<=[8]", 8, ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("[4,2]<=[2,4]T(1,0)", 8, ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['a'=2,'b'=4] {'a'}", 8, ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh[a=2,b=4] {b}", 8, ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh[a=2,b=4] {a,b}", 8, (tuple(range(8)),)),
    ("mesh[x=8] {x:(1)2}", 8, ((0, 4), (1, 5), (2, 6), (3, 7))),  # a sub-axis: the major 2 of 8
    ("mesh[x=8] {x:(2)2}", 8, ((0, 2), (1, 3), (4, 6), (5, 7))),  # the middle 2
    ("mesh[a=2,b=4], device_ids=([4,2]T(1,0)) {b}", 8, ((0, 2, 4, 6), (1, 3, 5, 7))),
])
def test_replica_group_forms(text, n, groups):
    assert traffic.replica_groups(text, n) == groups


def test_the_iota_forms_of_a_real_step():
    # [4,8]<=[8,4]T(1,0): 4 groups of 8 with stride 4 (the data axis of an (8, 4) mesh)
    groups = traffic.replica_groups("[4,8]<=[8,4]T(1,0)", 32)
    assert groups[0] == tuple(range(0, 32, 4)) and groups[3] == tuple(range(3, 32, 4))
    # as jax 0.10.2 / libtpu print a group over the model axis of dense_1p7b's (8, 1, 1, 4) mesh
    text = "mesh['axis_0'=1,'axis_1'=1,'axis_2'=4,'axis_3'=8], device_ids=([8,4]T(1,0)) {'axis_2'}"
    assert traffic.replica_groups(text, 32) == traffic.replica_groups("[8,4]<=[32]", 32)


LOOP = """HloModule loop_toy, is_scheduled=true, num_partitions=32

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%cond (p: (s32[], bf16[16,128])) -> pred[] {
  %p = (s32[]{:T(128)}, bf16[16,128]{1,0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %bound = s32[]{:T(128)} constant(6)
  ROOT %lt = pred[]{:T(512)} compare(%i, %bound), direction=LT
}

%body (p: (s32[], bf16[16,128])) -> (s32[], bf16[16,128]) {
  %p = (s32[]{:T(128)}, bf16[16,128]{1,0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %two = s32[]{:T(128)} constant(2)
  %next = s32[]{:T(128)} add(%i, %two)
  %x = bf16[16,128]{1,0:T(8,128)(2,1)} get-tuple-element(%p), index=1
  %ar = bf16[16,128]{1,0:T(8,128)(2,1)} all-reduce(%x), channel_id=1, replica_groups=[4,8]<=[8,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %kernel = bf16[16,128]{1,0} custom-call(%ar), custom_call_target="tpu_custom_call", backend_config={"body": "module {
    func.func @kernel() {
    }
  }"}
  ROOT %t = (s32[]{:T(128)}, bf16[16,128]{1,0}) tuple(%next, %kernel)
}

ENTRY %main (x: bf16[16,128]) -> bf16[16,128] {
  %x = bf16[16,128]{1,0} parameter(0)
  %zero = s32[]{:T(128)} constant(0)
  %copy = s32[]{:T(128)} copy(%zero)
  %init = (s32[]{:T(128)}, bf16[16,128]{1,0}) tuple(%copy, %x)
  %loop = (s32[]{:T(128)}, bf16[16,128]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[16,128]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_a_loop_bound_read_from_its_condition_past_a_multi_line_config(tmp_path):
    # i = 0, 2, 4 < 6: 3 trips of an all-reduce of bf16[16,128] (4096 B) in groups of 8 that vary
    # the first axis of an (8, 4) mesh; the custom call's config spans lines ending in "  }"
    comps, entry, _ = traffic.parse(LOOP)
    assert entry == "main" and comps["body"].root.name == "t" and "kernel" in comps["body"].instrs
    out = traffic.count_bytes(LOOP, (np.arange(32).reshape(8, 4), ("x", "y")))
    assert out["total"] == 3 * 2 * 4096 * 7 / 8 and out["by_axes"] == {"x": 3 * 2 * 4096 * 7 / 8}
    assert out["collectives"] == 3 and out["unknown_trip_counts"] == 0
    (tmp_path / "module.after_optimizations.txt").write_text(LOOP)  # an XLA dump file
    assert traffic.count_bytes(tmp_path / "module.after_optimizations.txt")["total"] == out["total"]


ASYNC = """HloModule async_toy, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_cmp (param_0: s32[]) -> pred[] {
  %param_0 = s32[] parameter(0)
  %zero = s32[] constant(0)
  ROOT %gt = pred[] compare(%param_0, %zero), direction=GT
}

%cond (p: (s32[], f32[64])) -> pred[] {
  %p = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %f = pred[] fusion(%i), kind=kLoop, calls=%fused_cmp
}

%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(1)
  %next = s32[] subtract(%i, %one)
  %x = f32[64]{0} get-tuple-element(%p), index=1
  %ags = ((f32[64]{0}), f32[256]{0}) all-gather-start(%x), channel_id=1, replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}, use_global_device_ids=true
  %agd = f32[256]{0} all-gather-done(%ags)
  %cps = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = f32[64]{0} collective-permute-done(%cps)
  ROOT %t = (s32[], f32[64]{0}) tuple(%next, %cpd)
}

%rs_async (q: f32[32,8]) -> f32[16,8] {
  %q = f32[32,8]{1,0} parameter(0)
  ROOT %rs = f32[16,8]{1,0} reduce-scatter(%q), channel_id=3, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, to_apply=%add
}

%branch_small (b0: f32[64]) -> f32[64] {
  %b0 = f32[64]{0} parameter(0)
  %s = f32[16]{0} slice(%b0), slice={[0:16]}
  %a2a = f32[16]{0} all-to-all(%s), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %pad = f32[64]{0} pad(%a2a, %b0), padding=0_48
}

%branch_big (b1: f32[64]) -> f32[64] {
  %b1 = f32[64]{0} parameter(0)
  ROOT %a2a = f32[64]{0} all-to-all(%b1), channel_id=5, replica_groups=[2,4]<=[8], dimensions={0}
}

%all-reduce-scatter.7 (input: f32[128]) -> f32[32] {
  %input = f32[128]{0} parameter(0)
  %ar = f32[128]{0} all-reduce(%input), channel_id=6, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %offset = u32[] partition-id()
  ROOT %ds = f32[32]{0} dynamic-slice(%ar, %offset), dynamic_slice_sizes={32}
}

%opaque_cond (p2: (s32[], f32[8])) -> pred[] {
  %p2 = (s32[], f32[8]{0}) parameter(0)
  ROOT %r = pred[] custom-call(%p2), custom_call_target="opaque"
}

%body2 (p3: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p3 = (s32[], f32[8]{0}) parameter(0)
  %i3 = s32[] get-tuple-element(%p3), index=0
  %w3 = f32[8]{0} get-tuple-element(%p3), index=1
  %all = f32[8]{0} all-reduce(%w3), channel_id=7, replica_groups={}, to_apply=%add
  ROOT %t3 = (s32[], f32[8]{0}) tuple(%i3, %all)
}

ENTRY %main (x: f32[64], y: f32[32,8], idx: s32[], z: f32[128], w: f32[8]) -> f32[64] {
  %x = f32[64]{0} parameter(0)
  %y = f32[32,8]{1,0} parameter(1)
  %idx = s32[] parameter(2)
  %z = f32[128]{0} parameter(3)
  %w = f32[8]{0} parameter(4)
  %four = s32[] constant(4)
  %init = (s32[], f32[64]{0}) tuple(%four, %x)
  %loop = (s32[], f32[64]{0}) while(%init), condition=%cond, body=%body
  %rs-start = ((f32[32,8]{1,0}), f32[16,8]{1,0}) async-start(%y), calls=%rs_async
  %rs-done = f32[16,8]{1,0} async-done(%rs-start), calls=%rs_async
  %branch = f32[64]{0} conditional(%idx, %x, %x), branch_computations={%branch_small, %branch_big}
  %fus = f32[32]{0} fusion(%z), kind=kCustom, calls=%all-reduce-scatter.7
  %zero = s32[] constant(0)
  %init2 = (s32[], f32[8]{0}) tuple(%zero, %w)
  %known = (s32[], f32[8]{0}) while(%init2), condition=%opaque_cond, body=%body2, backend_config={"known_trip_count":{"n":"10"}}
  %unknown = (s32[], f32[8]{0}) while(%init2), condition=%opaque_cond, body=%body2
  ROOT %o = f32[64]{0} get-tuple-element(%loop), index=1
}
"""
MESH_2x4 = (np.arange(8).reshape(2, 4), ("a", "b"))
# By hand, per chip (f32): the countdown loop runs i = 4, 3, 2, 1 (4 trips): all-gather of 256 B
# from 4 chips (768 B) and a collective-permute of 256 B that only chips 0-3 send; the async
# reduce-scatter of 1024 B over 2 (512 B); the conditional's costlier branch, an all-to-all of
# 256 B over 4 (192 B); the all-reduce-scatter fusion, a reduce-scatter of 512 B over 4 (384 B);
# an all-reduce of 32 B over all 8 (56 B) 10 times (known_trip_count) and once (bound unknown).
AG, CP, RS, A2A, FUSED, AR = 4 * 768, 4 * 256, 512, 192, 384, 11 * 56


def test_async_forms_conditionals_fusions_and_trip_counts_from_literal_hlo():
    out = traffic.count_bytes(ASYNC, MESH_2x4)
    assert out["chip"] == 0 and out["total"] == AG + CP + RS + A2A + FUSED + AR  # 5800
    assert out["mean_total"] == AG + CP / 2 + RS + A2A + FUSED + AR  # chips 4-7 permute nothing
    assert out["by_kind"] == {"all-gather": AG, "collective-permute": CP, "reduce-scatter": RS + FUSED,
                              "all-to-all": A2A, "all-reduce": AR}
    assert out["by_axes"] == {"b": AG + CP + A2A + FUSED, "a": RS, "a,b": AR}
    # the -start forms count once and -done not at all; one branch; the unknown loop once
    assert out["collectives"] == 4 + 4 + 1 + 1 + 1 + 11 and out["unknown_trip_counts"] == 1
    assert traffic.count(ASYNC)["by_axes"] == {}  # without the mesh: no axes


def test_a_group_spanning_slices_in_one_program_is_dcn_traffic():
    # the same program with chips 0-3 in slice 0 and 4-7 in slice 1: every group over axis a
    # (the reduce-scatter, the all-reduces over all 8) crosses slices, all of its bytes on DCN
    out = traffic.count_bytes(ASYNC, MESH_2x4, slice_of=lambda i: i // 4)
    assert (out["dcn"], out["ici"]) == (RS + AR, AG + CP + A2A + FUSED)


MEGASCALE = """HloModule jit_step, num_partitions=4

ENTRY %main.0_spmd (param.1: f32[2,1024]) -> f32[2,1024] {
  %param.1 = f32[2,1024]{1,0:T(2,128)} parameter(0)
  %after-all = token[] after-all()
  %bitcast = f32[8,2,128]{2,1,0:T(2,128)} bitcast(%param.1)
  %send = (f32[8,2,128]{2,1,0:T(2,128)}, u32[], token[]) send(%bitcast, %after-all), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_reduce_operation="SUM",_xla_megascale_target={{100000,300000},{100001,300001},{100002,300002},{100003,300003},{200000,400000},{200001,400001},{200002,400002},{200003,400003}},_xla_megascale_transfer_type="ALL_REDUCE"}
  %send-done = token[] send-done(%send), channel_id=2, is_host_transfer=true
  %send.1 = (f32[2,1024]{1,0:T(2,128)}, u32[], token[]) send(%param.1, %after-all), channel_id=3, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_target={{100000->200000},{200000->300000},{300000->400000},{400000->100000},{100001->200001},{200001->300001},{300001->400001},{400001->100001},{100002->200002},{200002->300002},{300002->400002},{400002->100002},{100003->200003},{200003->300003},{300003->400003},{400003->100003}},_xla_megascale_transfer_type="ONE_TO_ONE"}
  %send.2 = (f32[1,2,1024]{2,1,0:T(2,128)}, u32[], token[]) send(%bitcast, %after-all), channel_id=4, is_host_transfer=true, frontend_attributes={_xla_megascale_target="{1,2,3,4}x{0:3}",_xla_megascale_transfer_type="ALL_GATHER"}
  ROOT %copy = f32[2,1024]{1,0:T(2,128)} copy(%param.1)
}
"""


def test_megascale_sends_of_a_four_slice_program():
    # as libtpu compiles for 4 slices of 4 chips (device ids 100000 + slice x 100000 + chip), on a
    # (s1=2, s2=2, c=4) mesh: an all-reduce of 8192 B over s1 (slices 0 and 2), a permute of
    # 8192 B around the slices, an all-gather of 8192 B from all 4 slices
    ids = np.asarray([100000 * (s + 1) + c for s in range(4) for c in range(4)])
    mesh = (ids.reshape(2, 2, 4), ("s1", "s2", "c"))
    out = traffic.count_bytes(MEGASCALE, mesh, slice_of=lambda i: i // 100000 - 1)
    assert out["by_kind"] == {"all-reduce": 8192, "collective-permute": 8192, "all-gather": 3 * 8192}
    assert out["by_axes"] == {"s1": 8192, "s2": 8192, "s1,s2": 3 * 8192}  # 1 -> 2 is s2; all 4 slices
    assert out["dcn"] == out["total"] == 5 * 8192 and out["ici"] == 0 and out["collectives"] == 3


# ---- the roofline, and fit_presets' mesh ----------------------------------------------------

def test_roofline_terms_and_mfu():
    # v5p: 459 TFLOP/s bf16, 4800 Gbps = 600 GB/s of ICI, 50 Gbps = 6.25 GB/s of DCN per chip
    r = traffic.roofline(459e12, {"ici": 1200e9, "dcn": 6.25e9}, "TPU v5")
    assert (r["chip"], r["compute_s"], r["ici_s"], r["dcn_s"]) == ("v5p", 1.0, 2.0, 1.0)
    assert (r["step_s"], r["bound"], r["mfu"]) == (2.0, "ici", 0.5)
    assert (r["no_overlap_step_s"], r["no_overlap_mfu"]) == (4.0, 0.25)
    gib = traffic.roofline(197e12, {"ici_gib": 0.0, "dcn_gib": 0.0}, "v5e")
    assert (gib["bound"], gib["mfu"]) == ("compute", 1.0)


def test_the_step_model_counts_recompute_and_hbm_traffic():
    """Issue 58: the compute term is what the compiled step runs (full remat: ~8 N per token where
    the model needs 6 N), the HBM term its memory traffic; MFU stays the model's FLOPs over the
    modelled step, so recompute lowers it."""
    # v5p: 2765 GB/s of HBM. 6 N T = 459e12 FLOPs (1 s); counted 8/6 of that; 4147.5e9 bytes read/written.
    r = traffic.roofline(459e12, {"ici": 0.0, "dcn": 0.0}, "v5p", counted_flops=459e12 * 8 / 6,
                         hbm_bytes=2765e9 * 1.5)
    assert (r["compute_s"], r["hbm_s"], r["step_s"], r["bound"]) == (1.3333, 1.5, 1.5, "hbm")
    assert r["mfu"] == round(1 / 1.5, 4) and r["no_overlap_step_s"] == 2.8333 and r["compute_counts"] == "counted"
    assert traffic.roofline(459e12, {"ici": 0.0, "dcn": 0.0}, "v5p")["compute_counts"] == "model"


def test_fit_presets_takes_a_mesh_of_three_or_all_axes():
    path = Path(__file__).resolve().parents[1] / "bench" / "fit_presets.py"
    spec = importlib.util.spec_from_file_location("fit_presets", path)
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    cfg = fit.cli.load("dense_1p7b")
    assert fit.sharding.AXES == ("data", "fsdp", "context", "expert", "model")
    assert fit.resolve_mesh(cfg, 32, (8, 1, 4)) == (8, 1, 1, 1, 4)  # data, expert, model: fsdp 1
    assert fit.resolve_mesh(cfg, 32, (1, 8, 1, 4)) == (1, 8, 1, 1, 4)  # data, fsdp, expert, model
    assert fit.resolve_mesh(cfg, 32, (1, 8, 2, 1, 2)) == (1, 8, 2, 1, 2)  # every axis, in AXES order
    with pytest.raises(fit.ConfigError, match="mesh"):
        fit.resolve_mesh(cfg, 32, (8, 1, 2))


def test_the_model_flops_of_a_hybrid_count_attention_in_its_attention_layers_only():
    """Qwen3.5-2B's 24 layers are 18 Gated DeltaNet and 6 attention: the term that grows with the
    sequence is 6 layers' causal attention (it counted all 24 before, an MFU of 1.18 at 64k)."""
    import dataclasses
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "fit_presets.py"
    spec = importlib.util.spec_from_file_location("fit_presets", path)
    fit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fit)
    cfg = fit.cli.load("qwen3_5_2b_64k")
    m, tokens = cfg.model, 16 * 65_536

    def per_token(seq):  # FLOPs per token at this sequence length, the same tokens a step
        c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=seq, batch_size=tokens // seq,
                                                               microbatches=1))
        return fit.model_tflops(c, 1) * 1e12 / tokens

    layers = (per_token(65_536) - per_token(4_096)) / (6 * 2 * m.q_heads * m.head_dim * (65_536 - 4_096) / 2)
    assert round(layers, 3) == 6
    gdn = per_token(4_096) - 6 * fit.param_counts.activated_params(m) - 6 * 2 * 6 * m.q_heads * m.head_dim * 2_048
    assert 0 < gdn < 0.05 * 6 * fit.param_counts.activated_params(m)  # the rule: ~1% of the matmuls'
