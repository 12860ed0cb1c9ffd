"""ControlNets inside the compiled program (`GenerateProgram.controlnets`): at every step they steer
the UNet with the residuals they compute from each image's control image, scaled by its own scale
between its own start and end, all inputs, so that changing them never recompiles. A ControlNet Union
(`sdxl.models.controlnet_union`) also reads each image's control mode, an input too."""

from collections.abc import Callable

import jax.numpy as jnp

from ..models import controlnet_union
from ..models.layers import STEP_INVARIANTS
from .mesh import interleave


def models(program) -> list:
    return [config.model(program.dtype) for config in program.controlnets]


def steering(program, inputs) -> list[dict]:
    """Each ControlNet's own inputs as the model's batch holds them (both halves with guidance): its
    control images, and a Union's control modes (and how many rows each image has)."""
    pair = (lambda x: interleave(x, x)) if program.guided else (lambda x: x)  # noqa: E731
    steered = []
    for k, (config, image) in enumerate(zip(program.controlnets, inputs.control_images or ())):
        steered.append({"controlnet_cond": pair(image.astype(program.dtype))})
        if isinstance(config, controlnet_union.ControlNetUnionConfig):
            rows = 2 if program.guided else 1
            steered[-1].update(control_mode=pair(inputs.control_modes[:, k]), rows_per_image=rows)
    return steered


def invariants(program, params, inputs, cond: dict) -> tuple:
    """Each ControlNet's step invariants (`STEP_INVARIANTS`) for the UNet's conditioning `cond`; their
    outputs are unused, so the compiled program keeps only what computes the invariants."""
    batch = len(cond["encoder_hidden_states"])  # 2B with guidance, else B
    h, w, _ = program.spec.latent_shape(program.height, program.width)
    x_in, zeros = jnp.zeros((batch, h, w, program.spec.vae.latent_channels), program.dtype), jnp.zeros(batch)
    return tuple(
        model.apply({"params": program.as_read(p)}, x_in, zeros, conditioning_scale=zeros, **steered,
                    **text_of(cond), mutable=[STEP_INVARIANTS])[1]
        for model, p, steered in zip(models(program), params.get("controlnets", ()), steering(program, inputs))
    )


def control(program, params, invariants: dict, inputs) -> Callable[..., dict]:
    """`control(x_in, t, step, cond)`: the UNet's extra inputs from the ControlNets at loop iteration
    `step`, given its conditioning `cond`: their residuals, each scaled by its image's scale where `step`
    lies between its start and end, and summed (as diffusers' MultiControlNet). {} without ControlNets.

    diffusers' keep mask: a ControlNet steers the i-th of the n model evaluations that run unless
    i / n < start or (i + 1) / n > end (n counts to the schedule's end, past a `denoising_end`).
    """
    if not program.controlnets:
        return lambda x_in, t, step, cond: {}
    evaluations = program.method.evaluations
    first = evaluations(inputs.first_step)
    count = (evaluations(inputs.schedule.num_steps) - first).astype(jnp.float32)
    steered, nets = steering(program, inputs), models(program)
    step_invariants = invariants.get("controlnets") or ({},) * len(nets)  # none in `whole`: XLA hoists them
    nets_params = params["controlnets"]

    def control(x_in, t, step, cond) -> dict:
        done = (step - first).astype(jnp.float32)
        keep = ~((done / count < inputs.control_starts) | ((done + 1) / count > inputs.control_ends))  # [B, K]
        scales = inputs.control_scales * keep
        x_control = x_in[..., : program.spec.vae.latent_channels]  # without an inpainting UNet's extra channels
        down, mid = None, None
        for k, model in enumerate(nets):
            scale = interleave(scales[:, k], scales[:, k]) if program.guided else scales[:, k]
            # Dequantized here, in the loop's body, where XLA fuses it into the weights' reads.
            variables = {"params": program.as_read(nets_params[k]), **step_invariants[k]}
            residuals, middle = model.apply(variables, x_control, t, conditioning_scale=scale, **steered[k],
                                            **text_of(cond))
            down = residuals if down is None else [a + b for a, b in zip(down, residuals)]
            mid = middle if mid is None else mid + middle
        return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}

    return control


def text_of(cond: dict) -> dict:
    """What a ControlNet reads of the UNet's conditioning: all but an LCM UNet's guidance embedding and
    the IP-Adapters' image prompts (diffusers' ControlNets take neither)."""
    return {name: value for name, value in cond.items() if name not in ("timestep_cond", "image_prompts")}
