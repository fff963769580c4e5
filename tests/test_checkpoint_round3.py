"""Issue 57's checkpoint faults: a read error whose text names a step folder such as 500 (or an
offset or a shape with 503 in it) is the checkpoint's fault, not a storage outage; a continued
run (`--init-from`) whose source's newest checkpoint is unsealed starts from the newest sealed one."""

import jax.numpy as jnp
import pytest

from gattn.train import checkpoint

from test_faults import STATE, flip, largest, read_all, saved_run


@pytest.mark.parametrize("text", [
    'DATA_LOSS: Error reading "params.big" in /runs/a/checkpoints/500/state/ocdbt.process_0/d/1f2e',
    "FileNotFoundError: [Errno 2] No such file or directory: '/r/checkpoints/503/state/_METADATA'",
    "ValueError: Error reading chunk at offset 429, shape (503, 16): checksum mismatch",
    "gs://bucket/run-504/checkpoints/10/state: OUT_OF_RANGE reading byte 500",
    "Corrupted file C:\\runs\\checkpoints\\502\\state\\manifest.ocdbt",
])
def test_a_number_in_a_path_offset_or_shape_is_not_a_storage_outage(text):
    """Before: TRANSIENT's \\b50[0234]\\b matched the step folder 500 (qwen3_5_2b's and
    extend_1p7b_32k's first save), an offset or a shape, and the read was retried 4 times and the
    run stopped saying the storage did not answer."""
    assert not checkpoint.transient(ValueError(text))


@pytest.mark.parametrize("text", [
    "503 Service Unavailable: GET https://storage.googleapis.com/bucket/run/checkpoints/500",
    "HTTP 429 Too Many Requests",
    "google.api_core.exceptions.ServiceUnavailable: 503 GET https://storage.googleapis.com/b/o",
    "UNAVAILABLE: HTTP response code: 503 with body: backend error",
    "gcsfs: HttpError 502 (Bad Gateway) for /b/checkpoints/400/state",
    "Received status code 500 from server",
    "DEADLINE_EXCEEDED: deadline for /b/checkpoints/500 passed",
])
def test_a_storage_outage_is_still_transient(text):
    assert checkpoint.transient(OSError(text))


def test_a_damaged_checkpoint_at_step_500_falls_back_to_step_400(tmp_path, monkeypatch, capfd):
    """The issue's case end to end: step 500's arrays cut in half (its seal removed, so the read
    itself fails, naming .../checkpoints/500/...). Before: 'the storage did not answer' after 4
    tries; a run could not resume. Now: step 400 is used, with one warning."""
    monkeypatch.setattr(checkpoint, "RETRY_SECONDS", 0.01)
    mngr = saved_run(tmp_path, steps=(400, 500))
    five = tmp_path / "checkpoints" / "500"
    big = largest(five)
    big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
    checkpoint.seal(five)  # sealed as it now is: only the read can tell
    step, (state, _, _) = checkpoint.first_readable(mngr, read_all(mngr))
    mngr.close()
    err = capfd.readouterr().err
    assert step == 400 and int(state["step"]) == 400, step
    assert "checkpoint step 500" in err and "using step 400 instead" in err, err
    assert len(err.strip().splitlines()) == 1, err
