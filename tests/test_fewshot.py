"""Few-shot task files scored through lm-eval (gattn/eval/fewshot.py with gattn's model class):
log-likelihoods equal a direct computation, k-shot prompts, task checks, generation scored by
exact match, BOS."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gattn.config import Config, DataConfig, GateSpec, ModelConfig, TrainConfig
from gattn.eval import decode, fewshot
from gattn.interop import harness
from gattn.model.transformer import Transformer

TASKS = Path(__file__).parent / "data" / "tasks"
CFG = ModelConfig(vocab_size=128, d_model=32, num_layers=2, q_heads=4, kv_heads=2, head_dim=8, d_ff=64,
                  gate=GateSpec())


class CharTokenizer:
    """One token per ASCII character (what the scoring needs of a tokenizer)."""

    def encode(self, text):
        return [ord(c) % 128 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def eos_id(self):
        return 4

    def bos_id(self):
        return 1


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


def lm(model, bos=False, seq_len=DIRECT_LEN):
    cfg = Config(model=CFG, train=dataclasses.replace(TrainConfig(), seq_len=seq_len),
                 data=dataclasses.replace(DataConfig(), bos=bos))
    return harness.GattnLM(workdir="memory", loaded=(cfg, model, CharTokenizer(), 0), batch_size=2, max_gen_toks=6)


def samples(lm_, path, shots):
    import lm_eval
    from lm_eval.tasks import TaskManager

    res = lm_eval.simple_evaluate(model=lm_, tasks=[fewshot.task_config(path)], num_fewshot=shots, log_samples=True,
                                  task_manager=TaskManager(include_defaults=False), verbosity="ERROR")
    return sorted(next(iter(res["samples"].values())), key=lambda s: s["doc_id"])


def test_multiple_choice_scores_with_the_direct_log_likelihoods(model):
    """0-shot: each choice's score is log p(choice | context) by one plain forward pass."""
    tok = CharTokenizer()
    res = fewshot.evaluate_tasks(lm(model), [TASKS / "python_mc.jsonl"])["python_mc"]
    examples, _ = fewshot.load_task(TASKS / "python_mc.jsonl")
    assert res["kind"] == "multiple_choice" and res["n"] == len(examples) and res["chance"] == pytest.approx(1 / 3)
    for ex, got in zip(examples, res["examples"]):
        ctx = ex["context"].rstrip()  # (lm-eval scores a context's trailing spaces with the continuation)
        space = ex["context"][len(ctx):]
        want = [direct_loglik(model, tok.encode(ctx), tok.encode(space + c)) for c in ex["choices"]]
        np.testing.assert_allclose(got["loglik"], want, rtol=1e-4, atol=1e-4)
        assert got["correct"] == (int(np.argmax(want)) == ex["answer"])
    assert res["acc"] == pytest.approx(np.mean([e["correct"] for e in res["examples"]]))


def test_prompts_take_k_dev_examples_with_their_answers(model):
    examples, dev = fewshot.load_task(TASKS / "arith.jsonl")
    for s in samples(lm(model), TASKS / "arith.jsonl", 3):
        prompt = s["arguments"][0][0]
        assert prompt.endswith(examples[s["doc_id"]]["context"]) and prompt.count("Q: ") == 4
        assert prompt.count("\n\n") == 3 and sum(f"{d['context']}{d['answer']}\n\n" in prompt for d in dev) == 3


def test_bad_task_files_name_the_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"context": "x", "choices": ["a", "b"], "answer": 2}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl example 0: 'answer' = 2, expected the index"):
        fewshot.load_task(bad)
    bad.write_text(json.dumps({"context": "x"}) + "\n")
    with pytest.raises(ValueError, match="expected 'choices'"):
        fewshot.load_task(bad)
    bad.write_text(json.dumps({"context": "x", "answer": "1", "stop": ["\n"]}) + "\n"
                   + json.dumps({"context": "y", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match="'stop' differs between examples"):
        fewshot.load_task(bad)


def test_generation_exact_match_with_stop_strings(model, tmp_path):
    """Answers set to what greedy decoding produces (by the full forward pass, no cache) score 1,
    a wrong one 0; the output is cut at the first stop string."""
    tok = CharTokenizer()
    contexts = ["Q: What is 2 + 3?\nA:", "Q: 7 + 1?\nA:", "hello"]
    ref = [tok.decode(r) for r in decode.generate_without_cache(model, [tok.encode(c) for c in contexts],
                                                                max_new_tokens=6, eos_id=tok.eos_id())]
    stop = next((c for c in ref[0][1:] if c.strip()), None)  # a character the first output contains
    cut = [r[:r.index(stop)] if stop and stop in r else r for r in ref]
    rows = [{"context": contexts[0], "answer": cut[0]}, {"context": contexts[1], "answer": cut[1]},
            {"context": contexts[2], "answer": cut[2] + "WRONG"}]
    path = tmp_path / "gen.jsonl"
    path.write_text("".join(json.dumps({**r, **({"stop": [stop]} if stop else {})}) + "\n" for r in rows))
    res = fewshot.evaluate_tasks(lm(model), [path])["gen"]
    assert [e["correct"] for e in res["examples"]] == [True, True, False], (ref, res["examples"])
    assert res["exact_match"] == pytest.approx(2 / 3) and "exact_match_number" not in res
    assert all(stop not in e["output"] for e in res["examples"]) if stop else True


def test_a_bos_trained_model_gets_bos_before_every_prompt(model):
    """With data.bos every training document opens with BOS: so does every few-shot prompt, and a
    prompt cut to the run's length loses tokens from its left."""
    tok = CharTokenizer()
    examples, _ = fewshot.load_task(TASKS / "python_mc.jsonl")
    res = fewshot.evaluate_tasks(lm(model, bos=True), [TASKS / "python_mc.jsonl"])["python_mc"]
    ex = examples[0]  # (no trailing space in its context)
    want = [direct_loglik(model, [1] + tok.encode(ex["context"]), tok.encode(c)) for c in ex["choices"]]
    np.testing.assert_allclose(res["examples"][0]["loglik"], want, rtol=1e-4, atol=1e-4)
    short = lm(model, bos=True, seq_len=20)
    long_ctx, cont = list(range(10, 50)), [7, 8]
    got = short.scorer.loglikelihood([([1] + long_ctx, cont)], 1)[0][0]
    assert got == pytest.approx(direct_loglik(model, (long_ctx + cont)[-21:-2], cont), abs=1e-4)
