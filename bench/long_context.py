"""Long context on CPU: decode speed and prefill memory against context length.

    python bench/long_context.py [--config configs/tiny.py] [--variant sdpa_elementwise]
                                 [--lengths 512,1024,2048,4096,8192] [--chunk 512] [--batch 1]
                                 [--new-tokens 32] [--config.FIELD=VALUE ...]

For each context length L (a cache of L slots, a prompt of L - new_tokens random tokens, a
randomly initialised model), prints JSON with:
  - prefill seconds, chunked (`--chunk` tokens per pass, as eval.py --ruler runs) and in one pass;
  - the compiled temporary memory of one prefill pass (XLA's memory_analysis: the [chunk, L] or
    [L, L] attention scores per layer dominate it) for both, and their ratio;
  - the compiled temporary memory of the training-path forward at length L with the xla
    attention's causal query blocks (exec.attention_block_q), without (0: one [L, L] block), and
    with the sequential query chunks for long contexts (exec.attention_query_chunk = --chunk);
  - decode tokens/s (greedy, kv cache) after the prompt, and the process's peak RSS so far.
Lengths run from short to long, so the peak RSS after each is that length's high-water mark.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gattn.cli import ensure_malloc_tunables, keep_jax_off_absent_tpu  # noqa: E402

keep_jax_off_absent_tpu()  # no libtpu start-up errors on a CPU host (libtpu is only a compiler here)
ensure_malloc_tunables()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from gattn import cli  # noqa: E402
from gattn.config import ExecConfig, ModelConfig  # noqa: E402
from gattn.eval import decode  # noqa: E402
from gattn.eval.ruler import peak_rss_mb  # noqa: E402
from gattn.model.transformer import Transformer  # noqa: E402

MIB = 2 ** 20


def prefill_temp_mib(model, tokens, valid, cache) -> float:
    """Temporary memory XLA plans for one prefill pass of `tokens` into `cache`."""
    graphdef, state = nnx.split(model)
    compiled = decode._prefill.lower(graphdef, state, tokens, valid, cache).compile()
    return compiled.memory_analysis().temp_size_in_bytes / MIB


def forward_temp_mib(cfg: ModelConfig, ex: ExecConfig, length: int) -> float:
    """Temporary memory of the training-path forward (logits of one row of `length` tokens)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, ex, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    return fwd.lower(state, tokens).compile().memory_analysis().temp_size_in_bytes / MIB


def timed(fn):
    t = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return out, time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--variant", default="sdpa_elementwise")
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    args, overrides = cli.parse_args(ap, argv)
    cfg = cli.load(args.config, overrides, variant=args.variant)
    model = Transformer(cfg.model, cfg.exec, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    out = {"jax": jax.__version__, "config": args.config, "variant": args.variant, "batch": args.batch,
           "chunk": args.chunk, "new_tokens": args.new_tokens,
           "attention_block_q": cfg.exec.attention_block_q,
           "per_length": []}
    for length in sorted(int(x) for x in args.lengths.split(",")):
        s = length - args.new_tokens
        tokens = rng.integers(0, cfg.model.vocab_size, (args.batch, s)).astype(np.int32)
        valid = np.ones_like(tokens, bool)
        row = {"length": length}
        # Prefill: compile (first call), then time; chunked as eval.py --ruler runs it, and whole.
        for name, chunk in (("chunked", args.chunk), ("one_pass", None)):
            run = lambda: decode.prefill(model, tokens, valid, model.init_cache(args.batch, length),  # noqa: E731
                                         chunk=chunk, last_only=True)
            run()
            (_, cache), sec = timed(run)
            row[f"prefill_{name}_s"] = round(sec, 3)
            c = chunk or s
            row[f"prefill_{name}_temp_mib"] = round(prefill_temp_mib(
                model, jnp.asarray(tokens[:, :c]), jnp.asarray(valid[:, :c]), model.init_cache(args.batch, length)), 1)
        row["prefill_memory_ratio"] = round(row["prefill_one_pass_temp_mib"] / row["prefill_chunked_temp_mib"], 2)
        for name, block, chunk in (("blocked", cfg.exec.attention_block_q, 0), ("unblocked", 0, 0),
                                   ("query_chunked", 0, args.chunk)):
            ex = dataclasses.replace(cfg.exec, attention_block_q=block, attention_query_chunk=chunk)
            row[f"forward_{name}_temp_mib"] = round(forward_temp_mib(cfg.model, ex, length), 1)
        # Decode after the prompt: one greedy token per step against the `length`-slot cache.
        graphdef, state = nnx.split(model)
        logits, cache = decode.prefill(model, tokens, valid, model.init_cache(args.batch, length),
                                       chunk=args.chunk, last_only=True)
        next_B, cache = decode._step(graphdef, state, jnp.argmax(logits, -1).astype(jnp.int32), cache)  # compile
        t = time.perf_counter()
        for _ in range(args.new_tokens - 1):
            next_B, cache = decode._step(graphdef, state, next_B, cache)
        jax.block_until_ready(next_B)
        row["decode_tokens_per_s"] = round(args.batch * (args.new_tokens - 1) / (time.perf_counter() - t), 1)
        row["peak_rss_mib"] = round(peak_rss_mb(), 1)
        out["per_length"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    raise SystemExit(cli.run_cli(main))
