"""Pretokenized shards (`python -m gattn.prepare`, gattn/data/prepare.py, gattn/data/shards.py):
a Hugging Face tokenizer.json checked against the model, long documents stored as the text path
encodes them (gattn's SentencePiece model and tokenizer.json kinds that add a "▁" at each text
they are given), the same bytes from one and from two Beam workers, training that reads the
shards without a tokenizer call and gives the same batches for any process layout, and a run
bound to its shards."""

import json
import random

import numpy as np
import pytest

from gattn.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig
from gattn.data import corpus, pipeline, prepare, record, shards
from gattn.data.tokenizer import HFTokenizer, load_tokenizer, read_tokenizer, tokenizer_path, train_tokenizer

WORDS = "the gate attention sink sparse head value query key model layer token über 漢字".split()


def hf_tokenizer(folder, vocab: int = 300):
    """A byte-level BPE tokenizer.json (Qwen's kind) with its tokenizer_config.json naming EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder / "tokenizer.json"


def text(rng, words: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice([" ", " ", "  ", "\n", ", "]) for _ in range(words))


def corpus_folder(folder):
    """Two .txt domains (one with long documents) and a .jsonl with two more, 120 documents."""
    rng = random.Random(0)
    for domain, n, words in (("law", 30, 400), ("code", 30, 40)):
        (folder / domain / "sub").mkdir(parents=True)
        for i in range(n):
            (folder / domain / ("sub" if i % 3 else ".") / f"{i}.txt").write_text(text(rng, words))
    (folder / "web.jsonl").write_text("".join(
        json.dumps({"text": text(rng, 30), **({"domain": "news"} if i % 2 else {})}) + "\n" for i in range(60)))
    return folder


MAX_CHARS = 300  # the law documents (~2.5k characters) are cut into several pieces


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The corpus, its tokenizer, and its shards written by one Beam worker."""
    root = tmp_path_factory.mktemp("prepare")
    source, tok = corpus_folder(root / "corpus"), hf_tokenizer(root / "tok")
    prepare.prepare(str(source), str(tok), str(root / "one"), workers=1, num_shards=3, max_chars=MAX_CHARS, quiet=True)
    return root, source, tok


def cfg_for(source: str, batch: int = 8, seed: int = 0, **data) -> Config:
    return Config(model=ModelConfig(vocab_size=512, d_model=32, num_layers=1, q_heads=2, kv_heads=1,
                                    head_dim=16, d_ff=64),
                  train=TrainConfig(batch_size=batch, seq_len=32, steps=10, warmup_steps=1, seed=seed),
                  data=DataConfig(source=source, eval_batches=2, eval_batch_size=2, **data))


def remade(source, tok, out, old) -> None:
    """`out` made again from the corpus with one document edited (the corpus is then restored)."""
    doc = source / "law" / "sub" / "1.txt"
    kept = doc.read_bytes()
    doc.write_text("edited " * 50)
    try:
        out.rename(old)
        prepare.prepare(str(source), str(tok), str(out), num_shards=3, max_chars=MAX_CHARS, quiet=True)
    finally:
        doc.write_bytes(kept)


def test_a_tokenizer_json_larger_than_the_model_vocabulary_is_refused_in_one_line(tmp_path):
    tok = hf_tokenizer(tmp_path, vocab=300)
    cfg = Config(model=ModelConfig(vocab_size=280), data=DataConfig(tokenizer=str(tok)))
    with pytest.raises(ConfigError) as e:
        load_tokenizer(cfg, tmp_path / "run")
    assert e.value.field == "model.vocab_size" and "300 pieces" in str(e.value) and "\n" not in str(e.value)
    assert load_tokenizer(Config(model=ModelConfig(vocab_size=300), data=cfg.data), tmp_path / "run").eos_id() == 0


LONG = "the gate attention sink sparse head value query key 12 345 über café 漢字 мир 🙂 x".split()
SPACES = [" ", " ", " ", "  ", "\n", "\n\n", "\t", " \n  ", ", ", ".\n\t", "   "]


def long_text(rng, chars: int) -> str:
    """About `chars` characters of words and varied whitespace (runs of spaces, newlines, tabs),
    starting with a word (a Metaspace tokenizer does not give back a leading space)."""
    out, n = [], 0
    while n < chars:
        out.append(rng.choice(LONG) + rng.choice(SPACES))
        n += len(out[-1])
    return "".join(out)


def metaspace_tokenizer(folder, texts, prepend: bool = False):
    """A BPE tokenizer.json that adds a "▁" at the start of each text it is given: a Metaspace
    pre-tokenizer with prepend_scheme="always" (T5's, Mistral's kind), or with `prepend` Llama 2's
    normalizers (Prepend("▁"), spaces as "▁"); its tokenizer_config.json names EOS."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if prepend:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        tok.decoder = decoders.Metaspace(prepend_scheme="always")
    lines = [line for t in texts for line in t.splitlines()]  # (no pre-tokenizer: each line is one word)
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"], show_progress=False,
                                                       initial_alphabet=sorted(set("".join(texts)) | {"▁"})))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder / "tokenizer.json"


@pytest.fixture(scope="module")
def long_made(tmp_path_factory):
    """Long documents (11k-24k characters), gattn's default tokenizer (a SentencePiece model
    trained as a run trains it) and their shards; (shards folder, corpus folder, tokenizer)."""
    root = tmp_path_factory.mktemp("long")
    rng, folder = random.Random(5), root / "corpus" / "long"
    folder.mkdir(parents=True)
    i = 0
    while i < 8 or not any(corpus.Document(f"long/{j}.txt", "long", "").split == "validation" for j in range(i)):
        (folder / f"{i}.txt").write_text(long_text(rng, rng.randint(11_000, 24_000)))
        i += 1
    model = train_tokenizer(str(root / "corpus"), 0, 400, root / "spm.model")
    prepare.prepare(str(root / "corpus"), str(model), str(root / "shards"), num_shards=2, quiet=True)
    return root / "shards", root / "corpus", model


def test_long_documents_are_stored_as_the_text_path_encodes_them(long_made):
    """The shards' tokens, as training reads them, equal the text path's (the same tokenizer
    encoding each document) token for token, and each record decodes to its document's text."""
    out, source, model = long_made
    sp = read_tokenizer(model)
    docs = list(corpus.documents(str(source), 0))
    assert len(docs) >= 8 and all(len(d.text) > 10_000 for d in docs)
    text_path = pipeline._tokenize(sp)
    expected = sorted((d.split, text_path({"text": d.text})["tokens"].tolist()) for d in docs)
    folder, from_record = shards.open_shards(f"shards:{out}"), pipeline._from_record(sp)
    records = [("train", r) for r in folder.source("train")] + [
        ("validation", r) for d in folder.held_out_domains() for r in folder.source("validation", d)]
    stored = sorted((split, from_record(r)["tokens"].tolist()) for split, r in records)
    differ = sum(a != b for a, b in zip(stored, expected))
    assert len(stored) == len(expected) and differ == 0, f"{differ} of {len(docs)} documents differ"
    assert sorted(sp.decode(shards.decode_record(r)[1].tolist()) for _, r in records) == sorted(d.text for d in docs)


@pytest.mark.parametrize("kind", ["sentencepiece", "metaspace_always", "prepend_normalizer"])
def test_a_long_document_encodes_as_the_text_path_encodes_it(long_made, tmp_path, kind):
    """prepare's encoding (the DoFn body) of long documents is the text path's, for gattn's
    SentencePiece model (also in pieces of 40 characters: cut only where no id changes) and for
    tokenizer.json files that add a "▁" at each text they are given; each decodes to the text."""
    _, source, model = long_made
    docs = [d.text for d in corpus.documents(str(source), 0)][:4]
    if kind != "sentencepiece":
        model = metaspace_tokenizer(tmp_path, docs, prepend=kind == "prepend_normalizer")
    tok = read_tokenizer(model)
    text_path = pipeline._tokenize(tok)
    for max_chars in (corpus.MAX_CHARS, 40) if kind == "sentencepiece" else (corpus.MAX_CHARS,):
        encode = prepare.Encode(str(model), 2, max_chars)
        got = [np.frombuffer(next(encode(("d", "long", t, 0)))[1][2], np.int32).tolist() for t in docs]
        differ = sum(g != text_path({"text": t})["tokens"][:-1].tolist() or g != tok.encode(t)  # (encoded whole)
                     for g, t in zip(got, docs))
        assert differ == 0, f"{differ} of {len(docs)} documents differ (max_chars={max_chars})"
        assert [tok.decode(g) for g in got] == docs


def test_one_and_two_beam_workers_write_the_same_bytes(made, capsys):
    root, source, tok = made
    prepare.prepare(str(source), str(tok), str(root / "two"), workers=2, num_shards=3, max_chars=MAX_CHARS)
    one, two = sorted(p.relative_to(root / "one") for p in (root / "one").rglob("*") if p.is_file()), \
        sorted(p.relative_to(root / "two") for p in (root / "two").rglob("*") if p.is_file())
    assert one == two and len([p for p in one if p.suffix == ".array_record"]) >= 6
    assert all((root / "one" / p).read_bytes() == (root / "two" / p).read_bytes() for p in one)
    # The summary: per domain, documents and tokens of each split, and what went to held-out.
    err = capsys.readouterr().err
    m = json.loads((root / "two" / shards.MANIFEST).read_text())
    held = m["counts"]["total"]["held_out"]["documents"]
    assert f"held out: {held} of 120 documents" in err and all(d in err for d in ("law", "code", "news", "text"))
    # The counts are the on-the-fly corpus report's: the same split rule, the same ids (the cuts
    # change no token of this tokenizer), + EOS.
    hf = HFTokenizer(tok)
    expected = corpus.count(corpus.documents(str(source), 0), lambda t: len(hf.encode(t)) + 1)
    assert m["counts"] == json.loads(json.dumps(expected))
    assert m["tokenizer_sha256"] == record.sha256(tok) and len(m["source_fingerprint"]) == 12


def test_training_reads_the_shards_with_no_tokenizer_call(made):
    root, _, tok = made

    class NoEncode(HFTokenizer):
        def encode(self, text):
            raise AssertionError("a tokenizer call while reading pretokenized shards")

    cfg = cfg_for(f"shards:{root / 'one'}")
    batch = next(pipeline.train_iterator(cfg, NoEncode(tok), root / "run"))
    assert batch["tokens"].shape == (8, 33) and (batch["tokens"] == 0).sum() > 0  # EOS (id 0) ends documents
    val = pipeline.validation_batches(cfg, NoEncode(tok), root / "run")
    manifest = json.loads((root / "one" / shards.MANIFEST).read_text())
    held = {d for d, c in manifest["counts"]["domains"].items() if c["held_out"]["documents"]}
    assert set(val) == held and len(held) >= 3 and all(len(b) == 2 for b in val.values())
    # Held-out text is each held-out document's ids + EOS, as the on-the-fly path makes them.
    hf = HFTokenizer(tok)
    text_ = pipeline.held_out_text(cfg, NoEncode(tok), root / "run")
    docs = [d for d in corpus.documents(str(made[1]), 0) if d.split == "validation"]
    for domain, ids in text_.items():
        assert len(ids) == sum(len(hf.encode(d.text)) + 1 for d in docs if d.domain == domain)


def test_any_process_layout_gives_the_same_batches_and_a_resume_is_exact(made):
    root, _, tok = made
    cfg, hf, work = cfg_for(f"shards:{root / 'one'}"), HFTokenizer(tok), root / "run"
    whole = pipeline.train_iterator(cfg, hf, work, range(8))                                    # 1 process x 8 rows
    halves = [pipeline.train_iterator(cfg, hf, work, range(p * 4, p * 4 + 4)) for p in (0, 1)]  # 2 processes x 4
    for _ in range(3):
        a, parts = next(whole), [next(h) for h in halves]
        for k in a:
            assert np.array_equal(a[k], np.concatenate([p[k] for p in parts]))
    # A checkpoint of the 2 x 4 layout (each process's rows, through JSON) resumes on 1 x 8 and back.
    state = json.loads(json.dumps({**halves[0].get_state(), **halves[1].get_state()}))
    expected = [next(whole)["tokens"] for _ in range(4)]
    resumed = pipeline.train_iterator(cfg, hf, work, range(8))
    pipeline.set_state(resumed, state)
    assert all(np.array_equal(e, next(resumed)["tokens"]) for e in expected)
    back = [pipeline.train_iterator(cfg, hf, work, range(p * 4, p * 4 + 4)) for p in (0, 1)]
    for b in back:
        pipeline.set_state(b, state)
    assert all(np.array_equal(e, np.concatenate([next(b)["tokens"] for b in back])) for e in expected)
    other = pipeline.train_iterator(cfg_for(cfg.data.source, seed=1), hf, work, range(8))
    assert not np.array_equal(next(other)["tokens"], next(pipeline.train_iterator(cfg, hf, work, range(8)))["tokens"])


def test_a_run_records_its_shards_and_a_resume_on_other_shards_is_refused(made, tmp_path):
    root, source, tok = made
    out = tmp_path / "shards"
    prepare.prepare(str(source), str(tok), str(out), num_shards=3, max_chars=MAX_CHARS, quiet=True)
    cfg, work = cfg_for(f"shards:{out}"), tmp_path / "run"
    work.mkdir()
    path = tokenizer_path(cfg, work)
    assert path == out / "tokenizer" / "tokenizer.json"
    record.write(cfg, work, path)
    rec = json.loads((work / record.RECORD).read_text())
    manifest_sha = record.sha256(out / shards.MANIFEST)
    assert rec["manifest_sha256"] == manifest_sha and rec["fingerprint"] == f"shards-{manifest_sha[:12]}"
    assert record.check_resume(cfg, work, path, False) == []            # the same shards: resumes
    # The same folder made again from other text (a document edited): another manifest.
    remade(source, tok, out, tmp_path / "old")
    with pytest.raises(ConfigError) as e:
        record.check_resume(cfg, work, tokenizer_path(cfg, work), False)
    assert e.value.field == "data.source" and rec["fingerprint"] in str(e.value) and "\n" not in str(e.value)
    assert record.check_resume(cfg, work, path, True) == [rec["fingerprint"]]  # --allow-corpus-change
    # data.tokenizer other than the shards' own is refused, naming the field.
    other = hf_tokenizer(tmp_path / "other", vocab=290)
    with pytest.raises(ConfigError) as e:
        tokenizer_path(cfg_for(f"shards:{out}", tokenizer=str(other)), work)
    assert e.value.field == "data.tokenizer"
    with pytest.raises(ConfigError, match="manifest.json"):
        tokenizer_path(cfg_for(f"shards:{tmp_path / 'none'}"), work)


def test_a_bad_document_in_a_beam_worker_is_one_line_naming_the_file(tmp_path, made):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    with pytest.raises(corpus.DataError) as e:
        prepare.prepare(str(folder), str(made[2]), str(tmp_path / "out"), quiet=True)
    assert "a.jsonl:2" in str(e.value) and "not valid JSON" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="holds files already"):
        prepare.prepare(str(made[1]), str(made[2]), str(made[0] / "one"), quiet=True)


def test_the_command_says_a_bad_source_in_one_line_and_exits_2(tmp_path, made, capsys):
    from gattn import cli

    argv = ["--source", str(tmp_path / "none"), "--tokenizer", str(made[2]), "--out", str(tmp_path / "out")]
    assert cli.run_cli(prepare.main, argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --source=") and "no such folder" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_a_negative_code_budget_or_an_out_that_is_a_file_is_one_line(tmp_path, made, capsys):
    """(Before: --code-max-bytes -1 made shards without the code domain, and nothing said so;
    --out naming a file raised NotADirectoryError.)"""
    from gattn import cli

    (tmp_path / "afile").write_text("x")
    for extra, flag in ((["--out", str(tmp_path / "out"), "--code-max-bytes", "-1"], "--code-max-bytes"),
                        (["--out", str(tmp_path / "afile")], "--out")):
        argv = ["--source", "embedded", "--tokenizer", str(made[2]), *extra]
        assert cli.run_cli(prepare.main, argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and f"'{flag}'" in err and "\n" not in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and (tmp_path / "afile").read_text() == "x"


@pytest.mark.slow  # ~90 s: three train.py runs (the data-level checks above run by default)
def test_train_py_trains_on_shards_and_refuses_a_resume_on_other_shards(made, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from conftest import run_config_file

    root, source, tok = made
    out = tmp_path / "shards"
    prepare.prepare(str(source), str(tok), str(out), num_shards=3, max_chars=MAX_CHARS, quiet=True)
    config = tmp_path / "run.py"
    config.write_text(run_config_file(steps=2, warmup_steps=1, eval_every=2, checkpoint_every=2)
                      .replace("code_max_bytes=200_000", f"source='shards:{out}'"))
    cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "train.py"), "--config", str(config),
           "--workdir", str(tmp_path / "run"), "--quiet"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    rec = json.loads((tmp_path / "run" / record.RECORD).read_text())
    assert rec["manifest_sha256"] == record.sha256(out / shards.MANIFEST)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["completed"]
    remade(source, tok, out, tmp_path / "old")
    refused = subprocess.run(cmd + ["--steps", "3"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "data.source" in refused.stderr and rec["fingerprint"] in refused.stderr
    assert "Traceback" not in refused.stderr
