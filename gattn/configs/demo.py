"""`python -m gattn.demo`'s model: the tiny model's shapes with a 512-piece vocabulary (mostly the
256 byte pieces) and batches of 8 x 128, trained 40 steps without warmup, on the embedded corpus's
documentation and a little of its code, so that every variant of the paper gets a short look
with the training loop of train.py."""

from gattn.config import Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    model = ModelConfig(vocab_size=512, d_model=128, num_layers=4, q_heads=4, kv_heads=2,
                        head_dim=32, d_ff=352)
    train = TrainConfig(seed=0, batch_size=8, seq_len=128, steps=40, learning_rate=3e-3,
                        min_learning_rate=3e-4, warmup_steps=0)
    return Config(model=model, train=train,
                  data=DataConfig(code_max_bytes=200_000, eval_batches=1, eval_batch_size=8))
