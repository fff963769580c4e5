"""A run keeps the tokenizer it was trained with (WORKDIR/data.json, gattn/data/record.py): a
changed corpus no longer swaps the tokenizer under a resume or an eval; a resume on changed data
is refused (unless allowed); a run directory from before the record keeps working."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from gattn import cli
from gattn.config import ConfigError
from gattn.data import record
from gattn.data.tokenizer import load_tokenizer, tokenizer_path
from gattn.train import trainer

TEXT = "the gated model trains a sink layer"


def corpus_folder(folder: Path, docs: int = 40) -> Path:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "train", "model", "token", "sink", "gate", "layer"]
    folder.mkdir()
    for i in range(docs):
        (folder / f"{i}.txt").write_text(" ".join(rng.choice(words) + rng.choice(["", "s", "ing", "ed"])
                                                  for _ in range(300)))
    return folder


def add_files(folder: Path) -> None:  # the user adds text: a tokenizer trained now would differ
    for j in range(10):
        (folder / f"new{j}.txt").write_text("zeta eta theta iota kappa lambda omicron " * 200)


def started(cfg, work: Path):
    """A run that started in `work` (as train.py does: prepare, then the record once accepted)."""
    tok, path, earlier = trainer.prepare(cfg, work, None)
    record.write(cfg, work, path, earlier, tok)
    return tok


def test_a_resume_of_another_model_is_refused_before_any_file_of_the_run_is_rewritten(tmp_path, monkeypatch):
    """(Before: the model's check came with the checkpoint's restore, after the dataset's
    preparation had written the refused vocab_size into WORKDIR/corpus_report.json.)"""
    from gattn.train import rundir

    data = corpus_folder(tmp_path / "data")
    cfg = cli.load("tiny", [f"data.source={data}", "model.vocab_size=300"])
    work = tmp_path / "run"
    started(cfg, work)
    rundir.write_config(work, cfg)
    files = {p: p.read_bytes() for p in work.rglob("*") if p.is_file()}
    assert (work / "corpus_report.json") in files
    monkeypatch.setattr(trainer.checkpoint, "saved_steps", lambda workdir: [6])  # the run has a checkpoint
    with pytest.raises(ConfigError) as e:
        trainer.prepare(cli.load("tiny", [f"data.source={data}", "model.vocab_size=400"]), work, None)
    assert (e.value.field, e.value.value) == ("model.vocab_size", 400) and "300" in e.value.allowed
    assert {p: p.read_bytes() for p in work.rglob("*") if p.is_file()} == files


def test_the_run_keeps_its_tokenizer_and_a_resume_refuses_changed_data(tmp_path, monkeypatch, capsys):
    data = corpus_folder(tmp_path / "data")
    cfg = cli.load("tiny", [f"data.source={data}", "model.vocab_size=300"])
    work = tmp_path / "run"
    ids = started(cfg, work).encode(TEXT)
    rec = json.loads((work / record.RECORD).read_text())
    assert rec["tokenizer"].startswith("tokenizer/spm-") and len(rec["tokenizer_sha256"]) == 64
    assert rec["fingerprint"] in rec["tokenizer"]

    add_files(data)
    assert load_tokenizer(cfg, work).encode(TEXT) == ids  # eval.py, studies: the run's own tokenizer
    assert "is not the data" in capsys.readouterr().err   # ... with a note
    monkeypatch.setattr(trainer.checkpoint, "saved_steps", lambda workdir: [6])  # the run has a checkpoint
    with pytest.raises(ConfigError) as e:
        trainer.prepare(cfg, work, None)
    assert e.value.field == "data.source" and "--workdir" in str(e.value) and "\n" not in str(e.value)
    assert rec["fingerprint"] in str(e.value) and record.fingerprint(cfg) in str(e.value)
    assert json.loads((work / record.RECORD).read_text()) == rec  # a refused resume writes nothing
    tok, path, earlier = trainer.prepare(cfg, work, None, allow_corpus_change=True)
    assert tok.encode(TEXT) == ids and earlier == [rec["fingerprint"]]
    assert len(list((work / "tokenizer").glob("spm-*.model"))) == 1  # none was trained for the new text

    # The recorded file, changed, is refused; a run from before the record finds its only tokenizer.
    own = work / rec["tokenizer"]
    good = own.read_bytes()
    own.write_bytes(good + b"\0")
    with pytest.raises(ConfigError, match="not the file this run was trained with"):
        load_tokenizer(cfg, work)
    own.write_bytes(good)
    (work / record.RECORD).unlink()
    assert tokenizer_path(cfg, work) == own and load_tokenizer(cfg, work).encode(TEXT) == ids
    assert "no data.json" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="data changed since this run was trained"):
        trainer.prepare(cfg, work, None)  # (judged by the fingerprint in the tokenizer's name)
    (work / "tokenizer" / "spm-0123456789ab-300.model").write_bytes(good)
    with pytest.raises(ConfigError, match="holds 2 tokenizers of other corpora"):
        load_tokenizer(cfg, work)


def test_a_run_from_before_the_record_resumes_on_the_same_data(tmp_path, monkeypatch):
    # Its tokenizer is named by the fingerprint of before (without domains): found, not retrained.
    data = corpus_folder(tmp_path / "data", docs=20)
    cfg = cli.load("tiny", [f"data.source={data}", "model.vocab_size=300"])
    work = tmp_path / "run"
    path = tokenizer_path(cfg, work, fresh=True)
    load_tokenizer(cfg, work, fresh=True)
    _, legacy = record.corpus.fingerprints(str(data), cfg.data.code_max_bytes)
    old = path.with_name(f"spm-{legacy}-300.model")
    path.rename(old)
    monkeypatch.setattr(trainer.checkpoint, "saved_steps", lambda workdir: [6])
    tok, found, earlier = trainer.prepare(cfg, work, None)
    assert found == old and earlier == [] and not path.exists()


@pytest.mark.slow
def test_train_py_refuses_to_resume_on_changed_data(tmp_path):
    from conftest import run_config_file

    data = corpus_folder(tmp_path / "data")
    config = tmp_path / "run.py"
    text = run_config_file(steps=2, warmup_steps=1, eval_every=2, checkpoint_every=2)
    config.write_text(text.replace("code_max_bytes=200_000", f"source={str(data)!r}")
                      .replace("vocab_size=512", "vocab_size=300"))
    cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "train.py"), "--config", str(config),
           "--workdir", str(tmp_path / "run"), "--quiet"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    add_files(data)
    out = subprocess.run(cmd + ["--steps", "3"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "data.source" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(cmd + ["--steps", "3", "--allow-corpus-change"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rec = json.loads((tmp_path / "run" / record.RECORD).read_text())
    assert len(rec["earlier_fingerprints"]) == 1 and rec["fingerprint"] not in rec["earlier_fingerprints"]


def test_the_corpus_report_counts_each_domain_and_split_and_is_printed_once(tmp_path, monkeypatch, capsys):
    """WORKDIR/corpus_report.json: per domain and split, the documents and tokens training reads
    (ids + EOS), equal to a direct count; printed once, when the run starts; a resume neither
    counts nor prints again. Domains: a top-level .txt is 'text', one in a folder is the first
    sub-folder's name, a .jsonl line its "domain" field (else 'text', wherever the file lies)."""
    from gattn.data import corpus

    data = corpus_folder(tmp_path / "data", docs=30)          # top-level files: domain 'text'
    (data / "law" / "deep").mkdir(parents=True)
    for i in range(12):
        (data / "law" / f"{i}.txt").write_text(f"Article {i}. The court holds the gate open. " * 40)
    (data / "law" / "deep" / "x.txt").write_text("Annex: a deeper file is still law. " * 40)
    (data / "law" / "notes.jsonl").write_text(json.dumps({"text": "a note without a domain " * 30}) + "\n")
    (data / "web.jsonl").write_text("".join(json.dumps({"text": f"page {i} " * 50, "domain": "web"}) + "\n"
                                            for i in range(10)))
    cfg = cli.load("tiny", [f"data.source={data}", "model.vocab_size=300"])
    work = tmp_path / "run"
    tok = started(cfg, work)
    err = capsys.readouterr().err
    assert err.count("corpus report") == 1, err
    report = json.loads((work / corpus.REPORT).read_text())

    docs = {d.id: d for d in corpus.documents(str(data), 0)}
    assert docs["0.txt"].domain == "text" and docs["law/deep/x.txt"].domain == "law"
    assert docs["law/notes.jsonl:0"].domain == "text" and docs["web.jsonl:0"].domain == "web"
    expected: dict = {}
    for d in docs.values():
        split = "held_out" if d.split == "validation" else "train"
        counts = expected.setdefault(d.domain, {"train": [0, 0], "held_out": [0, 0]})[split]
        counts[0] += 1
        counts[1] += len(tok.encode(d.text)) + 1          # + EOS
    assert {dom: {s: [c["documents"], c["tokens"]] for s, c in splits.items()}
            for dom, splits in report["domains"].items()} == expected
    for s in ("train", "held_out"):
        assert [report["total"][s]["documents"], report["total"][s]["tokens"]] == \
            [sum(e[s][0] for e in expected.values()), sum(e[s][1] for e in expected.values())]
    for dom, e in expected.items():  # one printed row per domain: docs and tokens of each split
        assert f"{e['train'][0]:,}" in next(line for line in err.splitlines() if line.split()[:1] == [dom])

    # A resume: the report is there; nothing is counted or printed again.
    monkeypatch.setattr(trainer.checkpoint, "saved_steps", lambda workdir: [6])
    monkeypatch.setattr(corpus, "count", lambda *a: pytest.fail("counted again on a resume"))
    trainer.prepare(cfg, work, None)
    assert "corpus report" not in capsys.readouterr().err


def hf_tokenizer(folder: Path, eos: str) -> Path:
    """A word-level tokenizer.json whose tokenizer_config.json names `eos` (ids 1 and 2 both special)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = ["alpha", "beta", "gamma", "delta", "train", "model", "token", "sink", "gate", "layer"]
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<|endoftext|>": 1, "<|im_end|>": 2,
                                      **{w: i + 3 for i, w in enumerate(words)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True), AddedToken("<|im_end|>", special=True)])
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(tok.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return folder / "tokenizer.json"


def test_a_tokenizer_json_whose_config_names_another_eos_is_refused(tmp_path):
    """A tokenizer.json's EOS and BOS come from the tokenizer_config.json beside it, which no
    sha256 covers. (Before: an edited config, or an identical tokenizer.json beside another one,
    was accepted by a resume and by shards made with the first, and every document ended with
    another id.)"""
    from gattn.data import prepare

    first = hf_tokenizer(tmp_path / "a", "<|endoftext|>")
    other = hf_tokenizer(tmp_path / "b", "<|im_end|>")  # the same tokenizer.json, another EOS
    data = corpus_folder(tmp_path / "data", docs=12)
    cfg = cli.load("tiny", [f"data.source={data}", f"data.tokenizer={first}"])
    work = tmp_path / "run"
    work.mkdir()
    record.write(cfg, work, first, tokenizer=load_tokenizer(cfg, work, fresh=True))
    rec = json.loads((work / record.RECORD).read_text())
    assert (rec["eos_id"], rec["bos_id"]) == (1, -1)
    (first.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ConfigError) as e:  # a resume, an eval
        load_tokenizer(cfg, work)
    assert e.value.field == "data.tokenizer" and "eos_id 2 (the run's: 1)" in str(e.value)
    (work / record.RECORD).write_text(json.dumps({k: v for k, v in rec.items() if k not in ("eos_id", "bos_id")}))
    assert load_tokenizer(cfg, work).eos_id() == 2  # a record written before gattn kept the ids: as it was
    (first.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))

    prepare.prepare(str(data), str(first), str(tmp_path / "shards"), num_shards=1, quiet=True)
    source = f"data.source=shards:{tmp_path / 'shards'}"
    with pytest.raises(ConfigError) as e:
        load_tokenizer(cli.load("tiny", [source, f"data.tokenizer={other}"]), tmp_path / "s1", fresh=True)
    assert e.value.field == "data.tokenizer" and "eos_id 2 (the shards': 1)" in str(e.value)
    assert "\n" not in str(e.value)
    for tokenizer in (first, ""):  # the file the shards were made with, with its config; their own copy
        assert load_tokenizer(cli.load("tiny", [source, f"data.tokenizer={tokenizer}"]), tmp_path / "s2",
                              fresh=True).eos_id() == 1
