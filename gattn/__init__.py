"""gattn: gated attention for LLMs (Qiu et al. 2025) in JAX / Flax NNX.

The layers, left to right (a module imports only from its own package or from those to its left;
tests/test_layers.py enforces it):

    config, variants,       the schema of a run, the paper's variants, the processes of a
    cluster, cli            multi-host run (joining, watching, one line per failure), the
                            command-line layer
    kernels, data           attention kernels (Pallas + reference); text, tokenizers, batches
    model                   layers, the gate, attention, MoE, the transformer, sharding, counts
    train                   loss, optimizer, checkpoints, the run directory, the training loop
    eval                    measurements, perplexity, decoding, few-shot, long context, figures
    interop, experiments    Hugging Face conversion; studies, the main job, the demo

The modules `gattn.convert`, `gattn.study`, `gattn.main_job`, `gattn.demo`, `gattn.params`, `gattn.rehearse`,
`gattn.launch`, `gattn.lm_eval` and `gattn.generate` are the `python -m` entry points; each only calls
into its layer.
"""
