"""The RULER-style generator: deterministic, the needles really there once at their depth, the
prompts filling their length, and a perfect reader (the oracle) scoring 100%."""

import re

import pytest

from gattn.eval import ruler


def count(text):
    """A stand-in tokenizer (words and punctuation): the generator takes any token counter."""
    return len(re.findall(r"\w+|[^\w\s]", text))


@pytest.mark.parametrize("task", ruler.TASKS)
def test_same_seed_same_samples_and_prompts_fill_their_length(task):
    a = ruler.generate(task, 1024, 3, count, seed=7)
    assert a == ruler.generate(task, 1024, 3, count, seed=7)
    assert [s.prompt for s in ruler.generate(task, 1024, 3, count, seed=8)] != [s.prompt for s in a]
    assert len({s.prompt for s in a}) == 3
    for s in a:
        assert 0.9 * 1024 < count(s.prompt) + s.max_new_tokens <= 1024
        assert s.task == task and s.length == 1024 and s.answers


def _context(prompt):
    return prompt[len(ruler.NIAH_INTRO):prompt.rindex("\nWhat ")]


@pytest.mark.parametrize("length", [1024, 4096])
def test_the_needle_is_present_once_at_its_depth(length):
    samples = ruler.generate("niah_single", length, 4, count, seed=0)
    assert [s.depth for s in samples] == [0.125, 0.375, 0.625, 0.875]
    for s in samples:
        (value,) = s.answers
        context = _context(s.prompt)
        needles = ruler.NEEDLE_RE.findall(context)
        assert len(needles) == 1 and needles[0][1] == value
        assert s.prompt.count(value) == 1  # the haystack holds no digits
        at = context.index(ruler.NEEDLE.format(key=needles[0][0], value=value))
        sentences = context.count(". ") + 1
        assert at / len(context) == pytest.approx(s.depth, abs=3 / sentences + 0.02)


def test_distractors_values_and_queries():
    (mk,) = ruler.generate("niah_multikey", 2048, 1, count, seed=1)
    needles = ruler.NEEDLE_RE.findall(_context(mk.prompt))
    assert len(needles) == 1 + ruler.NUM_DISTRACTORS and len({k for k, _ in needles}) == len(needles)
    asked = re.search(r"magic number for (\S+) mentioned", mk.prompt).group(1)
    assert [v for k, v in needles if k == asked] == list(mk.answers)

    (mv,) = ruler.generate("niah_multivalue", 2048, 1, count, seed=1)
    needles = ruler.NEEDLE_RE.findall(_context(mv.prompt))
    assert len({k for k, _ in needles}) == 1 and sorted(v for _, v in needles) == sorted(mv.answers)

    (mq,) = ruler.generate("niah_multiquery", 2048, 1, count, seed=1)
    assert len(mq.answers) == ruler.NUM_VALUES and all(mq.prompt.count(v) == 1 for v in mq.answers)


def test_variable_chain_and_common_words():
    (vt,) = ruler.generate("variable_tracking", 2048, 1, count, seed=2)
    chain = re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", vt.prompt)
    assert [name for name, _ in chain] == list(vt.answers) and len(chain) == ruler.CHAIN_HOPS + 1
    assert all(src == f"VAR {prev}" for (_, src), (prev, _) in zip(chain[1:], chain))

    (cw,) = ruler.generate("common_words", 2048, 1, count, seed=2)
    words = re.findall(r"\d+\. (\w+)", cw.prompt.split("\n")[1])
    freq = {w: words.count(w) for w in set(words)}
    assert {w for w, n in freq.items() if n == ruler.COMMON_FREQ} == set(cw.answers)
    assert max(n for w, n in freq.items() if w not in cw.answers) <= ruler.RARE_FREQ


@pytest.mark.parametrize("length", [512, 2048])
def test_a_perfect_reader_scores_100_and_wrong_answers_score_0(length):
    for task in ruler.TASKS:
        samples = ruler.generate(task, length, 3, count, seed=3)
        assert ruler.score(samples, [ruler.oracle(s.prompt) for s in samples]) == {"exact": 100.0, "partial": 100.0}
        assert ruler.score(samples, ["" for _ in samples]) == {"exact": 0.0, "partial": 0.0}
    # Distractors' values, a longer number that contains the answer, and half the values.
    (mk,) = ruler.generate("niah_multikey", length, 1, count, seed=4)
    others = [v for _, v in ruler.NEEDLE_RE.findall(mk.prompt) if v not in mk.answers]
    assert ruler.score([mk], [", ".join(others)])["exact"] == 0.0
    assert ruler.score([mk], [mk.answers[0] + "9"])["exact"] == 0.0
    (mv,) = ruler.generate("niah_multivalue", length, 1, count, seed=4)
    assert ruler.score([mv], [" ".join(mv.answers[:2])]) == {"exact": 0.0, "partial": 50.0}


def test_a_length_too_short_for_the_task_is_refused():
    with pytest.raises(ruler.TooShort) as e:
        ruler.generate("niah_multiquery", 64, 1, count)
    assert e.value.need > 64
    need = ruler.shortest(ruler.TASKS, count)
    assert set(need) == set(ruler.TASKS) and need["niah_single"] < need["niah_multiquery"]
    with pytest.raises(ValueError, match="not one of"):
        ruler.generate("qa", 1024, 1, count)


def test_ruler_prompts_open_with_bos_within_their_length(monkeypatch):
    """A data.bos run's RULER prompts open with BOS, and the BOS counts in each length's budget."""
    from gattn.eval import decode

    class Words:  # `count`'s tokens as ids
        def encode(self, text):
            return [5 + len(w) for w in re.findall(r"\w+|[^\w\s]", text)]

        def decode(self, ids):
            return ""

        def eos_id(self):
            return 2

    seen = []
    monkeypatch.setattr(decode, "generate", lambda m, ids, max_new_tokens, max_len, **kw:
                        seen.extend((i, max_new_tokens, max_len) for i in ids) or [[] for _ in ids])
    ruler.run(None, Words(), [512], tasks=("niah_single", "common_words"), num_samples=2, bos=1)
    assert len(seen) == 4
    for ids, new, length in seen:
        assert ids[0] == 1 and 1 not in ids[1:] and len(ids) + new <= length
