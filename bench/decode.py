"""Greedy decoding speed: the kv cache against rerunning the full forward pass per token.

    python bench/decode.py [--config configs/tiny.py] [--variant sdpa_elementwise] [--batch 4]
                           [--prompt-len 64] [--new-tokens 64]

Prints JSON: tokens/s of `gattn.eval.decode.generate` (batched, cached) and of
`generate_without_cache` (the reference: one row at a time, the whole sequence rerun per token),
their ratio, and whether both produced the same tokens. A randomly initialised model (no eos), so
every row generates exactly --new-tokens tokens; both are warmed up (compiled) before timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gattn.cli import ensure_malloc_tunables, keep_jax_off_absent_tpu  # noqa: E402

keep_jax_off_absent_tpu()  # no libtpu start-up errors on a CPU host (libtpu is only a compiler here)
ensure_malloc_tunables()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from gattn import cli  # noqa: E402
from gattn.eval import decode  # noqa: E402
from gattn.model.transformer import Transformer  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--variant", default="sdpa_elementwise")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    args, overrides = cli.parse_args(ap, argv)
    cfg = cli.load(args.config, overrides, variant=args.variant)
    model = Transformer(cfg.model, cfg.exec, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.model.vocab_size, args.prompt_len - i).tolist() for i in range(args.batch)]
    # generate pads prompts to a multiple of 16 where the cache leaves room: with this cache the
    # warm-up (2 new tokens) and the timed call pad to the same length and share one compilation.
    max_len = decode.round_up(args.prompt_len, 16) + args.new_tokens
    out = {"jax": jax.__version__, "config": args.config, "variant": args.variant, "batch": args.batch,
           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    results = {}
    for name, fn in (("cached", decode.generate), ("without_cache", decode.generate_without_cache)):
        fn(model, prompts[:1] * len(prompts), max_new_tokens=2, max_len=max_len)  # compile
        t = time.perf_counter()
        results[name] = fn(model, prompts, max_new_tokens=args.new_tokens, max_len=max_len)
        sec = time.perf_counter() - t
        out[f"{name}_tokens_per_s"] = round(args.batch * args.new_tokens / sec, 1)
        out[f"{name}_s"] = round(sec, 3)
    out["speedup"] = round(out["cached_tokens_per_s"] / out["without_cache_tokens_per_s"], 2)
    out["same_tokens"] = results["cached"] == results["without_cache"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    raise SystemExit(cli.run_cli(main))
