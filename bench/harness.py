"""Requests per second through lm-evaluation-harness: gattn's model class vs lm-eval's own `hf`
backend, on the same tiny Qwen3 (built here with transformers, converted by gattn on load) and the
same generated tasks.

    python bench/harness.py [--docs 200] [--layers 4] [--width 256] [--batch 16]

Tasks: an ARC-style multiple-choice task (`--docs` questions x 4 choices, 1-shot: loglikelihood),
a rolling-perplexity task over the same texts (loglikelihood_rolling) and a GSM8K-style generation
task (`--docs // 10` questions, 16 greedy tokens: generate_until). Each backend runs the suite
twice: `cold` includes what the first run pays (model load, conversion, compiles; torch has none),
`warm` is the second. Prints JSON: requests, seconds and requests/s per backend and run, and the
ratios. Target (issue 30): gattn >= 2x the hf backend.
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


def build(root: Path, layers: int, width: int) -> Path:
    from test_lm_eval import build_qwen3

    return build_qwen3(root / "hf", [f"Question: {WORDS} ? Answer: x\n#### {i}\n" for i in range(100)], 1000, 0.05,
                       vocab_size=1024, hidden_size=width, intermediate_size=3 * width, num_hidden_layers=layers,
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
    gsm = [{"question": sentence(int(rng.integers(8, 30))) + "?", "answer": "x\n#### 1"} for _ in range(max(docs // 10, 1))]
    for split in ("train", "test"):
        write_jsonl(root / "data" / "gsm8k" / f"{split}.jsonl", gsm)
    folder = lm_tasks.write(root / "data", root / "tasks")
    (folder / "rolling.yaml").write_text(
        "task: rolling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'data' / 'arc_easy' / 'test.jsonl'}\noutput_type: loglikelihood_rolling\ntest_split: test\n"
        "doc_to_text: ''\ndoc_to_target: '{{question}}'\nmetric_list:\n  - metric: word_perplexity\n")
    return folder


def run(model, manager) -> tuple[int, float]:
    import lm_eval

    start = time.perf_counter()
    res = lm_eval.simple_evaluate(model=model, tasks=["local_arc_easy", "rolling", "local_gsm8k"], num_fewshot=1,
                                  task_manager=manager, gen_kwargs="max_gen_toks=16",
                                  log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  fewshot_random_seed=0, verbosity="ERROR")
    seconds = time.perf_counter() - start
    return sum(len(s["arguments"]) for samples in res["samples"].values() for s in samples), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from gattn.interop import harness

    root = Path(tempfile.mkdtemp(prefix="bench-lm-eval-"))
    hf, folder = build(root, args.layers, args.width), tasks(root, args.docs)
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    out = {"docs": args.docs, "layers": args.layers, "width": args.width, "batch": args.batch,
           "torch_threads": torch.get_num_threads()}
    for name, make in (("gattn", lambda: harness.GattnLM(workdir=str(hf), batch_size=args.batch, max_length=1024)),
                       ("hf", lambda: HFLM(pretrained=str(hf), dtype="float32", batch_size=args.batch, max_length=1024,
                                           device="cpu"))):
        start = time.perf_counter()
        model = make()
        load = time.perf_counter() - start
        for attempt in ("cold", "warm"):
            n, seconds = run(model, manager)
            seconds += load if attempt == "cold" else 0.0
            out[f"{name}_{attempt}"] = {"requests": n, "seconds": round(seconds, 2), "requests_per_s": round(n / seconds, 1)}
    for attempt in ("cold", "warm"):
        out[f"ratio_{attempt}"] = round(out[f"gattn_{attempt}"]["requests_per_s"] / out[f"hf_{attempt}"]["requests_per_s"], 2)
    out["target"] = ">= 2x the hf backend (issue 30)"
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
