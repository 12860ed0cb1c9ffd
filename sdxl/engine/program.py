"""The pure program of generation: every stage a function of arrays, compiled by `sdxl.engine.pipeline`.

`GenerateProgram` holds only static, hashable fields (the model's spec, the sampler, the image size,
the dtype), so it can be a static argument of `jax.jit`; its methods are the stages. The array
inputs of one batch travel together as `Inputs`; the denoising loop's state as `State`.

The whole generation runs as one program (`whole`): text encoding, the denoising loop
(`lax.fori_loop` over a traced step count), VAE decoding and the conversion to uint8. For progress
reports the same stages compile separately (`prepare`, then `denoise` over a few steps at a time,
then `finish`), so the host learns how far the loop is without callbacks inside it: host callbacks
would keep JAX from writing the program to the persistent compilation cache on multi-device machines.

`GenerateProgram` is the one compile key: its fields are everything static (the batch and image
sizes, the sampler and its family, where the loop starts from, which optional inputs there are).
Prompts, seeds, guidance scales, the number of steps, the schedule (its type included) and the
stretch of it that runs are array inputs, so changing them reuses the compiled program.

Where the loop starts (`GenerateProgram.start_from`), as diffusers' SDXL pipelines start:
- "noise": text-to-image, from noise times the schedule's `init_noise_sigma`.
- "image": image-to-image and inpainting, from the VAE's encoding of an image, noised to the level
  of the first step that runs (`Inputs.first_step`; a strength picks it on the host).
- "clean_latents": a hires fix's second pass (`sdxl.engine.hires`), from a first pass's latents,
  upscaled, noised as an image's encoding would be.
- "latents": the second expert of a base-plus-refiner run, from another run's latents as they are.

ControlNets (`GenerateProgram.controlnets`) steer the UNet at every step with the residuals they
compute from a control image, each image's scaled by its own scale between its own start and end
(`sdxl.engine.controlnet_steps`).

IP-Adapters (`GenerateProgram.ip_adapters`) add a picture to the text: its image encoder's features,
projected to tokens, which every cross-attention layer also attends to at each image's scale there.
The pictures and scales are inputs; the adapters' tokens are computed once, before the loop.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct, traverse_util

from ..checkpoints import ModelSpec
from ..checkpoints.ip_adapters import IPAdapterConfig
from ..models import clip_vision, controlnet, controlnet_union, ip_adapter, previews, unet, vae
from ..models.layers import STEP_INVARIANTS, ImagePromptTokens
from ..models.quantization import dequantized
from ..sampling import methods
from ..sampling.samplers import Sampler, add_noise, denoised_from_model_output, model_input, run_steps
from ..sampling.schedulers import Schedule
from . import controlnet_steps
from .latents import one_image_per_device_at_a_time, scaled_latents, unscaled_latents
from .mesh import interleave
from .text_encoding import encode_text


# The stages, by their method names: the whole generation, or its three parts for progress reports.
STAGES = ("whole", "prepare", "denoise", "finish")
START_FROM = ("noise", "image", "clean_latents", "latents")
# As diffusers' `output_type`: uint8 pixels (as PIL images hold them), float32 in [0, 1], or the latents undecoded.
OUTPUT_TYPES = ("pil", "np", "latent")


@struct.dataclass
class Inputs:
    """One batch's array inputs, B images (padded to a multiple of the device count)."""

    # [B, 2, C, E, K * 77] int32 token ids, K chunks (`sdxl.prompts.tokens.Tokens`); axis 1 is (negative,
    # positive), axis 2 each prompt's C conditionings (its edits' texts), axis 3 the text encoders; and each
    # token's weight, float32.
    ids: jax.Array
    weights: jax.Array
    rescale: jax.Array  # [B] bool: weighted chunks keep their mean (webui's "original" emphasis)
    # [B, E] int32 per text encoder, the hidden state its context is, counted back from its last layer's
    # output (1; 2 the penultimate); and [B, E] bool, whether the final layer norm follows (webui's clip
    # skip: `sdxl.engine.inputs.clip_layers`).
    clip_layer: jax.Array
    clip_norm: jax.Array
    # [B, 2, C] int32: each text's chunks, those after them unread; None when every text has the one chunk.
    chunks: jax.Array | None
    zero_negative: jax.Array  # [B] bool: all-zero negative conditioning (SDXL's empty negative prompt)
    time_ids: jax.Array | None  # [B, 2, K] float32 SDXL's size (and aesthetic score) ids, (negative, positive)
    seeds: jax.Array  # [B] uint32; image b's noise depends only on (seeds[b], image_index[b])
    image_index: jax.Array  # [B] uint32
    guidance_scale: jax.Array  # [B] float32 classifier-free guidance weights
    guidance_rescale: jax.Array  # [B] float32 CFG rescale factors (`rescaled_guidance`)
    schedule: Schedule  # the sampler's padded noise schedule, with its step count (`Schedule.num_steps`)
    # Scalar int32: the steps first_step..stop_step-1 of the schedule run (0 and its num_steps for
    # text-to-image; a later first step for image-to-image, an earlier stop for a base model that hands
    # its latents to a refiner).
    first_step: jax.Array
    stop_step: jax.Array
    noise: jax.Array | None  # optional [B, h, w, C] float32 latents that replace the sampled noise
    # Optional [B, D, h, w, C] float32 the noise draws of a stochastic sampler (`Sampler.draws` of the
    # program's max_steps; draw k at [:, k]), drawn on the host, replacing the seeded noise
    # (`GenerateProgram.given_step_noise`).
    step_noise: jax.Array | None = None
    # [B, 2, S] int32 the conditioning each loop iteration of the program's S (`GenerateProgram.evaluations`)
    # reads (`Tokens.conditioning_steps`); None where every prompt has one (`GenerateProgram.conditionings`).
    conditioning_steps: jax.Array | None = None
    # start_from "image": [B, H, W, 3] float32 in [0, 1], the images to start from; start_from
    # "clean_latents": [B, h, w, C] float32, their latents; "latents": the sampler's state to continue.
    image: jax.Array | None = None
    # Inpainting: [B, H, W, 1] float32, 1 where the image is repainted and 0 where it is kept.
    mask: jax.Array | None = None
    # start_from "image": scalar bool, start from noise alone all the same (diffusers' inpainting at strength 1).
    from_noise: jax.Array | None = None
    # ControlNets: one [B, H, W, C] float32 control image in [0, 1] per ControlNet; and [B, K] each
    # image's conditioning scale per ControlNet, and the fractions of the steps that run between which
    # it steers (diffusers' `control_guidance_start` and `control_guidance_end`).
    control_images: tuple | None = None
    control_scales: jax.Array | None = None
    control_starts: jax.Array | None = None
    control_ends: jax.Array | None = None
    # [B, K] int32 each image's control mode per ControlNet, read by the ControlNet Unions only; None
    # where none is a Union (`GenerateProgram.control_modes`).
    control_modes: jax.Array | None = None
    # IP-Adapters: one [B, S, S, 3] float32 picture per adapter as its image encoder takes it
    # (normalised), and [B, K, L] each image's scale per adapter at each of the UNet's spatial
    # transformers (`unet.attention_layers`).
    image_prompt_pixels: tuple | None = None
    image_prompt_scales: jax.Array | None = None


# The inputs every device reads whole; the others are per image, split over the devices with the batch.
PER_CALL_INPUTS = ("schedule", "first_step", "stop_step", "from_noise")


@struct.dataclass
class State:
    """The denoising loop's state: what every step reads alike, and the sampler's carry it advances."""

    # The UNet's text conditioning, [2B, ...] as (negative, positive) pairs; with several conditionings, the
    # text's entries [2B, C, ...], one of which each step reads (`GenerateProgram.step_cond`).
    cond: dict
    carry: Any  # the sampler's loop state (`sdxl.sampling.samplers`)
    # What a stochastic sampler's noise comes from (`sampling.samplers.step_noise`): [B] PRNG keys, or
    # [B, D, h, w, C] noise drawn on the host; None for other samplers.
    step_noise: jax.Array | None
    known: "Known | None" = None  # inpainting: what the mask keeps


@struct.dataclass
class Known:
    """What inpainting keeps of the image, in latents (h x w, as the UNet sees them)."""

    mask: jax.Array  # [B, h, w, 1] 1 where the image is repainted (the pixel mask, nearest-sampled)
    latents: jax.Array | None  # [B, h, w, C] the whole image's scaled latents (4-channel UNets blend them back)
    noise: jax.Array | None  # [B, h, w, C] the starting noise, which re-noises `latents` at each step
    masked_latents: jax.Array | None  # [B, h, w, C] the kept pixels' latents (9-channel inpainting UNets' input)


def per_image_keys(seeds: jax.Array, image_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The PRNG keys of each image, from its (seed, index) alone.

    Args:
      seeds, image_index: [B] uint32.

    Returns:
      ([B] keys for the starting noise, [B] keys for the noise a stochastic sampler adds).
    """
    keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.key(seed), index))(seeds, image_index)
    noise_keys = jax.vmap(lambda key: jax.random.fold_in(key, 0))(keys)
    sampler_keys = jax.vmap(lambda key: jax.random.fold_in(key, 1))(keys)
    return noise_keys, sampler_keys


@dataclasses.dataclass(frozen=True)
class GenerateProgram:
    """What one compiled program is specialised to; its methods are the pure stages of generation.

    Work that every step would repeat alike, the UNet's step invariants (`sdxl.models.layers.STEP_INVARIANTS`:
    cross-attention's keys and values of the text, and the transformed kernels of the convolutions
    that use Winograd), is `prepare`'s output and every `denoise` call's input. `whole` leaves it
    to XLA's loop-invariant code motion, which hoists it out of the program's loop (a test checks on
    the CPU), and so saves tracing the UNet a second time.

    Without guidance (`guided=False`: no image of the batch has a guidance scale above 1, where
    diffusers uses the conditional prediction alone, or an LCM UNet that takes the scale as an
    embedding) the UNet sees only the prompts, one pass per step on B latents instead of 2B; the
    negative prompts' ids are then not read.

    `params` is always the {"unet", "vae", "text_encoder"[, "text_encoder_2"][, "controlnets"][, "ip_adapters"]
    [, "embeddings"]} parameter tree, in `dtype` (but the UNet's and ControlNets' large weights, in
    `weights_dtype`); "controlnets" holds one tree per entry of `controlnets`, "ip_adapters" one
    {"image_encoder", "image_proj", "unet"} per entry of `ip_adapters`, whose "unet" holds `to_k_ip` and
    `to_v_ip` in every `attn2` of the UNet's tree; "embeddings" one [embedding_rows, C_e] table of
    textual-inversion vectors per text encoder.
    """

    spec: ModelSpec
    sampler: str  # a name in `sampling.methods.SAMPLER_NAMES`
    height: int
    width: int
    batch: int  # images per call: a multiple of the device count
    dtype: jnp.dtype
    max_steps: int  # the schedules' padded length: the most steps a call may run
    output_type: str = "pil"  # one of `OUTPUT_TYPES`
    guided: bool = True  # classifier-free guidance: the UNet also sees the negative prompts
    start_from: str = "noise"  # one of `START_FROM`
    inpaint: bool = False  # `Inputs.mask` says what to repaint; the rest is kept (`Known`)
    given_noise: bool = False  # `Inputs.noise` replaces the seeded starting noise
    given_step_noise: bool = False  # `Inputs.step_noise` replaces a stochastic sampler's seeded noise
    chunks: int = 1  # the prompts' chunks of 77 tokens (`sdxl.prompts.tokens.CHUNK_COUNTS`)
    # Each prompt's conditionings, its edits' texts (`sdxl.prompts.tokens.CONDITIONING_COUNTS`): 1 for
    # prompts without editing or alternation, which then cost what they did before it.
    conditionings: int = 1
    # `previews.project`'s (matrix, bias) for the previews `denoise` returns; None: the family's.
    preview_factors: tuple | None = None
    # `Inputs.control_images` steer the UNet through these (a `ControlNetUnionConfig` is a Union's).
    controlnets: tuple[controlnet.ControlNetConfig, ...] = ()
    # The sampler runs as A1111's k-diffusion one, on one of A1111's schedule types; else as diffusers'.
    a1111: bool = False
    # The VAE decodes (and encodes) in overlapping tiles, as diffusers' after `enable_vae_tiling()`
    # (`vae.tiled_decode`): a picture of any size in the memory of one tile.
    vae_tiling: bool = False
    # `Inputs.image_prompt_pixels` steer the UNet through these IP-Adapters.
    ip_adapters: tuple[IPAdapterConfig, ...] = ()
    # The prompts' ids past each encoder's vocabulary select rows of `params["embeddings"]`, this many
    # (`sdxl.checkpoints.embeddings.table`: a multiple of a block, so loading one more seldom changes it).
    embedding_rows: int = 0
    # How the weights are stored (`sdxl.models.quantization.WEIGHT_DTYPES`): the UNet's and ControlNets'
    # large weights as `Quantized` leaves in 8 bits, dequantized to `dtype` where the model reads them (in
    # the `quantization.COMPUTE_MODES`, but those its layers compute with in 8 bits).
    weights_dtype: str = "default"

    def as_read(self, tree: dict) -> dict:
        """A UNet's or ControlNet's parameters as its layers read them (`quantization.dequantized`): to call
        inside the compiled program, where the model reads them."""
        return dequantized(tree, self.dtype, self.weights_dtype)

    @property
    def method(self) -> Sampler:
        """The sampler's loop (`sampling.methods.loop`)."""
        return methods.loop(self.sampler, self.a1111)

    @property
    def draws(self) -> int:
        """The most noise draws its stochastic sampler makes in a run (`Inputs.step_noise`'s length; at
        least 1, which a loop that draws none still indexes)."""
        return max(1, self.method.draws(self.max_steps)) if self.method.stochastic else 0

    @property
    def evaluations(self) -> int:
        """The most loop iterations (model evaluations) a call runs: `Inputs.conditioning_steps`' length."""
        return int(self.method.evaluations(self.max_steps))

    @property
    def control_modes(self) -> bool:
        """Whether a ControlNet is a Union, which reads `Inputs.control_modes`."""
        return any(isinstance(config, controlnet_union.ControlNetUnionConfig) for config in self.controlnets)

    def initial_state(self, params, inputs: Inputs) -> State:
        """Text conditioning, the starting latents and the sampler's state."""
        spec = self.spec
        if self.guided:  # [2B]: (negative, positive) pairs, a zeroed negative where asked
            rows = lambda x: None if x is None else x.reshape(-1, *x.shape[2:])  # noqa: E731
            keep = interleave(~inputs.zero_negative, jnp.ones_like(inputs.zero_negative))
            both = lambda x: interleave(x, x)  # noqa: E731
        else:  # [B]: the prompts alone
            rows = lambda x: None if x is None else x[:, 1]  # noqa: E731
            keep, both = jnp.ones(inputs.ids.shape[0], bool), lambda x: x  # noqa: E731
        time_ids = rows(inputs.time_ids)
        ids, weights, count = rows(inputs.ids), rows(inputs.weights), self.conditionings
        per_text = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731  [rows, C, ...] -> [rows * C, ...]
        per_row = lambda x: jnp.repeat(both(x), count, axis=0)  # noqa: E731  a row's setting for its C texts
        context, pooled = encode_text(
            spec, params, per_text(ids), per_text(weights), per_row(inputs.rescale), per_row(inputs.clip_layer),
            per_row(inputs.clip_norm), self.dtype,
        )
        # [rows, C, ...]; one conditioning: [rows, ...], as before editing existed.
        by_row = (lambda x: x) if count == 1 else (lambda x: x.reshape(len(ids), count, *x.shape[1:]))  # noqa: E731
        keep = keep if count == 1 else keep[:, None]
        cond = {"encoder_hidden_states": by_row(context) * keep[..., None, None].astype(context.dtype)}
        if inputs.chunks is not None:  # shorter prompts attend to their own chunks only
            chunks = rows(inputs.chunks)
            cond["encoder_lengths"] = (chunks[:, 0] if count == 1 else chunks) * spec.max_tokens
        if spec.is_sdxl:
            cond["text_embeds"] = by_row(pooled) * keep[..., None].astype(pooled.dtype)
            cond["time_ids"] = time_ids
        if spec.unet.time_cond_proj_dim is not None:  # an LCM UNet: the guidance scale as an embedding
            w = inputs.guidance_scale - 1
            cond["timestep_cond"] = unet.guidance_scale_embedding(w, spec.unet.time_cond_proj_dim)
        if self.ip_adapters:
            cond["image_prompts"] = self._image_prompts(params, inputs)

        noise_keys, sampler_keys = per_image_keys(inputs.seeds, inputs.image_index)
        noise = inputs.noise
        if noise is None:
            shape = spec.latent_shape(self.height, self.width)
            noise = jax.vmap(lambda key: jax.random.normal(key, shape))(noise_keys)
        method = self.method
        schedule = inputs.schedule
        from_noise = noise.astype(jnp.float32) * schedule.init_noise_sigma
        known = None
        if self.start_from == "noise":
            latents = from_noise
        elif self.start_from == "latents":
            latents = inputs.image
        else:
            encoded = self.encode(params, inputs.image * 2 - 1) if self.start_from == "image" else inputs.image
            # scheduler.add_noise at the first step that runs.
            latents = add_noise(method, encoded, noise, schedule.sigmas[inputs.first_step])
            if inputs.from_noise is not None:
                latents = jnp.where(inputs.from_noise, from_noise, latents)
            if self.inpaint:
                known = self._known(params, inputs, encoded, noise)
        step_noise = None
        if method.stochastic:
            step_noise = inputs.step_noise if self.given_step_noise else sampler_keys
        return State(cond, method.init(latents), step_noise, known)

    def step_cond(self, cond: dict, inputs: Inputs, step) -> dict:
        """The UNet's conditioning at loop iteration `step`: with several conditionings, each row's text
        entries at the one its step reads (webui's per-step choice, `Tokens.conditioning_steps`)."""
        if self.conditionings == 1:
            return cond
        picked = inputs.conditioning_steps[:, :, step]  # [B, 2]
        picked = picked.reshape(-1) if self.guided else picked[:, 1]
        rows = jnp.arange(len(picked))
        return {name: value[rows, picked] if name in _TEXT_CONDITIONING else value for name, value in cond.items()}

    def _image_prompts(self, params, inputs: Inputs) -> tuple[ImagePromptTokens, ...]:
        """Each IP-Adapter's tokens of each image's picture, with their scales, in the UNet's rows. With
        guidance the negative rows take diffusers' negative image embeddings: the plain projection of
        zero image embeds; a Plus or full-face projection of the features of a zero pixel tensor (after
        the processor's normalisation: the mean colour, not black)."""
        prompts = []
        for k, (config, p, pixels) in enumerate(zip(self.ip_adapters, params["ip_adapters"],
                                                    inputs.image_prompt_pixels)):
            encoder = clip_vision.CLIPVisionModelWithProjection(config.encoder, self.dtype)
            projection = ip_adapter.image_projection(config.projection, self.dtype)

            def features(pixels, encoder=encoder, config=config, p=p):
                out = encoder.apply({"params": p["image_encoder"]}, pixels.astype(self.dtype))
                return out.hidden_states[-2] if config.projection.reads_hidden_states else out.image_embeds

            def tokens(features, projection=projection, p=p):
                return projection.apply({"params": p["image_proj"]}, features)

            positive = features(pixels)
            states, scales = tokens(positive), inputs.image_prompt_scales[:, k]
            if self.guided:
                zero = features(jnp.zeros_like(pixels[:1])) if config.projection.reads_hidden_states else (
                    jnp.zeros_like(positive[:1]))
                negative = jnp.broadcast_to(tokens(zero), states.shape)
                states, scales = interleave(negative, states), interleave(scales, scales)
            prompts.append(ImagePromptTokens(states, scales))
        return tuple(prompts)

    def encode(self, params, images: jax.Array) -> jax.Array:
        """[B, H, W, 3] images in [-1, 1] -> [B, h, w, C] the diffusion model's latents.

        The posterior's mean: diffusers samples the posterior with the call's generator, but the
        published VAEs' posteriors are narrow, and the mean keeps an image's encoding the same
        for every seed. As diffusers' SDXL pipelines, a VAE that says it overflows in float16
        (`force_upcast`) encodes in float32.
        """
        spec = self.spec
        dtype = jnp.float32 if spec.is_sdxl and spec.vae.force_upcast else self.dtype
        encoder = vae.AutoencoderKL(spec.vae, dtype=dtype)
        if self.vae_tiling:
            encode = functools.partial(vae.tiled_encode, encoder, params["vae"])
        else:
            encode = functools.partial(encoder.apply, {"params": params["vae"]}, method=encoder.encode)
        mean, _ = one_image_per_device_at_a_time(encode, images.astype(dtype))
        return scaled_latents(spec, mean.astype(self.dtype).astype(jnp.float32))

    def _known(self, params, inputs: Inputs, encoded: jax.Array, noise: jax.Array) -> Known:
        """What the mask keeps, as diffusers' inpainting pipelines prepare it: the mask at the
        latents' size (torch's nearest interpolation: every f-th pixel), and either the masked image's
        latents (a 9-channel UNet's extra input) or the image's latents and noise (a 4-channel UNet's
        known region, blended back after every step)."""
        f = self.spec.vae.downscale_factor
        mask = inputs.mask[:, ::f, ::f]
        if self.spec.unet.in_channels > self.spec.vae.latent_channels:
            masked = self.encode(params, (inputs.image * 2 - 1) * (inputs.mask < 0.5))
            return Known(mask, None, None, masked)
        return Known(mask, encoded, noise.astype(jnp.float32), None)

    def prepare(self, params, inputs: Inputs) -> tuple[State, dict]:
        """The initial state and the step invariants: {"unet": the UNet's, "controlnets": each ControlNet's}."""
        state = self.initial_state(params, inputs)
        batch = len(state.cond["encoder_hidden_states"])  # 2B with guidance, else B
        h, w, _ = self.spec.latent_shape(self.height, self.width)
        zeros = jnp.zeros(batch)
        cond = self.step_cond(state.cond, inputs, 0)
        # The models' outputs are unused, so the compiled program keeps only what computes the invariants.
        x_in = jnp.zeros((batch, h, w, self.spec.unet.in_channels), self.dtype)
        _, unet_invariants = self._unet().apply(
            {"params": self.as_read(self._unet_params(params))}, x_in, zeros, **cond,
            mutable=[STEP_INVARIANTS],
        )
        invariants = {"unet": unet_invariants, "controlnets": controlnet_steps.invariants(self, params, inputs, cond)}
        if self.conditionings > 1:  # the text's keys and values change with the step's text: computed per step
            invariants = _without_text_invariants(invariants)
        return state, invariants

    def _unet(self) -> unet.UNet2DConditionModel:
        return unet.UNet2DConditionModel(self.spec.unet, dtype=self.dtype)

    def _unet_params(self, params) -> dict:
        """The UNet's parameters, with each IP-Adapter k's key and value weights in every cross-attention
        layer as `to_k_ip.{k}` and `to_v_ip.{k}` (`layers.Attention`)."""
        if not self.ip_adapters:
            return params["unet"]
        flat = traverse_util.flatten_dict(params["unet"])
        for k, p in enumerate(params["ip_adapters"]):
            for path, weight in traverse_util.flatten_dict(p["unet"]).items():
                flat[(*path[:-2], f"{path[-2]}.{k}", path[-1])] = weight
        return traverse_util.unflatten_dict(flat)

    def denoise(self, params, invariants: dict, state: State, inputs: Inputs, start, stop) -> tuple[Any, jax.Array]:
        """Sampler iterations start..stop-1 (one model evaluation each; `Sampler.evaluations` of the
        step count in all) with the guided UNet as the denoiser. Returns the new carry, and [B, h, w, 3]
        uint8 previews: the last step's clean-latent prediction through `previews.project`."""
        denoised = jnp.zeros_like(self.method.finish(state.carry))
        carry, denoised = self._denoise(params, invariants, state, inputs, start, stop, denoised)
        factors = self.preview_factors or previews.factors_for(self.spec)
        return carry, previews.project(denoised, factors)

    def _denoise(self, params, invariants: dict, state: State, inputs: Inputs, start, stop, denoised=None) -> Any:
        """The denoising loop over iterations start..stop-1: the new carry (and given `denoised`, the
        last denoised prediction: `sampling.run_steps`)."""
        model, unet_params, unet_invariants = self._unet(), self._unet_params(params), invariants.get("unet", {})
        control = controlnet_steps.control(self, params, invariants, inputs)
        g = inputs.guidance_scale[:, None, None, None]
        rescale = inputs.guidance_rescale[:, None, None, None]
        known = state.known
        extra = None  # a 9-channel inpainting UNet's mask and masked-image latents, after the latents
        if known is not None and known.masked_latents is not None:
            extra = jnp.concatenate([known.mask, known.masked_latents], axis=-1)
            extra = interleave(extra, extra) if self.guided else extra

        scheduler = self.spec.scheduler

        def denoiser(x, sigma, timestep, step):
            batch = x.shape[0]
            x_in = model_input(x, sigma, scheduler.sigma_data)
            if self.guided:
                x_in = interleave(x_in, x_in)
            if extra is not None:
                x_in = jnp.concatenate([x_in, extra], axis=-1)
            x_in = x_in.astype(self.dtype)
            t = jnp.broadcast_to(timestep, (len(x_in),))
            cond = self.step_cond(state.cond, inputs, step)
            # Dequantized here, in the loop's body, where XLA fuses it into the weights' reads.
            variables = {"params": self.as_read(unet_params), **unet_invariants}
            out = model.apply(variables, x_in, t, **cond, **control(x_in, t, step, cond)).astype(jnp.float32)
            if self.guided:
                out = out.reshape(batch, 2, *out.shape[1:])
                uncond, positive = out[:, 0], out[:, 1]
                # diffusers skips guidance for scales <= 1 and uses the conditional prediction alone.
                guided = rescaled_guidance(uncond + g * (positive - uncond), positive, rescale)
                out = jnp.where(g > 1, guided, positive)
            return denoised_from_model_output(x, out, sigma, scheduler.prediction_type, scheduler.sigma_data)

        method = self.method
        if known is not None and known.latents is not None:
            method = _blending_known(method, known, method.evaluations(inputs.stop_step))
        return run_steps(
            method, denoiser, state.carry, inputs.schedule, inputs.schedule.num_steps, start, stop, state.step_noise,
            denoised=denoised,
        )

    def finish(self, params, state: State) -> tuple[jax.Array, jax.Array]:
        """VAE decoding. Returns images [B, H, W, 3] (uint8, or float32 in [0, 1]), or the latents
        [B, h, w, C] undecoded; and finite [B]."""
        latents = self.method.finish(state.carry)
        if self.output_type == "latent":
            return latents, jnp.isfinite(latents).all(axis=(1, 2, 3))
        latents = unscaled_latents(self.spec, latents)
        # diffusers' SDXL pipeline decodes in float32 a float16 VAE that says it overflows (force_upcast).
        upcast = self.spec.is_sdxl and self.spec.vae.force_upcast and self.dtype == jnp.float16
        dtype = jnp.float32 if upcast else self.dtype
        decoder = vae.AutoencoderKL(self.spec.vae, dtype=dtype)
        if self.vae_tiling:
            decode = functools.partial(vae.tiled_decode, decoder, params["vae"])
        else:
            decode = functools.partial(decoder.apply, {"params": params["vae"]}, method=decoder.decode)
        images = one_image_per_device_at_a_time(decode, latents.astype(dtype))
        images = images.astype(jnp.float32)
        finite = jnp.isfinite(images).all(axis=(1, 2, 3))
        images = jnp.clip(images / 2 + 0.5, 0.0, 1.0)
        if self.output_type == "pil":
            images = jnp.round(images * 255).astype(jnp.uint8)
        return images, finite

    def whole(self, params, inputs: Inputs) -> tuple[jax.Array, jax.Array]:
        """All stages in one program."""
        state = self.initial_state(params, inputs)
        evaluations = self.method.evaluations
        carry = self._denoise(params, {}, state, inputs, evaluations(inputs.first_step), evaluations(inputs.stop_step))
        return self.finish(params, state.replace(carry=carry))


def rescaled_guidance(guided: jax.Array, positive: jax.Array, rescale: jax.Array) -> jax.Array:
    """Lin et al. 2023's CFG rescale (section 3.4), as diffusers' `rescale_noise_cfg` on the UNet's
    outputs: each image's guided prediction scaled to the conditional one's standard deviation
    (torch's, unbiased), mixed with the guided one by `rescale` ([B, 1, 1, 1]; 0: the guided one as it is)."""
    std = lambda x: jnp.std(x, axis=(1, 2, 3), keepdims=True, ddof=1)  # noqa: E731
    mixed = rescale * guided * (std(positive) / std(guided)) + (1 - rescale) * guided
    return jnp.where(rescale > 0, mixed, guided)


# The conditioning's entries that come from the text, which a prompt's edits change from step to step.
_TEXT_CONDITIONING = ("encoder_hidden_states", "encoder_lengths", "text_embeds")


def _without_text_invariants(invariants: dict) -> dict:
    """Step invariants less the cross-attention keys and values of the text (`layers.Attention`'s "key" and
    "value"), which the models then compute from each step's conditioning."""

    def kept(model_invariants: dict) -> dict:
        flat = traverse_util.flatten_dict(model_invariants)
        return traverse_util.unflatten_dict({path: v for path, v in flat.items() if path[-1] not in ("key", "value")})

    return {"unet": kept(invariants["unet"]), "controlnets": tuple(kept(i) for i in invariants["controlnets"])}


def _blending_known(method: Sampler, known: Known, stop) -> Sampler:
    """`method` with diffusers' inpainting step for a 4-channel UNet: after every step, the kept region
    is the image's latents noised to the level the step reached (clean after the last, stop - 1)."""

    def step(denoiser, schedule, num_steps, i, carry, noise):
        carry = method.step(denoiser, schedule, num_steps, i, carry, noise)
        sigma = jnp.where(i < stop - 1, schedule.sigmas[i + 1], 0.0)
        kept = add_noise(method, known.latents, known.noise, sigma)
        latents = (1 - known.mask) * kept + known.mask * method.finish(carry)
        return method.with_latents(carry, latents)

    return method._replace(step=step)
