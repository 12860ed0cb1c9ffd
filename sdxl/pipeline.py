"""Text-to-image as one compiled, sharded function.

The whole generation runs inside a single `jax.jit` program: text encoding, the denoising loop
(`lax.fori_loop` over a traced step count), VAE decoding and the conversion to uint8. Parameters
are replicated and the image batch is sharded over a 1-D mesh of all devices, so each device
renders its share of the images with no communication.

Only the batch size, the image size and the sampler are static. Prompts, seeds, guidance scales and
the number of steps are array inputs, so changing them reuses the compiled program.

When the caller wants progress reports, the same stages compile as separate programs and the loop
runs as a chain of calls (see `Pipeline.run`): host callbacks inside the loop would keep JAX from
writing the program to the persistent compilation cache on multi-device machines.
"""

import dataclasses
import functools
import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import checkpoint, clip, unet, vae
from .config import cache_root, config_from_file
from .layers import STEP_INVARIANTS
from .sampling import SAMPLERS, denoised_from_model_output, run_steps
from .schedulers import Schedule, SchedulerConfig
from .tokenizer import load_tokenizer, tokenize
from .weights import CheckpointError, flatten, load_params, unflatten

BATCH_AXIS = "batch"
MAX_SEED = 2**32 - 1


class PromptTruncatedWarning(UserWarning):
    """A prompt had more tokens than the text encoder takes; the rest was dropped."""


class NonFiniteImageError(RuntimeError):
    """The model produced NaN or infinite values (typically fp16/bf16 overflow)."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything static about a checkpoint: the configs that shape the compiled program.

    The model family follows from the configs. SDXL: two text encoders, whose penultimate hidden
    states are the context, plus the pooled text and size ids as extra conditioning. SD 1.x/2.x: one
    text encoder, whose last hidden state is the context, and no extra conditioning.
    """

    unet: unet.UNetConfig
    vae: vae.VAEConfig
    text_encoders: tuple[clip.CLIPTextConfig, ...]
    scheduler: SchedulerConfig
    force_zeros_for_empty_prompt: bool

    @property
    def is_sdxl(self) -> bool:
        """SDXL conditions on two encoders' penultimate states plus pooled text and size ids."""
        return self.unet.addition_embed_type == "text_time"

    @property
    def text_encoder_names(self) -> tuple[str, ...]:
        return ("text_encoder", "text_encoder_2")[: len(self.text_encoders)]

    @property
    def latent_factor(self) -> int:
        """Image pixels per latent pixel, times the UNet's total downsampling: sizes must divide by it."""
        return self.vae.downscale_factor * 2 ** (len(self.unet.block_out_channels) - 1)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(h, w, channels) of the latents of a height x width image (NHWC, without the batch)."""
        f = self.vae.downscale_factor
        return height // f, width // f, self.unet.in_channels

    @property
    def native_size(self) -> int:
        """The training resolution in pixels (1024 for SDXL, 512 for SD 1.x)."""
        return self.unet.sample_size * self.vae.downscale_factor

    @property
    def max_tokens(self) -> int:
        return self.text_encoders[0].max_position_embeddings

    @classmethod
    def from_folder(cls, folder: Path) -> "ModelSpec":
        """Reads the configs of a diffusers pipeline folder.

        Only the text encoders, UNet, VAE and scheduler are read. Other entries of model_index.json
        are ignored, whether they name a component or are null: SD 1.x's `safety_checker` and
        `feature_extractor` (no safety checker runs: images come out as from a diffusers pipeline
        built with safety_checker=None), `requires_safety_checker`, `image_encoder`.

        Raises:
          CheckpointError: model_index.json or a config is missing, or no text encoder is named.
        """
        index = checkpoint.read_model_index(folder)
        names = [n for n in ("text_encoder", "text_encoder_2") if index.get(n) and index[n][0] is not None]
        if not names:
            raise CheckpointError(f"{folder}: model_index.json names no text encoder")
        try:
            return cls(
                unet=config_from_file(unet.UNetConfig, folder / "unet" / "config.json"),
                vae=config_from_file(vae.VAEConfig, folder / "vae" / "config.json"),
                text_encoders=tuple(
                    config_from_file(clip.CLIPTextConfig, folder / name / "config.json") for name in names
                ),
                scheduler=config_from_file(SchedulerConfig, folder / "scheduler" / "scheduler_config.json"),
                force_zeros_for_empty_prompt=bool(index.get("force_zeros_for_empty_prompt", False)),
            )
        except FileNotFoundError as e:
            raise CheckpointError(f"{folder}: missing config file {e.filename}") from e

    def abstract_params(self) -> dict:
        """The parameter tree's shapes, with nothing allocated."""
        params = {"unet": _shapes(unet.abstract_params, self.unet), "vae": _shapes(vae.abstract_params, self.vae)}
        for name, config in zip(self.text_encoder_names, self.text_encoders):
            params[name] = _shapes(clip.abstract_params, config)
        return params


@functools.cache
def _model_sources_digest() -> bytes:
    """The parameter shapes follow from a config and these files."""
    digest = hashlib.sha256()
    for name in ("layers.py", "clip.py", "unet.py", "vae.py"):
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.digest()


def _shapes(abstract_params: Callable, config) -> dict:
    """`abstract_params(config)`, kept on disk keyed by the config and the model sources.

    Tracing the modules' `init` for SDXL's 2,641 parameter shapes takes 7-9 s on a CPU host, which
    was a quarter of a full-size load.
    """
    key = hashlib.sha256(_model_sources_digest() + repr(config).encode()).hexdigest()[:32]
    path = cache_root() / "shapes" / f"{key}.json"
    try:
        stored = json.loads(path.read_text())
        return unflatten({tuple(k.split("/")): jax.ShapeDtypeStruct(tuple(v), jnp.float32) for k, v in stored.items()})
    except (OSError, ValueError):
        pass
    tree = abstract_params(config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"/".join(k): list(v.shape) for k, v in flatten(tree).items()}))
        partial.replace(path)  # atomic, so a concurrent reader never sees half a file
    except OSError:
        pass  # a read-only cache only costs the tracing
    return tree


# Per component: how a stored key maps to the module's name, and the stored buffers to skip.
_KEY_RULES = {
    "unet": (lambda key: key, ()),
    "vae": (vae.rename_key, ()),
    "text_encoder": (clip.rename_key, clip.IGNORED_KEYS),
    "text_encoder_2": (clip.rename_key, clip.IGNORED_KEYS),
}


def load_checkpoint_params(folder: Path, spec: ModelSpec, dtype, put) -> dict:
    """Loads every component's safetensors into a parameter tree, checking every key and shape."""
    prefer_variant = None if np.dtype(dtype) == np.float32 else "fp16"
    params = {}
    for name, tree in spec.abstract_params().items():
        rename, ignore = _KEY_RULES[name]
        files = checkpoint.weight_files(folder / name, prefer_variant=prefer_variant)
        params[name] = load_params(files, tree, dtype=dtype, rename=rename, ignore=ignore, put=put)
    return params


def encode_text(spec: ModelSpec, params: dict, ids: jax.Array, dtype) -> tuple[jax.Array, jax.Array | None]:
    """Text conditioning as the diffusers pipelines compute it.

    Args:
      ids: [B, E, T] token ids, one row per text encoder.

    Returns:
      context: [B, T, D] cross-attention states. SDXL: both encoders' penultimate hidden states,
        concatenated; SD 1.x/2.x: the single encoder's last (final-normed) hidden state.
      pooled: [B, P] the last encoder's projected pooled output (SDXL), else None.
    """
    states, pooled = [], None
    for e, (name, config) in enumerate(zip(spec.text_encoder_names, spec.text_encoders)):
        out = clip.CLIPTextModel(config, dtype=dtype).apply({"params": params[name]}, ids[:, e])
        states.append(out.hidden_states[-2] if spec.is_sdxl else out.last_hidden_state)
        pooled = out.text_embeds
    return jnp.concatenate(states, axis=-1), (pooled if spec.is_sdxl else None)


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


def _interleave(negative: jax.Array, positive: jax.Array) -> jax.Array:
    """[B, ...] x2 -> [2B, ...] as (neg_0, pos_0, neg_1, pos_1, ...).

    Keeping each image's two guidance branches adjacent keeps them on the same device, so the
    batched CFG call needs no cross-device traffic.
    """
    return jnp.stack([negative, positive], axis=1).reshape(-1, *negative.shape[1:])


@dataclasses.dataclass(frozen=True)
class GenerateProgram:
    """What one compiled program is specialised to; its methods are the pure stages of generation.

    `generate` is the whole of it in one program: token ids in, images out. For progress reports
    the same stages also compile separately (`prepare`, then `denoise` over a few steps at a time,
    then `finish`), so the host learns how far the loop is without callbacks inside it.

    Work that every step would repeat alike, the UNet's step invariants (`sdxl.layers.STEP_INVARIANTS`:
    cross-attention's keys and values of the text, and the transformed kernels of the convolutions
    that use Winograd), is `prepare`'s output and every `denoise` call's input. `generate` leaves it
    to XLA's loop-invariant code motion, which hoists it out of the program's loop (a test checks on
    the CPU), and so saves tracing the UNet a second time.

    Array arguments:
      params: {"unet", "vae", "text_encoder"[, "text_encoder_2"]} parameter trees.
      invariants: the UNet's step invariants, from `prepare`.
      ids: [B, 2, E, T] token ids; axis 1 is (negative, positive), axis 2 the text encoders.
      zero_negative: [B] bool, use all-zero negative conditioning (SDXL's empty negative prompt).
      seeds, image_index: [B] uint32; image b's noise depends only on (seeds[b], image_index[b]).
      guidance_scale: [B] float32 classifier-free guidance weights.
      schedule: the sampler's padded noise schedule; num_steps: scalar int32 <= its length.
      noise: optional [B, h, w, C] latents that replace the sampled noise.
    """

    spec: ModelSpec
    sampler: str  # a name in `sampling.SAMPLERS`
    height: int
    width: int
    dtype: jnp.dtype
    as_uint8: bool

    def initial_state(self, params, ids, zero_negative, seeds, image_index, schedule, noise):
        """Text conditioning, the starting noise and the sampler's state. Returns (cond, carry, keys)."""
        spec, batch = self.spec, ids.shape[0]
        context, pooled = encode_text(spec, params, ids.reshape(2 * batch, *ids.shape[2:]), self.dtype)
        keep = _interleave(~zero_negative, jnp.ones_like(zero_negative))  # [2B]
        cond = {"encoder_hidden_states": context * keep[:, None, None].astype(context.dtype)}
        if spec.is_sdxl:
            # (original size, crop top-left, target size), as diffusers' _get_add_time_ids.
            time_ids = jnp.array([self.height, self.width, 0, 0, self.height, self.width], jnp.float32)
            cond["text_embeds"] = pooled * keep[:, None].astype(pooled.dtype)
            cond["time_ids"] = jnp.broadcast_to(time_ids, (2 * batch, 6))

        noise_keys, sampler_keys = per_image_keys(seeds, image_index)
        if noise is None:
            shape = spec.latent_shape(self.height, self.width)
            noise = jax.vmap(lambda key: jax.random.normal(key, shape))(noise_keys)
        method = SAMPLERS[self.sampler]
        carry = method.init(noise.astype(jnp.float32) * schedule.init_noise_sigma)
        return cond, carry, (sampler_keys if method.stochastic else None)

    def prepare(self, params, ids, zero_negative, seeds, image_index, schedule, noise):
        """The initial state and the UNet's step invariants. Returns (cond, carry, keys, invariants)."""
        cond, carry, keys = self.initial_state(params, ids, zero_negative, seeds, image_index, schedule, noise)
        batch = 2 * ids.shape[0]
        x_in = jnp.zeros((batch, *self.spec.latent_shape(self.height, self.width)), self.dtype)
        # The model's output is unused, so the compiled program keeps only what computes the invariants.
        _, invariants = self._unet().apply(
            {"params": params["unet"]}, x_in, jnp.zeros(batch), **cond, mutable=[STEP_INVARIANTS]
        )
        return cond, carry, keys, invariants

    def _unet(self) -> unet.UNet2DConditionModel:
        return unet.UNet2DConditionModel(self.spec.unet, dtype=self.dtype)

    def denoise(self, params, invariants, cond, carry, keys, guidance_scale, schedule, num_steps, start, stop):
        """Sampler steps start..stop-1 with the guided UNet as the denoiser."""
        model, variables = self._unet(), {"params": params["unet"], **invariants}
        g = guidance_scale[:, None, None, None]

        def denoiser(x, sigma, timestep):
            batch = x.shape[0]
            x_in = x / jnp.sqrt(sigma**2 + 1)
            x_in = _interleave(x_in, x_in).astype(self.dtype)
            t = jnp.broadcast_to(timestep, (2 * batch,))
            out = model.apply(variables, x_in, t, **cond).astype(jnp.float32)
            out = out.reshape(batch, 2, *out.shape[1:])
            uncond, positive = out[:, 0], out[:, 1]
            # diffusers skips guidance for scales <= 1 and uses the conditional prediction alone.
            guided = jnp.where(g > 1, uncond + g * (positive - uncond), positive)
            return denoised_from_model_output(x, guided, sigma, self.spec.scheduler.prediction_type)

        return run_steps(SAMPLERS[self.sampler], denoiser, carry, schedule, num_steps, start, stop, keys)

    def finish(self, params, carry):
        """VAE decoding. Returns images [B, H, W, 3] (uint8, or float32 in [0, 1]) and finite [B]."""
        latents = SAMPLERS[self.sampler].finish(carry) / self.spec.vae.scaling_factor
        decoder = vae.AutoencoderKL(self.spec.vae, dtype=self.dtype)
        images = decoder.apply({"params": params["vae"]}, latents.astype(self.dtype), method=decoder.decode)
        images = images.astype(jnp.float32)
        finite = jnp.isfinite(images).all(axis=(1, 2, 3))
        images = jnp.clip(images / 2 + 0.5, 0.0, 1.0)
        if self.as_uint8:
            images = jnp.round(images * 255).astype(jnp.uint8)
        return images, finite

    def generate(self, params, ids, zero_negative, seeds, image_index, guidance_scale, schedule, num_steps, noise):
        """All stages in one program."""
        cond, carry, keys = self.initial_state(params, ids, zero_negative, seeds, image_index, schedule, noise)
        carry = self.denoise(params, {}, cond, carry, keys, guidance_scale, schedule, num_steps, 0, num_steps)
        return self.finish(params, carry)


@dataclasses.dataclass
class Generation:
    """One batch's outputs, with what the caller may want to report."""

    images: np.ndarray  # [N, H, W, 3] uint8, or float32 in [0, 1]
    finite: np.ndarray  # [N] bool: False where the model produced NaN/inf
    truncated_prompts: list[str]
    seconds: float

    def raise_if_not_finite(self) -> None:
        if not self.finite.all():
            bad = ", ".join(str(i) for i in np.flatnonzero(~self.finite))
            raise NonFiniteImageError(
                f"image(s) {bad} came out as NaN/inf: the model overflowed (try float32, or another checkpoint)"
            )


class Pipeline:
    """Stable Diffusion (XL) text-to-image, compiled once per image size and batch size.

    pipe = Pipeline.from_pretrained("stabilityai/stable-diffusion-xl-base-1.0")
    images = pipe.generate("a photo of an astronaut riding a horse", seed=0)
    """

    def __init__(
        self,
        spec: ModelSpec,
        params: dict,
        tokenizers: Sequence,
        *,
        mesh: Mesh,
        dtype,
        max_steps: int = 100,
        name: str = "",
    ):
        self.spec = spec
        self.params = params
        self.tokenizers = list(tokenizers)
        self.mesh = mesh
        self.dtype = jnp.dtype(dtype)
        self.max_steps = max_steps
        self.name = name
        self._executables: dict[tuple, jax.stages.Compiled] = {}
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._sharded = NamedSharding(mesh, PartitionSpec(BATCH_AXIS))

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str,
        *,
        dtype: str | None = None,
        max_steps: int = 100,
        devices: Sequence[jax.Device] | None = None,
    ) -> "Pipeline":
        """Loads a diffusers-format SDXL or SD 1.x/2.x checkpoint.

        Args:
          path_or_repo_id: a folder, a Hub repo id, or a built-in name ("tiny", "tiny-sd1": random
            tiny models in the SDXL and SD 1.x layouts).
          dtype: parameter and activation dtype. Defaults to bfloat16 on accelerators and float32 on
            CPU. Schedulers and sampler state are float32 regardless.
          max_steps: the largest step count a call may ask for (the schedule's padded length).
          devices: the devices to shard the batch over (default: all).
        """
        devices = list(devices or jax.devices())
        dtype = dtype or ("float32" if devices[0].platform == "cpu" else "bfloat16")
        folder = checkpoint.resolve(path_or_repo_id, prefer_variant=None if dtype == "float32" else "fp16")
        spec = ModelSpec.from_folder(folder)
        tokenizers = [load_tokenizer(folder / n.replace("text_encoder", "tokenizer")) for n in spec.text_encoder_names]
        mesh = Mesh(np.array(devices), (BATCH_AXIS,))
        replicated = NamedSharding(mesh, PartitionSpec())
        params = load_checkpoint_params(folder, spec, jnp.dtype(dtype), lambda a: place(a, replicated))
        return cls(spec, params, tokenizers, mesh=mesh, dtype=dtype, max_steps=max_steps, name=str(path_or_repo_id))

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    def device_description(self) -> str:
        device = self.mesh.devices.flat[0]
        return f"{self.num_devices}× {getattr(device, 'device_kind', device.platform)}"

    def devices_of(self, num_images: int) -> list[str]:
        """Which device renders each image of an `num_images` batch (the batch is split in order)."""
        per_device = self.padded_batch(num_images) // self.num_devices
        devices = self.mesh.devices.flat
        return [f"{devices[i // per_device].platform.upper()} {devices[i // per_device].id}" for i in range(num_images)]

    def is_compiled(self, height: int, width: int, num_images: int, sampler: str = "euler") -> bool:
        """Whether the progress-reporting programs for this size and batch are ready (else the next run compiles)."""
        program = self._program(sampler, height, width, as_uint8=True)
        return ("denoise", program, self.padded_batch(num_images), False) in self._executables

    def schedule(self, sampler: str, num_steps: int) -> Schedule:
        return _padded_schedule(sampler, self.spec.scheduler, num_steps, self.max_steps)

    def validate(
        self, *, height: int, width: int, num_steps: int, seed: int, guidance_scale: float, sampler: str = "euler"
    ) -> None:
        """Raises ValueError with a user-facing message for any out-of-range argument."""
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; choose one of: {', '.join(SAMPLERS)}")
        f = self.spec.latent_factor
        for label, size in (("height", height), ("width", width)):
            if not isinstance(size, (int, np.integer)) or size < f or size > 4096 or size % f:
                raise ValueError(f"{label} must be a multiple of {f} between {f} and 4096, got {size!r}")
        if not isinstance(num_steps, (int, np.integer)) or not 1 <= num_steps <= self.max_steps:
            raise ValueError(f"steps must be an integer from 1 to {self.max_steps}, got {num_steps!r}")
        if not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed must be an integer from 0 to {MAX_SEED}, got {seed!r}")
        if not np.isfinite(guidance_scale) or not 0 <= guidance_scale <= 100:
            raise ValueError(f"guidance scale must be a number from 0 to 100, got {guidance_scale!r}")

    def _program(self, sampler: str, height: int, width: int, as_uint8: bool) -> GenerateProgram:
        return GenerateProgram(self.spec, sampler, height, width, self.dtype, as_uint8)

    def _compiled_stage(
        self, stage: str, program: GenerateProgram, batch: int, with_noise: bool
    ) -> jax.stages.Compiled:
        """One of the program's stages ("generate", "prepare", "denoise", "finish"), compiled once."""
        key = (stage, program, batch, with_noise)
        if key not in self._executables:
            self._executables[key] = self._lowered_stage(stage, program, batch, with_noise).compile()
        return self._executables[key]

    def _lowered_stage(
        self,
        stage: str,
        program: GenerateProgram,
        batch: int,
        with_noise: bool,
        platforms: tuple[str, ...] | None = None,
    ) -> jax.stages.Lowered:
        inputs = self._abstract_inputs(program.sampler, program.height, program.width, batch, with_noise)
        ids, zero_negative, seeds, image_index, guidance, schedule, num_steps, noise = inputs
        if stage == "generate":
            args = inputs
        elif stage == "prepare":
            args = (ids, zero_negative, seeds, image_index, schedule, noise)
        elif stage == "denoise":
            cond, carry, keys, invariants = self._compiled_stage("prepare", program, batch, with_noise).out_info
            args = (invariants, cond, carry, keys, guidance, schedule, num_steps, num_steps, num_steps)
        else:
            _, carry, _, _ = self._compiled_stage("prepare", program, batch, with_noise).out_info
            args = (carry,)
        shardings = self._sharded
        if stage == "prepare":  # (cond, carry, keys) split by image; the invariants as computed:
            shardings = (self._sharded,) * 3 + (None,)  # the text's keys by image, kernels on every device
        fn = jax.jit(getattr(program, stage), out_shardings=shardings)
        # The mesh in context lets kernels XLA cannot partition (splash attention) split the batch.
        with jax.set_mesh(self.mesh):
            return fn.trace(self.params, *args).lower(lowering_platforms=platforms)

    def _abstract_inputs(self, sampler: str, height: int, width: int, batch: int, with_noise: bool) -> tuple:
        def sharded(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self._sharded)

        def replicated(x):
            return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=self._replicated)

        noise = sharded((batch, *self.spec.latent_shape(height, width)), np.float32)
        return (
            sharded((batch, 2, len(self.spec.text_encoders), self.spec.max_tokens), np.int32),
            sharded((batch,), np.bool_),
            sharded((batch,), np.uint32),
            sharded((batch,), np.uint32),
            sharded((batch,), np.float32),
            jax.tree.map(replicated, self.schedule(sampler, 1)),
            replicated(np.int32(1)),
            noise if with_noise else None,
        )

    def compiled(
        self, height: int, width: int, batch: int | None = None, sampler: str = "euler", stage: str = "generate"
    ) -> jax.stages.Compiled:
        """The whole-generation program (uint8 output) for a size and batch, compiled on first request,
        or one of the stages that progress reports run ("prepare", "denoise", "finish")."""
        program = self._program(sampler, height, width, as_uint8=True)
        return self._compiled_stage(stage, program, self.padded_batch(batch or self.num_devices), False)

    def lowered(
        self,
        height: int,
        width: int,
        batch: int | None = None,
        sampler: str = "euler",
        platforms: tuple[str, ...] | None = None,
    ) -> jax.stages.Lowered:
        """The whole-generation program, lowered for `platforms` (default: the devices'), not compiled.

        Lowering for another platform needs none of its devices: a CPU host can check that the program
        it would run on a TPU lowers (the splash kernels go through Mosaic at this point).
        """
        program = self._program(sampler, height, width, as_uint8=True)
        return self._lowered_stage("generate", program, self.padded_batch(batch or self.num_devices), False, platforms)

    def warmup(
        self, height: int, width: int, batch: int | None = None, sampler: str = "euler", *, progress: bool = False
    ) -> float:
        """Compiles ahead of time for one size; returns the seconds it took.

        Args:
          progress: compile the stage programs that `run(..., on_step=...)` uses, instead of the
            single whole-generation program.
        """
        start = time.perf_counter()
        for stage in ("prepare", "denoise", "finish") if progress else ("generate",):
            self.compiled(height, width, batch, sampler, stage)
        return time.perf_counter() - start

    def padded_batch(self, n: int) -> int:
        """The batch that `n` images compile and run as: a multiple of the device count."""
        return -(-n // self.num_devices) * self.num_devices

    def _tokenize(self, prompts: list[str]) -> tuple[np.ndarray, list[str]]:
        """[N, E, T] ids for every text encoder, and the prompts that were truncated."""
        per_encoder, truncated = [], set()
        for tokenizer in self.tokenizers:
            ids, cut = tokenize(tokenizer, prompts, self.spec.max_tokens)
            per_encoder.append(ids)
            truncated.update(p for p, c in zip(prompts, cut) if c)
        return np.stack(per_encoder, axis=1), [p for p in dict.fromkeys(prompts) if p in truncated]

    def run(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str],
        seeds: Sequence[int],
        image_index: Sequence[int],
        guidance_scales: Sequence[float],
        *,
        steps: int,
        height: int,
        width: int,
        sampler: str = "euler",
        noise: np.ndarray | None = None,
        as_uint8: bool = True,
        on_step: Callable[[int], None] | None = None,
        steps_per_report: int = 1,
    ) -> Generation:
        """Renders one image per entry of the per-image argument lists, in one compiled call.

        Args:
          prompts, negative_prompts, seeds, image_index, guidance_scales: one entry per image.
          noise: optional [N, h, w, C] latents (NHWC) replacing the sampled noise.
          on_step: called with the number of finished steps, every `steps_per_report` steps. The
            loop then runs as a chain of compiled calls; the next is always queued on the devices
            before the host waits for the last, so the devices never idle for the report.

        Raises:
          ValueError: an argument is out of range.
        """
        n = len(prompts)
        if not (n == len(negative_prompts) == len(seeds) == len(image_index) == len(guidance_scales)) or n == 0:
            raise ValueError("every per-image argument needs the same, non-zero, number of entries")
        for seed, g in zip(seeds, guidance_scales):
            self.validate(height=height, width=width, num_steps=steps, seed=seed, guidance_scale=g, sampler=sampler)
        batch = self.padded_batch(n)
        pad = batch - n

        def padded(values, dtype):
            values = np.asarray(values, dtype=dtype)
            return np.concatenate([values, np.repeat(values[-1:], pad, axis=0)]) if pad else values

        start = time.perf_counter()
        positive, truncated = self._tokenize(list(prompts))
        negative, truncated_negative = self._tokenize(list(negative_prompts))
        zero_negative = [self.spec.force_zeros_for_empty_prompt and not p for p in negative_prompts]
        inputs = (
            place(padded(np.stack([negative, positive], axis=1), np.int32), self._sharded),
            place(padded(zero_negative, np.bool_), self._sharded),
            place(padded(seeds, np.uint32), self._sharded),
            place(padded(image_index, np.uint32), self._sharded),
            place(padded(guidance_scales, np.float32), self._sharded),
            jax.tree.map(lambda a: place(a, self._replicated), self.schedule(sampler, steps)),
            place(np.int32(steps), self._replicated),
            None if noise is None else place(padded(noise, np.float32), self._sharded),
        )
        program = self._program(sampler, height, width, as_uint8)
        if on_step is None:
            images, finite = self._compiled_stage("generate", program, batch, noise is not None)(self.params, *inputs)
        else:
            images, finite = self._run_in_stages(program, batch, inputs, steps, on_step, steps_per_report)
        images, finite = _fetch(images)[:n], _fetch(finite)[:n]
        return Generation(images, finite, truncated + truncated_negative, time.perf_counter() - start)

    def _run_in_stages(self, program, batch, inputs, steps, on_step, steps_per_report):
        ids, zero_negative, seeds, image_index, guidance, schedule, num_steps, noise = inputs
        stage = functools.partial(self._compiled_stage, program=program, batch=batch, with_noise=noise is not None)
        prepare = stage("prepare")
        cond, carry, keys, invariants = prepare(self.params, ids, zero_negative, seeds, image_index, schedule, noise)
        denoise = stage("denoise")
        in_flight = []  # (steps done when it finishes, its output)
        for start in range(0, steps, steps_per_report):
            stop = min(start + steps_per_report, steps)
            bounds = [place(np.int32(i), self._replicated) for i in (start, stop)]
            carry = denoise(self.params, invariants, cond, carry, keys, guidance, schedule, num_steps, *bounds)
            in_flight.append((stop, carry))
            if len(in_flight) > 1:
                done, finished = in_flight.pop(0)
                jax.block_until_ready(finished)
                on_step(done)
        images = stage("finish")(self.params, carry)
        jax.block_until_ready(carry)
        on_step(steps)
        return images

    def generate(
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str] = "",
        *,
        seed: int = 0,
        steps: int = 25,
        guidance_scale: float = 5.0,
        height: int | None = None,
        width: int | None = None,
        num_images: int | None = None,
        sampler: str = "euler",
        latents: np.ndarray | None = None,
        output_type: str = "pil",
    ):
        """Generates images; image i depends only on (seed, i), whatever the device count.

        Args:
          prompt, negative_prompt: a string (used for every image) or a list (one per image). An
            empty negative prompt means "none", and is treated as diffusers treats a missing one:
            SDXL (force_zeros_for_empty_prompt) uses zero conditioning, SD 1.x/2.x encodes "".
          height, width: default to the model's native resolution (1024 for SDXL, 512 for SD 1.x).
          num_images: defaults to the prompt list's length, else one image per device.
          sampler: a name in `sampling.SAMPLERS` ("euler", "euler_ancestral", "dpmpp_2m",
            "dpmpp_2m_karras", "ddim"). Each sampler compiles once.
          latents: [N, C, h, w] noise in diffusers' layout, replacing the seeded noise.
          output_type: "pil" for PIL images, "np" for a float32 [N, H, W, 3] array in [0, 1].

        Raises:
          ValueError: an argument is out of range.
          NonFiniteImageError: the output contains NaN/inf.

        Warns:
          PromptTruncatedWarning: a prompt was longer than the text encoder's 77 tokens.
        """
        height = self.spec.native_size if height is None else height
        width = self.spec.native_size if width is None else width
        if output_type not in ("pil", "np"):
            raise ValueError(f'output_type must be "pil" or "np", got {output_type!r}')
        lists = [p for p in (prompt, negative_prompt) if not isinstance(p, str)]
        if num_images is None:
            num_images = len(lists[0]) if lists else (len(latents) if latents is not None else self.num_devices)
        prompts = [prompt] * num_images if isinstance(prompt, str) else list(prompt)
        negatives = [negative_prompt] * num_images if isinstance(negative_prompt, str) else list(negative_prompt)
        if not len(prompts) == len(negatives) == num_images:
            raise ValueError(
                f"got {len(prompts)} prompts and {len(negatives)} negative prompts for {num_images} images"
            )
        noise = None
        if latents is not None:
            h, w, channels = self.spec.latent_shape(height, width)
            expected = (num_images, channels, h, w)
            if tuple(latents.shape) != expected:
                raise ValueError(f"latents must have shape {expected}, got {tuple(latents.shape)}")
            noise = np.asarray(latents, np.float32).transpose(0, 2, 3, 1)
        result = self.run(
            prompts,
            negatives,
            [seed] * num_images,
            list(range(num_images)),
            [guidance_scale] * num_images,
            steps=steps,
            height=height,
            width=width,
            sampler=sampler,
            noise=noise,
            as_uint8=output_type == "pil",
        )
        result.raise_if_not_finite()
        for p in result.truncated_prompts:
            message = f"prompt truncated to {self.spec.max_tokens} tokens: {p!r}"
            warnings.warn(PromptTruncatedWarning(message), stacklevel=2)
        if output_type == "np":
            return result.images
        from PIL import Image

        return [Image.fromarray(image) for image in result.images]


def place(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array that every process holds alike, as a global array; each process fills its own devices.

    Not `jax.device_put`: given devices of several processes, it first checks that they all passed
    the same value, with a collective per array. The loader places arrays from a thread pool, in an
    order that differs between hosts, so those collectives mismatched (and gloo aborted).
    """
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


@functools.lru_cache(maxsize=256)
def _padded_schedule(sampler: str, config: SchedulerConfig, num_steps: int, max_steps: int) -> Schedule:
    return SAMPLERS[sampler].schedule(config, num_steps, max_steps)


def _fetch(array: jax.Array) -> np.ndarray:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)
