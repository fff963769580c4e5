"""The paper's MoE 15A2B (Sec. 3.1, Sec. 3.2.1, Table 1): 24 layers, d_model 2048, GQA 32 query /
4 kv heads of 128, 128 fine-grained SwiGLU experts top-8 with a softmax router, global-batch
load-balancing loss and router z-loss, sequence 4096, RoPE base 10k (Sec. 4.4), 1k warmup to 2e-3
and cosine to 3e-5 over 100k steps at batch 1024, AdamW with its defaults and no gradient
clipping (Sec. 3.1).

Ours, where the paper is silent (every field and its source: `PROVENANCE` below, printed by
`python -m gattn.params --provenance moe_15a2b`, docs/presets.md): QK-norm; renormalised top-k
weights; the load-balancing and z-loss coefficients (1e-3 each); the initialisation (truncated
normal, std 0.02); the expert width and the vocabulary, which the paper prints neither of. With
128 experts and top-8 the routed experts are 16x their activated share, so 15B total and 2.54B
activated fix both the expert parameters (~0.83B activated) and everything else (~1.7B): expert
width 704 and an untied vocabulary of 303,104 (a multiple of 128) give 15.0B total and 2.54B
activated (`python -m gattn.params --preset moe_15a2b`). Table 1 row 4 (+4 experts) then adds
415M, not the paper's 400M (`python -m gattn.params --table1`). Gradient clipping, ours too, is
one flag away: --config.train.grad_clip=1.0. The gated variant is `--variant sdpa_elementwise`.
bf16 compute, scanned and rematerialised layers, the fused Pallas attention: a TPU config.

Which slice it fits (`python bench/fit_presets.py --preset moe_15a2b --topology v5p:4x4x2`: the
trainer's train and eval steps compiled by libtpu at the real batch of 1024 x 4096, docs/presets.md):
a v5p-64 slice (v5p:4x4x2, 32 chips) on pure FSDP (mesh fsdp 32, expert 1: every weight, the
experts' included, sharded over every chip and gathered layer by layer, as MaxText's FSDP configs
run a MoE), the dropless MoE with megablox on each chip's own tokens (exec.moe_impl="ragged" with
no expert axis: nothing exchanged), the batch in one pass and exec.loss_chunk=512: 73.6 GiB per
chip, 104 GiB sent per chip per step (before, on fsdp 4 x expert 8 in 2 microbatches: 53.6 GiB and
606 GiB sent), and the shortest modelled step of those bench/fit_presets.py tried (issue 58's step
model: counted FLOPs, HBM bytes and network; docs/presets.md, 'How moe_15a2b's mesh was chosen').
In one pass the global-batch load-balancing loss counts expert loads over the whole batch of
1024 rows, as the paper's global-batch LBL does.
"""

from gattn.config import Config, ExecConfig, MeshConfig, ModelConfig, MoESpec, TrainConfig


def get_config() -> Config:
    model = ModelConfig(vocab_size=303_104, d_model=2048, num_layers=24, q_heads=32, kv_heads=4,
                        head_dim=128, d_ff=704, qk_norm=True, rope_base=10_000.0,
                        moe=MoESpec(num_experts=128, top_k=8, expert_width=704, lbl_coef=1e-3,
                                    lbl_scope="global", z_loss_coef=1e-3),
                        param_dtype="float32")
    # The dropless MoE with jax's Pallas grouped matmul (megablox): 1.0x the FLOPs of capacity
    # routing on v5p (docs/moe-and-mesh.md), where the partitioned path costs 17-33x. On pure FSDP
    # (expert axis 1) the ragged path exchanges nothing: each chip runs its own routed rows through
    # every expert (gathered), dropless; moe_buffer has nothing to bound.
    tpu = ExecConfig(dtype="bfloat16", scan_layers=True, remat="full", attention_impl="pallas",
                     moe_impl="ragged", grouped_matmul="megablox", loss_chunk=512)
    # The batch in one pass: 32 rows per chip on 32 v5p chips (the docstring's fit); the
    # global-batch LBL counts expert loads over all 1024 rows.
    train = TrainConfig(batch_size=1024, seq_len=4096, steps=100_000, lr_preset="moe_15a2b",
                        grad_clip=0.0, eval_every=2000, checkpoint_every=1000, log_every=50, microbatches=1)
    return Config(model=model, train=train, mesh=MeshConfig(data=1, fsdp=-1, expert=1), exec=tpu)


_FIT = "ours: fitted so the model has 15.0B parameters, 2.54B activated (the paper prints neither)"
_TABLE1 = "Table 1 (q=32, k=4, d_k=128); 24 layers and d_model 2048 are what its Added Param " \
          "column implies (24 x 2048 x 32 x 128 = 201M)"

# Where each value comes from: a paper section or table, or "ours: why". Fields not named here
# take gattn.experiments.provenance.COMMON's source (defaults, bookkeeping, execution).
PROVENANCE = {
    "model.vocab_size": _FIT,
    "model.d_model": _TABLE1,
    "model.num_layers": _TABLE1,
    "model.q_heads": _TABLE1,
    "model.kv_heads": _TABLE1,
    "model.head_dim": _TABLE1,
    "model.d_ff": "unused: the FFN is the MoE (set to the expert width)",
    "model.qk_norm": "ours: Qwen3-MoE has it, the paper never mentions it "
                     "(--config.model.qk_norm=false to leave it out)",
    "model.rope_base": "Sec. 4.4: pretraining uses base 10k (raised to 1M only for the 32k extension)",
    "model.moe.num_experts": "Sec. 3.1 (128 experts)",
    "model.moe.top_k": "Sec. 3.1 (top-8 softmax gating)",
    "model.moe.expert_width": _FIT + "; fine-grained experts: Sec. 3.1",
    "model.moe.renormalize": "ours: Qwen3-MoE's renormalised top-k (Sec. 3.1 says only 'top-8 "
                             "softmax gating'; --config.model.moe.renormalize=false keeps the raw weights)",
    "model.moe.capacity_factor": "ours: dropless routing (the paper does not say)",
    "model.moe.lbl_coef": "ours: 1e-3 (Sec. 3.1 names the loss, not its weight)",
    "model.moe.lbl_scope": "Sec. 3.1 (global-batch LBL, Qiu et al. 2025)",
    "model.moe.micro_batches": "unused with the global scope",
    "model.moe.z_loss_coef": "ours: 1e-3, ST-MoE's value (Sec. 3.1 names the z-loss, not its weight)",
    "train.batch_size": "Sec. 3.2.1 (global batch 1024)",
    "train.seq_len": "Sec. 3.1 (sequence length 4096)",
    "train.steps": "Sec. 3.2.1 (100k steps)",
    "train.lr_preset": "Sec. 3.2.1 (1k warmup to 2e-3, cosine to 3e-5)",
    "train.learning_rate": "Sec. 3.2.1 (max LR 2e-3), through train.lr_preset",
    "train.min_learning_rate": "Sec. 3.2.1 (cosine to 3e-5), through train.lr_preset",
    "train.warmup_steps": "Sec. 3.2.1 (1k steps), through train.lr_preset",
    "train.microbatches": "ours: execution; the batch of 1024 in one pass on pure FSDP over 32 v5p chips, "
                          "the shortest modelled step within HBM (docs/presets.md, 'How moe_15a2b's mesh "
                          "was chosen'); the global-batch LBL counts loads over all 1024 rows",
    "train.grad_clip": "Sec. 3.1 ('other hyperparameters follow the default values of the AdamW "
                       "optimizer'): no clipping; --config.train.grad_clip=1.0 clips at 1.0, "
                       "the small presets' default",
}
