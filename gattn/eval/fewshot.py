"""Few-shot evaluation from local JSONL task files: multiple choice by log-likelihood (HellaSwag /
MMLU / C-Eval / CMMLU style) and greedy generation scored by exact match (GSM8K style).

A task is a JSONL file, one example per line; its kind follows from the fields:

    multiple choice  {"context": "...", "choices": ["...", "..."], "answer": 1}
    generation       {"context": "...", "answer": "...", "stop": ["\\n"]}        ("stop" optional)

k-shot prompts take k examples from the dev split, the file NAME.dev.jsonl next to NAME.jsonl,
drawn per example with a fixed seed, each written as context + gold answer + `separator`, then
the example's context. A choice or answer is appended to its context as is, so include its leading
space (" Paris"). Multiple choice reports acc (highest summed log-probability of the choice's
tokens) and acc_norm (log-probability per byte of the choice, as lm-evaluation-harness does);
generation reports exact_match (the output up to the first stop string, stripped, equals the
stripped answer) and, when every answer is a number, exact_match_number (the last number in the
output equals it).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gattn.eval import decode

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


def gold(ex: dict) -> str:
    return ex["choices"][ex["answer"]] if "choices" in ex else ex["answer"]


def prompt(ex: dict, dev: list[dict], shots: int, seed: int, separator: str = "\n\n") -> str:
    """The k-shot prompt for `ex`: `shots` dev examples (drawn with `seed`) with their answers,
    then the example's context."""
    if shots > len(dev):
        raise ValueError(f"{shots} shots need a dev split of at least {shots} examples (NAME.dev.jsonl); "
                         f"it has {len(dev)}")
    picks = np.random.default_rng(seed).choice(len(dev), shots, replace=False) if shots else []
    return "".join(dev[i]["context"] + gold(dev[i]) + separator for i in picks) + ex["context"]


def split_tokens(tokenizer, context: str, continuation: str, bos: int | None = None) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) whose concatenation is the tokenization of the whole
    text (as lm-evaluation-harness does: tokens that merge across the boundary go to the
    continuation). `bos` (a data.bos run's BOS id) opens the context, as it opens every training
    document."""
    start = [] if bos is None else [bos]
    whole = start + tokenizer.encode(context + continuation)
    ctx = start + tokenizer.encode(context)
    n = len(ctx)
    while n and whole[:n] != ctx[:n]:
        n -= 1
    if n == len(whole):  # the continuation merged into the context's last token
        n -= 1
    return whole[:n], whole[n:]


@functools.partial(jax.jit, static_argnums=0)
def _token_logprobs(graphdef, state, tokens_BxL, segment_ids_BxL):
    """log p(token[t+1] | tokens[..t]) for every position: [B, L-1] (float32)."""
    logits = nnx.merge(graphdef, state)(tokens_BxL[:, :-1], None, segment_ids_BxL[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens_BxL[:, 1:, None], axis=-1)[..., 0]


def _last(ids: list[int], n: int, bos: int | None) -> list[int]:
    """The last `n` of `ids`, keeping a leading `bos` when it has to cut."""
    if len(ids) <= n:
        return list(ids)
    return [bos] + list(ids[len(ids) - n + 1:]) if bos is not None and ids and ids[0] == bos else list(ids[-n:])


def loglikelihood(model, requests: list[tuple[list[int], list[int]]], *, batch_size: int = 8,
                  max_len: int | None = None, bos: int | None = None) -> list[float]:
    """Sum of log p(continuation tokens | context tokens) for each (context, continuation) pair,
    batched (rows right-padded to a multiple of 32 tokens, padding has segment id 0). A pair longer
    than `max_len` loses tokens from the left of its context (after its leading `bos`, if any)."""
    graphdef, state = nnx.split(model)
    out = []
    for start in range(0, len(requests), batch_size):
        chunk = requests[start:start + batch_size]
        seqs = []
        for ctx, cont in chunk:
            if not cont:
                raise ValueError("loglikelihood: an empty continuation has no tokens to score")
            seq = list(ctx) + list(cont)
            if max_len is not None:
                seq = _last(seq, max_len, bos)
            seqs.append((seq, min(len(cont), len(seq) - 1)))
        length = decode.round_up(max(len(s) for s, _ in seqs), 32)
        tokens = np.zeros((batch_size, length), np.int32)
        segments = np.zeros((batch_size, length), np.int32)
        for row, (seq, _) in enumerate(seqs):
            tokens[row, :len(seq)], segments[row, :len(seq)] = seq, 1
        logp = np.asarray(_token_logprobs(graphdef, state, jnp.asarray(tokens), jnp.asarray(segments)))
        # Token t is predicted at index t - 1: the continuation is indices [len - n - 1, len - 1).
        out += [float(logp[row, len(seq) - n - 1: len(seq) - 1].sum()) for row, (seq, n) in enumerate(seqs)]
    return out


def multiple_choice(model, tokenizer, examples, prompts, *, batch_size=8, max_len=None, bos=None) -> dict:
    requests, owners = [], []
    for i, (ex, p) in enumerate(zip(examples, prompts)):
        for choice in ex["choices"]:
            requests.append(split_tokens(tokenizer, p, choice, bos))
            owners.append(i)
    scores = loglikelihood(model, requests, batch_size=batch_size, max_len=max_len, bos=bos)
    per_example = [[] for _ in examples]
    for i, s in zip(owners, scores):
        per_example[i].append(s)
    acc = [int(np.argmax(s) == ex["answer"]) for s, ex in zip(per_example, examples)]
    norm = [int(np.argmax(np.asarray(s) / [max(len(c.encode()), 1) for c in ex["choices"]]) == ex["answer"])
            for s, ex in zip(per_example, examples)]
    return {"kind": "multiple_choice", "n": len(examples), "acc": float(np.mean(acc)),
            "acc_norm": float(np.mean(norm)), "chance": float(np.mean([1 / len(ex["choices"]) for ex in examples])),
            "examples": [{"loglik": s, "correct": bool(a)} for s, a in zip(per_example, acc)]}


def _cut(text: str, stops: list[str]) -> str:
    cuts = [text.index(s) for s in stops if s in text]
    return text[:min(cuts)] if cuts else text


def generation(model, tokenizer, examples, prompts, *, max_new_tokens=64, batch_size=8,
               max_len=None, bos=None) -> dict:
    """Greedy decoding with the kv cache (gattn.eval.decode), stopped at eos or the first stop
    string; `bos` opens each prompt."""
    eos = tokenizer.eos_id() if tokenizer.eos_id() >= 0 else None
    # Rows of one batch share a stop rule: batch the examples by their stop strings.
    groups: dict[tuple, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(tuple(ex.get("stop", [])), []).append(i)
    outputs = [""] * len(examples)
    for stops, members in groups.items():
        stop = (lambda toks, stops=stops: any(s in tokenizer.decode(toks) for s in stops)) if stops else None
        for start in range(0, len(members), batch_size):
            rows = members[start:start + batch_size]
            ids = [([] if bos is None else [bos]) + tokenizer.encode(prompts[i]) for i in rows]
            if max_len is not None:
                ids = [_last(x, max_len - max_new_tokens, bos) for x in ids]
            for i, toks in zip(rows, decode.generate(model, ids, max_new_tokens=max_new_tokens,
                                                     eos_id=eos, stop=stop)):
                outputs[i] = _cut(tokenizer.decode(toks), list(stops))
    em = [int(o.strip() == ex["answer"].strip()) for o, ex in zip(outputs, examples)]
    result = {"kind": "generation", "n": len(examples), "exact_match": float(np.mean(em))}
    if all(NUMBER.fullmatch(ex["answer"].strip()) for ex in examples):
        last = [NUMBER.findall(o) for o in outputs]
        result["exact_match_number"] = float(np.mean(
            [bool(n) and _number(n[-1]) == _number(ex["answer"].strip()) for n, ex in zip(last, examples)]))
    result["examples"] = [{"output": o, "correct": bool(e)} for o, e in zip(outputs, em)]
    return result


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def evaluate_task(model, tokenizer, path: str | Path, *, shots: int = 0, seed: int = 0,
                  limit: int | None = None, batch_size: int = 8, max_len: int | None = None,
                  max_new_tokens: int = 64, bos: int | None = None) -> dict:
    """Scores the examples of the task file `path` (the first `limit`) with `shots`-shot prompts,
    each opened by `bos` (the BOS id of a data.bos run, which trained on documents that open with it)."""
    examples, dev = load_task(path)
    examples = examples[:limit]
    prompts = [prompt(ex, dev, shots, seed + i) for i, ex in enumerate(examples)]
    if "choices" in examples[0]:
        res = multiple_choice(model, tokenizer, examples, prompts, batch_size=batch_size, max_len=max_len,
                              bos=bos)
    else:
        res = generation(model, tokenizer, examples, prompts, max_new_tokens=max_new_tokens,
                         batch_size=batch_size, max_len=max_len, bos=bos)
    return {"task": str(path), "shots": shots, **res}
