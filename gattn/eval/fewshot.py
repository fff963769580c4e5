"""Few-shot evaluation from local JSONL task files, scored by lm-evaluation-harness (the same
model class and scoring as `eval.py --lm-eval`, gattn/interop/harness.py): multiple choice by
log-likelihood (HellaSwag / MMLU / C-Eval / CMMLU style) and greedy generation scored by exact
match (GSM8K style). Each file becomes an lm-eval task (`task_config`).

A task is a JSONL file, one example per line; its kind follows from the fields:

    multiple choice  {"context": "...", "choices": ["...", "..."], "answer": 1}
    generation       {"context": "...", "answer": "...", "stop": ["\\n"]}        ("stop" optional)

k-shot prompts take k examples from the dev split, the file NAME.dev.jsonl next to NAME.jsonl
(lm-eval's sampler, a fixed seed), each written as context + gold answer + a blank line, then the
example's context. A choice or answer is appended to its context as is, so include its leading
space (" Paris"). Multiple choice reports acc (highest summed log-probability of the choice's
tokens) and acc_norm (log-probability per byte of the choice, lm-eval's); generation reports
exact_match (the output up to the first stop string or 64 tokens, at most half the run's
train.seq_len, stripped, equals the stripped answer) and,
when every answer is a number, exact_match_number (the last number in the output equals it,
commas ignored). The examples of a generation task share one "stop" list (lm-eval stops a task's
generations on one list).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def load_task(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(examples, dev examples) of a task file, checked; dev is empty without NAME.dev.jsonl."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file {path} does not exist")
    dev_path = path.with_name(path.name.removesuffix(".jsonl") + ".dev.jsonl")
    examples = _read(path)
    dev = _read(dev_path) if dev_path.is_file() else []
    kinds = {_kind(ex, path, i) for i, ex in enumerate(examples + dev)}
    if len(kinds) != 1:
        raise ValueError(f"{path}: mixes multiple-choice and generation examples")
    if kinds == {"generation"} and len({tuple(ex.get("stop", [])) for ex in examples}) > 1:
        raise ValueError(f"{path}: 'stop' differs between examples; a generation task has one list of "
                         "stop strings (split the file by its stop strings)")
    return examples, dev


def _read(path: Path) -> list[dict]:
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i + 1}: not JSON ({e})") from None
    if not out:
        raise ValueError(f"{path}: no examples")
    return out


def _kind(ex: dict, path: Path, i: int) -> str:
    where = f"{path} example {i}"
    if not isinstance(ex.get("context"), str):
        raise ValueError(f"{where}: 'context' must be a string")
    if "choices" in ex:
        choices, answer = ex["choices"], ex.get("answer")
        if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)):
            raise ValueError(f"{where}: 'choices' must be a list of >= 2 non-empty strings")
        if not (isinstance(answer, int) and 0 <= answer < len(choices)):
            raise ValueError(f"{where}: 'answer' = {answer!r}, expected the index of the right choice "
                             f"(0..{len(choices) - 1})")
        return "multiple_choice"
    if not isinstance(ex.get("answer"), str):
        raise ValueError(f"{where}: expected 'choices' + 'answer' (index) for multiple choice, or "
                         "'answer' (string) for generation")
    if not all(isinstance(s, str) and s for s in ex.get("stop", [])):
        raise ValueError(f"{where}: 'stop' must be a list of non-empty strings")
    return "generation"


def task_config(path: str | Path) -> dict:
    """The lm-eval task (a config dict for `simple_evaluate`) that scores task file `path`."""
    path = Path(path).absolute()
    examples, dev = load_task(path)
    dev_path = path.with_name(path.name.removesuffix(".jsonl") + ".dev.jsonl")
    files = {"test": str(path), **({"dev": str(dev_path)} if dev else {})}
    cfg = {"task": f"jsonl_{path.stem}", "dataset_path": "json", "dataset_name": None,
           "dataset_kwargs": {"data_files": files}, "test_split": "test", "fewshot_split": "dev" if dev else None,
           "doc_to_text": "context", "target_delimiter": "", "fewshot_delimiter": "\n\n", "metadata": {"version": 1}}
    if "choices" in examples[0]:
        return {**cfg, "output_type": "multiple_choice", "doc_to_choice": "choices", "doc_to_target": "answer",
                "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}
    strip = {"name": "strip", "filter": [{"function": "regex", "regex_pattern": r"(?s)^\s*(.*?)\s*$"},
                                         {"function": "take_first"}]}
    number = {"name": "number", "filter": [{"function": "regex", "regex_pattern": NUMBER.pattern, "group_select": -1},
                                           {"function": "take_first"}]}
    numeric = all(NUMBER.fullmatch(ex["answer"].strip()) for ex in examples)
    # The shots show each answer as written; exact match ignores the whitespace around it.
    return {**cfg, "output_type": "generate_until", "doc_to_target": "answer",
            "generation_kwargs": {"until": list(examples[0].get("stop", [])), "do_sample": False},
            "filter_list": [strip, number] if numeric else [strip],
            "metric_list": [{"metric": "exact_match",
                             "regexes_to_ignore": [r"^\s+", r"\s+$", *([","] if numeric else [])]}]}


def evaluate_tasks(lm, paths: list[str | Path], *, shots: int = 0, limit: int | None = None) -> dict:
    """{task name: result} of the task files `paths` scored through lm-eval with `lm` (an lm-eval
    model, e.g. gattn's GattnLM): kind, n, shots, acc / acc_norm / chance or exact_match
    (/ exact_match_number), and per example its log-likelihoods or output and whether it was right."""
    import lm_eval  # noqa: PLC0415
    from lm_eval.tasks import TaskManager  # noqa: PLC0415

    configs = {Path(p).stem: task_config(p) for p in paths}
    res = lm_eval.simple_evaluate(model=lm, tasks=list(configs.values()), num_fewshot=shots, limit=limit,
                                  log_samples=True, task_manager=TaskManager(include_defaults=False),
                                  verbosity="ERROR")
    out = {}
    for name, cfg in configs.items():
        metrics, samples = res["results"][cfg["task"]], res["samples"][cfg["task"]]
        base = {"task": str(Path(cfg["dataset_kwargs"]["data_files"]["test"])), "shots": shots}
        if cfg["output_type"] == "multiple_choice":
            samples = sorted(samples, key=lambda s: s["doc_id"])
            out[name] = {**base, "kind": "multiple_choice", "n": len(samples), "acc": float(metrics["acc,none"]),
                         "acc_norm": float(metrics["acc_norm,none"]),
                         "chance": float(np.mean([1 / len(s["doc"]["choices"]) for s in samples])),
                         "examples": [{"loglik": [float(r[0][0]) for r in s["resps"]], "correct": bool(s["acc"])}
                                      for s in samples]}
            continue
        strip = sorted((s for s in samples if s["filter"] == "strip"), key=lambda s: s["doc_id"])
        out[name] = {**base, "kind": "generation", "n": len(strip),
                     "exact_match": float(metrics["exact_match,strip"]),
                     **({"exact_match_number": float(metrics["exact_match,number"])}
                        if "exact_match,number" in metrics else {}),
                     "examples": [{"output": s["filtered_resps"][0], "correct": bool(s["exact_match"])} for s in strip]}
    return out
