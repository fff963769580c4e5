"""The embedded corpus, the local tokenizer, the TFDS dataset and the Grain packing pipeline."""

import json

import numpy as np
import pytest
from flax import nnx

from gattn.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig
from gattn.data import corpus, pipeline, tfds_text
from gattn.data.tokenizer import EOS, load_tokenizer
from gattn.model.transformer import Transformer

CFG = Config(model=ModelConfig(vocab_size=512, d_model=32, num_layers=1, q_heads=2, kv_heads=1,
                               head_dim=16, d_ff=64),
             train=TrainConfig(batch_size=4, seq_len=32, steps=10, warmup_steps=1),
             data=DataConfig(eval_batches=2, eval_batch_size=2, code_max_bytes=300_000))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def tokenizer(workdir):
    return load_tokenizer(CFG, workdir)


def test_embedded_corpus_has_two_domains_and_stable_held_out_splits():
    docs = list(corpus.documents("embedded", 300_000))
    seen = {(d.domain, d.split) for d in docs}
    assert seen == {("docs", "train"), ("docs", "validation"), ("code", "train"), ("code", "validation")}
    assert sum(len(d.text) for d in docs if d.domain == "code") <= 300_000
    assert [d.split for d in docs] == [d.split for d in corpus.documents("embedded", 300_000)]
    assert corpus.fingerprint("embedded", 300_000) != corpus.fingerprint("embedded", 200_000)


def test_user_folder_of_txt_and_jsonl(tmp_path):
    (tmp_path / "law").mkdir()
    (tmp_path / "law" / "a.txt").write_text("Article one.")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "x = 1", "domain": "code"}) + "\n\n" +
                                      json.dumps({"text": "plain"}) + "\n")
    docs = {d.id: d for d in corpus.documents(str(tmp_path), 0)}
    assert {(d.domain, d.text) for d in docs.values()} == \
        {("law", "Article one."), ("code", "x = 1"), ("text", "plain")}
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:1: .*'text'"):
        list(corpus.documents(str(tmp_path), 0))
    (tmp_path / "law" / "empty").mkdir()
    with pytest.raises(corpus.DataError, match="data.source.*holds no .txt"):
        list(corpus.documents(str(tmp_path / "law" / "empty"), 0))


def test_fingerprint_sees_a_relabelled_domain(tmp_path):
    # The fingerprint names the TFDS build and the tokenizer cache: a .jsonl file whose documents
    # moved to another domain must get a new one, or the old build (old domains) is reused.
    lines = [{"text": f"document number {i} " * 5, "domain": "web"} for i in range(40)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    before = corpus.fingerprint(str(tmp_path), 0)
    for r in lines[:20]:
        r["domain"] = "code"
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert corpus.fingerprint(str(tmp_path), 0) != before


def test_tokenizer_round_trips_code_and_unicode_and_is_cached(workdir, tokenizer):
    text = "def f(x):\n\treturn x  # über ≥ 漢字\n\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.get_piece_size() == CFG.model.vocab_size
    cached = list((workdir / "tokenizer").glob("*.model"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    load_tokenizer(CFG, workdir)
    assert cached[0].stat().st_mtime_ns == mtime      # reused, not retrained


def test_user_tokenizer_file(workdir, tokenizer, tmp_path):  # (`tokenizer`: the one trained in workdir)
    own = next((workdir / "tokenizer").glob("*.model"))
    cfg = Config(model=CFG.model, train=CFG.train, data=DataConfig(tokenizer=str(own)))
    assert load_tokenizer(cfg, tmp_path).get_piece_size() == 512
    with pytest.raises(ConfigError) as e:
        load_tokenizer(Config(model=CFG.model, data=DataConfig(tokenizer=str(tmp_path / "no.model"))), tmp_path)
    assert e.value.field == "data.tokenizer"
    small = Config(model=ModelConfig(vocab_size=300), data=DataConfig(tokenizer=str(own)))
    with pytest.raises(ConfigError) as e:
        load_tokenizer(small, tmp_path)
    assert e.value.field == "model.vocab_size" and "512" in e.value.allowed


def test_an_empty_or_malformed_tokenizer_file_is_one_line_naming_the_field(tmp_path):
    """(Before: an empty .model read as a tokenizer of no pieces and the first id lookup crashed
    train.py and prepare with a segmentation fault; a malformed tokenizer.json raised the
    tokenizers library's bare Exception.)"""
    from gattn.data.tokenizer import read_tokenizer

    (tmp_path / "empty.model").write_bytes(b"")
    (tmp_path / "bad.json").write_text('{"model": 5}')
    for name, says in (("empty.model", "has none"), ("bad.json", "does not read as one")):
        with pytest.raises(ConfigError) as e:
            read_tokenizer(tmp_path / name)
        assert e.value.field == "data.tokenizer" and says in e.value.allowed, e.value


def test_tfds_dataset_matches_the_corpus_split(workdir):
    source = tfds_text.data_source(CFG.data, workdir, "validation")
    expected = [d for d in corpus.documents("embedded", 300_000) if d.split == "validation"]
    assert len(source) == len(expected)
    assert sorted(source[i]["text"].decode() for i in range(len(source))) == sorted(d.text for d in expected)


def test_batches_are_packed_rows_with_segments_and_positions(workdir, tokenizer):
    it = pipeline.train_iterator(CFG, tokenizer, workdir)
    for _ in range(5):
        batch = next(it)
        assert set(batch) == {"tokens", "segment_ids", "positions"}
        assert all(v.shape == (4, 33) and v.dtype == np.int32 for v in batch.values())
        for seg, pos, tok in zip(batch["segment_ids"], batch["positions"], batch["tokens"]):
            starts = np.flatnonzero(np.diff(seg) != 0) + 1
            assert seg[0] == 1 and np.all(np.diff(seg) >= 0)
            for s in starts:                     # a new document starts at position 0 ...
                if seg[s] != 0:
                    assert pos[s] == 0 and tok[s - 1] == EOS   # ... after the previous one's EOS
            inner = np.diff(seg) == 0
            assert np.all(np.diff(pos)[inner & (seg[1:] != 0)] == 1)


def test_pipeline_is_deterministic_and_its_state_resumes_exactly(workdir, tokenizer):
    a, b = pipeline.train_iterator(CFG, tokenizer, workdir), pipeline.train_iterator(CFG, tokenizer, workdir)
    first = [next(a)["tokens"] for _ in range(3)]
    assert all(np.array_equal(x, next(b)["tokens"]) for x in first)
    state = json.loads(json.dumps(a.get_state()))   # as stored in a checkpoint
    expected = [next(a)["tokens"] for _ in range(3)]
    c = pipeline.train_iterator(CFG, tokenizer, workdir)
    pipeline.set_state(c, state)
    assert all(np.array_equal(x, next(c)["tokens"]) for x in expected)
    other = Config(model=CFG.model, train=TrainConfig(batch_size=4, seq_len=32, steps=10,
                                                      warmup_steps=1, seed=1), data=CFG.data)
    d = pipeline.train_iterator(other, tokenizer, workdir)
    assert not all(np.array_equal(x, next(d)["tokens"]) for x in first)


def test_each_stream_shuffles_its_own_rows_at_any_batch_size(workdir, tokenizer):
    """data.shuffle_window is rows per stream: at a batch (8) larger than the window (4), each
    row's stream still returns every window of 4 packed rows in a shuffled order."""
    def stream_rows(window):
        cfg = Config(model=CFG.model, train=TrainConfig(batch_size=8, seq_len=32, steps=10, warmup_steps=1),
                     data=DataConfig(eval_batches=2, eval_batch_size=2, code_max_bytes=300_000,
                                     shuffle_window=window))
        it = pipeline.train_iterator(cfg, tokenizer, workdir)
        batches = [next(it)["tokens"] for _ in range(8)]            # two windows of every stream
        return [[tuple(b[r]) for b in batches] for r in range(8)]    # [stream][row]
    packed, shuffled = stream_rows(1), stream_rows(4)                # 1: packing order
    for rows, order in zip(shuffled, packed):
        for w in (0, 4):
            assert sorted(rows[w:w + 4]) == sorted(order[w:w + 4])  # the same rows, in its window
    assert sum(rows != order for rows, order in zip(shuffled, packed)) >= 6


def test_packed_documents_do_not_attend_across_boundaries(workdir, tokenizer):
    """Logits of each document inside a packed row equal the logits of that document alone."""
    # Built and run under jit: one compile per row length, not ~200 op-by-op compiles (~5 s).
    model = nnx.jit(lambda: Transformer(CFG.model, rngs=nnx.Rngs(0)))()
    forward = nnx.jit(lambda model, tokens, **kw: model(tokens, **kw))
    it = pipeline.train_iterator(CFG, tokenizer, workdir)
    row = None
    while row is None:                                # find a row holding several documents
        batch = next(it)
        for i in range(4):
            if len(set(batch["segment_ids"][i]) - {0}) >= 2:
                row = {k: v[i:i + 1, :-1] for k, v in batch.items()}
                break
    packed = forward(model, row["tokens"], positions_BxS=row["positions"], segment_ids_BxS=row["segment_ids"])
    for seg_id in set(row["segment_ids"][0]) - {0}:
        idx = np.flatnonzero(row["segment_ids"][0] == seg_id)
        alone = forward(model, row["tokens"][:, idx], positions_BxS=row["positions"][:, idx])
        np.testing.assert_allclose(packed[0, idx], alone[0], rtol=1e-4, atol=1e-4)


def test_validation_batches_per_domain(workdir, tokenizer):
    """Each domain's batches hold exactly that domain's held-out text (all of it, when it fits)."""
    big = Config(model=CFG.model, train=CFG.train,
                 data=DataConfig(eval_batches=10_000, eval_batch_size=2, code_max_bytes=300_000))
    val = pipeline.validation_batches(big, tokenizer, workdir)
    assert set(val) == {"code", "docs"}
    held_out = [d for d in corpus.documents("embedded", 300_000) if d.split == "validation"]
    for domain, batches in val.items():
        assert all(b["tokens"].shape == (2, 33) for b in batches)
        tokens = sum(int((b["segment_ids"] != 0).sum()) for b in batches)
        expected = sum(len(tokenizer.encode(d.text)) + 1 for d in held_out if d.domain == domain)
        assert tokens == expected          # nothing dropped, nothing from another domain
    few = pipeline.validation_batches(CFG, tokenizer, workdir)
    assert all(len(b) == 2 for b in few.values())


def test_a_tokenizer_without_eos_is_refused_not_given_id_2(tmp_path):
    """Documents end with the tokenizer's own EOS; one without an EOS (a tokenizer.json whose
    tokenizer_config.json names none, or is missing) is refused: id 2 would be an ordinary token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from gattn.data.tokenizer import HFTokenizer

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "</s>": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    with pytest.raises(ConfigError, match="'data.tokenizer'.*no EOS token"):
        pipeline._tokenize(HFTokenizer(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    assert pipeline._tokenize(HFTokenizer(tmp_path / "tokenizer.json"))({"text": "a b"})["tokens"].tolist() == [1, 2, 3]


def test_special_token_text_in_a_document_is_text_not_a_special_id(tmp_path):
    """(Before: a tokenizer.json turned "</s>" or "<|endoftext|>" in a document's text into the
    EOS id in the document's middle.) Prompts (`encode`) keep special tokens' ids."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from gattn.data.tokenizer import HFTokenizer, document_encoder

    added = [AddedToken("<s>", special=True), AddedToken("</s>", special=True),
             AddedToken("<|im_end|>", special=False)]  # (the EOS, marked special nowhere)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "<|im_end|>": 5}
    unigram = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), ("\u2581a", -2.0), ("\u2581b", -2.0),
               ("\u2581", -3.0), ("<", -5.0), ("/", -5.0), ("s", -5.0), (">", -5.0), ("|", -5.0)]
    kinds = {  # the library's added-token matching, and the model's own vocabulary holding "</s>"
        "wordlevel": (models.WordLevel(words, unk_token="<unk>"), pre_tokenizers.WhitespaceSplit()),
        "bpe": (models.BPE(words, [], unk_token="<unk>", ignore_merges=True), pre_tokenizers.WhitespaceSplit()),
        "unigram": (models.Unigram(unigram, unk_id=0), pre_tokenizers.Metaspace()),
    }
    for name, (model, pre) in kinds.items():
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre
        tok.add_tokens(added)
        folder = tmp_path / name
        folder.mkdir()
        (folder / "tokenizer.json").write_text(tok.to_str())
        for eos in ("</s>", "<|im_end|>"):
            (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "bos_token": "<s>"}))
            hf = HFTokenizer(folder / "tokenizer.json")
            special = {tok.token_to_id("<s>"), tok.token_to_id("</s>"), hf.eos_id()}  # (<|im_end|>: as the EOS)
            text = "a </s> b <s> a <|im_end|> b"
            ids = pipeline._tokenize(hf, True)({"text": text})["tokens"].tolist()
            assert ids[0] == hf.bos_id() and ids[-1] == hf.eos_id() and not special & set(ids[1:-1]), (name, eos, ids)
            assert document_encoder(hf)(text) == hf.encode_document(text)
            assert set(hf.encode(text)) >= special, (name, hf.encode(text))  # prompts: unchanged
            assert hf.encode_document("a b a") == hf.encode("a b a")


def test_the_window_shuffle_permutes_each_window_and_resumes_mid_window():
    """pipeline.WindowShuffle (Grain's window shuffle with numpy's permutation): each window of
    the parent's elements comes out as a permutation of it, different windows in different
    orders, the same for the same seed; a state saved mid-window resumes the same sequence."""
    import grain

    parent = grain.MapDataset.range(100).to_iter_dataset()
    it = iter(pipeline.WindowShuffle(parent, window_size=8, seed=3))
    out = [next(it) for _ in range(13)]
    state = it.get_state()
    rest = [next(it) for _ in range(43)]
    seq = out + rest
    for w in range(7):
        assert sorted(seq[8 * w:8 * w + 8]) == list(range(8 * w, 8 * w + 8))
    assert seq[:8] != list(range(8)) and [x % 8 for x in seq[:8]] != [x % 8 for x in seq[8:16]]
    again = iter(pipeline.WindowShuffle(parent, window_size=8, seed=3))
    assert [next(again) for _ in range(56)] == seq
    resumed = iter(pipeline.WindowShuffle(parent, window_size=8, seed=3))
    resumed.set_state(state)
    assert [next(resumed) for _ in range(43)] == rest
    other = iter(pipeline.WindowShuffle(parent, window_size=8, seed=4))
    assert [next(other) for _ in range(56)] != seq


def _words_folder(folder, docs: int, words: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "train", "model", "token", "sink", "gate", "layer"]
    folder.mkdir()
    for i in range(docs):
        (folder / f"{i}.txt").write_text(" ".join(rng.choice(vocab) + rng.choice(["", "s", "ing", "ed"])
                                                  for _ in range(words)))
    return folder


def test_a_tokenizer_trained_on_little_text_for_its_pieces_warns(tmp_path, capsys):
    """Below MIN_BYTES_PER_PIECE (200) bytes of training text per piece: one warning line that
    states the rule; not above it."""
    from gattn.data.tokenizer import MIN_BYTES_PER_PIECE, train_tokenizer

    small = _words_folder(tmp_path / "small", docs=30, words=100)   # ~20 KB: ~65 bytes per piece
    large = _words_folder(tmp_path / "large", docs=40, words=400)   # ~110 KB: ~350 bytes per piece
    train_bytes = sum(len(d.text.encode()) for d in corpus.documents(str(small), 0) if d.split == "train")
    assert train_bytes < MIN_BYTES_PER_PIECE * 300
    train_tokenizer(str(small), 0, 300, tmp_path / "small.model")
    lines = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert len(lines) == 1 and lines[0].startswith("warning: trained a 300-piece tokenizer on ")
    assert f"({train_bytes / 300:.0f} bytes per piece, under {MIN_BYTES_PER_PIECE};" in lines[0]
    assert "model.vocab_size" in lines[0] and str(small) in lines[0]
    train_tokenizer(str(large), 0, 300, tmp_path / "large.model")
    assert "warning" not in capsys.readouterr().err


def test_processes_that_prepare_the_same_tokenizer_and_dataset_side_by_side_both_go_on(tmp_path, monkeypatch):
    """A study's `--part K/N` processes share one tokenizer and one prepared dataset: when another
    process finishes either one first, this one keeps the first and goes on (it raised
    FileExistsError on the tokenizer, and TFDS's rename of its dataset failed)."""
    from etils import epath

    from gattn.data import tokenizer as tok

    folder = _words_folder(tmp_path / "text", docs=40, words=400)
    path = epath.Path(tmp_path / "tok" / "spm.model")
    real_train = tok._train_spm

    def other_process_first(lines, model, vocab_size):
        real_train(lines, model, vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"the other process's model")

    monkeypatch.setattr(tok, "_train_spm", other_process_first)
    assert tok.train_tokenizer(str(folder), 0, 300, path) == path
    assert path.read_bytes() == b"the other process's model"          # the first one stands
    assert [p.name for p in path.parent.iterdir()] == ["spm.model"]  # and no temporary is left

    data = DataConfig(source=str(folder), code_max_bytes=1000)
    real_prepare, raced = tfds_text.GattnText._download_and_prepare, []

    def other_process_prepares_meanwhile(self, *args, **kwargs):
        if not raced:
            raced.append(True)
            tfds_text.prepare(data, epath.Path(tmp_path))  # the other process, start to end
        return real_prepare(self, *args, **kwargs)

    monkeypatch.setattr(tfds_text.GattnText, "_download_and_prepare", other_process_prepares_meanwhile)
    name = tfds_text.prepare(data, epath.Path(tmp_path))
    assert raced
    source = tfds_text.data_source(data, epath.Path(tmp_path), "validation")
    expected = [d for d in corpus.documents(str(folder), 1000) if d.split == "validation"]
    assert name == corpus.fingerprint(str(folder), 1000) and len(source) == len(expected) > 0
