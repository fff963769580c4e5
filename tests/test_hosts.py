"""What the hosts of a pod slice share, simulated on one process: process 1 with its own disk
receives process 0's tokenizer files (a Hugging Face tokenizer.json and the tokenizer_config.json
beside it, which holds its EOS and BOS)."""

import json

from etils.epath import Path as EPath

from gattn.data.tokenizer import HFTokenizer
from gattn.train import hosts, trainer


def _as_process_1(monkeypatch, sent):
    """Process 1 of 2, receiving process 0's broadcasts `sent` (bytes, in order)."""
    monkeypatch.setattr(hosts, "count", lambda: 2)
    monkeypatch.setattr(hosts, "primary", lambda: False)
    monkeypatch.setattr(hosts, "_broadcast_bytes", lambda data: sent.pop(0))


def test_a_hugging_face_tokenizer_reaches_other_hosts_with_its_config(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "a": 1, "b": 2, "<|endoftext|>": 3}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    host0, host1 = tmp_path / "host0", tmp_path / "host1"
    host0.mkdir()
    (host0 / "tokenizer.json").write_text(tok.to_str())
    (host0 / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": None}))
    sent = [(host0 / "tokenizer.json").read_bytes(), b"1", (host0 / "tokenizer_config.json").read_bytes()]
    _as_process_1(monkeypatch, sent)
    trainer.share_tokenizer(EPath(host1 / "tokenizer.json"))
    assert not sent and HFTokenizer(EPath(host1 / "tokenizer.json")).eos_id() == 3

    # Without a config on process 0, none appears elsewhere (and nothing more is broadcast).
    (host0 / "tokenizer_config.json").unlink()
    host2 = tmp_path / "host2"
    sent = [(host0 / "tokenizer.json").read_bytes(), b"0"]
    _as_process_1(monkeypatch, sent)
    trainer.share_tokenizer(EPath(host2 / "tokenizer.json"))
    assert not sent and sorted(p.name for p in host2.iterdir()) == ["tokenizer.json"]
