"""A ~126M-parameter Qwen3-style model for GPU timing (bench/gpu_check.py, docs/gpu.md): 12 layers,
d_model 768, GQA 12 query / 4 kv heads of 64, QK-norm, SwiGLU 2048, vocabulary 32768, untied;
sequences of 2048, batch 16, bf16 compute over float32 parameters, scanned layers, and the
attention chosen per backend (`auto`). Synthetic tokens: a timing run needs no corpus."""

from gattn.config import Config, DataConfig, ExecConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    model = ModelConfig(vocab_size=32768, d_model=768, num_layers=12, q_heads=12, kv_heads=4,
                        head_dim=64, d_ff=2048, qk_norm=True, tie_embeddings=False)
    train = TrainConfig(batch_size=16, seq_len=2048, steps=100, learning_rate=1e-3,
                        min_learning_rate=1e-5, warmup_steps=10, log_every=10, eval_every=100,
                        checkpoint_every=100)
    ex = ExecConfig(dtype="bfloat16", scan_layers=True, attention_impl="auto")
    return Config(model=model, train=train, exec=ex, data=DataConfig(source="synthetic", eval_batches=1))
