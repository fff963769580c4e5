"""A tiny Qwen3-Next-shaped hybrid (docs/hybrid.md): 4 layers, 3 Gated DeltaNet : 1 gated
attention (layer 3: the G1 elementwise gate, QK-norm, partial RoPE over a quarter of the head),
an MoE with 4 experts (top 2) and a gated shared expert in every layer, zero-centred norms;
d_model 128 as the main job's tiny model; sequences of 256, batch 16, on the embedded corpus.

    python train.py --config configs/hybrid_tiny.py --workdir runs/hybrid

The layer pattern is `hybrid_layer_types(num_layers, 4)`: with `model.num_layers=8` pass
`model.layer_types` again, a comma-separated list with NAME*K for K in a row
(`--config.model.layer_types=linear_attention*3,full_attention,linear_attention*3,full_attention`),
or edit `LAYERS` here.
"""

from gattn.config import (Config, DataConfig, GateSpec, LinearAttentionSpec, ModelConfig, MoESpec, TrainConfig,
                          hybrid_layer_types)

LAYERS = 4


def get_config() -> Config:
    model = ModelConfig(
        vocab_size=4096, d_model=128, num_layers=LAYERS, q_heads=4, kv_heads=2, head_dim=32, d_ff=352,
        qk_norm=True, zero_centered_norm=True, rope_dim=8, gate=GateSpec(granularity="elementwise"),
        layer_types=hybrid_layer_types(LAYERS, 4),
        linear_attention=LinearAttentionSpec(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32, conv_kernel=4),
        moe=MoESpec(num_experts=4, top_k=2, expert_width=128, shared_expert_width=128, renormalize=True))
    train = TrainConfig(seed=0, batch_size=16, seq_len=256, steps=400, learning_rate=3e-3,
                        min_learning_rate=3e-5, warmup_steps=50, log_every=10, eval_every=200,
                        checkpoint_every=200)
    return Config(model=model, train=train, data=DataConfig(eval_batches=4, eval_batch_size=8),
                  variant="sdpa_elementwise")
