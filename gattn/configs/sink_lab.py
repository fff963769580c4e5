"""The sink lab: a model small enough for 2 CPU cores in which the baseline forms an attention sink
(docs/sinks.md). Bigram-Backcopy data (Guo et al. 2024) with four one-character trigger sets that
copy from offsets 1-4, so that each head has a job only after its trigger and must do "nothing"
elsewhere; one layer of d_model 128 with 4 heads of 32 (with two layers the second layer's heads
did the copying and the first layer's stayed near uniform: 1 of 8 heads became a sink); AdamW at
1e-3 (cosine to 1e-4), weight decay 0.1; 1,200 steps of 64 x 128 tokens (9.8M tokens: 84 s on
2 idle CPU cores, 4-7 minutes while other jobs share them). Sink-head share (Sink_1^0.3): 0.25
with seed 0, 0.75 with seed 1; a 2,000-step schedule did no better (docs/sinks.md).

    python train.py --config configs/sink_lab.py --workdir workdir/sink_lab
    python eval.py --workdir workdir/sink_lab      # results.json: "sinks" (Sink_1^0.3 share, ...)
"""

from gattn.config import BackcopySpec, Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    model = ModelConfig(vocab_size=64, d_model=128, num_layers=1, q_heads=4, kv_heads=4, head_dim=32,
                        d_ff=352, rope_base=10_000.0)
    train = TrainConfig(seed=0, batch_size=64, seq_len=128, steps=1200, learning_rate=1e-3,
                        min_learning_rate=1e-4, warmup_steps=50, weight_decay=0.1, log_every=50,
                        eval_every=600, checkpoint_every=300)
    data = DataConfig(source="bigram_backcopy", eval_batches=4, eval_batch_size=32,
                      backcopy=BackcopySpec(chars=63, triggers="0|1|2|3", offsets="1,2,3,4"))
    return Config(model=model, train=train, data=data)
