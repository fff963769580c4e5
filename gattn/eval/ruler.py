"""A RULER-style long-context benchmark (Hsieh et al. 2024), generated locally from a seed.

The paper's Table 5 scores context extension with RULER; its tasks are synthetic, so gattn builds
them itself, with haystack text from the embedded corpus (CPython's documentation) and nothing
downloaded:

    niah_single       one "special magic number" needle in the haystack, at a stated depth
    niah_multikey     the needle among needles of other keys (distractors)
    niah_multivalue   one key with several values: all of them must be given
    niah_multiquery   several keys asked at once: all of their values must be given
    variable_tracking a chain VAR A = 12345, VAR B = VAR A, ... hidden in the haystack: name
                      every variable that holds the value
    common_words      a numbered list of words: name the ones that occur most often

Every prompt fits `length` tokens of the run's tokenizer together with its answer budget. A sample
counts as correct when the greedy output contains every expected string as a whole word (RULER's
string_match_all, all or nothing: `exact`); `partial` is the share of expected strings found.
`oracle` solves a prompt from its text alone: the test that the needles are really there.

eval.py --ruler adds `analysis.window_perplexity` at each length: a measure small models show
where their RULER scores are all zero.
"""

from __future__ import annotations

import dataclasses
import random
import re
import resource
import time
from collections import Counter
from functools import lru_cache
from typing import Callable, Sequence

from gattn.data import corpus

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking",
         "common_words")
# Tokens the model may generate per task: enough for the answer with room to spare.
ANSWER_TOKENS = {"niah_single": 16, "niah_multikey": 16, "niah_multivalue": 48,
                 "niah_multiquery": 48, "variable_tracking": 40, "common_words": 40}
NUM_VALUES = 4       # values of niah_multivalue, keys of niah_multiquery
NUM_DISTRACTORS = 3  # other keys' needles in niah_multikey
CHAIN_HOPS = 4       # variable_tracking: VAR 1 = value, then 4 more variables copy it
COMMON_WORDS, COMMON_FREQ, RARE_FREQ = 5, 6, 2  # common_words: 5 words 6 times, the rest twice

NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
              "it. I will quiz you about the numbers afterwards.\n")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NEEDLE_RE = re.compile(r"One of the special magic numbers for ([\w-]+) is: (\d+)\.")


class TooShort(ValueError):
    """A length that cannot hold a task's fixed text (instructions, needles, question) and answer."""

    def __init__(self, need: int, task: str = "", length: int = 0):
        self.need = need
        super().__init__(f"RULER task {task} needs {need} tokens before any haystack; "
                         f"length {length} is too short" if task else f"needs {need} tokens before any haystack")


@dataclasses.dataclass(frozen=True)
class Sample:
    task: str
    length: int                 # the token budget: prompt + answer
    prompt: str
    answers: tuple[str, ...]    # every string the output must contain
    max_new_tokens: int
    depth: float | None = None  # where the (first) needle sits in the haystack, 0 = start, 1 = end


@lru_cache(maxsize=1)
def haystack_sentences() -> tuple[str, ...]:
    """Sentences of the embedded documentation, in a fixed order, without digits (numbers in the
    haystack are the needles' alone)."""
    out = []
    for doc in corpus.embedded_documents(0):  # 0 bytes of code: the docs domain only
        for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.text.split())):
            if 30 <= len(s) <= 300 and s[0].isupper() and not re.search(r"\d", s):
                out.append(s)
    return tuple(out)


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Plain lower-case words of the documentation (keys and the common-words lists)."""
    words = {w for s in haystack_sentences() for w in re.findall(r"\b[a-z]{4,10}\b", s)}
    return tuple(sorted(words))


def _fit(build: Callable[[int], str], most: int, count_tokens: Callable[[str], int], budget: int) -> str:
    """build(n) for the largest n <= most whose text has at most `budget` tokens (binary search)."""
    lo, hi = 0, most
    if (need := count_tokens(build(0))) > budget:
        raise TooShort(need)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count_tokens(build(mid)) <= budget else (lo, mid - 1)
    return build(lo)


def _haystack(rng: random.Random, n: int) -> list[str]:
    """n consecutive sentences from a random starting point (wrapping around)."""
    sents = haystack_sentences()
    start = rng.randrange(len(sents))
    return [sents[(start + i) % len(sents)] for i in range(n)]


def _insert(sentences: list[str], items: list[tuple[float, str]]) -> str:
    """The sentences with each (depth, text) put between sentences at that depth."""
    out = list(sentences)
    for depth, text in sorted(items, reverse=True):  # from the end, so earlier indices hold
        out.insert(round(depth * len(sentences)), text)
    return " ".join(out)


def _key(rng: random.Random) -> str:
    words = vocabulary()
    return f"{rng.choice(words)}-{rng.choice(words)}"


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _niah(task: str, rng: random.Random, depth: float):
    """(build(n) -> prompt, answers, depth) of a needle task."""
    n_keys = {"niah_multikey": 1 + NUM_DISTRACTORS, "niah_multiquery": NUM_VALUES}.get(task, 1)
    keys = []
    while len(keys) < n_keys:
        if (k := _key(rng)) not in keys:
            keys.append(k)
    per_key = NUM_VALUES if task == "niah_multivalue" else 1
    needles = [(k, _number(rng)) for k in keys for _ in range(per_key)]
    asked = keys if task == "niah_multiquery" else keys[:1]
    answers = tuple(v for k, v in needles if k in asked)
    # The first needle at `depth`; the others (distractors, more values, more keys) anywhere.
    depths = [depth] + [rng.random() for _ in needles[1:]]
    items = [(d, NEEDLE.format(key=k, value=v)) for d, (k, v) in zip(depths, needles)]
    many = len(answers) > 1
    names = ", ".join(asked[:-1]) + f" and {asked[-1]}" if len(asked) > 1 else asked[0]
    question = (f"\nWhat are all the special magic numbers for {names} mentioned in the provided text? "
                f"The special magic numbers for {names} mentioned in the provided text are" if many else
                f"\nWhat is the special magic number for {names} mentioned in the provided text? "
                f"The special magic number for {names} mentioned in the provided text is")
    seed = rng.random()

    def build(n):
        return NIAH_INTRO + _insert(_haystack(random.Random(seed), n), items) + question

    return build, answers, depth


def _variable_tracking(rng: random.Random, depth: float):
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = []
    while len(names) < CHAIN_HOPS + 1:
        if (v := "".join(rng.choice(letters) for _ in range(5))) not in names:
            names.append(v)
    value = str(rng.randrange(10_000, 100_000))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    # The chain in order, spread from `depth` towards the end of the haystack.
    items = [(depth + (1 - depth) * i / len(chain), text) for i, text in enumerate(chain)]
    question = ("\nQuestion: Find all variables that are assigned the value "
                f"{value} in the text above. Answer: According to the chain(s) of variable assignment in "
                f"the text above, {len(names)} variables are assigned the value {value}, they are:")
    seed = rng.random()

    def build(n):
        return ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
                + _insert(_haystack(random.Random(seed), n), items) + question)

    return build, tuple(names), depth


def _common_words(rng: random.Random):
    pool = rng.sample(vocabulary(), len(vocabulary()))
    common, rare = pool[:COMMON_WORDS], pool[COMMON_WORDS:]

    def rare_word(j):  # the pool's words, then compounds of two of them: as many as a length needs
        q, r = divmod(j, len(rare))
        return rare[r] if q == 0 else rare[r] + rare[q % len(rare)]

    order_seed = rng.random()

    def build(n):  # n rare-word slots, each rare word RARE_FREQ times
        words = [w for w in common for _ in range(COMMON_FREQ)]
        words += [rare_word(i // RARE_FREQ) for i in range(n)]
        random.Random(order_seed).shuffle(words)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        return ("Below is a numbered list of words. In these words, some appear more often than others. "
                f"Memorize the ones that appear most often.\n{listing}\nQuestion: What are the "
                f"{COMMON_WORDS} most common words in the above list? Answer: The top {COMMON_WORDS} "
                "words that appear most often in the list are:")

    return build, tuple(common), None


def generate(task: str, length: int, num_samples: int, count_tokens: Callable[[str], int],
             seed: int = 0) -> list[Sample]:
    """`num_samples` samples of `task` at `length` tokens, the same for the same seed. Needle
    depths are spread evenly over the samples ((i + 0.5) / num_samples). Raises TooShort when the
    task's fixed text and answer budget do not fit `length`."""
    if task not in TASKS:
        raise ValueError(f"RULER task {task!r} is not one of {', '.join(TASKS)}")
    budget = length - ANSWER_TOKENS[task]
    samples = []
    for i in range(num_samples):
        rng = random.Random(f"{seed}/{task}/{length}/{i}")
        depth = (i + 0.5) / num_samples
        if task.startswith("niah"):
            build, answers, depth = _niah(task, rng, depth)
        elif task == "variable_tracking":
            build, answers, depth = _variable_tracking(rng, depth)
        else:
            build, answers, depth = _common_words(rng)
        most = 4 * length if task == "common_words" else length  # a sentence or list item is >= 1 token
        try:
            prompt = _fit(build, most, count_tokens, budget)
        except TooShort as e:
            raise TooShort(e.need + ANSWER_TOKENS[task], task, length) from None
        samples.append(Sample(task, length, prompt, answers, ANSWER_TOKENS[task], depth))
    return samples


def shortest(tasks: Sequence[str], count_tokens: Callable[[str], int], seed: int = 0) -> dict[str, int]:
    """The tokens each task needs before any haystack (its first sample; others differ by a few)."""
    need = {}
    for task in tasks:
        try:
            generate(task, 1, 1, count_tokens, seed)
        except TooShort as e:
            need[task] = e.need
    return need


def found(output: str, answers: Sequence[str]) -> list[bool]:
    """Whether each expected string occurs in `output` as a whole word."""
    return [re.search(rf"(?<![\w-]){re.escape(a)}(?![\w-])", output) is not None for a in answers]


def oracle(prompt: str) -> str:
    """The answer, worked out from the prompt text alone (a perfect reader of the context)."""
    if "special magic number" in prompt:
        context, _, question = prompt.rpartition("\nWhat ")
        asked = re.search(r"magic numbers? for (.+) mentioned in the provided text\?", question).group(1)
        keys = re.split(r", | and ", asked)
        return ", ".join(v for k, v in NEEDLE_RE.findall(context) if k in keys)
    if prompt.startswith("Memorize and track"):
        value = re.search(r"assigned the value (\d+) in the text above", prompt).group(1)
        holds = set()
        for name, src in re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", prompt):
            if src == value or src.removeprefix("VAR ") in holds:
                holds.add(name)
        return ", ".join(sorted(holds))
    listing = prompt.split("\n")[1]
    counts = Counter(re.findall(r"\d+\. (\w+)", listing))
    k = int(re.search(r"What are the (\d+) most common words", prompt).group(1))
    return ", ".join(w for w, _ in counts.most_common(k))


def score(samples: Sequence[Sample], outputs: Sequence[str]) -> dict:
    """{exact, partial} in percent over the samples (see the module docstring)."""
    hits = [found(o, s.answers) for s, o in zip(samples, outputs, strict=True)]
    n = max(len(hits), 1)
    return {"exact": 100.0 * sum(all(h) for h in hits) / n,
            "partial": 100.0 * sum(sum(h) / len(h) for h in hits) / n}


def peak_rss_mb() -> float:
    """The process's peak resident memory so far (MiB; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(model, tokenizer, lengths: Sequence[int], *, tasks: Sequence[str] = TASKS, num_samples: int = 8,
        seed: int = 0, batch_size: int = 4, prefill_chunk: int = 512, keep_outputs: int = 2,
        bos: int | None = None) -> dict:
    """Scores `model` on every task at every length (greedy, kv cache of `length` slots, prefill
    `prefill_chunk` tokens at a time). Per length: per-task exact / partial scores, their mean,
    seconds and the process's peak memory after it (lengths run from short to long). `bos` (a
    data.bos run's BOS id) opens each prompt and counts in its length."""
    from gattn.eval import decode  # noqa: PLC0415 (the generator above needs no JAX)

    start = [] if bos is None else [bos]

    def count(text):
        return len(start) + len(tokenizer.encode(text))

    eos = tokenizer.eos_id() if tokenizer.eos_id() >= 0 else None
    out = {"tasks": list(tasks), "lengths": sorted(lengths), "num_samples": num_samples, "seed": seed,
           "prefill_chunk": prefill_chunk, "per_length": {}}
    for length in sorted(lengths):
        t0, per_task = time.perf_counter(), {}
        for task in tasks:
            samples = generate(task, length, num_samples, count, seed)
            outputs = []
            for i in range(0, len(samples), batch_size):
                batch = samples[i:i + batch_size]
                tokens = decode.generate(model, [start + tokenizer.encode(s.prompt) for s in batch],
                                         max_new_tokens=batch[0].max_new_tokens, eos_id=eos, max_len=length,
                                         prefill_chunk=min(prefill_chunk, length))
                outputs += [tokenizer.decode(t) for t in tokens]
            per_task[task] = score(samples, outputs) | {
                "examples": [{"depth": s.depth, "answers": list(s.answers), "output": o}
                             for s, o in list(zip(samples, outputs))[:keep_outputs]]}
        out["per_length"][str(length)] = {
            "tasks": per_task,
            "exact": sum(r["exact"] for r in per_task.values()) / len(per_task),
            "partial": sum(r["partial"] for r in per_task.values()) / len(per_task),
            "seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}
    return out
