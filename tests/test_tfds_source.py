"""A TFDS dataset read by name (data.source="tfds:NAME[/CONFIG][:VERSION]", gattn/data/tfds_text.py):
a small builder prepared here (nothing downloads), then read by name alone, without its class,
through tfds.data_source and Grain, tokenized on the fly."""

import json

import numpy as np
import pytest
import tensorflow_datasets as tfds

from gattn.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig, from_dict
from gattn.data import pipeline, record, tfds_text
from gattn.data.tokenizer import load_tokenizer

from test_prepare import hf_tokenizer

ARTICLES = [f"article {i}: the gate keeps the sink away from token {i} " * (1 + i % 5) for i in range(60)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """`tiny_wiki/en:1.0.1` with splits train (50) and validation (10), features `body` and `title`,
    as ArrayRecord files; the builder is not registered, so gattn finds the dataset by its files."""
    root = tmp_path_factory.mktemp("tfds")
    with tfds.core.registered.skip_registration():
        class TinyWiki(tfds.core.GeneratorBasedBuilder):
            VERSION = tfds.core.Version("1.0.1")
            BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="en")]
            code_path = None

            def _info(self):
                return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                    {"body": tfds.features.Text(), "title": tfds.features.Text()}))

            def _split_generators(self, dl_manager):
                return {"train": self._generate_examples(0, 50), "validation": self._generate_examples(50, 60)}

            def _generate_examples(self, lo, hi):
                for i in range(lo, hi):
                    yield i, {"body": ARTICLES[i], "title": f"t{i}"}

    TinyWiki.name = "tiny_wiki"
    TinyWiki(config="en", data_dir=str(root), file_format="array_record").download_and_prepare()
    return root


def config(data_dir, tokenizer_file, **data) -> Config:
    fields = {"source": "tfds:tiny_wiki/en:1.0.1", "tfds_data_dir": str(data_dir), "text_feature": "body",
              "tokenizer": str(tokenizer_file), "eval_batches": 2, "eval_batch_size": 2, **data}
    return Config(model=ModelConfig(vocab_size=512, d_model=32, num_layers=1, q_heads=2, kv_heads=1, head_dim=16,
                                    d_ff=64),
                  train=TrainConfig(batch_size=4, seq_len=32, steps=10, warmup_steps=1), data=DataConfig(**fields))


def test_a_tfds_dataset_is_read_by_name(data_dir, tmp_path):
    with pytest.raises(tfds.core.registered.DatasetNotFoundError):  # no class: read from its files
        tfds.core.registered.imported_builder_cls("tiny_wiki")
    cfg = config(data_dir, hf_tokenizer(tmp_path / "tok"))
    tok = load_tokenizer(cfg, tmp_path / "run")
    source, tokens = pipeline.documents(cfg, tok, tmp_path / "run", "train")
    assert len(source) == 50 and sorted(source[i]["body"].decode() for i in range(50)) == sorted(ARTICLES[:50])
    batches = pipeline.train_iterator(cfg, tok, tmp_path / "run")
    batch = next(batches)
    assert batch["tokens"].shape == (4, 33) and (batch["tokens"] == tok.eos_id()).any()
    state = json.loads(json.dumps(batches.get_state()))
    expected = next(batches)["tokens"]
    again = pipeline.train_iterator(cfg, tok, tmp_path / "run")
    pipeline.set_state(again, state)
    assert np.array_equal(next(again)["tokens"], expected)
    val = pipeline.validation_batches(cfg, tok, tmp_path / "run")
    assert list(val) == ["tiny_wiki"] and len(val["tiny_wiki"]) == 2
    held = pipeline.held_out_text(cfg, tok, tmp_path / "run")["tiny_wiki"]
    assert len(held) == sum(len(tok.encode(a)) + 1 for a in ARTICLES[50:])
    # Another split choice (the dataset's train split alone, sliced) is another fingerprint.
    sliced = config(data_dir, cfg.data.tokenizer, tfds_splits="train[:90%],train[90%:]")
    assert len(pipeline.documents(sliced, tok, tmp_path, "validation")[0]) == 5
    assert record.fingerprint(cfg).startswith("tfds-") and record.fingerprint(sliced) != record.fingerprint(cfg)


def test_what_a_tfds_source_needs_is_named_in_one_line(data_dir, tmp_path):
    tok_file = hf_tokenizer(tmp_path / "tok")
    cases = [({"text_feature": "text"}, "data.text_feature", "body, title"),
             ({"source": "tfds:tiny_wiki/en:9.9.9"}, "data.source", "tfds_data_dir"),
             ({"tfds_data_dir": str(tmp_path / "empty")}, "data.source", "tfds build"),
             ({"tfds_splits": "train,test"}, "data.tfds_splits", "train, validation"),
             ({"tokenizer": ""}, "data.tokenizer", "tokenizer.json")]
    for data, field, says in cases:
        cfg = config(data_dir, tok_file, **data)
        with pytest.raises(ConfigError) as e:
            tok = load_tokenizer(cfg, tmp_path / "run")
            pipeline.prepare(cfg, tmp_path / "run", tok)
        assert e.value.field == field and says in str(e.value) and "\n" not in str(e.value), (data, str(e.value))
    with pytest.raises(ConfigError, match="TRAIN,HELD_OUT"):
        DataConfig(source="tfds:x", tfds_splits="train")


def test_the_same_split_for_training_and_validation_is_refused():
    # (before: accepted, and validation ran on the training documents)
    for splits in ("train,train", " train , train", "train[:90%],train[:90%]"):
        with pytest.raises(ConfigError, match="two different splits") as e:
            DataConfig(source="tfds:x", tfds_splits=splits)
        assert e.value.field == "tfds_splits" and "\n" not in str(e.value)
    with pytest.raises(ConfigError) as e:  # as a run's flags name it
        from_dict(Config, {"data": {"source": "tfds:x", "tfds_splits": "train,train"}})
    assert e.value.field == "data.tfds_splits"
    DataConfig(source="tfds:x", tfds_splits="train[:90%],train[90%:]")


def test_the_named_dataset_prints_its_sizes(data_dir, tmp_path, capsys):
    cfg = config(data_dir, hf_tokenizer(tmp_path / "tok"))
    pipeline.prepare(cfg, tmp_path / "run", load_tokenizer(cfg, tmp_path / "run"))
    assert "tiny_wiki/en:1.0.1" in capsys.readouterr().err and tfds_text.domain(cfg.data) == "tiny_wiki"
