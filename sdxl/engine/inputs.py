"""A request's arrays as a compiled program takes them (`sdxl.engine.program.Inputs`), defined once.

`host_inputs` builds them from a prepared request; `placed` puts them on the mesh, per image or whole
(`PER_CALL_INPUTS`); `abstract_inputs` gives the shapes compiling needs, from the same function run
on a `placeholder` request of the program's shapes.
"""

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from ..prompts.tokens import Tokens
from ..sampling import methods
from . import conditionings, mesh as meshes
from .images import unit
from .prepared import PreparedRequest, planned
from .program import PER_CALL_INPUTS, GenerateProgram, Inputs
from .request import Request


def clip_layers(spec, request: Request) -> tuple[tuple[int, bool], ...]:
    """Per text encoder, the hidden state its context is, counted back from its last layer's output
    (1), and whether the final layer norm follows (`text_encoding.chosen_state`), as webui reads them:
    - SD 1.x: clip skip N gives (N, True); the default 1 the last hidden state.
    - SD 2.x: always (1, True): webui reads its OpenCLIP encoder through a class that ignores clip skip.
    - SDXL: both encoders' penultimate states, (2, False); with `sdxl_clip_l_skip`, CLIP-L's is
      (N, False) instead (so clip skip 1 reads its last layer's output, unnormed), and OpenCLIP-G's stays.
    """
    if not spec.is_sdxl:
        return tuple((request.clip_skip if c.openai else 1, True) for c in spec.text_encoders)
    skip = request.clip_skip if request.sdxl_clip_l_skip else 2
    return tuple((skip if c.openai else 2, False) for c in spec.text_encoders)


def host_inputs(prepared: PreparedRequest) -> Inputs:
    """The arrays of a prepared request's program, each image's padded to the program's batch by
    repeating the last image's."""
    request, program, tokens = prepared.request, prepared.program, prepared.tokens
    spec, n = program.spec, len(request)

    def per_image(values, dtype):
        if isinstance(values, jax.Array):  # already on the devices (a base model's latents)
            values = values.astype(dtype)
            return values if n == program.batch else values[np.minimum(np.arange(program.batch), n - 1)]
        values = np.asarray(values, dtype=dtype)
        return values if n == program.batch else np.concatenate([values, np.repeat(values[-1:], program.batch - n, 0)])

    zero_negative = [spec.force_zeros_for_empty_prompt and not p for p in request.negative_prompts]
    time_ids = None
    if spec.is_sdxl:
        score, negative_score = request.aesthetic_scores
        pair = [spec.time_ids(request.height, request.width, s) for s in (negative_score, score)]
        time_ids = per_image(np.broadcast_to(np.array(pair, np.float32), (n, *np.shape(pair))), np.float32)
    start = {}
    if program.start_from == "image":
        # diffusers' inpainting starts from noise alone at strength 1; its image-to-image never does.
        from_noise = request.masks is not None and request.strength == 1
        start = {"image": per_image(unit(request.images), np.float32), "from_noise": np.bool_(from_noise)}
    elif program.start_from in ("clean_latents", "latents"):
        start = {"image": per_image(request.start_latents, np.float32)}
    conditioned = {name: jax.tree.map(lambda a: per_image(a, a.dtype), arrays)  # each kind's (`conditionings`)
                   for name, arrays in conditionings.host_arrays(request, program).items()}
    plan = prepared.plan
    layers = clip_layers(spec, request)
    return Inputs(
        ids=per_image(tokens.ids, np.int32),
        weights=per_image(tokens.weights, np.float32),
        rescale=per_image(tokens.rescale, np.bool_),
        clip_layer=per_image([[layer for layer, _ in layers]] * n, np.int32),
        clip_norm=per_image([[norm for _, norm in layers]] * n, np.bool_),
        chunks=per_image(tokens.chunks, np.int32) if program.chunks > 1 else None,
        conditioning_steps=None if program.conditionings == 1 else per_image(
            tokens.conditioning_steps(program.evaluations, program.method.evaluations(plan.first)), np.int32),
        zero_negative=per_image(zero_negative, np.bool_),
        time_ids=time_ids,
        seeds=per_image(request.seeds, np.uint32),
        image_index=per_image(request.image_index, np.uint32),
        guidance_scale=per_image(request.guidance_scales, np.float32),
        guidance_rescale=per_image(request.guidance_rescales or (0.0,) * n, np.float32),
        schedule=plan.schedule,
        first_step=np.int32(plan.first),
        stop_step=np.int32(plan.stop),
        noise=per_image(request.noise, np.float32) if program.given_noise else None,
        step_noise=per_image(_padded_draws(request.step_noise, program.draws), np.float32)
        if program.given_step_noise else None,
        mask=per_image(request.masks[..., None], np.float32) if program.inpaint else None,
        **start,
        **conditioned,
    )


def _padded_draws(step_noise: np.ndarray, draws: int) -> np.ndarray:
    """[N, d, ...] noise draws as [N, draws, ...]: the padded ones, never read, hold zeros."""
    missing = draws - step_noise.shape[1]
    return np.pad(step_noise, [(0, 0), (0, missing)] + [(0, 0)] * (step_noise.ndim - 2)) if missing else step_noise


def placed(inputs: Inputs, mesh: Mesh) -> Inputs:
    """Host inputs as global arrays on the mesh: per-image ones split by image, the others whole."""
    return _by_field(inputs, mesh, meshes.place)


def abstract_inputs(program: GenerateProgram, mesh: Mesh) -> Inputs:
    """The program's inputs as shapes, dtypes and shardings: what compiling it needs."""
    arrays = host_inputs(placeholder(program))
    return _by_field(arrays, mesh, lambda a, sharding: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding))


def _by_field(inputs: Inputs, mesh: Mesh, leaf) -> Inputs:
    by_image, whole = meshes.by_image(mesh), meshes.replicated(mesh)
    return inputs.replace(**{
        field.name: jax.tree.map(
            lambda a, name=field.name: leaf(a, whole if name in PER_CALL_INPUTS else by_image),
            getattr(inputs, field.name),
        )
        for field in dataclasses.fields(inputs)
    })


def placeholder(program: GenerateProgram) -> PreparedRequest:
    """A prepared request of the program's shapes whose values do not matter. Its pixel arrays are
    views of one zero, so that a large batch allocates nothing."""
    spec, n = program.spec, program.batch

    def zeros(*shape):
        return np.broadcast_to(np.float32(0), shape)

    shape = (n, 2, program.conditionings, len(spec.text_encoders), program.chunks * spec.max_tokens)
    per_text = (n, 2, program.conditionings)
    tokens = Tokens(np.zeros(shape, np.int32), np.ones(shape, np.float32), np.ones(per_text, np.int32),
                    np.ones(n, bool), np.zeros((n, 2, 1), np.int32))
    guidance = 2.0 if program.guided else 1.0
    latents = zeros(n, *spec.latent_shape(program.height, program.width))
    request = Request(
        ("",) * n, ("",) * n, (0,) * n, (0,) * n, (guidance,) * n, 1, program.height, program.width, program.sampler,
        schedule_type="Automatic" if program.a1111 else methods.DIFFUSERS,
        noise=latents if program.given_noise else None,
        step_noise=zeros(n, program.draws, *latents.shape[1:]) if program.given_step_noise else None,
        images=zeros(n, program.height, program.width, 3) if program.start_from == "image" else None,
        masks=zeros(n, program.height, program.width) if program.inpaint else None,
        start_latents=latents if program.start_from in ("clean_latents", "latents") else None,
        denoising_start=0.5 if program.start_from == "latents" else None,
        **conditionings.placeholders(program),
    )
    return PreparedRequest(request, tokens, program, planned(program, request, first_step=0))
