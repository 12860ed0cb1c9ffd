"""Rendering a prepared request: its inputs built (`sdxl.engine.inputs`), its compiled programs run
(`sdxl.engine.compiled`) with the parameters of the loaded model it was prepared against, and its
images fetched. A refiner's part continues the latents the first part leaves on the devices; a hires
fix's second pass starts from the first pass's result, upscaled. Nothing here changes any state but the
compiled programs' cache and where weights are (a model waiting in host memory moves onto the devices:
`sdxl.engine.residency`): a prepared request renders the same whatever is loaded meanwhile.
"""

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import numpy as np

from . import conditionings, hires as hires_fix, inputs, mesh as meshes
from .compiled import Executables, ProgressReports, run_in_stages
from .latent_upscale import upscale_latents
from .prepared import PreparedRequest


class NonFiniteImageError(RuntimeError):
    """The model produced NaN or infinite values (typically fp16/bf16 overflow)."""


@dataclasses.dataclass
class Generation:
    """A request's images, with what the caller may want to report."""

    images: np.ndarray  # [N, H, W, 3] uint8, or float32 in [0, 1]; or a jax.Array of latents, left on the devices
    finite: np.ndarray  # [N] bool: False where the model produced NaN/inf
    devices: list[str]  # the device that rendered each image
    seconds: float  # the whole call's time, compilation included
    moving_seconds: float = 0.0  # of it, moving the model's weights onto the devices (`sdxl.engine.residency`)

    def part(self, start: int, stop: int) -> "Generation":
        """Images start..stop-1 of a merged batch: one request's share."""
        return Generation(self.images[start:stop], self.finite[start:stop], self.devices[start:stop], self.seconds,
                          self.moving_seconds)

    def raise_if_not_finite(self) -> None:
        if not self.finite.all():
            bad = ", ".join(str(i) for i in np.flatnonzero(~self.finite))
            raise NonFiniteImageError(
                f"image(s) {bad} came out as NaN/inf: the model overflowed (try float32, or another checkpoint)"
            )


def render(prepared: PreparedRequest, executables: Executables, on_step: Callable | None = None,
           on_preview: Callable | None = None, steps_per_report: int = 1) -> Generation | None:
    """A prepared request's images, in one compiled call per part, or in a chain of them that reports
    progress (`Pipeline.render` says what `on_step` and `on_preview` hear); None where `on_step` gave
    the rendering up."""
    start = time.perf_counter()
    placement = prepared.model.placement
    moving = 0.0 if placement is None else placement.use()  # a model waiting in host memory moves in first
    result = _render_part(prepared, executables, on_step, on_preview, steps_per_report)
    if result is not None and prepared.refined is not None:
        refined = dataclasses.replace(prepared.refined, request=dataclasses.replace(
            prepared.refined.request, start_latents=result.images))
        result = _render_part(refined, executables, *_counting_on(prepared, on_step, on_preview), steps_per_report)
    if result is not None and prepared.hires is not None:
        second = _second_pass_from(prepared, result.images)
        result = _render_part(second, executables, *_counting_on(prepared, on_step, on_preview), steps_per_report)
    if result is not None:
        result.seconds, result.moving_seconds = time.perf_counter() - start, moving
    return result


def _render_part(prepared: PreparedRequest, executables: Executables, on_step, on_preview,
                 steps_per_report) -> Generation | None:
    """One program's run: one model's part of a prepared request."""
    request, program, model = prepared.request, prepared.program, prepared.model
    n = len(request)
    arrays = inputs.placed(inputs.host_inputs(prepared), model.mesh)
    params = model.params_with(request.loras)
    # The ControlNets', IP-Adapters' and embeddings' weights are the program's only where this request reads them.
    used = {kind.units: getattr(program, kind.units) for kind in conditionings.KINDS}
    unused = {name for name, used in {**used, "embeddings": program.embedding_rows}.items() if not used}
    params = {k: v for k, v in params.items() if k not in unused}
    if on_step is None and on_preview is None:
        images, finite = executables.compiled(program, "whole")(params, arrays)
    else:
        evaluations, plan = program.method.evaluations, prepared.plan
        report = ProgressReports(on_step, on_preview, plan.steps_run, evaluations(plan.first), n)
        stage = functools.partial(executables.compiled, program)
        rendered = run_in_stages(stage, params, arrays, evaluations(plan.first), evaluations(plan.stop), report,
                                 steps_per_report)
        if rendered is None:
            return None
        images, finite = rendered
    images = images[:n] if program.output_type == "latent" else meshes.fetch(images)[:n]
    return Generation(images, meshes.fetch(finite)[:n], model.devices_of(n), 0.0)


def _second_pass_from(prepared: PreparedRequest, first_pass) -> PreparedRequest:
    """The hires fix's second pass, starting from the first pass's result upscaled: its latents on the
    devices, or its pictures on the host (`sdxl.engine.hires`)."""
    request, second, model = prepared.request, prepared.hires, prepared.model
    hires, f = request.hires, model.spec.vae.downscale_factor
    up_height, up_width = hires.upscaled_latent_size(request.height, request.width, model.spec)
    rows, columns = hires.crop(request.height, request.width, model.spec)
    height, width = second.request.height // f, second.request.width // f
    if hires.in_latents:
        latents = _upscaled_latents(first_pass, up_height, up_width, hires.upscaler)
        start = dict(start_latents=latents[:, rows // 2: rows // 2 + height, columns // 2: columns // 2 + width])
    else:
        # webui makes its first pass's pictures uint8 by truncation, not rounding.
        pictures = hires_fix.upscaled_pictures((first_pass * 255).astype(np.uint8), up_height * f, up_width * f,
                                               hires.upscaler, model.upscalers)
        top, left = rows // 2 * f, columns // 2 * f
        start = dict(images=pictures[:, top: top + height * f, left: left + width * f])
    return dataclasses.replace(second, request=dataclasses.replace(second.request, **start))


def _counting_on(prepared: PreparedRequest, *reports) -> list:
    """Progress reports for the part that continues `prepared`: counting on from its steps."""
    done_before = prepared.plan.steps_run
    return [None if report is None else (lambda done, *preview, report=report: report(done_before + done, *preview))
            for report in reports]


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _upscaled_latents(latents: jax.Array, height: int, width: int, upscaler: str) -> jax.Array:
    return upscale_latents(latents, height, width, upscaler)
