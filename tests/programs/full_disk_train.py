"""train.py whose checkpoint writes of step GATTN_TEST_FULL_AT fail with ENOSPC on process
GATTN_TEST_FULL_PROCESS (a full disk, for machines where a test cannot mount a small tmpfs)."""

import errno
import os
import runpy
import sys
from pathlib import Path

from orbax.checkpoint._src.handlers import json_checkpoint_handler as handler

real = handler.JsonCheckpointHandler._save_fn


async def full(self, x, directory):
    if (os.environ.get("JAX_PROCESS_ID", "0") == os.environ["GATTN_TEST_FULL_PROCESS"]
            and f"/{os.environ['GATTN_TEST_FULL_AT']}." in str(directory)):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))
    return await real(self, x, directory)


handler.JsonCheckpointHandler._save_fn = full
train = Path(__file__).resolve().parents[2] / "train.py"
sys.argv = [str(train)] + sys.argv[1:]
runpy.run_path(str(train), run_name="__main__")
