"""Few-shot evaluation: log-likelihood scoring equals a direct computation, prompts, task checks,
and generation scored by exact match."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gattn.eval import decode
from gattn.eval import fewshot
from gattn.config import GateSpec, ModelConfig
from gattn.model.transformer import Transformer

TASKS = Path(__file__).parent / "data" / "tasks"
CFG = ModelConfig(vocab_size=128, d_model=32, num_layers=2, q_heads=4, kv_heads=2, head_dim=8, d_ff=64,
                  gate=GateSpec())


class CharTokenizer:
    """One token per ASCII character (what the scoring needs of a SentencePiece processor)."""

    def encode(self, text):
        return [ord(c) % 128 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def eos_id(self):
        return 4


DIRECT_LEN = 160


@pytest.fixture(scope="module")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


def direct_loglik(model, ctx, cont):
    """One unbatched forward pass of context + continuation, without segment ids (trailing filler to
    a fixed length changes nothing before it under causal attention, and saves recompiling)."""
    seq = list(ctx) + list(cont)
    seq = jnp.asarray([seq + [0] * (DIRECT_LEN - len(seq))])
    logp = np.asarray(jax.nn.log_softmax(model(seq)[0], axis=-1))
    return float(logp[np.arange(len(ctx) - 1, len(ctx) + len(cont) - 1), cont].sum())


def test_loglikelihood_equals_summing_token_log_probs_directly(model):
    rng = np.random.default_rng(0)
    requests = [(rng.integers(0, 128, n).tolist(), rng.integers(0, 128, m).tolist())
                for n, m in [(5, 1), (20, 7), (40, 3), (1, 12), (33, 2)]]  # lengths cross the 32-token bucket
    got = fewshot.loglikelihood(model, requests, batch_size=2)
    want = [direct_loglik(model, c, x) for c, x in requests]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # Truncation keeps the continuation and the right end of the context.
    ctx, cont = requests[2]
    assert fewshot.loglikelihood(model, [(ctx, cont)], max_len=20)[0] == pytest.approx(
        direct_loglik(model, ctx[-17:], cont), abs=1e-4)


def test_split_tokens_concatenates_to_the_whole_text():
    class Merging(CharTokenizer):  # "ab" is one token: merges across the context/choice boundary
        def encode(self, text):
            out, i = [], 0
            while i < len(text):
                out.append(200 if text[i:i + 2] == "ab" else ord(text[i]))
                i += 2 if text[i:i + 2] == "ab" else 1
            return out
    tok = Merging()
    ctx, cont = fewshot.split_tokens(tok, "xa", "bc")
    assert ctx + cont == tok.encode("xabc") and ctx == [ord("x")] and cont == [200, ord("c")]


def test_multiple_choice_scores_with_the_direct_log_likelihoods(model):
    tok = CharTokenizer()
    examples, dev = fewshot.load_task(TASKS / "python_mc.jsonl")
    examples = examples[:4]
    prompts = [fewshot.prompt(ex, dev, 1, i) for i, ex in enumerate(examples)]
    res = fewshot.multiple_choice(model, tok, examples, prompts)
    assert res["n"] == len(examples) == 4
    for ex, p, row in zip(examples, prompts, res["examples"]):
        want = [direct_loglik(model, tok.encode(p), tok.encode(c)) for c in ex["choices"]]
        np.testing.assert_allclose(row["loglik"], want, rtol=1e-4, atol=1e-4)
        assert row["correct"] == (int(np.argmax(want)) == ex["answer"])
    norm = np.mean([np.argmax(np.asarray(r["loglik"]) / [len(c) for c in ex["choices"]]) == ex["answer"]
                    for r, ex in zip(res["examples"], examples)])
    assert res["acc_norm"] == pytest.approx(norm)
    assert res["acc"] == pytest.approx(np.mean([r["correct"] for r in res["examples"]]))


def test_prompts_take_k_dev_examples_with_their_answers():
    examples, dev = fewshot.load_task(TASKS / "arith.jsonl")
    p = fewshot.prompt(examples[0], dev, 3, seed=5)
    assert p.endswith(examples[0]["context"]) and p.count("Q: ") == 4 and p.count("\n\n") == 3
    assert all(f"{d['context']}{d['answer']}\n\n" in p for d in dev if d["context"] in p)
    assert p == fewshot.prompt(examples[0], dev, 3, seed=5)  # deterministic
    with pytest.raises(ValueError, match="5 shots need a dev split"):
        fewshot.prompt(examples[0], dev, 5, seed=0)


def test_bad_task_files_name_the_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"context": "x", "choices": ["a", "b"], "answer": 2}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl example 0: 'answer' = 2, expected the index"):
        fewshot.load_task(bad)
    bad.write_text(json.dumps({"context": "x"}) + "\n")
    with pytest.raises(ValueError, match="expected 'choices'"):
        fewshot.load_task(bad)


def test_generation_exact_match_with_stop_strings(model, tmp_path):
    """Answers set to what greedy decoding produces (by the full forward pass, no cache) score 1,
    a wrong one 0; the output is cut at the first stop string."""
    tok = CharTokenizer()
    contexts = ["Q: What is 2 + 3?\nA:", "Q: 7 + 1?\nA:", "hello"]
    ref = decode.generate_without_cache(model, [tok.encode(c) for c in contexts], max_new_tokens=6,
                                        eos_id=tok.eos_id())
    texts = [tok.decode(r) for r in ref]
    stop = texts[0][2] if len(texts[0]) > 3 else None  # a character the first output contains
    rows = [{"context": contexts[0], "answer": texts[0][:texts[0].index(stop)] if stop else texts[0],
             **({"stop": [stop]} if stop else {})},
            {"context": contexts[1], "answer": texts[1]},
            {"context": contexts[2], "answer": texts[2] + "WRONG"}]
    path = tmp_path / "gen.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = fewshot.evaluate_task(model, tok, path, max_new_tokens=6)
    assert [e["correct"] for e in res["examples"]] == [True, True, False]
    assert res["exact_match"] == pytest.approx(2 / 3) and "exact_match_number" not in res


def test_a_bos_trained_model_gets_bos_before_every_prompt(model, monkeypatch):
    """With data.bos every training document opens with BOS: few-shot prompts do too (split_tokens
    before its prefix match, generation's prompt ids), and a prompt cut to max_len keeps it."""
    tok, bos = CharTokenizer(), 1
    ctx, cont = fewshot.split_tokens(tok, "xa", "bc", bos=bos)
    assert ctx == [bos, ord("x"), ord("a")] and cont == [ord("b"), ord("c")]
    examples, dev = fewshot.load_task(TASKS / "python_mc.jsonl")
    ex, p = examples[0], fewshot.prompt(examples[0], dev, 0, 0)
    res = fewshot.multiple_choice(model, tok, [ex], [p], bos=bos)
    want = [direct_loglik(model, [bos] + tok.encode(p), tok.encode(c)) for c in ex["choices"]]
    np.testing.assert_allclose(res["examples"][0]["loglik"], want, rtol=1e-4, atol=1e-4)
    long_ctx, short = [bos] + list(range(10, 50)), [7, 8]
    assert fewshot.loglikelihood(model, [(long_ctx, short)], max_len=20, bos=bos)[0] == pytest.approx(
        direct_loglik(model, [bos] + long_ctx[-17:], short), abs=1e-4)
    seen = []
    monkeypatch.setattr(fewshot.decode, "generate", lambda m, ids, **kw: seen.extend(ids) or [[] for _ in ids])
    fewshot.generation(model, tok, [{"context": "Q: 1?", "answer": "1"}] * 2, ["Q: 1?", "x" * 90],
                       max_new_tokens=4, max_len=64, bos=bos)
    assert seen[0] == [bos] + tok.encode("Q: 1?") and seen[1] == [bos] + tok.encode("x" * 59)
