"""The instability lab: the paper's dense baseline architecture (pre-RMSNorm blocks, QK-norm,
SwiGLU, RoPE base 10k, tied embeddings, GQA; AdamW with weight decay 0.01 and no gradient
clipping; linear warmup then cosine to 1% of the peak, as `dense_1p7b.py`) scaled down to 2 CPU
cores: 12 layers of d_model 64 (4 query / 2 kv heads of 16, SwiGLU 176), the embedded corpus with
a 4,096-piece vocabulary, 200 steps of 16 x 128 tokens (0.4M tokens), 30 warmup steps. About
100 s per run on the shared cores. The search that chose it, and what it showed: docs/instability.md
(the baseline never diverged within the search; at peak LR 1.0 it spikes).

Ours, where the paper's 1.7B is scaled down: every width and the depth (the 48-layer model's
depth-to-width ratio cannot be kept at d_model 64), the budget, the warmup (15% of the steps
instead of 1%), the vocabulary. The peak LR is the study's axis (configs/study/instability_verdict.py).

    python train.py --config configs/instability_lab.py --config.train.learning_rate=1.0 \
        --config.train.min_learning_rate=0.01 --workdir workdir/instability_lab
"""

from gattn.config import Config, DataConfig, ExecConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    model = ModelConfig(vocab_size=4096, d_model=64, num_layers=12, q_heads=4, kv_heads=2, head_dim=16,
                        d_ff=176, qk_norm=True, tie_embeddings=True, rope_base=10_000.0)
    train = TrainConfig(seed=0, batch_size=16, seq_len=128, steps=200, learning_rate=3e-1,
                        min_learning_rate=3e-3, warmup_steps=30, weight_decay=0.01, grad_clip=0.0,
                        log_every=1, eval_every=200, checkpoint_every=200)
    return Config(model=model, train=train, data=DataConfig(eval_batches=2, eval_batch_size=8),
                  exec=ExecConfig(scan_layers=True))
