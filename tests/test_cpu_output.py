"""What a CPU user sees: no libtpu initialisation errors from an entry point (libtpu is installed
with the test extra, for ahead-of-time compiles), and no "Downloading" line for local text."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gattn import cli
from gattn.config import DataConfig
from gattn.data import tfds_text

ROOT = Path(__file__).resolve().parents[1]
LIBTPU_ERRORS = ("TPU accelerator type", "unexpected worker hostname")

# An entry point as gattn.main_job is one: JAX imported first, then run_entry_point(main).
ENTRY = """
import jax
from gattn.cli import run_entry_point

def main(argv=None):
    print(jax.devices()[0].platform)

run_entry_point(main)
"""

cpu_host_with_libtpu = pytest.mark.skipif(
    not cli._libtpu_installed() or cli._tpu_here() or cli._gpu_here(),
    reason="needs libtpu installed on a host with neither a TPU nor a GPU")


@cpu_host_with_libtpu
@pytest.mark.parametrize("reexec", [True, False], ids=["reexecuted", "not_reexecuted"])
def test_entry_point_on_cpu_prints_no_libtpu_errors(tmp_path, reexec):
    script = tmp_path / "entry.py"
    script.write_text(ENTRY)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "GLIBC_TUNABLES")}
    env["GATTN_NO_REEXEC"] = "0" if reexec else "1"
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "cpu"
    assert not [e for e in LIBTPU_ERRORS if e in out.stderr], out.stderr


@pytest.mark.parametrize("setting", ["user_set", "tpu_host", "gpu_host"])
def test_jax_is_left_alone_where_the_user_or_the_host_decides(monkeypatch, setting):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(cli, "_libtpu_installed", lambda: True)
    monkeypatch.setattr(cli, "_gpu_here", lambda: setting == "gpu_host")
    if setting == "user_set":
        monkeypatch.setenv("JAX_PLATFORMS", "")  # empty: JAX chooses
    if setting == "tpu_host":
        monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    cli.keep_jax_off_absent_tpu()
    assert os.environ.get("JAX_PLATFORMS") == ("" if setting == "user_set" else None)


def test_building_the_dataset_from_local_text_says_nothing_of_downloading(tmp_path, capfd):
    data = DataConfig(code_max_bytes=300_000)
    tfds_text.data_source(data, tmp_path, "validation")
    out, err = capfd.readouterr()
    assert "download" not in (out + err).lower(), out + err
    assert "from local text" in err and not out.strip()
    tfds_text.data_source(data, tmp_path, "train")  # built once: nothing more to say
    out, err = capfd.readouterr()
    assert not (out + err).strip(), out + err
