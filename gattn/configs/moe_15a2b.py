"""The paper's MoE 15A2B (Sec. 3.1, Table 1): 24 layers, d_model 2048, GQA 32 query / 4 kv heads
of 128 with QK-norm, 128 fine-grained SwiGLU experts top-8 (softmax router, renormalised top-k),
global-batch load-balancing loss and router z-loss, sequence 4096, the paper's MoE LR recipe.

The paper gives neither the expert width nor the vocabulary. With 128 experts and top-8 the
routed experts are 16x their activated share, so 15B total and 2.54B activated fix both the
expert parameters (~0.83B activated) and everything else (~1.7B): expert width 704 and an untied
vocabulary of 303,104 (a multiple of 128) give 15.0B total and 2.54B activated
(`python -m gattn.params --preset moe_15a2b`). The gated variant is `--variant sdpa_elementwise`.
bf16 compute, scanned and rematerialised layers, the fused Pallas attention: a TPU config.
"""

from gattn.config import Config, ExecConfig, MeshConfig, ModelConfig, MoESpec, TrainConfig


def get_config() -> Config:
    model = ModelConfig(vocab_size=303_104, d_model=2048, num_layers=24, q_heads=32, kv_heads=4,
                        head_dim=128, d_ff=704, qk_norm=True, rope_base=1_000_000.0,
                        moe=MoESpec(num_experts=128, top_k=8, expert_width=704, lbl_coef=1e-3,
                                    lbl_scope="global", z_loss_coef=1e-3),
                        param_dtype="float32")
    tpu = ExecConfig(dtype="bfloat16", scan_layers=True, remat="full", attention_impl="pallas")
    train = TrainConfig(batch_size=1024, seq_len=4096, steps=100_000, lr_preset="moe_15a2b",
                        eval_every=2000, checkpoint_every=1000, log_every=50)
    return Config(model=model, train=train, mesh=MeshConfig(data=-1, expert=8, model=4), exec=tpu)
