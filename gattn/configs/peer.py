"""The PyTorch peer's shapes of bench/step_time.py (docs/performance.md): 4 layers, d_model 256, 4 x 64 heads (MHA),
SwiGLU 688, vocab 8192, untied, sequence 256, batch 8, fp32. The reference point for CPU speed."""

from gattn.config import Config, ModelConfig, TrainConfig


def get_config() -> Config:
    model = ModelConfig(vocab_size=8192, d_model=256, num_layers=4, q_heads=4, kv_heads=4,
                        head_dim=64, d_ff=688, tie_embeddings=False)
    return Config(model=model, train=TrainConfig(batch_size=8, seq_len=256, learning_rate=1e-3))
