"""The input pipeline alone, per host: tokens/s reading pretokenized shards vs tokenizing on the fly,
and the margin over what one v5p host consumes in `dense_1p7b`.

    python bench/input_pipeline.py [--mb 32] [--rows 128] [--steps 32] [--workdir DIR]

Both paths are the trainer's (`pipeline.train_iterator`: one stream per row, packing into rows of
seq_len + 1 with segment ids and positions, the window shuffle), on one host's rows of the global
batch: by default rows 0..127 of 1024 x 4096, a host's share of `dense_1p7b` on a v5p-64 (8 hosts
of 4 chips). `--steps 32` is one full window (data.shuffle_window): every row stream packs
exactly 32 rows, so the time counts each token once, the first window's fill included.

- on the fly: the corpus folder's TFDS build, each document tokenized when read, with a
  Qwen-sized tokenizer.json (151,643 BPE pieces, bench/prepare.py `qwen_sized_tokenizer`);
- shards: the same corpus prepared by `python -m gattn.prepare` (data.source="shards:DIR").

The host's consumption: tokens per step per host / the step time at 50% MFU, from the AOT model
FLOPs of `dense_1p7b` on v5p-64 (docs/presets.md, "Which slice each preset fits": 1538 TFLOP per
chip per step, bench/fit_presets.py) and v5p's 459 TFLOP/s bf16 peak per chip. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prepare import generate_corpus, qwen_sized_tokenizer  # noqa: E402 (bench/prepare.py)

# dense_1p7b on v5p-64 (v5p:4x4x2): 32 chips, 8 hosts of 4, batch 1024 x 4096.
TFLOP_PER_CHIP_STEP = 1538  # docs/presets.md (bench/fit_presets.py, AOT): 6 N tokens + attention, per chip
V5P_PEAK_TFLOPS = 459       # bf16 per chip
MFU = 0.5
HOSTS, BATCH, SEQ = 8, 1024, 4096


def host_consumption() -> dict:
    step_s = TFLOP_PER_CHIP_STEP / (MFU * V5P_PEAK_TFLOPS)
    tokens = BATCH * SEQ // HOSTS
    return {"step_seconds_at_50pct_mfu": round(step_s, 2), "tokens_per_step_per_host": tokens,
            "tokens_per_s_per_host": round(tokens / step_s)}


def rate(cfg, tokenizer, workdir: Path, rows: int, steps: int) -> dict:
    from gattn.data import pipeline

    start = time.perf_counter()
    it = pipeline.train_iterator(cfg, tokenizer, workdir, range(rows))
    built = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(it)
    seconds = time.perf_counter() - start
    tokens = steps * rows * (cfg.train.seq_len + 1)
    assert batch["tokens"].shape == (rows, cfg.train.seq_len + 1)
    return {"seconds": round(seconds, 2), "iterator_seconds": round(built, 2), "tokens": tokens,
            "tokens_per_s": round(tokens / seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=32, help="corpus size in MB")
    ap.add_argument("--rows", type=int, default=BATCH // HOSTS, help="this host's rows of the global batch")
    ap.add_argument("--steps", type=int, default=32, help="batches read (32: one full shuffle window)")
    ap.add_argument("--workdir", default="", help="keeps corpus, tokenizer and shards between runs")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core, as the trainer's one data thread
    from gattn.config import Config, DataConfig, ModelConfig, TrainConfig
    from gattn.data import prepare, tfds_text
    from gattn.data.tokenizer import HFTokenizer

    work = Path(args.workdir or tempfile.mkdtemp(prefix="gattn-bench-input-"))
    tok_file = qwen_sized_tokenizer(work / "tokenizer")
    source = generate_corpus(work / f"corpus-{args.mb}mb", args.mb)
    shards = work / f"shards-{args.mb}mb"
    start = time.perf_counter()
    if not (shards / "manifest.json").is_file():
        prepare.prepare(str(source), str(tok_file), str(shards), workers=2, quiet=True)
    prepared = time.perf_counter() - start

    def config(data_source: str) -> Config:
        return Config(model=ModelConfig(vocab_size=151_936),
                      train=TrainConfig(batch_size=BATCH, seq_len=SEQ, steps=10, warmup_steps=1),
                      data=DataConfig(source=data_source, tokenizer=str(tok_file) if data_source == str(source) else ""))

    tokenizer = HFTokenizer(tok_file)
    fly_cfg = config(str(source))
    start = time.perf_counter()
    tfds_text.prepare(fly_cfg.data, work / "run")  # the on-the-fly path's TFDS build (once per corpus)
    built = time.perf_counter() - start
    results = {"shards": rate(config(f"shards:{shards}"), tokenizer, work / "run", args.rows, args.steps),
               "on_the_fly": rate(fly_cfg, tokenizer, work / "run", args.rows, args.steps)}
    host = host_consumption()
    print(json.dumps({
        "corpus_mb": args.mb, "rows": args.rows, "seq_len": SEQ, "steps": args.steps,
        "tokenizer_pieces": tokenizer.get_piece_size(), "cores": os.cpu_count(),
        "load_average": os.getloadavg()[0], "prepare_seconds": round(prepared, 1),
        "tfds_build_seconds": round(built, 1), **results,
        "shards_over_on_the_fly": round(results["shards"]["tokens_per_s"] / results["on_the_fly"]["tokens_per_s"], 1),
        "v5p_host_dense_1p7b": host,
        "margin_shards": round(results["shards"]["tokens_per_s"] / host["tokens_per_s_per_host"], 1),
        "margin_on_the_fly": round(results["on_the_fly"]["tokens_per_s"] / host["tokens_per_s_per_host"], 2),
    }, indent=1))


if __name__ == "__main__":
    main()
