"""A first look at every variant of the paper on the embedded corpus.

    python -m gattn.demo [--config configs/demo.py] [--variants a,b,...] [--steps 40] [--json]

For each variant: parameters (and those added to the baseline), a short AdamW run on the bytes of
CPython's own documentation (the embedded corpus's "docs" domain), the held-out loss,
and the paper's gate statistics from the real forward pass: mean gate score, F-Attn (attention
on the first token) and M-Act (max hidden activation). Identical data and seed for all variants.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
import optax
from flax import nnx

from gattn import variants
from gattn.eval import analysis
from gattn import config as config_lib
from gattn.data import corpus
from gattn.train.loss import lm_loss
from gattn.model.transformer import Transformer
from gattn.model.params import count_params
from gattn.cli import ensure_malloc_tunables


def embedded_bytes() -> tuple[np.ndarray, np.ndarray]:
    """The embedded corpus's documentation domain as bytes: its train and held-out splits."""
    docs = [d for d in corpus.documents(corpus.EMBEDDED, 0) if d.domain == "docs"]

    def as_bytes(split):
        text = "\n\n".join(d.text for d in docs if d.split == split)
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    return as_bytes("train"), as_bytes("validation")


def batches(data: np.ndarray, batch: int, seq: int, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        yield np.stack([data[s:s + seq + 1] for s in starts])


def run_variant(cfg, baseline_params: int, train, held_out, steps: int) -> dict:
    model_cfg, t = cfg.model, cfg.train
    model = Transformer(model_cfg, rngs=nnx.Rngs(t.seed))
    opt = nnx.Optimizer(model, optax.adamw(t.learning_rate), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, tokens):
        loss, grads = nnx.value_and_grad(lm_loss)(model, tokens)
        opt.update(model, grads)
        return loss

    start = time.perf_counter()
    data = batches(train, t.batch_size, t.seq_len, t.seed)
    losses = [float(step(model, opt, next(data))) for _ in range(steps)]
    eval_batch = next(batches(held_out, t.batch_size, t.seq_len, t.seed + 1))
    held_out_loss = float(nnx.jit(lm_loss)(model, eval_batch))
    overall = analysis.summarize(model, eval_batch[:, :-1])["overall"]
    stats = {k: overall[k] for k in ("m_act", "f_attn", "gate_score") if k in overall}
    params = count_params(model_cfg)
    return {"variant": cfg.variant, "params": params, "added_params": params - baseline_params,
            "first_loss": losses[0],
            "last_loss": losses[-1], "held_out_loss": held_out_loss, **stats,
            "seconds": time.perf_counter() - start}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/demo.py")
    ap.add_argument("--variants", default="all", help="comma-separated names, or 'all'")
    ap.add_argument("--steps", type=int, default=40, help="AdamW steps per variant (a short look; "
                    "train.steps is train.py's budget)")
    ap.add_argument("--json", action="store_true")
    args, overrides = config_lib.parse_args(ap, argv)
    names = (variants.applicable(config_lib.load(args.config, overrides).model)
             if args.variants == "all" else args.variants.split(","))
    # Each variant is applied to the config file's model, then the overrides (as in train.py);
    # every config is built, and so checked, before any training.
    cfgs = [config_lib.load(args.config, overrides, variant=n) for n in names]
    baseline_params = count_params(config_lib.load(args.config, overrides, variant="baseline").model)
    cfg = cfgs[0]
    train, held_out = embedded_bytes()
    print(f"embedded corpus: {len(train):,} train / {len(held_out):,} held-out bytes; "
          f"{args.steps} AdamW steps of {cfg.train.batch_size}x{cfg.train.seq_len} per variant "
          f"on {jax.devices()[0].platform}", flush=True)
    rows = []
    for name, variant_cfg in zip(names, cfgs):
        rows.append(run_variant(variant_cfg, baseline_params, train, held_out, args.steps))
        r = rows[-1]
        if not args.json:
            gate = f"{r['gate_score']:.3f}" if "gate_score" in r else "-"
            if len(rows) == 1:
                print(f"{'variant':<30}{'params':>10}{'added':>9}{'loss@0':>8}{'loss@N':>8}"
                      f"{'held-out':>9}{'gate':>7}{'F-Attn':>8}{'M-Act':>8}")
            print(f"{name:<30}{r['params']:>10,}{r['added_params']:>+9,}"
                  f"{r['first_loss']:>8.3f}{r['last_loss']:>8.3f}{r['held_out_loss']:>9.3f}"
                  f"{gate:>7}{r['f_attn']:>8.3f}{r['m_act']:>8.2f}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    ensure_malloc_tunables()
    raise SystemExit(config_lib.run_cli(main))
