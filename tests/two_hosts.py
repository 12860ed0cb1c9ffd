"""One process of a multi-host run, for test_pipeline: `python two_hosts.py ID COUNT PORT CHECKPOINT OUT KWARGS`.

Each process has 2 CPU devices, and jax.distributed joins every process's devices into one mesh, as
on a TPU pod slice or several GPU hosts. Every process makes the same calls (the one-program
`generate`, and `run` with progress reports, the demo's path) and saves the images it gets to OUT.
"""

import json
import os
import sys

process_id, num_processes, port, checkpoint, out, kwargs = sys.argv[1:]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives between processes
jax.distributed.initialize(f"localhost:{port}", num_processes=int(num_processes), process_id=int(process_id))

from sdxl.pipeline import Pipeline  # noqa: E402

pipe = Pipeline.from_pretrained(checkpoint, dtype="float32", max_steps=8)
assert pipe.num_devices == 2 * int(num_processes) and jax.local_device_count() == 2
kwargs = json.loads(kwargs)
images = pipe.generate("a cat", output_type="np", **kwargs)
n = len(images)
reported = []
staged = pipe.run(
    ["a cat"] * n, [""] * n, [kwargs["seed"]] * n, list(range(n)), [5.0] * n,
    steps=kwargs["steps"], height=kwargs["height"], width=kwargs["width"], on_step=reported.append,
)
np.savez(out, generate=images, run=staged.images, reported=np.array(reported))
