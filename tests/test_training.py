"""`python -m sdxl train-shapes`: a few steps of every phase, the exported model, and resuming.

The shipped model's training is a command, not a test (hours); this checks the command's machinery
on a handful of steps of batch 2.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sdxl import Pipeline

pytestmark = pytest.mark.cli

ROOT = Path(__file__).parents[1]
FEW_STEPS = "--vae-steps 2 --vae-batch 2 --steps 2 --batch 2 --decoder-steps 1 --checkpoint-every 1".split()


def _train(*args):
    result = subprocess.run(
        [sys.executable, "-m", "sdxl", "train-shapes", *args], capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_every_phase_runs_exports_a_loadable_model_and_resumes(tmp_path):
    out = _train("--out", str(tmp_path), *FEW_STEPS)
    for line in ("phase 1 step 2/2", "phase 2 step 2/2", "phase 3 step 1/1", "latent scaling factor"):
        assert line in out, out
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == ["decoder.msgpack", "diffusion.msgpack", "vae.msgpack"]

    pipe = Pipeline.from_pretrained(str(tmp_path / "model"), dtype="float32")
    assert pipe.spec.native_size == 64 and pipe.spec.default_sampler == "euler"
    images = pipe.generate("a red circle on a blue background", steps=2, num_images=1, output_type="np")
    assert images.shape == (1, 64, 64, 3) and np.isfinite(images).all()

    # Run again: every phase resumes from its checkpoint, at its last step, and trains nothing more.
    again = _train("--out", str(tmp_path), *FEW_STEPS)
    for phase in ("vae", "diffusion", "decoder"):
        assert f"resumed {tmp_path / 'checkpoints' / phase}.msgpack at step" in again, again
    assert "phase 2 step" not in again
