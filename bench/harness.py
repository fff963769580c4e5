"""Requests per second through lm-evaluation-harness: gattn's model class vs lm-eval's own `hf`
backend, on the same Qwen3 (built here with transformers at random, converted by gattn on load)
and the same generated tasks.

    python bench/harness.py [--docs 100] [--layers 8] [--width 512] [--vocab 32768] [--batch 16]
    python bench/harness.py --docs 200 --layers 4 --width 256 --vocab 1024    (the toy: ~1 minute)
    python bench/harness.py --tasks mmlu --shots 5                           (MMLU, 5-shot)

Tasks (`--tasks`, default arc,rolling,gsm8k; `--shots`, default 1): an ARC-style multiple-choice
task (`--docs` questions x 4 choices: loglikelihood), a rolling-perplexity task over the same texts
(loglikelihood_rolling), a GSM8K-style generation task (`--docs // 10` questions, 16 greedy
tokens: generate_until), and `mmlu`: an MMLU subject (`--docs` questions x 4 one-token choices,
the same first few-shot examples before every question, as lm-eval's MMLU samples them). Each
backend runs the suite twice: `cold` includes what the first run pays (model load, conversion,
compiles; torch has none), `warm` is the second.

Two clocks per run: `end_to_end` is lm-eval's `simple_evaluate` (building the prompts from their
templates, the metrics, ...: work that is the same whichever model answers), `model` is the time
inside the model class's three request methods (tokenizing, batching, the forward passes,
decoding), which is what a backend decides. Prints JSON: requests, seconds and requests/s per
backend, run and clock, and the ratios. Target (issue 30): gattn >= 2x the hf backend.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
WORDS = "the gate attention sigmoid input output head query key value layer model token sink score"


def build(root: Path, layers: int, width: int, vocab: int = 1024) -> Path:
    """The model: a random Qwen3, `vocab` rows of embedding (the tokenizer uses the first 1,000)."""
    from test_lm_eval import build_qwen3

    return build_qwen3(root / "hf", [f"Question: {WORDS} ? Answer: x\n#### {i}\n" for i in range(100)], 1000, 0.05,
                       vocab_size=vocab, hidden_size=width, intermediate_size=3 * width, num_hidden_layers=layers,
                       num_attention_heads=width // 32, num_key_value_heads=width // 64, head_dim=32,
                       max_position_embeddings=1024)


def tasks(root: Path, docs: int) -> Path:
    import numpy as np
    from test_lm_eval import write_jsonl

    from gattn.eval import lm_tasks

    rng = np.random.default_rng(0)
    words = WORDS.split()

    def sentence(n):
        return " ".join(rng.choice(words, n)).capitalize()

    arc = [{"id": f"q{i}", "question": sentence(int(rng.integers(8, 40))) + "?",
            "choices": {"text": [sentence(int(rng.integers(1, 12))) for _ in range(4)], "label": list("ABCD")},
            "answerKey": "ABCD"[i % 4]} for i in range(docs)]
    for split in ("train", "validation", "test"):
        write_jsonl(root / "data" / "arc_easy" / f"{split}.jsonl", arc)
    mmlu = [{"question": sentence(int(rng.integers(8, 40))) + "?", "subject": "abstract_algebra",
             "choices": [sentence(int(rng.integers(1, 6))) for _ in range(4)], "answer": i % 4} for i in range(docs)]
    write_jsonl(root / "data" / "mmlu" / "abstract_algebra" / "test.jsonl", mmlu)
    write_jsonl(root / "data" / "mmlu" / "abstract_algebra" / "dev.jsonl", mmlu[:5])
    gsm = [{"question": sentence(int(rng.integers(8, 30))) + "?", "answer": "x\n#### 1"} for _ in range(max(docs // 10, 1))]
    for split in ("train", "test"):
        write_jsonl(root / "data" / "gsm8k" / f"{split}.jsonl", gsm)
    folder = lm_tasks.write(root / "data", root / "tasks")
    (folder / "rolling.yaml").write_text(
        "task: rolling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'data' / 'arc_easy' / 'test.jsonl'}\noutput_type: loglikelihood_rolling\ntest_split: test\n"
        "doc_to_text: ''\ndoc_to_target: '{{question}}'\nmetric_list:\n  - metric: word_perplexity\n")
    return folder


REQUEST_METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def timed(model) -> dict:
    """Wraps the model's request methods (on the instance) to add their seconds to the dict returned."""
    clock = {"model": 0.0}

    def wrap(method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                clock["model"] += time.perf_counter() - start
        return call

    for name in REQUEST_METHODS:
        setattr(model, name, wrap(getattr(model, name)))
    return clock


TASKS = {"arc": "local_arc_easy", "rolling": "rolling", "gsm8k": "local_gsm8k", "mmlu": "local_mmlu_abstract_algebra"}


def run(model, manager, clock: dict, tasks=("arc", "rolling", "gsm8k"), shots: int = 1) -> tuple[int, float, float]:
    """(requests, end-to-end seconds, seconds in the model's request methods) of one suite run."""
    import lm_eval

    clock["model"] = 0.0
    start = time.perf_counter()
    res = lm_eval.simple_evaluate(model=model, tasks=[TASKS[t] for t in tasks], num_fewshot=shots,
                                  task_manager=manager, gen_kwargs="max_gen_toks=16",
                                  log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  fewshot_random_seed=0, verbosity="ERROR")
    seconds = time.perf_counter() - start
    return sum(len(s["arguments"]) for samples in res["samples"].values() for s in samples), seconds, clock["model"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32768, help="the model's vocabulary rows (>= 1024)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tasks", default="arc,rolling,gsm8k", help=f"comma-separated, of {sorted(TASKS)}")
    ap.add_argument("--shots", type=int, default=1, help="few-shot examples per task (num_fewshot)")
    args = ap.parse_args()
    tasks_run = args.tasks.split(",")
    if not set(tasks_run) <= set(TASKS):
        ap.error(f"--tasks {args.tasks!r}: each one of {sorted(TASKS)}")
    from gattn.cli import ensure_malloc_tunables

    ensure_malloc_tunables()  # glibc's settings of every gattn command (both backends run in this process)
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from gattn.interop import harness

    root = Path(tempfile.mkdtemp(prefix="bench-lm-eval-"))
    hf, folder = build(root, args.layers, args.width, args.vocab), tasks(root, args.docs)
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    out = {"docs": args.docs, "layers": args.layers, "width": args.width, "vocab": args.vocab, "batch": args.batch,
           "tasks": tasks_run, "shots": args.shots, "torch_threads": torch.get_num_threads()}
    for name, make in (("gattn", lambda: harness.GattnLM(workdir=str(hf), batch_size=args.batch, max_length=1024)),
                       ("hf", lambda: HFLM(pretrained=str(hf), dtype="float32", batch_size=args.batch, max_length=1024,
                                           device="cpu"))):
        start = time.perf_counter()
        model = make()
        load = time.perf_counter() - start
        clock = timed(model)
        for attempt in ("cold", "warm"):
            n, seconds, in_model = run(model, manager, clock, tasks_run, args.shots)
            extra = load if attempt == "cold" else 0.0
            for kind, secs in (("end_to_end", seconds + extra), ("model", in_model + extra)):
                out[f"{name}_{attempt}_{kind}"] = {"requests": n, "seconds": round(secs, 2),
                                                   "requests_per_s": round(n / secs, 1)}
    for attempt in ("cold", "warm"):
        for kind in ("end_to_end", "model"):
            out[f"ratio_{attempt}_{kind}"] = round(out[f"gattn_{attempt}_{kind}"]["requests_per_s"]
                                                   / out[f"hf_{attempt}_{kind}"]["requests_per_s"], 2)
    out["target"] = ">= 2x the hf backend (issue 30)"
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
