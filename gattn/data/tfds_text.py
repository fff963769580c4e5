"""A TFDS dataset over local text (the embedded corpus or a user's folder), written as ArrayRecord
and read back with random access through `tfds.data_source` (no TensorFlow needed)."""

from __future__ import annotations

import sys

from etils.epath import Path  # local paths, and gs:// or other remote workdirs
import tensorflow_datasets as tfds
from absl import logging as absl_logging

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
    builder.download_and_prepare()
    return builder.builder_config.name


def data_source(data_cfg, workdir: Path, split: str):
    """The ArrayRecord data source of `split`, built under WORKDIR/tfds on first use and read
    with `tfds.data_source` (random access, no TensorFlow)."""
    name = prepare(data_cfg, workdir)
    return tfds.data_source(f"{GattnText.name}/{name}", data_dir=str(workdir / "tfds"), split=split)
