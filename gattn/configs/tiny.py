"""The main job's small model: 4 layers, d_model 128, GQA 4 query / 2 kv heads of 32, SwiGLU 352,
a 4096-piece SentencePiece vocabulary trained on the embedded corpus; sequences of 256, batch 16.

Pick a variant with `--variant NAME` (see `python -m gattn.variants`).
"""

from gattn.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    model = ModelConfig(vocab_size=4096, d_model=128, num_layers=4, q_heads=4, kv_heads=2,
                        head_dim=32, d_ff=352, qk_norm=False, rope_base=10_000.0)
    train = TrainConfig(seed=0, batch_size=16, seq_len=256, steps=400, learning_rate=3e-3,
                        min_learning_rate=3e-5, warmup_steps=50, log_every=10, eval_every=200,
                        checkpoint_every=200)
    return Config(model=model, train=train, data=DataConfig(eval_batches=4, eval_batch_size=8))
