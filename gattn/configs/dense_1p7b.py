"""The paper's dense 1.7B (Sec. 3.1, Table 2): 28 layers, Qwen-style (RMSNorm, SwiGLU, RoPE, GQA
with QK-norm): d_model 2048, 16 query / 8 kv heads of 128, SwiGLU 6144, tied vocabulary of
151,936, sequence 4096, LR 4e-3 at batch 1024 (`dense_400b`). 1.72B parameters. The gated variant
is `--variant sdpa_elementwise`; `configs/dense_1p7b_48l.py` is the 48-layer model.
bf16 compute, scanned and rematerialised layers, the fused Pallas attention: a TPU config.
"""

from gattn.config import Config, ExecConfig, MeshConfig, ModelConfig, TrainConfig


def model(num_layers: int = 28, d_ff: int = 6144) -> ModelConfig:
    return ModelConfig(vocab_size=151_936, d_model=2048, num_layers=num_layers, q_heads=16,
                       kv_heads=8, head_dim=128, d_ff=d_ff, qk_norm=True, tie_embeddings=True,
                       rope_base=1_000_000.0, param_dtype="float32")


# bf16 compute, scanned and rematerialised layers, the fused Pallas attention: how it runs on a TPU.
TPU = ExecConfig(dtype="bfloat16", scan_layers=True, remat="full", attention_impl="pallas")


def get_config() -> Config:
    train = TrainConfig(batch_size=1024, seq_len=4096, steps=100_000, lr_preset="dense_400b",
                        eval_every=2000, checkpoint_every=1000, log_every=50)
    return Config(model=model(), train=train, mesh=MeshConfig(data=-1, model=4), exec=TPU)
