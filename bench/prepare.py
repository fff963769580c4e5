"""Tokens per second of `python -m gattn.prepare` (Apache Beam, DirectRunner) with 1 and 2 workers.

    python bench/prepare.py [--mb 500] [--workers 1,2] [--workdir DIR]

The corpus is generated here from the embedded one (`--mb` MB of .jsonl files of 8 MB, each
document a random mix of paragraphs of the embedded documents, domain "docs" or "code" after its
first paragraph's); the tokenizer is Qwen-sized: a byte-level BPE with 151,643 pieces and Qwen's
pre-tokenizer regex, trained here (`qwen_sized_tokenizer`). Each run is a fresh
`python -m gattn.prepare` process with TOKENIZERS_PARALLELISM=false, so a worker is one core.
Prints JSON: per worker count the seconds, tokens, tokens/s and MB/s, and the scaling (2 workers'
tokens/s over 1's); the shards of every run are checked to be the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN_PIECES = 151_643  # Qwen2/3's BPE pieces, before its special tokens (151,936 embedding rows in all)
QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")


def qwen_sized_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer.json of Qwen's size and pre-tokenizer (cached in `folder`):
    trained on the embedded corpus, plus generated compounds of its words (snake_case and
    CamelCase identifiers), without which 2 MB of text yields only ~27k merges."""
    path = folder / "tokenizer.json"
    if path.is_file():
        return path
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from gattn.data import corpus

    texts = [d.text for d in corpus.documents("embedded", 1_500_000)]
    words = sorted({w for t in texts for w in t.split() if w.isalpha() and 3 <= len(w) <= 12})
    rng = random.Random(0)
    weights = [1 / (i + 1) for i in range(len(words))]
    rng.shuffle(words)
    compounds = []
    for _ in range(60):
        pairs = rng.choices(words, weights, k=2 * 40_000)
        compounds.append(" ".join(f"{a}_{b}" if i % 2 else f"{a.title()}{b.title()}"
                                  for i, (a, b) in enumerate(zip(pairs[::2], pairs[1::2]))))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_REGEX), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts + compounds, trainers.BpeTrainer(
        vocab_size=QWEN_PIECES + 1, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return path


def generate_corpus(folder: Path, mb: int, seed: int = 0) -> Path:
    """`mb` MB of .jsonl files (8 MB each) made of the embedded corpus's paragraphs (cached)."""
    done = folder / "done.json"
    if done.is_file() and json.loads(done.read_text()) == {"mb": mb, "seed": seed}:
        return folder
    from gattn.data import corpus

    paragraphs = [(d.domain, p) for d in corpus.documents("embedded", 1_500_000) for p in d.text.split("\n\n") if p.strip()]
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(max(1, mb // 8)):
        lines, size = [], 0
        while size < min(8, mb) * 2**20:
            parts = rng.choices(paragraphs, k=rng.randint(2, 60))
            text = "\n\n".join(p for _, p in parts)
            lines.append(json.dumps({"text": text, "domain": parts[0][0]}))
            size += len(text)
        (folder / f"part-{i:04d}.jsonl").write_text("\n".join(lines) + "\n")
    done.write_text(json.dumps({"mb": mb, "seed": seed}))
    return folder


def run_prepare(source: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    load = os.getloadavg()[0]  # other jobs on the machine take cores from the workers
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "gattn.prepare", "--source", str(source), "--tokenizer",
                           str(tokenizer), "--out", str(out), "--workers", str(workers), "--num-shards", "16",
                           "--json"], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    total = result["counts"]["total"]
    tokens = total["train"]["tokens"] + total["held_out"]["tokens"]
    nbytes = total["train"]["bytes"] + total["held_out"]["bytes"]
    digest = hashlib.sha256()
    for f in sorted(out.glob("*.array_record")) + [out / "manifest.json"]:
        digest.update(f.read_bytes())
    return {"workers": workers, "seconds_pipeline": result["seconds"],
            "seconds_process": round(time.perf_counter() - start, 1), "tokens": tokens, "mb": round(nbytes / 2**20, 1),
            "tokens_per_s": round(tokens / result["seconds"]), "mb_per_s": round(nbytes / 2**20 / result["seconds"], 2),
            "shards_sha256": digest.hexdigest()[:16], "load_average_before_after": [load, os.getloadavg()[0]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=500, help="corpus size in MB (>= 500 for the issue's number)")
    ap.add_argument("--workers", default="1,2", help="worker counts to run, comma-separated")
    ap.add_argument("--workdir", default="", help="keeps the corpus and tokenizer between runs (default: a temp dir)")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gattn-bench-prepare-"))
    t0 = time.perf_counter()
    tokenizer = qwen_sized_tokenizer(work / "tokenizer")
    source = generate_corpus(work / f"corpus-{args.mb}mb", args.mb)
    setup = time.perf_counter() - t0
    runs = []
    for n in map(int, args.workers.split(",")):
        out = work / f"shards-{args.mb}mb-{n}w"
        if out.exists():
            subprocess.run(["rm", "-rf", str(out)], check=True)
        runs.append(run_prepare(source, tokenizer, out, n))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    from tokenizers import Tokenizer

    report = {"corpus_mb": args.mb, "tokenizer_pieces": Tokenizer.from_file(str(tokenizer)).get_vocab_size(),
              "cores": os.cpu_count(), "setup_seconds": round(setup, 1), "runs": runs,
              "same_bytes": len({r["shards_sha256"] for r in runs}) == 1}
    if len(runs) > 1:
        report["scaling"] = round(runs[-1]["tokens_per_s"] / runs[0]["tokens_per_s"], 2)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
