"""A ~33M-parameter model for CPU benchmarks and longer local runs: 8 layers, d_model 512, GQA
8 query / 4 kv heads of 64, SwiGLU 1408, vocabulary 8192, sequences of 256, batch 8."""

from gattn.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    model = ModelConfig(vocab_size=8192, d_model=512, num_layers=8, q_heads=8, kv_heads=4,
                        head_dim=64, d_ff=1408)
    train = TrainConfig(batch_size=8, seq_len=256, steps=2000, learning_rate=1e-3,
                        min_learning_rate=1e-5, warmup_steps=100, eval_every=500,
                        checkpoint_every=500)
    return Config(model=model, train=train, data=DataConfig(code_max_bytes=3_000_000))
