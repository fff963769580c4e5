"""python -m gattn.generate: a Hugging Face folder's greedy text is transformers' own; sampling is
reproducible per seed; a batch of prompts gives what each prompt gives alone; every tokenizer gattn
reads is a `Tokenizer`."""

import io
import json

import pytest
import sentencepiece as spm

from gattn import generate
from gattn.config import ConfigError
from gattn.data import backcopy, tokenizer
from gattn.interop import runs

from test_lm_eval import build_qwen3

PROMPTS = ["The attention gate is", "Question: What is the gate? Answer:", "12 + 30 ="]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny random Qwen3 folder (transformers' own files, eos id 0) and what runs.load makes of it."""
    text = ["Question: What is the gate? Answer: a sigmoid of the input.\n",
            "The attention gate is a sigmoid. 12 + 30 = 42\n"] * 50
    folder = build_qwen3(tmp_path_factory.mktemp("generate") / "hf", text, 300, 0.2, vocab_size=320,
                         hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
    return folder, runs.load(folder)


def run(capsys, *argv) -> list[dict]:
    """python -m gattn.generate ARGV --json, in this process: its rows."""
    assert generate.main([*map(str, argv), "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_greedy_text_of_a_hugging_face_folder_is_transformers_own(qwen3, capsys):
    """The done-when of `python -m gattn.generate`: three prompts of different lengths in one
    batch give, each, the tokens and text of transformers' model.generate(do_sample=False) on
    that prompt alone, cut at its EOS."""
    import torch
    import transformers

    folder, _ = qwen3
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    rows = run(capsys, "--workdir", folder, "--max-tokens", MAX_TOKENS, *PROMPTS)
    assert [r["prompt"] for r in rows] == PROMPTS
    lengths = set()
    for row in rows:
        ids = hf_tok(row["prompt"], add_special_tokens=False)["input_ids"]
        lengths.add(len(ids))
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=0, pad_token_id=0)
        want = out[0, len(ids):].tolist()
        want = want[:want.index(0)] if 0 in want else want
        assert row["tokens"] == want and len(want) > 0
        assert row["completion"] == hf_tok.decode(want)
    assert len(lengths) == len(PROMPTS)  # the batch really is left-padded
    assert len({tuple(r["tokens"]) for r in rows}) == len(PROMPTS)


def test_plain_output_is_each_continuation(qwen3, capsys):
    """Without --json: one prompt's continuation as it is; several, each after a `==> prompt <==` line."""
    folder, (cfg, model, tok, _) = qwen3
    want = [r["completion"] for r in generate.complete(cfg, model, tok, PROMPTS, max_tokens=MAX_TOKENS)]
    assert generate.main(["--workdir", str(folder), "--max-tokens", str(MAX_TOKENS), *PROMPTS]) == 0
    assert capsys.readouterr().out == "".join(f"==> {p} <==\n{c}\n\n" for p, c in zip(PROMPTS, want))


def test_a_prompts_file_gives_what_each_prompt_gives_alone(qwen3, tmp_path, capsys):
    """A .jsonl (one prompt of two lines) after an argument: prompts of different lengths in one
    batch, each row what that prompt generates alone; a plain file is one prompt per line."""
    folder, (cfg, model, tok, _) = qwen3
    prompts = [PROMPTS[1], "The gate\nis", PROMPTS[2]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts[1:]))
    rows = run(capsys, "--workdir", folder, "--max-tokens", MAX_TOKENS, prompts[0], "--prompts-file", tmp_path / "p.jsonl")
    assert len({len(tok.encode(p)) for p in prompts}) == len(prompts)
    assert rows == [generate.complete(cfg, model, tok, [p], max_tokens=MAX_TOKENS)[0] for p in prompts]
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS[:2]) + "\n\n")
    assert generate.read_prompts(tmp_path / "p.txt") == PROMPTS[:2]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        generate.read_prompts(tmp_path / "bad.jsonl")


def test_sampling_is_reproducible_per_seed_and_a_tiny_top_p_is_greedy(qwen3):
    _, (cfg, model, tok, _) = qwen3

    def tokens(**kw):
        return [r["tokens"] for r in generate.complete(cfg, model, tok, PROMPTS, max_tokens=MAX_TOKENS, **kw)]

    drawn = tokens(temperature=1.0, seed=3)
    assert drawn == tokens(temperature=1.0, seed=3)
    assert drawn != tokens(temperature=1.0, seed=4)
    greedy = tokens()
    assert drawn != greedy
    assert tokens(temperature=1.0, top_p=1e-6, seed=3) == greedy


@pytest.mark.parametrize("flags, field", [
    (["--temperature", "-1"], "--temperature"), (["--temperature", "nan"], "--temperature"),
    # (before: accepted; logits / 1e-39 overflow to inf and the lowest ids were drawn)
    (["--temperature", "1e-39"], "--temperature"),
    (["--temperature", "1", "--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "--top-p"),
    (["--max-tokens", "0"], "--max-tokens")])
def test_bad_sampling_flags_are_one_config_error_before_the_model_loads(tmp_path, flags, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        generate.main(["--workdir", str(tmp_path / "absent"), "hello", *flags])
    with pytest.raises(ConfigError, match="'prompts'"):
        generate.main(["--workdir", str(tmp_path / "absent")])


def test_every_tokenizer_gattn_reads_is_a_tokenizer(qwen3):
    folder, _ = qwen3
    model = io.BytesIO()
    tokenizer._train_spm(iter(["the attention gate is a sigmoid of the input"] * 20), model, 280)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    hf = tokenizer.HFTokenizer(folder / "tokenizer.json")
    chars = backcopy.Tokenizer(" ea")
    for tok in (sp, hf, chars):
        assert isinstance(tok, tokenizer.Tokenizer), type(tok)
    assert (sp.bos_id(), hf.bos_id(), hf.eos_id(), chars.bos_id(), chars.eos_id()) == (tokenizer.BOS, -1, 0, backcopy.START, -1)
    assert chars.decode([chars.bos_id()] + chars.encode("ea e")) == "^ea e"
    no_bos = type("NoBos", (), {k: getattr(backcopy.Tokenizer, k) for k in ("encode", "decode", "eos_id", "get_piece_size")})
    assert not isinstance(no_bos(), tokenizer.Tokenizer)


def test_prompts_open_with_bos_where_the_runs_documents_do():
    """data.bos runs and Bigram-Backcopy (whose every sequence opens with <s>) get BOS first; an
    empty prompt is BOS, else EOS, else refused."""
    from types import SimpleNamespace

    def cfg(bos, source="embedded"):
        return SimpleNamespace(data=SimpleNamespace(bos=bos, source=source))

    chars = backcopy.Tokenizer(" ea")
    assert generate.opening(cfg(False, "bigram_backcopy"), chars) == backcopy.START
    assert generate.encode(chars, ["ea", ""], backcopy.START) == [[backcopy.START, 2, 3], [backcopy.START]]
    assert generate.opening(cfg(False), chars) is None
    no_bos = type("NoBos", (backcopy.Tokenizer,), {"bos_id": lambda self: -1})(" ea")
    assert generate.opening(cfg(True), no_bos) is None
    with pytest.raises(ConfigError, match="'prompt'"):
        generate.encode(chars, ["e", ""], None)
    with_eos = type("WithEos", (backcopy.Tokenizer,), {"eos_id": lambda self: 1})(" ea")
    assert generate.encode(with_eos, ["e", ""], None) == [[2], [1]]


def test_a_hugging_face_folder_loads_in_memory_as_its_converted_run(qwen3, tmp_path):
    """runs.load converts a Hugging Face folder in memory, writing no checkpoint, into the model
    that `convert from-hf` and loading that run give: the same config, step 0, every parameter
    identical, the same tokens; execution overrides apply (scanned layers: the same logits)."""
    import jax
    import numpy as np

    from gattn.interop import convert

    folder, (cfg, model, tok, step) = qwen3
    cfg2, model2, tok2, step2 = runs.load(convert.from_hf(folder, tmp_path / "run"))
    assert step == step2 == 0 and cfg == cfg2
    for a, b in zip(jax.tree.leaves(nnx_state(model)), jax.tree.leaves(nnx_state(model2)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert tok.encode(PROMPTS[1]) == tok2.encode(PROMPTS[1])
    scanned = runs.load(folder, overrides=["exec.scan_layers=true"])
    assert scanned[0].exec.scan_layers and not cfg.exec.scan_layers
    ids = np.asarray([tok.encode(PROMPTS[0])])
    np.testing.assert_allclose(np.asarray(scanned[1](ids)), np.asarray(model(ids)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError) as e:  # (before: --step 5 was dropped, the folder's weights used)
        runs.load(folder, 5)
    assert (e.value.field, e.value.value) == ("--step", 5)


def nnx_state(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)
