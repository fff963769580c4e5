"""Expert parallelism with an explicit all-to-all (gattn/model/expert_parallel.py): with
exec.moe_impl="all_to_all", on meshes with an expert axis the MoE runs in shard_map, and (with a
capacity that drops nothing) its loss, aux values and gradients equal the single-device model's;
the default "partitioned" MoE stays one program under the same mesh; with drops, the partitioned
MoE on one data x expert shard's rows at a time (eval's path) gives its logits. 8 simulated CPU devices, in
a subprocess (tests/multidevice/expert_parallel_step.py)."""

import multidevice

MESHES = ["1,4,2", "2,2,2", "1,8,1"]  # (data, expert, model)


def test_explicit_expert_parallel_moe_equals_one_device():
    out = multidevice.run("expert_parallel_step", "--meshes", *MESHES)
    assert out.count("shards ok (2, 2, 2)") == 1, out  # with drops: eval's single-device path (analysis)
    assert out.count("ok") == len(MESHES) + 1, out
