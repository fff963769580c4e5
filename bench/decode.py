"""Greedy decoding speed: the kv cache against rerunning the full forward pass per token, or
(--mode speculative) self-speculative decoding with the MTP layer against plain cached decoding.

    python bench/decode.py [--config configs/tiny.py] [--variant sdpa_elementwise] [--batch 4]
                           [--prompt-len 64] [--new-tokens 64]
    python bench/decode.py --mode speculative --config.model.mtp_layers=1     # a random model
    python bench/decode.py --mode speculative --workdir RUN [--prompts-from-data]  # a trained one

Prints JSON: tokens/s of `gattn.eval.decode.generate` (batched, cached) and of
`generate_without_cache` (the reference: one row at a time, the whole sequence rerun per token),
their ratio, and whether both produced the same tokens. A randomly initialised model (no eos), so
every row generates exactly --new-tokens tokens; both are warmed up (compiled) before timing.
The speculative mode reports `gattn.eval.speculative.generate`'s tokens/s, acceptance rate and
main steps beside plain greedy decoding's, and whether the tokens are the same (they must be):
both compiled first, then timed --repeats times, alternated (the medians; `*_ms_per_step`: a
call's time over its main steps, the prompt's pass included). With --workdir it decodes that
run's model (no eos either), prompts from its validation data with --prompts-from-data (random
tokens otherwise). A batch runs until its slowest row is done, so its main steps are those of the
row whose drafts were accepted least.
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
from gattn.eval import decode, speculative  # noqa: E402
from gattn.model.transformer import Transformer  # noqa: E402


def prompts_of(cfg, workdir, args, vocab: int) -> list[list[int]]:
    """--batch prompts of --prompt-len tokens (the i-th i tokens shorter): random tokens, or the
    starts of the run's validation rows (--prompts-from-data)."""
    if not args.prompts_from_data:
        rng = np.random.default_rng(0)
        return [rng.integers(0, vocab, args.prompt_len - i).tolist() for i in range(args.batch)]
    from gattn.data.tokenizer import load_tokenizer  # noqa: PLC0415
    from gattn.train.trainer import data_source  # noqa: PLC0415

    batches = data_source(cfg).validation_batches(cfg, load_tokenizer(cfg, workdir), workdir)
    rows = [r for b in next(iter(batches.values())) for r in b["tokens"]]
    return [rows[i][:args.prompt_len - i].tolist() for i in range(args.batch)]


def bench_speculative(args, overrides) -> dict:
    if args.workdir:
        from gattn.interop import runs  # noqa: PLC0415

        cfg, model, _, _ = runs.load(args.workdir, None, overrides)
    else:
        cfg = cli.load(args.config, overrides, variant=args.variant)
        model = Transformer(cfg.model, cfg.exec, rngs=nnx.Rngs(0))
    prompts = prompts_of(cfg, Path(args.workdir) if args.workdir else None, args, cfg.model.vocab_size)
    out = {"jax": jax.__version__, "mode": "speculative", "model": args.workdir or args.config, "batch": args.batch,
           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "prompts": "data" if args.prompts_from_data
           else "random"}
    # each decoder's own cache length (plain greedy: the prompt and its new tokens; speculative: room
    # for the drafts too; before session 9 plain greedy was timed on the speculative one's, ~2x its
    # slots, which inflated the speed-up), the same in the warm-up, so each compiles once
    padded = decode.round_up(args.prompt_len, 16)
    plain_len, spec_len = (decode.round_up(padded + k * args.new_tokens, 16) for k in (1, 2))
    if args.same_cache:  # the earlier measurement, to compare with
        plain_len = spec_len
    decode.generate(model, prompts, max_new_tokens=2, max_len=plain_len)
    speculative.generate(model, prompts, max_new_tokens=3, max_len=spec_len)
    plain_s, spec_s = [], []
    for _ in range(args.repeats):  # alternated, so a slower spell of a shared machine hits both
        t = time.perf_counter()
        plain = decode.generate(model, prompts, max_new_tokens=args.new_tokens, max_len=plain_len)
        plain_s.append(time.perf_counter() - t)
        spec, stats = speculative.generate(model, prompts, max_new_tokens=args.new_tokens, max_len=spec_len,
                                           with_stats=True)
        spec_s.append(stats.seconds)
    sec, spec_sec = float(np.median(plain_s)), float(np.median(spec_s))
    out.update(repeats=args.repeats, plain_tokens_per_s=round(args.batch * args.new_tokens / sec, 1),
               plain_s=round(sec, 3), plain_ms_per_step=round(1000 * sec / args.new_tokens, 2))
    out.update(speculative_tokens_per_s=round(stats.tokens / spec_sec, 1), speculative_s=round(spec_sec, 3),
               speculative_ms_per_step=round(1000 * spec_sec / (stats.steps + 1), 2),
               acceptance_rate=round(stats.acceptance, 4), main_steps=stats.steps,
               tokens_per_main_step=round(stats.tokens / args.batch / max(stats.steps, 1), 3))
    out["speedup"] = round(out["speculative_tokens_per_s"] / out["plain_tokens_per_s"], 2)
    out["cache_slots"] = {"plain": plain_len, "speculative": spec_len}
    out["same_tokens"] = spec == plain
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--variant", default="sdpa_elementwise")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--mode", choices=("cache", "speculative"), default="cache")
    ap.add_argument("--workdir", help="speculative mode: a trained run (with model.mtp_layers = 1)")
    ap.add_argument("--repeats", type=int, default=3, help="speculative mode: timed calls of each (alternated); "
                    "the median is reported")
    ap.add_argument("--same-cache", action="store_true", help="speculative mode: time plain greedy on the "
                    "speculative decoder's cache length (2x its slots), as before session 9, to compare")
    ap.add_argument("--prompts-from-data", action="store_true", help="speculative mode with --workdir: "
                    "prompts from the run's validation data")
    args, overrides = cli.parse_args(ap, argv)
    if args.mode == "speculative":
        print(json.dumps(bench_speculative(args, overrides), indent=2))
        return
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
