"""lm-evaluation-harness over gattn (gattn/interop/harness.py, python -m gattn.lm_eval): the same
log-likelihoods, generations and metrics as lm-eval's own Hugging Face backend on a tiny Qwen3,
the paper's benchmarks from local files, packing, and several processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import lm_eval  # noqa: E402 (the test extra installs gattn[lm-eval])

from gattn.config import ConfigError  # noqa: E402
from gattn.eval import code_eval, lm_tasks  # noqa: E402
from gattn.interop import harness  # noqa: E402

TASKS = ["local_arc_easy", "local_hellaswag", "local_gsm8k", "local_mmlu_abstract_algebra", "rolling"]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def fixture_data(root: Path) -> Path:
    """A few records of each benchmark, in its Hugging Face dataset's schema (what `datasets`'
    to_json writes), under the layout gattn/eval/lm_tasks.py reads."""
    arc = [{"id": f"q{i}", "question": q, "choices": {"text": c, "label": list("ABCD")}, "answerKey": "ABCD"[a]}
           for i, (q, c, a) in enumerate([("What is the gate?", ["a sigmoid", "a tree", "a cat", "a sum"], 0),
                                          ("What scales attention?", ["input", "the gate", "the sum", "noise"], 1),
                                          ("Which is a number?", ["gate", "tree", "42", "input"], 2)])]
    for split in ("train", "validation", "test"):
        write_jsonl(root / "arc_easy" / f"{split}.jsonl", arc)
    hellaswag = [{"ind": i, "activity_label": "Gating", "ctx_a": "The attention gate", "ctx_b": "is",
                  "ctx": "The attention gate is", "endings": ["a sigmoid of the input.", "a tree.", "42.", "the answer"],
                  "label": str(i % 4), "split": "val", "split_type": "indomain", "source_id": f"s{i}"} for i in range(3)]
    for split in ("train", "validation"):
        write_jsonl(root / "hellaswag" / f"{split}.jsonl", hellaswag)
    gsm = [{"question": "What is 12 + 30?", "answer": "12 + 30 = 42\n#### 42"},
           {"question": "What is the gate?", "answer": "a sigmoid\n#### 1"}]
    for split in ("train", "test"):
        write_jsonl(root / "gsm8k" / f"{split}.jsonl", gsm)
    mmlu = [{"question": "What is the gate?", "subject": "abstract_algebra", "choices": ["a sigmoid", "a tree", "a cat", "a sum"], "answer": 0},
            {"question": "12 + 30?", "subject": "abstract_algebra", "choices": ["41", "42", "43", "44"], "answer": 1}]
    for split in ("test", "dev"):
        write_jsonl(root / "mmlu" / "abstract_algebra" / f"{split}.jsonl", mmlu)
    write_jsonl(root / "humaneval" / "test.jsonl", [
        {"task_id": "t/0", "prompt": "def add(a, b):\n", "entry_point": "add", "canonical_solution": "    return a + b\n",
         "test": "def check(f):\n    assert f(2, 3) == 5\n"}])
    return root


def task_folder(data: Path, folder: Path) -> Path:
    """The local tasks, plus a rolling-loglikelihood task over the gsm8k file (lm-eval's wikitext kind)."""
    lm_tasks.write(data, folder)
    (folder / "rolling.yaml").write_text(
        "task: rolling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data / 'gsm8k' / 'test.jsonl'}\noutput_type: loglikelihood_rolling\ntest_split: test\n"
        "doc_to_text: ''\ndoc_to_target: '{{question}} {{answer}}'\nmetric_list:\n"
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    return folder


def build_qwen3(folder: Path, text: list[str], pieces: int, std: float, **dims) -> Path:
    """A random Qwen3ForCausalLM (transformers' Qwen3Config `dims`, weights ~ N(0, std)) saved in
    `folder` with a byte-level BPE tokenizer.json of `pieces` pieces trained on `text` (eos
    '<eos>', id 0) that transformers loads as it is (PreTrainedTokenizerFast: Qwen2Tokenizer would
    replace its pre-tokenizer with Qwen's). The bench (bench/harness.py) builds its model here too."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=pieces, special_tokens=["<eos>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(eos_token_id=0, attn_implementation="eager", **dims))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny random Qwen3 (build_qwen3), the fixture benchmark files and their task folder."""
    root = tmp_path_factory.mktemp("lm_eval")
    text = ["Question: What is the gate? Answer: a sigmoid of the input.\n",
            "The attention gate is a sigmoid. 12 + 30 = 42 #### 42\n"] * 50
    build_qwen3(root / "hf", text, 300, 0.2, vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                rms_norm_eps=1e-6)
    data = fixture_data(root / "data")
    return root / "hf", data, task_folder(data, root / "tasks")


def _evaluate(model, folder, tasks=TASKS):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, tasks=tasks, num_fewshot=1, task_manager=TaskManager(include_path=str(folder), include_defaults=False),
                                   log_samples=True, gen_kwargs="max_gen_toks=12", random_seed=0, numpy_random_seed=0,
                                   torch_random_seed=0, fewshot_random_seed=0)


def _responses(results, task):
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def _metrics(results, task):
    return {k: float(v) for k, v in results["results"][task].items() if "," in k and "stderr" not in k}


def test_gattn_equals_lm_evals_hf_backend_on_a_tiny_qwen3(qwen3):
    """Every log-likelihood (multiple choice, few-shot, rolling windows) to 1e-4, the same greedy
    generations, identical metrics; the model is the Hugging Face folder itself (converted on load)."""
    from lm_eval.models.huggingface import HFLM

    hf_dir, _, folder = qwen3
    ours = _evaluate(harness.GattnLM(workdir=str(hf_dir), batch_size=4), folder)
    theirs = _evaluate(HFLM(pretrained=str(hf_dir), dtype="float32", batch_size=4, max_length=256, device="cpu"), folder)
    scored = 0
    for task in TASKS:
        a, b = _responses(ours, task), _responses(theirs, task)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b):
            if task == "local_gsm8k":
                assert x == y  # the same greedy text, cut at the same stop string
                continue
            x, y = np.asarray([r[0][0] if isinstance(r[0], list) else r[0] for r in x], float), \
                np.asarray([r[0][0] if isinstance(r[0], list) else r[0] for r in y], float)
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-4)
            scored += x.size
        assert _metrics(ours, task) == pytest.approx(_metrics(theirs, task), rel=1e-6), task
    assert scored >= 30
    assert any(len(s["resps"][0][0]) for s in ours["samples"]["local_gsm8k"])  # generations are not empty


def test_packing_fills_rows_and_keeps_every_request_exact(qwen3):
    """Requests of mixed lengths packed several to a row (segment ids, positions restarting) give
    the log-likelihood of each request run alone, and is_greedy is True where greedy decoding
    reproduces the continuation."""
    hf_dir, _, _ = qwen3
    lm = harness.GattnLM(workdir=str(hf_dir), batch_size=2)
    rng = np.random.default_rng(0)
    reqs = [(list(map(int, rng.integers(1, 300, n))), list(map(int, rng.integers(1, 300, m))))
            for n, m in [(30, 3), (12, 5), (50, 1), (7, 2), (40, 4), (25, 1), (60, 2), (9, 9)]]
    layout = harness.pack([len(c) + len(x) - 1 for c, x in reqs], harness.row_length(68, 256))
    assert len(layout) < len(reqs) and sorted(i for row in layout for i in row) == list(range(len(reqs)))
    alone = [lm.scorer.loglikelihood([r], 1)[0] for r in reqs]
    packed = lm.scorer.loglikelihood(reqs, 2)
    np.testing.assert_allclose([p[0] for p in packed], [a[0] for a in alone], atol=1e-5)
    from gattn.eval import decode

    ctx = reqs[0][0]
    toks = decode.generate(lm.scorer.model, [ctx], max_new_tokens=3)[0]  # greedy continuation
    assert lm.scorer.loglikelihood([(ctx, toks)], 1)[0][1] is True
    assert lm.scorer.loglikelihood([(ctx, toks[:-1] + [(toks[-1] + 1) % 300])], 1)[0][1] is False


def test_choices_that_share_a_context_compute_it_once_and_score_as_alone(qwen3):
    """A multiple-choice question's requests (one context, several continuations, one-token ones
    among them) are laid out as the context once and the choices after it (prefix ids): each
    log-likelihood and is_greedy equals the request run alone, with fewer tokens computed; a
    group too long for a row is cut into groups that fit."""
    from gattn.eval import decode

    hf_dir, _, _ = qwen3
    lm = harness.GattnLM(workdir=str(hf_dir), batch_size=2)
    rng = np.random.default_rng(1)
    ctx, other = (list(map(int, rng.integers(1, 300, n))) for n in (40, 25))
    greedy = decode.generate(lm.scorer.model, [ctx], max_new_tokens=3)[0]
    reqs = [(ctx, c) for c in ([5], [7, 8, 9], greedy, [11, 12], [13])] + [(other, [3, 4]), (other, [6]), ([9] * 30, [2])]
    batches = []

    def score(batch):
        batches.append(batch)
        return lm.scorer.score(batch)

    shared = lm.scorer.loglikelihood(reqs, 2, score=score)
    alone = [lm.scorer.loglikelihood([r], 1)[0] for r in reqs]
    np.testing.assert_allclose([s[0] for s in shared], [a[0] for a in alone], atol=2e-5)
    assert [s[1] for s in shared] == [a[1] for a in alone] and shared[2][1] is True and not shared[1][1]
    computed = sum(int((b.segments != 0).sum()) for b in batches)
    assert all(b.prefixes is not None for b in batches)
    assert computed == (40 + 0 + 2 + 2 + 1 + 0) + (25 + 1 + 0) + 30 < sum(len(c) + len(x) - 1 for c, x in reqs)
    items = [(i, c, x) for i, (c, x) in enumerate(reqs)]
    groups = harness.group(items, 44, share=True)
    assert max(g.length for g in groups) <= 44 and len(groups) == 4  # ctx's five choices in two groups
    assert sorted(i for g in groups for i, _ in g.members) == list(range(len(reqs)))
    assert len(harness.group(items, 256, share=False)) == len(reqs)


def test_registered_as_gattn_and_refuses_sampling(qwen3):
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    hf_dir, _, _ = qwen3
    lm = get_model("gattn").create_from_arg_string(f"workdir={hf_dir},batch_size=2,max_gen_toks=4")
    assert isinstance(lm, harness.GattnLM) and lm.rows == 2
    req = Instance("generate_until", {}, ("Question:", {"do_sample": True, "temperature": 0.7}), 0)
    with pytest.raises(Exception, match="generation_kwargs.*greedy"):
        lm.generate_until([req])


def test_a_misspelled_model_arg_is_refused_before_loading(qwen3):
    """(Before: `step` spelled stpe was dropped and the latest checkpoint scored.) lm-eval's own
    max_batch_size and device still pass."""
    from lm_eval.api.registry import get_model

    hf_dir, _, _ = qwen3
    with pytest.raises(ConfigError) as e:
        get_model("gattn").create_from_arg_string(f"workdir={hf_dir},stpe=2000", {"batch_size": 2, "device": "cpu"})
    assert (e.value.field, e.value.value) == ("--model_args", "stpe") and "step" in e.value.allowed
    lm = get_model("gattn").create_from_arg_string(f"workdir={hf_dir}", {"batch_size": 2, "max_batch_size": 4,
                                                                         "device": "cpu"})
    assert lm.rows == 2


def test_local_tasks_name_a_missing_file_and_code_runs_only_when_allowed(tmp_path, monkeypatch):
    data = fixture_data(tmp_path / "data")
    lm_tasks.check_files(["local_arc_easy", "local_gsm8k", "local_mmlu_abstract_algebra"], data)
    (data / "gsm8k" / "train.jsonl").unlink()
    with pytest.raises(Exception, match=r"--data-dir.*gsm8k/train.jsonl.*local_gsm8k"):
        lm_tasks.check_files(["local_arc_easy", "local_gsm8k"], data)
    fixture_data(data)
    with pytest.raises(Exception, match=r"mmlu/anatomy/dev.jsonl.*local_mmlu_anatomy"):
        lm_tasks.check_files(["paper_table4"], data)
    written = lm_tasks.tasks(data)
    assert len([n for n in written if n.startswith("local_mmlu_")]) == 57
    assert len([n for n in written if n.startswith("local_ceval_")]) == 52
    assert len([n for n in written if n.startswith("local_cmmlu_")]) == 67
    # HumanEval's pass@1 runs completions in a subprocess, only with the opt-in.
    monkeypatch.delenv(code_eval.ENV, raising=False)
    with pytest.raises(PermissionError, match="--allow-code-execution"):
        code_eval.pass_at_k(["assert add(2, 3) == 5"], [["def add(a, b):\n    return a + b\n"]])
    monkeypatch.setenv(code_eval.ENV, "1")
    assert code_eval.pass_at_k(["assert add(2, 3) == 5"], [["def add(a, b):\n    return a + b\n"]]) == 1.0
    assert code_eval.pass_at_k(["assert add(2, 3) == 5"], [["def add(a, b):\n    return a * b\n"]]) == 0.0
    assert not code_eval.passes("while True:\n    pass\n", timeout=1)


def test_the_command_scores_a_converted_model_and_humaneval_with_the_opt_in(qwen3, tmp_path):
    """`python -m gattn.lm_eval` is lm-eval's command line with --model gattn and --data-dir."""
    hf_dir, data, _ = qwen3
    out = subprocess.run([sys.executable, "-m", "gattn.lm_eval", "--model_args", f"workdir={hf_dir}",
                          "--tasks", "local_arc_easy,local_humaneval", "--data-dir", str(data), "--limit", "2",
                          "--gen_kwargs", "max_gen_toks=8", "--allow-code-execution",
                          "--output_path", str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "local_arc_easy" in out.stdout and "local_humaneval" in out.stdout
    assert "batch_size: 8" in out.stdout  # gattn's default rows per pass, not lm-eval's 1
    saved = list((tmp_path / "out").rglob("results_*.json"))
    assert saved and "pass_at_k,create_test" in json.loads(saved[0].read_text())["results"]["local_humaneval"]
    refused = subprocess.run([sys.executable, "-m", "gattn.lm_eval", "--model", "hf", "--model_args", "pretrained=x",
                              "--tasks", "local_arc_easy"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert refused.returncode == 2 and "--model" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


MOE_CONFIG = """
from gattn.config import Config, DataConfig, ModelConfig, MoESpec, TrainConfig

def get_config():
    return Config(
        model=ModelConfig(vocab_size=512, d_model=32, num_layers=2, q_heads=4, kv_heads=2, head_dim=8, d_ff=64,
                          moe=MoESpec(num_experts=4, top_k=2, expert_width=16) if MOE else None),
        train=TrainConfig(batch_size=4, seq_len=64, steps=3, warmup_steps=1, log_every=1, eval_every=3,
                          checkpoint_every=3),
        data=DataConfig(code_max_bytes=200_000, eval_batches=1, eval_batch_size=2))
"""


@pytest.mark.slow
def test_trained_runs_gated_and_moe_score_through_eval_py_and_two_processes_agree(tmp_path):
    """eval.py --lm-eval on gattn-trained runs (G1 elementwise; an MoE), and python -m gattn.lm_eval
    on 1 process x 4 devices and on 2 processes x 2 devices: the same responses, the same metrics."""
    data = fixture_data(tmp_path / "data")
    tasks = "local_arc_easy,local_gsm8k,local_mmlu_abstract_algebra"
    runs = {}
    for name, moe in (("gated", False), ("moe", True)):
        (tmp_path / f"{name}.py").write_text(f"MOE = {moe}\n" + MOE_CONFIG)
        train = subprocess.run([sys.executable, "train.py", "--config", str(tmp_path / f"{name}.py"), "--variant",
                                "sdpa_elementwise", "--workdir", str(tmp_path / name), "--quiet"],
                               capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert train.returncode == 0, train.stderr[-2000:]
        out = subprocess.run([sys.executable, "eval.py", "--workdir", str(tmp_path / name), "--lm-eval", tasks,
                              "--data-dir", str(data), "--shots", "1"], capture_output=True, text=True, cwd=ROOT,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[name] = json.loads((tmp_path / name / "eval" / "lm_eval.json").read_text())
        assert runs[name]["step"] == 3 and runs[name]["variant"] == "sdpa_elementwise"
        assert 0.0 <= runs[name]["results"]["local_arc_easy"]["acc,none"] <= 1.0
        assert "exact_match,strict-match" in runs[name]["results"]["local_gsm8k"]
    common = ["-m", "gattn.lm_eval", "--model_args", f"workdir={tmp_path / 'gated'}", "--tasks", tasks,
              "--data-dir", str(data), "--num_fewshot", "1", "--gen_kwargs", "max_gen_toks=8", "--log_samples"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    one = subprocess.run([sys.executable, *common, "--output_path", str(tmp_path / "one")],
                         capture_output=True, text=True, cwd=ROOT, timeout=900, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "gattn.launch", "--processes", "2", "--local-devices", "2",
                          *common, "--output_path", str(tmp_path / "two")],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    for task in tasks.split(","):
        a, b = (sorted((json.loads(x) for f in (tmp_path / d).rglob(f"samples_{task}_*.jsonl")
                        for x in f.read_text().splitlines()), key=lambda s: s["doc_id"]) for d in ("one", "two"))
        assert a and [s["resps"] for s in a] == [s["resps"] for s in b], task


def test_eval_py_lm_eval_refuses_bad_flags_before_loading_a_model(tmp_path, capsys):
    from gattn import cli

    from conftest import entry_point

    main = entry_point("eval").main

    def refused(*args):
        capsys.readouterr()
        try:
            code = cli.run_cli(main, list(map(str, args)))
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        return code, capsys.readouterr().err

    code, err = refused("--workdir", tmp_path, "--data-dir", tmp_path)
    assert code == 2 and "--lm-eval" in err
    code, err = refused("--workdir", tmp_path, "--lm-eval", "local_arc_easy", "--data-dir", tmp_path / "nope")
    assert code == 2 and "--data-dir" in err and len(err.strip().splitlines()) == 1
    code, err = refused("--workdir", tmp_path, "--lm-eval", "local_no_such_task")
    assert code == 2 and "'--lm-eval' = 'local_no_such_task'" in err and "--data-dir" in err
    fixture_data(tmp_path / "data")
    code, err = refused("--workdir", tmp_path, "--lm-eval", "paper_table4", "--data-dir", tmp_path / "data")
    assert code == 2 and "hellaswag" not in err and "local_mmlu_anatomy" in err  # (no model was needed)


def test_questions_that_share_few_shot_examples_compute_them_once(qwen3):
    """MMLU's questions repeat the same few-shot examples (its first_n sampler): contexts that
    begin with the same tokens form a family, laid out as those tokens once, then each question
    and its choices (two levels of prefix ids). Each log-likelihood equals the request run alone;
    a family too long for a row is cut, each piece with its own copy of the examples."""
    hf_dir, _, _ = qwen3
    lm = harness.GattnLM(workdir=str(hf_dir), batch_size=2)
    rng = np.random.default_rng(2)
    shots = list(map(int, rng.integers(1, 300, 40)))
    questions = [list(map(int, rng.integers(1, 300, n))) for n in (6, 9, 4)]
    reqs = [(shots + q, c) for q in questions for c in ([5], [7], [8, 9])] + [(shots[:10] + [1, 2], [3])]
    batches = []
    got = lm.scorer.loglikelihood(reqs, 2, score=lambda b: batches.append(b) or lm.scorer.score(b))
    alone = [lm.scorer.loglikelihood([r], 1)[0] for r in reqs]
    np.testing.assert_allclose([g[0] for g in got], [a[0] for a in alone], atol=2e-5)
    assert [g[1] for g in got] == [a[1] for a in alone]
    assert all(b.prefixes is not None and b.prefixes.shape[-1] == 2 for b in batches)
    computed = sum(int((b.segments != 0).sum()) for b in batches)
    assert computed == 40 + sum(len(q) + 1 for q in questions) + 12  # the examples once; [8, 9] adds one input
    items = [(i, c, x) for i, (c, x) in enumerate(reqs)]
    fams = harness.families(harness.group(items, 256, share=True), share=True)
    assert sorted(len(f.groups) for f in fams) == [1, 3] and max(len(f.prefix) for f in fams) == 40
    pieces = harness.chunk(max(fams, key=lambda f: len(f.groups)), 60)
    assert [len(f.groups) for f in pieces] == [2, 1] and pieces[0].prefix == shots and pieces[1].prefix == []
    assert all(f.length <= 60 for f in pieces)


def test_a_hybrid_scores_choices_without_sharing_their_context():
    """A Gated DeltaNet layer's recurrence cannot see a context laid out once: a hybrid refuses
    prefix ids, its choices are laid out whole, and score as alone."""
    from flax import nnx
    from test_hybrid import tiny_hybrid

    from gattn.model.transformer import Transformer

    scorer = harness.Scorer(Transformer(tiny_hybrid(), rngs=nnx.Rngs(0)), None, 64)
    assert not scorer.share
    seg, pre = np.asarray([[1] * 8 + [2] * 8]), np.asarray([[0] * 8 + [1] * 8])
    with pytest.raises(ValueError, match="prefix_ids.*Gated DeltaNet"):
        scorer.model.hidden(np.ones((1, 16), np.int32), np.arange(16)[None], seg, prefix_ids_BxSxK=pre)
    ctx = list(range(3, 23))
    reqs = [(ctx, [5]), (ctx, [7, 8, 9]), (ctx, [11, 12])]
    batches = []
    got = scorer.loglikelihood(reqs, 1, score=lambda b: batches.append(b) or scorer.score(b))  # (one shape)
    assert all(b.prefixes is None for b in batches) and len(batches) == 1
    np.testing.assert_allclose([g[0] for g in got], [scorer.loglikelihood([r], 1)[0][0] for r in reqs], atol=2e-5)


# A run as gattn trains its own: a SentencePiece tokenizer (gattn.data.tokenizer's settings), whose
# EOS decodes to '', and a tiny model trained a few seconds on these documents (each after an EOS).
SPM_DOCS = ["Question: What is the gate?\nAnswer: a sigmoid of the input.\n\nQuestion: What scales attention?\n"
            "Answer: the gate.", "The attention gate is a sigmoid of the input, and the sum of its heads is the "
            "output of the layer."]


def random_model(cfg, seed: int = 0):
    """A Transformer of `cfg`, weights ~ N(0, cfg.init_std) and norm scales 1 drawn in numpy: its
    own initializers compile a program per parameter shape (seconds on a slow CPU)."""
    import jax.numpy as jnp
    from flax import nnx

    from gattn.model.transformer import Transformer

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def draw(path, shape):
        return np.ones(shape) if path[-1] == "scale" else rng.normal(0, cfg.init_std, shape)

    return nnx.merge(graphdef, nnx.from_flat_state([(p, v.replace(jnp.asarray(draw(p, v.shape), v.dtype)))
                                                    for p, v in nnx.to_flat_state(abstract)]))


def train_briefly(model, rows: np.ndarray, steps: int):
    """`model` after `steps` Adam steps of the next-token loss on `rows` (enough to memorize them)."""
    import jax
    import optax
    from flax import nnx

    from gattn.train.loss import lm_loss

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.adam(1e-2)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: lm_loss(nnx.merge(graphdef, p, rest), rows))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = opt.init(params)
    for _ in range(steps):
        params, state = step(params, state)
    return nnx.merge(graphdef, params, rest)


@pytest.fixture(scope="module")
def spm_run():
    """The harness model of a gattn-trained run with its own SentencePiece tokenizer (SPM_DOCS)."""
    import io

    import sentencepiece as spm
    from conftest import tiny_model

    from gattn.config import Config, TrainConfig
    from gattn.data import tokenizer

    proto = io.BytesIO()
    tokenizer._train_spm(iter([line for d in SPM_DOCS for line in d.splitlines() if line] * 20), proto, 300)
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    stream = np.asarray(sum(([sp.eos_id()] + sp.encode(d) for d in SPM_DOCS), []) * 8, np.int32)
    rows = np.stack([stream[i:i + 48] for i in range(0, 16 * 7, 7)])
    cfg = Config(model=tiny_model(vocab_size=300), train=TrainConfig(seq_len=64))
    model = train_briefly(random_model(cfg.model), rows, 100)
    return harness.GattnLM(workdir="spm-run", batch_size=4, loaded=(cfg, model, sp, 0))


def test_a_sentencepiece_runs_generation_stops_at_its_eos_id_and_real_stop_strings(spm_run):
    """lm-eval adds the decoded EOS to every request's `until` (handle_stop_sequences), and a
    SentencePiece EOS decodes to '', which is in every text: an empty stop string stops nothing
    (it once stopped every row after one token); the EOS stops by its id. Each generation is
    greedy decoding (gattn.eval.decode) cut at the first real stop: a stop string, the EOS, or
    max_gen_toks."""
    from lm_eval.api.instance import Instance

    from gattn.eval import decode

    lm, until, n = spm_run, ["\n\n", "Question:"], 24
    assert lm.tok_decode(lm.eot_token_id) == ""
    contexts = ["Question: What is the gate?\nAnswer:", "The attention gate is",
                "Question: What scales attention?\nAnswer:"]
    got = lm.generate_until([Instance("generate_until", {}, (ctx, {"until": list(until), "do_sample": False,
                                                                    "max_gen_toks": n}), i)
                             for i, ctx in enumerate(contexts)])
    greedy = decode.generate(lm.scorer.model, [lm.tok_encode(ctx) for ctx in contexts], max_new_tokens=n,
                             eos_id=lm.eot_token_id)  # (stopped at the EOS only; the harness's compiled shapes)
    ends = []
    for tokens, text in zip(greedy, got):
        full = lm.tok_decode(tokens)
        cut = min([full.index(s) for s in until if s in full], default=len(full))
        assert text == full[:cut]
        ends.append("until" if cut < len(full) else "max_gen_toks" if len(tokens) == n else "eos")
    assert ends == ["until", "max_gen_toks", "eos"], (ends, got)
    assert got[0] == "a sigmoid of the input." and got[2] == "the gate.", got


def test_a_capacity_moe_scores_a_request_packed_as_alone_dropless():
    """With a capacity factor each expert keeps the first C tokens of a forward pass, so the
    requests (and padding) packed together would compete for expert slots; the harness scores
    dropless (harness.dropless, as decoding runs it): a request scores the same packed with
    others as alone, and as the dropless model's plain forward pass."""
    import dataclasses

    import jax
    from conftest import tiny_model
    from flax import nnx

    from gattn.config import MoESpec

    spec = MoESpec(num_experts=4, top_k=2, expert_width=16, capacity_factor=1.0)
    model = random_model(tiny_model(vocab_size=96, init_std=0.2, moe=spec))
    scorer = harness.Scorer(model, None, 64)
    rng = np.random.default_rng(3)
    reqs = [(list(map(int, rng.integers(1, 96, n))), list(map(int, rng.integers(1, 96, m))))
            for n, m in [(20, 4), (30, 2), (9, 3), (14, 5)]]
    packed = scorer.loglikelihood(reqs, 1)
    alone = [scorer.loglikelihood([r], 1)[0] for r in reqs]
    np.testing.assert_allclose([p[0] for p in packed], [a[0] for a in alone], rtol=0, atol=1e-5)
    ctx, cont = reqs[0]
    seq = np.asarray([ctx + cont])
    graphdef, state = nnx.split(harness.dropless(model))
    reference = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, seq[:, :-1])[0, len(ctx) - 1:]
    logp = jax.nn.log_softmax(reference, axis=-1)[np.arange(len(cont)), cont].sum()
    np.testing.assert_allclose(packed[0][0], float(logp), rtol=0, atol=1e-5)
    assert dataclasses.replace(spec, capacity_factor=None) == harness.dropless(model).cfg.moe
