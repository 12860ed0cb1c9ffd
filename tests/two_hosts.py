"""One process of a multi-host run, for test_pipeline: `python two_hosts.py ID COUNT PORT CHECKPOINT OUT REQUEST`.

Each process has 2 CPU devices, and jax.distributed joins every process's devices into one mesh, as
on a TPU pod slice or several GPU hosts. Every process makes the same calls (`render`) and saves the
images it gets to OUT; the test makes them in its own single process to compare.
"""

import json
import os
import sys

import numpy as np


def render(pipe, request: dict) -> dict[str, np.ndarray]:
    """`request` {prompt, seed, steps, guidance_scale, height, width} as 4 images, by the one-program
    `generate` and by `render` with progress reports (the demo's path), with the steps it reported."""
    from sdxl.engine.request import Request

    n, size = 4, dict(height=request["height"], width=request["width"])
    images = pipe.generate(
        request["prompt"], seed=request["seed"], steps=request["steps"], guidance_scale=request["guidance_scale"],
        num_images=n, output_type="np", **size,
    )
    reported = []
    staged = pipe.render(
        Request.from_prompt(
            request["prompt"], num_images=n, seed=request["seed"], steps=request["steps"],
            guidance_scale=request["guidance_scale"], **size,
        ),
        on_step=reported.append,
    )
    return dict(generate=images, run=staged.images, reported=np.array(reported))


def main(process_id: str, num_processes: str, port: str, checkpoint: str, out: str, request: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives between processes
    jax.distributed.initialize(f"localhost:{port}", num_processes=int(num_processes), process_id=int(process_id))
    from sdxl.engine.pipeline import Pipeline

    pipe = Pipeline.from_pretrained(checkpoint, dtype="float32", max_steps=8)
    assert pipe.num_devices == 2 * int(num_processes) and jax.local_device_count() == 2
    np.savez(out, **render(pipe, json.loads(request)))


if __name__ == "__main__":
    main(*sys.argv[1:])
