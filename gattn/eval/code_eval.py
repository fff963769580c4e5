"""pass@k for HumanEval without the network: each completion runs with the task's tests in a new
Python subprocess with a timeout (lm-eval's humaneval uses the `evaluate` library's code_eval,
whose code is downloaded from the Hub).

It executes code a model wrote. It runs only when GATTN_ALLOW_CODE_EXECUTION=1, which
`python -m gattn.lm_eval --allow-code-execution` (or eval.py's) sets; otherwise it refuses.
lm-eval loads this file by path (the `!function code_eval.pass_at_k` of gattn's local_humaneval
task), so it imports nothing from gattn.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from math import comb

ENV = "GATTN_ALLOW_CODE_EXECUTION"
TIMEOUT_SECONDS = float(os.environ.get("GATTN_CODE_TIMEOUT", "10"))


def passes(program: str, timeout: float = TIMEOUT_SECONDS) -> bool:
    """Whether `program` exits 0 within `timeout` seconds, in a fresh interpreter in a temporary folder."""
    if os.environ.get(ENV) != "1":
        raise PermissionError(f"local_humaneval runs the model's code: pass --allow-code-execution "
                              f"(or set {ENV}=1) to allow it")
    with tempfile.TemporaryDirectory() as folder:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", program], cwd=folder, timeout=timeout,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def pass_at_k(references: list[str], predictions: list[list[str]], k: list[int] | int = 1) -> float:
    """The unbiased pass@k estimate (Chen et al. 2021) of the largest k, averaged over problems:
    `references` are test programs, `predictions` the candidate programs per problem."""
    ks = [k] if isinstance(k, int) else list(k)
    scores = []
    for test, candidates in zip(references, predictions):
        n = len(candidates)
        c = sum(passes(candidate + "\n" + test) for candidate in candidates)
        kk = min(max(ks), n)
        scores.append(1.0 if n - c < kk else 1.0 - comb(n - c, kk) / comb(n, kk))
    return sum(scores) / max(len(scores), 1)


def build_predictions(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """Each completion behind its prompt (the function's signature and docstring)."""
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs)]
