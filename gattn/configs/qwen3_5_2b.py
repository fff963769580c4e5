"""Continued pretraining of Qwen3.5-2B (February 2026), the smallest released dense model that
carries the paper's gate besides the 0.8B, converted from its Hugging Face folder:

    python -m gattn.convert from-hf /path/to/Qwen3.5-2B --workdir workdir/qwen3_5_2b_hf
    python train.py --config configs/qwen3_5_2b.py --init-from workdir/qwen3_5_2b_hf \
        --workdir gs://BUCKET/runs/qwen3_5_2b --config.data.source=tfds --config.data.tfds_name=...

The model is the released config.json's text model as `gattn.convert` reads it (checked in
tests/test_convert_qwen35.py, so `--init-from` accepts the converted run): 24 layers of d_model
2048 in Qwen3.5's 3:1 pattern (18 Gated DeltaNet layers of 16 key / 16 value heads of 128, conv
width 4; 6 gated attention layers of 8 query / 2 kv heads of 256 with the elementwise G1 gate,
QK-norm and RoPE on a quarter of each head, base 10M), SwiGLU 6144, zero-centred norms, a tied
vocabulary of 248,320, and the MTP layer (model.mtp_layers = 1, its mtp.* tensors imported):
1.88B parameters, 1.94B with the MTP layer (`python -m gattn.params --preset qwen3_5_2b`). The text of
the multimodal checkpoint only: the vision tower is not converted.

Ours (the Qwen team publishes no continued-pretraining recipe): the schedule, a short warmup to a
peak LR of 1e-4 and cosine decay to 1e-5 (well below a from-scratch peak, so the released model
is not thrown off its minimum), AdamW's weight decay 0.1, clipping at 1.0, the batch (256 x 4096,
1M tokens a step), and the MTP loss weight 0.1 (DeepSeek-V3's late-training weight; Qwen3.5's is
not published) so the MTP layer keeps drafting for `python -m gattn.generate --speculative mtp`.

A TPU config: bf16 compute on float32 parameters, the fused Pallas attention, the Gated DeltaNet
rule as its Pallas kernel (`exec.gdn_impl=pallas`, gattn/kernels/gdn.py), the loss 512 positions
at a time. The slice, the mesh, the microbatches and the rematerialisation are the fit's (`python
bench/fit_presets.py --preset qwen3_5_2b --topology v5p:2x2x4`, docs/presets.md, issue 58): on
v5p-32 (v5p:2x2x4, 16 chips) with FSDP over all 16, 4 gathered microbatches of 4 rows per chip
(`exec.accumulate=gathered`) and no rematerialisation, the step model gives 2.54 s a step
(compute-bound, MFU 0.68) at 86.3 GiB per chip of 95, 17.0 GiB sent per chip per step; as
configured before (the jnp GDN rule, full remat, ZeRO-3 accumulation) it was 5.02 s, HBM-bound.
"""

from gattn.config import (Config, ExecConfig, GateSpec, LinearAttentionSpec, MeshConfig, ModelConfig, TrainConfig,
                          hybrid_layer_types)


def model() -> ModelConfig:
    return ModelConfig(
        vocab_size=248_320, d_model=2048, num_layers=24, q_heads=8, kv_heads=2, head_dim=256, d_ff=6144,
        rope_base=10_000_000.0, rope_dim=64, qk_norm=True, zero_centered_norm=True, tie_embeddings=True,
        norm_eps=1e-6, gate=GateSpec(granularity="elementwise"), layer_types=hybrid_layer_types(24, 4),
        linear_attention=LinearAttentionSpec(num_k_heads=16, num_v_heads=16, head_k_dim=128, head_v_dim=128,
                                             conv_kernel=4),
        mtp_layers=1, param_dtype="float32")


TPU = ExecConfig(dtype="bfloat16", scan_layers=False, remat="none", attention_impl="pallas", gdn_impl="pallas",
                 loss_chunk=512, accumulate="gathered")


def get_config() -> Config:
    train = TrainConfig(batch_size=256, seq_len=4096, steps=20_000, learning_rate=1e-4, min_learning_rate=1e-5,
                        warmup_steps=200, weight_decay=0.1, grad_clip=1.0, mtp_loss_weight=0.1,
                        eval_every=1000, checkpoint_every=500, log_every=20, microbatches=4)
    return Config(model=model(), train=train, mesh=MeshConfig(data=1, fsdp=-1), exec=TPU, variant="sdpa_elementwise")
