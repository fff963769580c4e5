"""The main job's small model: 4 layers, d_model 128, GQA 4 query / 2 kv heads of 32.

Byte-level vocabulary (256) until the training issue's sentencepiece tokenizer lands.
Pick a variant with `--variant NAME` (see `python -m gattn.variants`).
"""

from gattn.config import Config, ModelConfig, TrainConfig


def get_config() -> Config:
    model = ModelConfig(vocab_size=256, d_model=128, num_layers=4, q_heads=4, kv_heads=2,
                        head_dim=32, d_ff=352, qk_norm=False, rope_base=10_000.0)
    return Config(model=model, train=TrainConfig(seed=0, batch_size=8, seq_len=128, steps=200,
                                                 learning_rate=3e-3))
