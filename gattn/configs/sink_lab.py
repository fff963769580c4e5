"""The sink lab: a model small enough for 2 CPU cores in which the baseline forms an attention sink
that it relies on (docs/sinks.md). Bigram-Backcopy data (Guo et al. 2024) with four one-character
trigger sets that copy from offsets 1-4, so that each head has a job only after its trigger and
must do "nothing" elsewhere; the other tokens are drawn uniformly from 15 characters
(`background="uniform"`): with the docs' bigrams a head that spreads its attention over the
context is as harmless as one parked on <s> (the context is a good prior), and hiding <s> cost
only 0.002-0.006 nats. One layer of d_model 128 with 4 heads of 32; AdamW at 1e-3 (cosine to
1e-4), weight decay 0.1; 400 steps of 256 x 32 tokens (3.3M tokens). Baseline, seed 0 (the search
run, 600 steps): non-trigger alpha_1 per head 1.00 / 0.79 / 0.00 / 0.21, hiding <s> costs 0.26 nats.

    python train.py --config configs/sink_lab.py --workdir workdir/sink_lab
    python eval.py --workdir workdir/sink_lab      # results.json: "sinks" (ablation_cost, alpha_1, ...)
"""

from gattn.config import BackcopySpec, Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    model = ModelConfig(vocab_size=64, d_model=128, num_layers=1, q_heads=4, kv_heads=4, head_dim=32,
                        d_ff=352, rope_base=10_000.0)
    train = TrainConfig(seed=0, batch_size=256, seq_len=32, steps=400, learning_rate=1e-3,
                        min_learning_rate=1e-4, warmup_steps=50, weight_decay=0.1, log_every=50,
                        eval_every=400, checkpoint_every=100)
    data = DataConfig(source="bigram_backcopy", eval_batches=4, eval_batch_size=32,
                      backcopy=BackcopySpec(chars=15, triggers="0|1|2|3", offsets="1,2,3,4", background="uniform"))
    return Config(model=model, train=train, data=data)
