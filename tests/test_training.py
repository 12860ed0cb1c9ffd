"""`python -m sdxl train-shapes`: a few steps of every phase, the exported model, and resuming.

The shipped model's training is a command, not a test (hours); this checks the command's machinery
on a handful of steps of batch 2. Both runs are the command's `main` in this process, as
`python -m sdxl` runs it: a process each would pay its imports, and the resume would compile again the
small programs of eager operations (casts, random keys, reductions) that the first run left compiled here.
The command turns on no persistent compilation cache, so this process stays without one.
"""

import numpy as np
import pytest

from sdxl import Pipeline
from sdxl.__main__ import main

pytestmark = pytest.mark.compiles

FEW_STEPS = "--vae-steps 2 --vae-batch 2 --steps 2 --batch 2 --decoder-steps 1 --checkpoint-every 1".split()


def _train(capsys, *args):
    assert main(["train-shapes", *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_every_phase_runs_exports_a_loadable_model_and_resumes(tmp_path, capsys):
    out = _train(capsys, "--out", str(tmp_path), *FEW_STEPS)
    for line in ("phase 1 step 2/2", "phase 2 step 2/2", "phase 3 step 1/1", "latent scaling factor"):
        assert line in out, out
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == ["decoder.msgpack", "diffusion.msgpack", "vae.msgpack"]

    pipe = Pipeline.from_pretrained(str(tmp_path / "model"), dtype="float32")
    assert pipe.spec.native_size == 64 and pipe.spec.default_sampler == "euler"
    images = pipe.generate("a red circle on a blue background", steps=2, num_images=1, output_type="np")
    assert images.shape == (1, 64, 64, 3) and np.isfinite(images).all()

    # Run again: every phase resumes from its checkpoint, at its last step, and trains nothing more.
    again = _train(capsys, "--out", str(tmp_path), *FEW_STEPS)
    for phase in ("vae", "diffusion", "decoder"):
        assert f"resumed {tmp_path / 'checkpoints' / phase}.msgpack at step" in again, again
    assert "phase 2 step" not in again
