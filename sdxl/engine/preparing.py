"""Preparing a request: `prepare` makes a `Request` what the devices take, against one loaded model.

All the host's work before a request can be queued, done once where it is submitted: its values
checked (`Request.validated`), the LoRA files it names read, its prompts tokenized, its programs
named, its run planned (the schedule, which holds its own length, and the steps of it that run; a
hires pass's and a refiner's part planned alike), and the noise a torch noise source draws drawn.
The result (`sdxl.engine.prepared.PreparedRequest`) holds the loaded model it was prepared against,
which renders it as it is.
"""

import dataclasses

import numpy as np

from ..sampling import kdiffusion, methods, noise
from ..sampling.brownian import BrownianNoise
from . import conditionings
from .model import LoadedModel
from .prepared import Plan, PreparedRequest, planned
from .program import OUTPUT_TYPES, GenerateProgram
from .request import Limits, Request


def prepare(model: LoadedModel, request: Request, *, limits: Limits | None = None,
            output_type: str = "pil") -> PreparedRequest:
    """`request` as the devices take it, to render with `model`: checked against `limits` (default the
    model's: the demo narrows them to its sizes), its LoRAs read, its prompts tokenized, its programs named
    and its run planned.

    Args:
      output_type: "pil" for uint8 images, "np" for float32 in [0, 1], or "latent": the sampler's
        latents [N, h, w, C], undecoded and left on the devices, for a refiner to continue.

    Raises:
      ValueError: a value of the request is out of range, in one sentence.
      CheckpointError: a LoRA file it names cannot be read.
    """
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"output_type must be one of {', '.join(OUTPUT_TYPES)}, got {output_type!r}")
    request = request.validated(limits or model.limits)
    model = model.reading(source for source, _ in request.loras)
    if request.hires is not None:
        edit_steps = _edit_steps(request, request.steps)
        first = _prepared(model, dataclasses.replace(request, hires=None),
                          "latent" if request.hires.in_latents else "np", edit_steps=(edit_steps, None))
        drawn = dict(noise=first.request.noise, step_noise=first.request.step_noise)
        # The request as asked (its PNG parameters name the hires fix): its arrays are its first pass's.
        return dataclasses.replace(first, request=dataclasses.replace(request, **drawn),
                                   hires=_second_pass(model, request, output_type, edit_steps))
    if request.refine_from is None:
        return _prepared(model, request, output_type)
    base, refining = _handoff(request)
    base = _prepared(model, base, "latent")
    # The refiner continues the base's noise: a stochastic sampler's draws go on where it stopped.
    drawn = dict(noise=base.request.noise, step_noise=base.request.step_noise)
    refined = _prepared(model.refiner, dataclasses.replace(refining, **drawn), output_type)
    # The request as asked (its PNG parameters name the refiner): its arrays are its base part's.
    return dataclasses.replace(base, request=dataclasses.replace(request, **drawn), refined=refined)


def _second_pass(model: LoadedModel, request: Request, output_type: str, edit_steps: int) -> PreparedRequest:
    """A validated request's hires pass (`sdxl.engine.hires`): its first pass's settings but for what
    the hires fix changes, its noise drawn afresh at the new size, its schedule's last steps run, and
    the start (upscaled latents or pictures) left to fill when the first pass has rendered. Its prompts'
    edits count its own steps on from the first pass's `edit_steps` (webui's hires scheduling)."""
    hires, n = request.hires, len(request)
    total, first = hires.second_pass_steps(request.steps)
    height, width = hires.size(request.height, request.width, model.spec)
    given = {name: (value,) * n for name, value in (
        ("prompts", hires.prompt), ("negative_prompts", hires.negative_prompt),
        ("guidance_scales", hires.guidance_scale)) if value is not None}
    second = dataclasses.replace(
        request, steps=total, height=height, width=width, sampler=hires.sampler,
        schedule_type=hires.schedule_type, noise=None, step_noise=None, hires=None, **given,
    )
    start = "clean_latents" if hires.in_latents else "image"
    return _prepared(model, second, output_type, start=start, first_step=first,
                     edit_steps=(edit_steps, _edit_steps(second, total - first)))


def _prepared(
    model: LoadedModel, request: Request, output_type: str, start: str | None = None, first_step: int = 0,
    edit_steps: tuple[int, int] | None = None,
) -> PreparedRequest:
    """A validated request prepared for `model`'s program, with the noise its source draws on the host
    (`with_drawn_noise`). A hires pass gives its `start` (where it starts from) and `first_step`, and
    runs to its schedule's end; `edit_steps` are the (first pass, hires pass) step counts its prompts'
    edits are scheduled over."""
    steps, hires_steps = edit_steps or (_edit_steps(request, request.steps), None)  # a hires fix's: given
    spec = model.spec
    tokens = model.prompts.tokens(
        request.prompts, request.negative_prompts, request.emphasis, steps=steps, hires_steps=hires_steps
    )
    drawn = request.noise_source != "jax"
    a1111 = request.schedule_type != methods.DIFFUSERS
    program = GenerateProgram(
        spec, request.sampler, request.height, request.width, model.padded_batch(len(request)), model.dtype,
        model.max_steps, output_type,
        # An LCM UNet takes the guidance scale as an embedding, with no unconditional pass (as diffusers).
        guided=request.guided and spec.unet.time_cond_proj_dim is None,
        start_from=request.start_from if start is None else start, inpaint=request.masks is not None,
        given_noise=drawn or request.noise is not None,
        given_step_noise=drawn and methods.loop(request.sampler, a1111).stochastic,
        chunks=tokens.num_chunks, conditionings=tokens.num_conditionings, preview_factors=model.preview_factors,
        a1111=a1111, vae_tiling=model.tiles_vae(request.height, request.width),
        embedding_rows=model.embedding_rows(tokens), weights_dtype=model.weights_dtype,
        **conditionings.program_fields(request, model),
    )
    plan = planned(program, request, first_step if start is not None else None)
    if drawn and request.noise is None:
        request = with_drawn_noise(request, program, plan)
    return PreparedRequest(request, tokens, program, plan, model)


def with_drawn_noise(request: Request, program: GenerateProgram, plan: Plan) -> Request:
    """`request` with the noise its source draws on the host (`sdxl.sampling.noise.drawn`): the starting
    noise, and for a stochastic sampler the draws after it, where the tools it comes from draw them:
    the sampler's draws from the first step that runs to the schedule's end. An SDE sampler on A1111's
    schedules draws from A1111's Brownian trees (`sdxl.sampling.brownian`)."""
    height, width, channels = program.spec.latent_shape(request.height, request.width)
    shape, method, length = (channels, height, width), program.method, plan.length
    total = method.draws(length) if method.stochastic else 0
    skipped = method.draws(plan.first) if method.stochastic else 0  # image-to-image skips the first steps' draws
    label = methods.SAMPLER_NAMES[request.sampler]
    trees = program.a1111 and kdiffusion.SAMPLERS[label].brownian and not request.batch_noise
    start, after = noise.drawn(
        request.noise_source, shape, request.seeds, request.image_index,
        later_draws=0 if trees else total - skipped, batch_noise=request.batch_noise,
        variation_seed=request.variation_seed, variation_strength=request.variation_strength, ensd=request.ensd,
    )
    if trees:  # the trees span the whole schedule, as A1111 builds them; the draws are those of the steps run
        sigmas = np.asarray(plan.schedule.sigmas)[: length + 1]
        seeds = [noise.a1111_seeds(seed, [index], request.variation_seed, request.variation_strength)[0][0]
                 for seed, index in zip(request.seeds, request.image_index)]
        tree = BrownianNoise(request.noise_source, shape, seeds, sigmas[sigmas > 0].min(), sigmas.max())
        after = kdiffusion.brownian_draws(label, sigmas, tree)[:, skipped:]
    step_noise = None
    if method.stochastic:  # Restart's short runs draw none
        step_noise = np.zeros((len(request), total, height, width, channels), np.float32)
        step_noise[:, skipped:] = after.transpose(0, 1, 3, 4, 2)
    return dataclasses.replace(request, noise=start.transpose(0, 2, 3, 1), step_noise=step_noise)


def _handoff(request: Request) -> tuple[Request, Request]:
    """A validated request with `refine_from` as its two parts: the base model's down to that fraction
    of the noise (`denoising_end`), and the refiner's from there (`denoising_start`; its latents, the
    `start_latents`, come from the first part when it renders). The LoRAs, ControlNets and IP-Adapters are
    the base's."""
    base = dataclasses.replace(request, refine_from=None, denoising_end=request.refine_from)
    refining = dataclasses.replace(request, refine_from=None, images=None, masks=None,
                                   denoising_start=request.refine_from, loras=(), **dict.fromkeys(conditionings.FIELDS))
    return base, refining


def _edit_steps(request: Request, steps: int) -> int:
    """The step count a prompt's edits are scheduled over for `steps` steps of the request's sampler: its
    model evaluations, as webui's `total_steps` (twice the steps for a second-order sampler)."""
    return int(methods.loop(request.sampler, request.schedule_type != methods.DIFFUSERS).evaluations(steps))
