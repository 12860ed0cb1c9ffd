"""Compiled programs: each stage of each `GenerateProgram` compiled once for a mesh, and run whole or
as a chain of stages that reports progress.

A program compiles from its fields alone: the parameters' shapes follow from its model spec and
dtype, the inputs' from `sdxl.engine.inputs.abstract_inputs`. So a host can compile for devices it does
not have (a TPU topology's), and one cache serves every pipeline on the same devices.
"""

import functools
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from ..checkpoints import ModelSpec
from ..checkpoints.spec import cached_shapes
from ..checkpoints import ip_adapters as ip_adapter_checkpoints
from ..models import controlnet, quantization
from . import mesh as meshes
from .inputs import abstract_inputs
from .program import GenerateProgram, Inputs

WHOLE = ("whole",)
IN_STAGES = ("prepare", "denoise", "finish")  # what progress reports run: `sdxl.engine.program.STAGES` but "whole"


def stages(progress: bool) -> tuple[str, ...]:
    return IN_STAGES if progress else WHOLE


class Executables:
    """The compiled stages of programs on one mesh, each compiled once, on first use."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self._compiled: dict[tuple[GenerateProgram, str], jax.stages.Compiled] = {}

    def has(self, program: GenerateProgram, progress: bool = False) -> bool:
        """Whether the stages that a run with or without `progress` takes are compiled."""
        return all((program, stage) in self._compiled for stage in stages(progress))

    def compile(self, program: GenerateProgram, progress: bool = False) -> None:
        for stage in stages(progress):
            self.compiled(program, stage)

    def compiled(self, program: GenerateProgram, stage: str) -> jax.stages.Compiled:
        key = (program, stage)
        if key not in self._compiled:
            self._compiled[key] = self.lowered(program, stage).compile()
        return self._compiled[key]

    def lowered(self, program: GenerateProgram, stage: str, platforms: tuple[str, ...] | None = None):
        """The stage lowered for `platforms` (default: the mesh's), not compiled."""
        inputs = abstract_inputs(program, self.mesh)
        if stage in ("whole", "prepare"):
            args = (inputs,)
        else:
            state, invariants = self.compiled(program, "prepare").out_info
            step = inputs.first_step
            args = (invariants, state, inputs, step, step) if stage == "denoise" else (state,)
        by_image = meshes.by_image(self.mesh)
        # `prepare` keeps the invariants as computed: the text's keys split by image, kernels on every device.
        fn = jax.jit(getattr(program, stage), out_shardings=(by_image, None) if stage == "prepare" else by_image)
        params = abstract_params(program.spec, program.controlnets, program.ip_adapters, program.embedding_rows,
                                 program.dtype, meshes.replicated(self.mesh), program.weights_dtype)
        # The mesh in context lets kernels XLA cannot partition (splash attention) split the batch.
        with jax.set_mesh(self.mesh):
            return fn.trace(params, *args).lower(lowering_platforms=platforms)


@functools.lru_cache(maxsize=8)
def abstract_params(spec: ModelSpec, controlnets: tuple, ip_adapters: tuple, embedding_rows: int, dtype,
                    sharding, weights_dtype: str = "default") -> dict:
    """The parameters a program of `spec` (steered by `controlnets`' and `ip_adapters`' configs, its prompts'
    textual-inversion vectors in `embedding_rows` rows per encoder) takes, as loaded: every leaf in `dtype`,
    on every device, but the large weights that `weights_dtype` stores in 8 bits (`quantization.Quantized`)."""
    tree = spec.abstract_params()
    if embedding_rows:
        tree["embeddings"] = tuple(jax.ShapeDtypeStruct((embedding_rows, config.hidden_size), np.float32)
                                   for config in spec.text_encoders)
    if controlnets:
        tree["controlnets"] = tuple(cached_shapes(controlnet.abstract_params, config) for config in controlnets)
    if ip_adapters:
        unet = tree["unet"]
        tree["ip_adapters"] = tuple(ip_adapter_checkpoints.abstract_params(config, unet) for config in ip_adapters)
    tree = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype, sharding=sharding), tree)
    return quantization.in_components(tree, lambda component: quantization.abstract(component, weights_dtype))


class ProgressReports:
    """Turns model evaluations into the steps done since the first that runs, for `on_step` and
    `on_preview`: one each, but for PLMS's second step, which takes two (its last report is then the
    step count again, which is not repeated). `on_step` returning False gives the run up."""

    def __init__(self, on_step, on_preview, steps: int, first: int, n: int):
        self.on_step, self.on_preview, self.steps, self.first, self.n = on_step, on_preview, steps, first, n
        self.reported = 0

    def __call__(self, evaluations: int, preview: jax.Array | None = None) -> bool:
        """Whether to go on."""
        done = min(evaluations - self.first, self.steps)
        if done <= self.reported:
            return True
        self.reported = done
        if self.on_step is not None and self.on_step(done) is False:
            return False
        if self.on_preview is not None and preview is not None:
            self.on_preview(done, meshes.fetch(preview)[: self.n])
        return True


def run_in_stages(
    stage: Callable[[str], jax.stages.Compiled], params, inputs: Inputs, first: int, evaluations: int,
    report: ProgressReports, steps_per_report: int,
) -> tuple[jax.Array, jax.Array] | None:
    """The whole program's work as prepare, denoise over `steps_per_report` model evaluations at a
    time (from `first`), finish; `report` hears the evaluations done. The next call is always queued
    on the devices before the host waits for the last, so the devices never idle for a report.
    Returns None when `report` gives the run up before its last step."""
    state, invariants = stage("prepare")(params, inputs)
    denoise = stage("denoise")
    whole = inputs.first_step.sharding
    in_flight = []  # (evaluations done when it finishes, its carry, its previews)
    carry = state.carry
    for start in range(first, evaluations, steps_per_report):
        stop = min(start + steps_per_report, evaluations)
        bounds = [meshes.place(np.int32(i), whole) for i in (start, stop)]
        carry, preview = denoise(params, invariants, state.replace(carry=carry), inputs, *bounds)
        in_flight.append((stop, carry, preview))
        if len(in_flight) > 1:
            done, finished, preview = in_flight.pop(0)
            jax.block_until_ready(finished)
            if not report(done, preview):
                return None
    images = stage("finish")(params, state.replace(carry=carry))
    jax.block_until_ready(carry)
    report(evaluations)  # the last: the images are made, whatever it answers
    return images
