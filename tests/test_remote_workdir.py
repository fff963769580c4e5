"""A gs:// run directory (docs/pod-slice.md): with the gcp extra, train.py gets past every import
and reaches for the bucket; without it, one line names the missing library and the extra that
brings it. No bucket is reachable from this machine, so the run itself ends on the network."""

import builtins
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gattn import cli
from gattn.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~1 min, nearly all of it gcsfs retrying a host it cannot resolve
def test_a_gs_workdir_gets_past_the_imports_and_fails_on_the_network_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "train.py", "--config", "tiny", "--workdir", "gs://gattn-no-such-bucket/run",
                          "--steps", "100", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "GCE_METADATA_HOST": "127.0.0.1:9",
                              "NO_GCE_CHECK": "True", "HOME": str(tmp_path)})
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1, out.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    assert "gcsfs" not in lines[0] and "ImportError" not in lines[0] and "Traceback" not in out.stderr
    assert "storage.googleapis.com" in lines[0]  # it went for the bucket


def test_a_missing_filesystem_library_is_one_line_naming_the_extra(monkeypatch):
    import fsspec

    def missing(protocol):
        raise ImportError("Install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(ConfigError, match=r"--workdir.*gs://b/run.*pip install 'gattn\[gcp\]'.*Install gcsfs"):
        cli.check_workdir("gs://b/run")
    cli.check_workdir("/a/local/run")  # local paths need nothing


def test_tensorboard_without_its_gs_library_is_refused_not_switched_off(monkeypatch):
    import fsspec

    real_import = builtins.__import__

    def no_storage(name, *args, **kwargs):
        if name.startswith("google.cloud.storage"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(fsspec, "get_filesystem_class", lambda protocol: object)  # gcsfs is there
    monkeypatch.setattr(builtins, "__import__", no_storage)
    with pytest.raises(ConfigError, match="google-cloud-storage.*TensorBoard.*gattn\\[gcp\\]"):
        cli.check_workdir("gs://b/run")
