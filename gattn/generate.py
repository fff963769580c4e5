"""`python -m gattn.generate`: text in, text out, from any gattn run or Hugging Face model folder.

    python -m gattn.generate --workdir RUN "The attention gate" "def add(a, b):"
    python -m gattn.generate --workdir HF_FOLDER --prompts-file prompts.jsonl --json
    python -m gattn.generate --workdir RUN "Once" --temperature 0.8 --top-p 0.95 --seed 1 --step 2000

RUN is a gattn run directory (its latest checkpoint, or --step) or a Hugging Face model folder
(converted in memory, as python -m gattn.lm_eval does). Each prompt is encoded with the run's
tokenizer, after BOS where the run's documents open with one (data.bos, or Bigram-Backcopy's <s>);
an empty prompt is that BOS alone, or EOS (gattn's documents follow one). All prompts run as one
batch through the kv-cache decoder (gattn.eval.decode), each row as it would alone, and each
stops at the tokenizer's EOS (not printed) or after --max-tokens tokens. Greedy by default;
--temperature > 0 samples from the --top-p nucleus, the same tokens for the same --seed.
`--speculative mtp` decodes greedily with the model's MTP layer drafting every second token
(model.mtp_layers = 1; gattn.eval.speculative): the same tokens as plain greedy decoding, with the
drafts' acceptance rate and the tokens/s on stderr; --compare-greedy decodes the prompts with plain
greedy decoding too and adds its tokens/s, the speed-up (both compiled first, then timed three
times, alternated: the medians) and whether the tokens are the same (bench/decode.py --mode
speculative measures the same on random or validation-data prompts, --repeats times).

Output: each prompt's continuation (after a `==> prompt <==` line when there are several), or
with --json one line per prompt: {"prompt", "completion", "tokens" (the generated ids)}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gattn import cli
from gattn.config import BACKCOPY, ConfigError


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a file: a .jsonl's {"prompt": ...} objects, else one prompt per line (blank
    lines skipped in both)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("--prompts-file", str(path), "an existing file (one prompt per line, or a .jsonl "
                          'of {"prompt": ...})')
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if path.suffix != ".jsonl":
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ConfigError("--prompts-file", f"{path}:{n}", 'a JSON object with a string "prompt" on every '
                              "non-blank line of a .jsonl (a plain text file: any other suffix)")
        prompts.append(row["prompt"])
    return prompts


def opening(cfg, tokenizer) -> int | None:
    """The BOS id every prompt opens with where the run's documents open with one (data.bos, or
    Bigram-Backcopy's <s>), else None."""
    bos = tokenizer.bos_id()
    return bos if (cfg.data.bos or cfg.data.source == BACKCOPY) and bos >= 0 else None


def encode(tokenizer, texts: list[str], bos: int | None) -> list[list[int]]:
    """Each prompt's token ids, after `bos` if given; an empty prompt without BOS is EOS."""
    start = [] if bos is None else [bos]
    prompts = [start + tokenizer.encode(t) for t in texts]
    eos = tokenizer.eos_id()
    if any(not p for p in prompts) and eos < 0:
        raise ConfigError("prompt", "", "a non-empty prompt (this run's tokenizer has neither BOS nor EOS to "
                          "open an empty one)")
    return [p or [eos] for p in prompts]


def complete(cfg, model, tokenizer, texts: list[str], *, max_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, speculative: str = "none",
             compare_greedy: bool = False) -> list[dict]:
    """{"prompt", "completion", "tokens"} per prompt: one batched decode of all of them (with
    `speculative` "mtp", greedy and drafted by the MTP layer; the statistics go to stderr, with
    `compare_greedy` against plain greedy decoding's: `_speculative`)."""
    import jax  # noqa: PLC0415

    from gattn.eval import decode  # noqa: PLC0415
    from gattn.model.transformer import off_mesh, with_exec  # noqa: PLC0415

    prompts = encode(tokenizer, texts, opening(cfg, tokenizer))
    eos = tokenizer.eos_id()
    model = with_exec(model, off_mesh(model.ex))
    if speculative == "mtp":
        tokens = _speculative(model, prompts, max_tokens, eos if eos >= 0 else None, compare_greedy)
    else:
        tokens = decode.generate(model, prompts, max_new_tokens=max_tokens, eos_id=eos if eos >= 0 else None,
                                 temperature=temperature, top_p=top_p, key=jax.random.key(seed))
    return [{"prompt": text, "completion": tokenizer.decode(t), "tokens": t} for text, t in zip(texts, tokens)]


COMPARE_REPEATS = 3  # --compare-greedy: timed calls of each decoder (alternated); the medians are compared


def _speculative(model, prompts: list[list[int]], max_tokens: int, eos: int | None, compare_greedy: bool):
    """The MTP-drafted greedy tokens, with one line of statistics on stderr: the drafts accepted,
    main steps and tokens/s (the call's compilation included). With `compare_greedy`, plain greedy
    decoding runs on the same prompts too: each decoder is compiled first (one short call), then
    timed COMPARE_REPEATS times, alternated, and the line gives both median tokens/s, the speed-up
    and whether the tokens are the same."""
    import numpy as np  # noqa: PLC0415

    from gattn.eval import decode  # noqa: PLC0415
    from gattn.eval import speculative as spec  # noqa: PLC0415

    if not compare_greedy:
        tokens, stats = spec.generate(model, prompts, max_new_tokens=max_tokens, eos_id=eos, with_stats=True)
        print(f"{_stats_line(stats, stats.seconds)} (compilation included; the speed-up against plain greedy "
              "decoding: --compare-greedy, or bench/decode.py --mode speculative)", file=sys.stderr, flush=True)
        return tokens
    # each decoder's own cache length (what it takes alone: plain greedy the prompt and its new
    # tokens, speculative decoding room for the drafts too; before, plain greedy was timed on the
    # speculative one's, ~2x its slots, which inflated the speed-up), the same for its warm-up
    # and its timed calls, so each compiles once
    padded = decode.round_up(max(map(len, prompts)), 16)
    plain_len, spec_len = (decode.round_up(padded + k * max_tokens, 16) for k in (1, 2))
    decode.generate(model, prompts, max_new_tokens=2, max_len=plain_len)
    spec.generate(model, prompts, max_new_tokens=3, max_len=spec_len)
    plain_s, spec_s = [], []
    for _ in range(COMPARE_REPEATS):
        t = time.perf_counter()
        plain = decode.generate(model, prompts, max_new_tokens=max_tokens, eos_id=eos, max_len=plain_len)
        plain_s.append(time.perf_counter() - t)
        tokens, stats = spec.generate(model, prompts, max_new_tokens=max_tokens, eos_id=eos, max_len=spec_len,
                                      with_stats=True)
        spec_s.append(stats.seconds)
    plain_rate = sum(map(len, plain)) / float(np.median(plain_s))
    spec_rate = stats.tokens / float(np.median(spec_s))
    print(f"{_stats_line(stats, float(np.median(spec_s)))} against plain greedy decoding's {plain_rate:.1f} "
          f"tokens/s (compiled first, medians of {COMPARE_REPEATS} calls each): "
          f"speed-up {spec_rate / plain_rate:.2f}x, "
          + ("the same tokens" if plain == tokens else "NOT the same tokens as plain greedy decoding"),
          file=sys.stderr, flush=True)
    return tokens


def _stats_line(stats, seconds: float) -> str:
    return (f"speculative (mtp): {stats.accepted} of {stats.drafts} drafts accepted ({100 * stats.acceptance:.1f}%), "
            f"{stats.tokens} tokens in {stats.steps} main steps, {stats.tokens / seconds:.1f} tokens/s")


def main(argv=None) -> int:
    cli.single_process("python -m gattn.generate")
    ap = argparse.ArgumentParser(prog="python -m gattn.generate", description=__doc__,
                                 formatter_class=cli.HelpWithDefaults)
    ap.add_argument("prompts", nargs="*", help="prompt texts (and/or --prompts-file)")
    ap.add_argument("--workdir", required=True, help="a gattn run directory or a Hugging Face model folder")
    ap.add_argument("--prompts-file", help='more prompts: one per line, or a .jsonl of {"prompt": ...}')
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt, at most")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled (default: %(default)s)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of most probable "
                    "tokens whose probability reaches this (1: every token; default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="the sampling key: jax.random.key(seed) (default: %(default)s)")
    ap.add_argument("--step", type=int, help="the checkpoint to load (default: the latest)")
    ap.add_argument("--speculative", choices=("none", "mtp"), default="none",
                    help="mtp: greedy decoding with the model's MTP layer drafting (the same tokens; "
                    "acceptance and tokens/s on stderr)")
    ap.add_argument("--compare-greedy", action="store_true", help="with --speculative mtp: decode with plain "
                    f"greedy too (both compiled first, then timed {COMPARE_REPEATS} times, alternated) and report "
                    "the speed-up of the median times and whether the tokens are the same on stderr")
    ap.add_argument("--json", action="store_true", help='one JSON line per prompt: {"prompt", "completion", "tokens"}')
    args, overrides = cli.parse_args(ap, argv)
    texts = list(args.prompts) + (read_prompts(args.prompts_file) if args.prompts_file else [])
    if not texts:
        raise ConfigError("prompts", [], "at least one prompt (arguments, or --prompts-file)")
    if args.max_tokens < 1:
        raise ConfigError("--max-tokens", args.max_tokens, "an integer >= 1")
    from gattn.eval import decode  # noqa: PLC0415

    decode.check_sampling(args.temperature, args.top_p, ("--temperature", "--top-p"))  # before the model loads
    if args.speculative != "none" and args.temperature != 0:
        raise ConfigError("--speculative", args.speculative, "'none' with --temperature > 0 (speculative "
                          "decoding here is greedy only)")
    if args.compare_greedy and args.speculative == "none":
        raise ConfigError("--compare-greedy", True, "only with --speculative mtp (it times speculative decoding "
                          "against plain greedy decoding)")
    from gattn.interop import runs  # noqa: PLC0415

    cfg, model, tokenizer, _ = runs.load(args.workdir, args.step, overrides)
    if args.speculative == "mtp" and not cfg.model.mtp_layers:
        raise ConfigError("--speculative", "mtp", f"'none' for {args.workdir}: its model has no MTP layer "
                          "(model.mtp_layers = 0)")
    rows = complete(cfg, model, tokenizer, texts, max_tokens=args.max_tokens, temperature=args.temperature,
                    top_p=args.top_p, seed=args.seed, speculative=args.speculative,
                    compare_greedy=args.compare_greedy)
    for row in rows:
        if args.json:
            print(json.dumps(row, ensure_ascii=False))
        elif len(rows) > 1:
            head = " ".join(row["prompt"].split())
            head = head if len(head) <= 60 else head[:57] + "..."
            print(f"==> {head} <==\n{row['completion']}\n")
        else:
            print(row["completion"])
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    cli.run_entry_point(main)
