"""What a ControlNet costs: a random one with the model's UNet shape, its request, and its FLOPs.

The benchmark times the model with one ControlNet against the same model without, in one process
(`speed.run_benchmark`), and counts the FLOPs of one guided step with and without it here.
"""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..checkpoints import controlnets as controlnet_checkpoints, random_models
from ..checkpoints.spec import ModelSpec
from ..checkpoints.weights import flatten
from ..engine.controls import Control
from ..engine.mesh import placing_replicated
from ..engine.pipeline import Pipeline
from ..engine.request import Request
from ..models import controlnet, unet
from ..models.layers import STEP_INVARIANTS
from . import counting
from .workload import batch_request


def with_controlnet(pipe: Pipeline, folder: Path) -> Pipeline:
    """`pipe`'s model steered by the ControlNet in `folder`: a pipeline that holds `pipe`'s own
    parameter arrays (the base model is not loaded twice) and the ControlNet's, loaded as
    `Pipeline.from_pretrained(..., controlnet=folder)` loads it."""
    checkpoint = controlnet_checkpoints.resolve(str(folder), pipe.spec, dtype=pipe.dtype)
    params = checkpoint.load(pipe.dtype, placing_replicated(pipe.mesh))
    model = pipe.model.replace(params={**pipe.params, "controlnets": (params,)}, controlnets=(checkpoint,),
                               name=f"{pipe.name} + {folder.name}")
    return Pipeline(model, pipe.executables)


def param_bytes_per_device(pipe: Pipeline) -> int:
    """Bytes of the ControlNets' parameters on one device (they are replicated: each holds them all)."""
    return sum(a.addressable_shards[0].data.nbytes for a in flatten({"c": dict(enumerate(pipe.params["controlnets"]))})
               .values())


def edges(n: int, height: int, width: int) -> np.ndarray:
    """[n, height, width, 3] uint8 control images like a canny map: thin white lines on black."""
    images = np.zeros((n, height, width, 3), np.uint8)
    images[:, :: max(1, height // 8)] = 255
    images[:, :, :: max(1, width // 6)] = 255
    return images


def steered_request(request: Request) -> Request:
    """`request` (not yet validated) with an edges control image for every image, at the default scale (1)."""
    control = Control(edges(1, request.height, request.width)[0])
    return dataclasses.replace(request, controls=((control,),) * len(request))


def step_flops(
    spec: ModelSpec,
    controlnet_config: controlnet.ControlNetConfig | None,
    batch: int,
    height: int,
    width: int,
    dtype=jnp.bfloat16,
    *,
    compiled: bool = False,
) -> float:
    """XLA's FLOP count of one denoising step's model evaluation on `batch` rows (2 per image with
    guidance): the UNet, steered by a ControlNet of `controlnet_config` when given, as the
    program's loop body runs them (`GenerateProgram._control`).

    The step invariants (the text's keys and values, the control image's embedding, Winograd
    kernels) are inputs, as the staged program gives them: what is counted is the work every step
    repeats. It is counted on the lowered program (no compile, so SDXL's size takes seconds), or
    with `compiled` on the program compiled for the default backend (after XLA's rewrites), in
    `dtype` (bfloat16, as accelerators run it, picks direct convolutions).
    """
    latent_h, latent_w, channels = spec.latent_shape(height, width)
    config = spec.unet

    def arg(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    cond = dict(timesteps=arg(batch), encoder_hidden_states=arg(batch, spec.max_tokens, config.cross_attention_dim))
    if config.addition_embed_type == "text_time":
        time_ids = len(spec.time_ids(height, width, 0.0))
        pooled = config.projection_class_embeddings_input_dim - time_ids * config.addition_time_embed_dim
        cond.update(text_embeds=arg(batch, pooled), time_ids=arg(batch, time_ids))
    sample = arg(batch, latent_h, latent_w, config.in_channels)
    model = unet.UNet2DConditionModel(config, dtype)
    models = {"unet": (model, unet.abstract_params(config), dict(sample=sample, **cond))}
    if controlnet_config is not None:
        f = spec.vae.downscale_factor
        image = arg(batch, latent_h * f, latent_w * f, controlnet_config.conditioning_channels)
        inputs = dict(sample=arg(batch, latent_h, latent_w, channels), controlnet_cond=image,
                      conditioning_scale=arg(batch), **cond)
        models["controlnet"] = (controlnet.ControlNetModel(controlnet_config, dtype),
                                controlnet.abstract_params(controlnet_config), inputs)
    # Each model's step invariants, as shapes: what it stores when its collection is mutable.
    invariants = {
        name: jax.eval_shape(lambda p, x, m=m: m.apply({"params": p}, **x, mutable=[STEP_INVARIANTS])[1], p, x)
        for name, (m, p, x) in models.items()
    }

    def step(params, invariants, inputs):
        extra = {}
        if "controlnet" in models:
            net = models["controlnet"][0]
            down, mid = net.apply({"params": params["controlnet"], **invariants["controlnet"]}, **inputs["controlnet"])
            extra = dict(down_block_additional_residuals=down, mid_block_additional_residual=mid)
        return model.apply({"params": params["unet"], **invariants["unet"]}, **inputs["unet"], **extra)

    params = {name: p for name, (_, p, _) in models.items()}
    inputs = {name: x for name, (_, _, x) in models.items()}
    if compiled:
        return counting.flops(jax.jit(step).lower(params, invariants, inputs).compile())
    return counting.flops(counting.lowered(step, params, invariants, inputs))


def first_run(pipe, scratch: Path, request: Request, dtype: str) -> tuple:
    """The model steered by a random ControlNet of its UNet's shape (`random_models.write_controlnet`), the
    benchmark's batch with a control image per image, and what the ControlNet adds: its compile
    time, its parameters' bytes per device, and the FLOPs of one guided step with it over without
    (from the lowered programs). Returns (pipeline, request, that)."""
    folder = random_models.write_controlnet(scratch / "controlnet", pipe.spec, dtype=dtype)
    steered = with_controlnet(pipe, folder)
    controlled = steered.prepare(steered_request(
        batch_request(len(request), request.height, request.width, request.steps)))
    compile_s = steered.compile(controlled.programs)
    steered.render(controlled)
    rows = pipe.padded_batch(len(request)) * 2  # with guidance, each image is two rows of the model's batch
    config = steered.controlnets[0].config
    step = [step_flops(pipe.spec, c, rows, request.height, request.width, pipe.dtype) for c in (None, config)]
    return steered, controlled, dict(
        controlnet_compile_s=compile_s,
        controlnet_param_bytes_per_device=param_bytes_per_device(steered),
        controlnet_step_flops=step[1],
        controlnet_step_flops_ratio=step[1] / step[0],
    )
