"""A Qwen3-Next-80B-A3B-shaped hybrid (its published config.json; docs/hybrid.md): 48 layers,
d_model 2048, the 3:1 pattern (36 Gated DeltaNet layers of 16 key / 32 value heads of 128, conv
width 4; 12 gated attention layers of 16 query / 2 kv heads of 256 with the G1 elementwise gate,
QK-norm and RoPE on a quarter of each head, base 10M), 512 experts of width 512, top 10, plus a
gated shared expert of 512 in every layer, zero-centred norms, a vocabulary of 151,936. About
80B parameters, ~3B activated per token (`python -m gattn.params --preset qwen3_next_80b`).

For continued training or measurement of the released weights after `python -m gattn.convert
from-hf` (which writes the converted model's own config.json), and for planning a slice:

    python bench/fit_presets.py --preset qwen3_next_80b --topology v5p:4x4x4

On v5p-128 (64 chips) the experts split over expert 32 and every weight's model dimension over
fsdp 2, the batch of 1024 x 4096 in 8 microbatches: 71.8 GiB per chip, 959 GiB sent per chip per
step, 9.38 s a step by the step model, HBM-bound (18.88 s with the jnp Gated DeltaNet rule;
docs/presets.md, "How qwen3_next_80b's mesh was chosen", issue 58). A larger slice adds
data-parallel replicas (data = -1).

A TPU config: bf16, rematerialised layers, the fused Pallas attention, the Gated DeltaNet rule as
its Pallas kernel (`exec.gdn_impl=pallas`), dropless expert parallelism (ragged, megablox). The layers are one scan over 12 groups of the 3:1 pattern
(`exec.scan_layers`, docs/hybrid.md), so the compiler sees one group of 4 layers, not 48. The
training settings are placeholders of the paper's MoE recipe; the Qwen team's are not published.
"""

from gattn.config import (Config, DataConfig, ExecConfig, GateSpec, LinearAttentionSpec, MeshConfig, ModelConfig,
                          MoESpec, TrainConfig, hybrid_layer_types)


def get_config() -> Config:
    model = ModelConfig(
        vocab_size=151_936, d_model=2048, num_layers=48, q_heads=16, kv_heads=2, head_dim=256, d_ff=5120,
        rope_base=10_000_000.0, rope_dim=64, qk_norm=True, zero_centered_norm=True,
        gate=GateSpec(granularity="elementwise"), layer_types=hybrid_layer_types(48, 4),
        linear_attention=LinearAttentionSpec(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128,
                                             conv_kernel=4),
        moe=MoESpec(num_experts=512, top_k=10, expert_width=512, shared_expert_width=512, renormalize=True,
                    lbl_coef=1e-3),
        param_dtype="float32")
    tpu = ExecConfig(dtype="bfloat16", scan_layers=True, remat="full", attention_impl="pallas", gdn_impl="pallas",
                     moe_impl="ragged", grouped_matmul="megablox", moe_buffer=1.25, loss_chunk=512)
    train = TrainConfig(batch_size=1024, seq_len=4096, steps=100_000, lr_preset="moe_15a2b", grad_clip=0.0,
                        eval_every=2000, checkpoint_every=1000, log_every=50, microbatches=8)
    return Config(model=model, train=train, mesh=MeshConfig(data=-1, fsdp=2, expert=32), exec=tpu,
                  data=DataConfig(eval_batch_size=64), variant="sdpa_elementwise")
