"""`python -m gattn.demo`'s model: the tiny model's shapes on bytes (vocabulary 256) with batches
of 8 x 128, so that every variant of the paper gets a short look in a few minutes."""

from gattn.config import Config, ModelConfig, TrainConfig


def get_config() -> Config:
    model = ModelConfig(vocab_size=256, d_model=128, num_layers=4, q_heads=4, kv_heads=2,
                        head_dim=32, d_ff=352)
    return Config(model=model, train=TrainConfig(seed=0, batch_size=8, seq_len=128,
                                                 learning_rate=3e-3))
