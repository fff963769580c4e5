"""A TFDS dataset over local text (the embedded corpus or a user's folder), written as ArrayRecord
and read back with random access through `tfds.data_source` (no TensorFlow needed); and a TFDS
dataset named by data.source="tfds:NAME[/CONFIG][:VERSION]", prepared by someone else, read the
same way."""

from __future__ import annotations

import hashlib
import json
import sys

from etils.epath import Path  # local paths, and gs:// or other remote workdirs
import tensorflow_datasets as tfds
from absl import logging as absl_logging

from gattn.config import ConfigError
from gattn.data import corpus


class GattnText(tfds.core.GeneratorBasedBuilder):
    """Documents with their domain; splits 'train' and 'validation' (corpus.Document.split)."""

    VERSION = tfds.core.Version("1.0.0")
    # TFDS looks for a checksums file next to the builder's package, which fails for an editable
    # install; nothing is downloaded, so there is nothing to checksum.
    code_path = None

    def __init__(self, *, source: str, code_max_bytes: int, decode_errors: str = "strict", **kwargs):
        self._source, self._code_max_bytes, self._decode_errors = source, code_max_bytes, decode_errors
        name = corpus.fingerprint(source, code_max_bytes, decode_errors)
        super().__init__(config=tfds.core.BuilderConfig(name=name), **kwargs)

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            description="Local text documents with a domain label (gattn).",
            features=tfds.features.FeaturesDict({"text": tfds.features.Text(),
                                                 "domain": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing is downloaded
        return {split: self._generate_examples(split) for split in ("train", "validation")}

    def _log_download_bytes(self):
        """TFDS prints "Downloading and preparing dataset ..." here, but nothing is downloaded:
        say what happens instead, on stderr so that a command's stdout (e.g. --json) stays clean."""
        print(f"preparing the dataset from local text (once) in {self.data_dir} ...",
              file=sys.stderr)

    def _log_download_done(self):
        """TFDS prints "Dataset ... downloaded and prepared"; the line above already said it."""

    def _generate_examples(self, split):
        for doc in corpus.documents(self._source, self._code_max_bytes, self._decode_errors):
            if doc.split == split:
                yield doc.id, {"text": doc.text, "domain": doc.domain}


def prepare(data_cfg, workdir: Path) -> str:
    """Builds the dataset under WORKDIR/tfds if it is not there yet; returns its name within
    the builder (the corpus fingerprint, `corpus.fingerprint`)."""
    tfds.display_progress_bar(False)
    absl_logging.set_verbosity(absl_logging.ERROR)  # "Using custom data configuration ..." etc.
    builder = GattnText(source=data_cfg.source, code_max_bytes=data_cfg.code_max_bytes,
                        decode_errors=data_cfg.decode_errors,
                        data_dir=str(workdir / "tfds"), file_format="array_record")
    try:
        builder.download_and_prepare()
    except FileExistsError:  # another process (a study's --part K/N) prepared it meanwhile: keep
        if not builder.is_prepared():  # the first one (TFDS renames a finished dataset into place)
            raise
    return builder.builder_config.name


def data_source(data_cfg, workdir: Path, split: str):
    """The ArrayRecord data source of `split`, built under WORKDIR/tfds on first use and read
    with `tfds.data_source` (random access, no TensorFlow)."""
    name = prepare(data_cfg, workdir)
    return tfds.data_source(f"{GattnText.name}/{name}", data_dir=str(workdir / "tfds"), split=split)


# data.source="tfds:NAME[/CONFIG][:VERSION]": a dataset someone has prepared (c4, wikipedia, ...),
# read with random access from its ArrayRecord files and tokenized on the fly.

def named(data_cfg) -> str:
    """The TFDS name of data.source="tfds:NAME[/CONFIG][:VERSION]" (TFDS's own syntax)."""
    return data_cfg.source[len("tfds:"):]


def domain(data_cfg) -> str:
    """The one held-out domain of a TFDS dataset: its name without config and version."""
    return named(data_cfg).split("/")[0].split(":")[0]


def _builder(data_cfg):
    tfds.display_progress_bar(False)
    absl_logging.set_verbosity(absl_logging.ERROR)
    where = data_cfg.tfds_data_dir or None
    how = (f"gattn downloads nothing: prepare it with `tfds build {named(data_cfg)} --data_dir DIR "
           "--file_format=array_record` and set data.tfds_data_dir=DIR")
    try:
        builder = tfds.builder(named(data_cfg), data_dir=where)
    except Exception as e:  # noqa: BLE001 (TFDS raises several kinds for a name it cannot find)
        raise ConfigError("data.source", data_cfg.source, "a TFDS dataset prepared under data.tfds_data_dir "
                          f"({data_cfg.tfds_data_dir or 'TFDS default'}; TFDS says: "
                          f"{str(e).splitlines()[0][:200]}); {how}") from None
    if not builder.is_prepared():
        raise ConfigError("data.source", data_cfg.source, f"a TFDS dataset prepared under data.tfds_data_dir: "
                          f"none is in {builder.data_dir}; {how}")
    return builder


def named_source(data_cfg, split: str):
    """The random-access source of the named dataset's training ("train") or held-out
    ("validation") split, as data.tfds_splits names them; its text feature checked."""
    builder = _builder(data_cfg)
    feature = data_cfg.text_feature
    features = builder.info.features
    if feature not in features:
        raise ConfigError("data.text_feature", feature, f"one of the dataset's features: {', '.join(sorted(features))}")
    tfds_split = [s.strip() for s in data_cfg.tfds_splits.split(",") if s.strip()][split != "train"]
    try:
        return tfds.data_source(named(data_cfg), data_dir=data_cfg.tfds_data_dir or None, split=tfds_split)
    except Exception as e:  # noqa: BLE001
        raise ConfigError("data.tfds_splits", data_cfg.tfds_splits,
                          f"splits of {named(data_cfg)} in ArrayRecord files (it has "
                          f"{', '.join(builder.info.splits)}; one prepared as TFRecord needs `tfds build "
                          f"--file_format=array_record`); TFDS says: {str(e).splitlines()[0][:200]}") from None


def describe(data_cfg) -> None:
    """Checks the named dataset and its splits, and says on stderr how many examples each holds."""
    sizes = [len(named_source(data_cfg, s)) for s in ("train", "validation")]
    print(f"dataset {named(data_cfg)} ({data_cfg.tfds_data_dir or 'TFDS default data dir'}): {sizes[0]:,} training "
          f"and {sizes[1]:,} held-out examples (data.tfds_splits={data_cfg.tfds_splits!r}), feature "
          f"{data_cfg.text_feature!r} tokenized as it is read", file=sys.stderr, flush=True)


def fingerprint(data_cfg) -> str:
    """What a run on a TFDS dataset records: its full name and the number of examples of each
    split it reads (another version or a re-preparation of other size changes it)."""
    builder = _builder(data_cfg)
    splits = {s: len(named_source(data_cfg, s)) for s in ("train", "validation")}
    text = json.dumps([builder.info.full_name, data_cfg.tfds_splits, data_cfg.text_feature, splits])
    return "tfds-" + hashlib.sha256(text.encode()).hexdigest()[:12]
