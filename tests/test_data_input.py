"""Bad input text is refused with one line naming the file and where in it (issue 19): invalid
UTF-8 (unless data.decode_errors="replace", which reports the count), binary files, a missing
folder, malformed .jsonl lines, and an empty domain."""

import json

import pytest

from gattn.config import ConfigError, DataConfig
from gattn.data import corpus


def _docs(folder, decode_errors="strict"):
    return list(corpus.documents(str(folder), 0, decode_errors))


def _held_out_file(folder):
    """Adds a document that lands in the held-out split (the split is a hash of the file name)."""
    name = next(f"held{i}.txt" for i in range(1000) if corpus.Document(f"held{i}.txt", "", "").split == "validation")
    (folder / name).write_text("held out")


def test_invalid_utf8_names_the_file_and_byte_offset(tmp_path):
    (tmp_path / "law").mkdir()
    (tmp_path / "law" / "latin1.txt").write_bytes("Art. 1\nLe café.\n".encode("latin-1"))
    with pytest.raises(corpus.DataError) as e:
        _docs(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'law' / 'latin1.txt'}: not valid UTF-8: byte 0xe9 "
                                   "at byte offset 13 (line 2)")
    assert "data.decode_errors=replace" in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ConfigError)  # the entry points print it as one line, exit 2


def test_replace_decodes_bad_bytes_and_reports_the_count(tmp_path, capsys):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 \xff\xfe ok")
    (tmp_path / "b.txt").write_text("clean \ufffd already")  # a real U+FFFD is not counted
    _held_out_file(tmp_path)
    docs = {d.id: d for d in _docs(tmp_path, "replace")}
    assert docs["a.txt"].text == "caf\ufffd \ufffd\ufffd ok" and docs["a.txt"].replaced_bytes == 3
    assert docs["b.txt"].replaced_bytes == 0
    corpus.fingerprint(str(tmp_path), 0, "replace")
    assert "replaced 3 invalid UTF-8 bytes with U+FFFD in 1 documents" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="decode_errors"):
        DataConfig(decode_errors="ignore")


@pytest.mark.parametrize("decode_errors", ["strict", "replace"])
def test_binary_files_are_refused(tmp_path, decode_errors):
    (tmp_path / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(corpus.DataError, match=r"image.txt: a NUL byte at byte offset 8: a binary file"):
        _docs(tmp_path, decode_errors)


def test_a_missing_folder_or_a_file_is_named_as_such(tmp_path):
    with pytest.raises(corpus.DataError, match=r"data.source='.*nope': no such folder"):
        _docs(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(corpus.DataError, match=r"data.source='.*notes.txt': a file, not a folder"):
        _docs(tmp_path / "notes.txt")


@pytest.mark.parametrize("line, problem", [
    ('{"text": "b",}', r"b.jsonl:3: not valid JSON \(Expecting property name .* at column 14\)"),
    ('{"text": 3}', r"b.jsonl:3: 'text' is int 3; expected 'text' to be a string"),
    ('{"text": "x", "domain": ["a"]}', r"b.jsonl:3: 'domain' is list \['a'\]; expected 'domain' to be a string"),
    ('["x"]', r"b.jsonl:3: a .jsonl line needs a 'text' field"),
])
def test_a_malformed_jsonl_line_names_the_file_and_line(tmp_path, line, problem):
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "a"}) + "\n\n" + line + "\n")
    with pytest.raises(corpus.DataError, match=problem):
        _docs(tmp_path)


def test_invalid_utf8_in_jsonl_names_the_line_and_file_offset(tmp_path):
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(corpus.DataError, match=r"b.jsonl:2: not valid UTF-8: byte 0xff at byte offset 24;"):
        _docs(tmp_path)


def test_an_empty_domain_is_an_error(tmp_path):
    with pytest.raises(ConfigError) as e:
        list(corpus.documents("embedded", 1))
    assert e.value.field == "data.code_max_bytes" and "'code' domain" in e.value.allowed
    (tmp_path / "law").mkdir()
    (tmp_path / "law" / "empty.txt").write_text("")
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(corpus.DataError, match="domain 'law' holds no text"):
        corpus.fingerprint(str(tmp_path), 0)


def test_a_domain_without_held_out_documents_is_reported(tmp_path, capsys):
    (tmp_path / "law").mkdir()
    (tmp_path / "law" / "a.txt").write_text("Article one.")  # its id hashes into the train split
    _held_out_file(tmp_path)
    assert [d.split for d in _docs(tmp_path) if d.domain == "law"] == ["train"]
    corpus.fingerprint(str(tmp_path), 0)
    assert "domain 'law' has no held-out documents (1 in all): it is not evaluated" in capsys.readouterr().err


def test_the_option_reaches_the_dataset_and_the_tokenizer_cache(tmp_path):
    from gattn.config import Config, ModelConfig
    from gattn.data import tfds_text, tokenizer

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_bytes("Le café est noir.".encode("latin-1"))
    with pytest.raises(corpus.DataError, match="none of its 1 documents is in the held-out split"):
        corpus.fingerprint(str(tmp_path / "text"), 0, "replace")  # (TFDS would fail on the empty split)
    for i in range(20):
        (tmp_path / "text" / f"b{i}.txt").write_text(f"document {i}")
    strict = Config(model=ModelConfig(vocab_size=512), data=DataConfig(source=str(tmp_path / "text")))
    with pytest.raises(corpus.DataError, match="a.txt: not valid UTF-8"):
        tfds_text.data_source(strict.data, tmp_path / "run", "train")
    with pytest.raises(corpus.DataError, match="a.txt: not valid UTF-8"):
        tokenizer.tokenizer_path(strict, tmp_path / "run")
    replace = Config(model=ModelConfig(vocab_size=512),
                     data=DataConfig(source=str(tmp_path / "text"), decode_errors="replace"))
    assert "spm-" in tokenizer.tokenizer_path(replace, tmp_path / "run").name
    texts = [ex["text"].decode() for split in ("train", "validation")
             for ex in tfds_text.data_source(replace.data, tmp_path / "run", split)]
    assert len(texts) == 21 and "Le caf\ufffd est noir." in texts


def test_train_py_prints_a_data_error_as_one_line_and_exits_2(tmp_path, capsys):
    from gattn import cli

    from conftest import entry_point

    train = entry_point("train")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"text": "ok"}\n{"text": ["not", "a", "string"]}\n')
    for source, expected in [(tmp_path / "nope", "data.source='{}': no such folder"),
                             (tmp_path / "data", "{}/a.jsonl:2: 'text' is list")]:
        argv = ["--config", "tiny", "--workdir", str(tmp_path / "run"), "--quiet", "--steps", "2",
                "--config.train.warmup_steps=1", f"--config.data.source={source}"]
        assert cli.run_cli(train.main, argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected.format(source) in err, err
