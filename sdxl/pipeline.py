"""The host side of generation: a checkpoint loaded onto a device mesh, and requests run on it.

`Pipeline` owns the parameters (replicated over a 1-D mesh of all devices), the tokenizers and the
compiled programs (one per stage of `sdxl.program`, image size, sampler, batch size and starting
point). `render(request)` tokenizes a `Request`, places its arrays with the image batch sharded
over the mesh, runs the compiled program and fetches the images: each device renders its share of
the images with no communication. `generate` is the same for one prompt, in diffusers' terms:
text-to-image, image-to-image, inpainting, and the SDXL refiner's two uses.
"""

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import checkpoints, images, lora, previews
from .checkpoints import ModelSpec
from .program import GenerateProgram, Inputs
from .request import DEFAULT_AESTHETIC_SCORES, DEFAULT_GUIDANCE_SCALE, DEFAULT_STEPS, Request, default_strength
from .sampling import SAMPLERS
from .schedulers import Schedule, SchedulerConfig
from .tokenizer import kept_text, load_tokenizer, tokenize

BATCH_AXIS = "batch"


class PromptTruncatedWarning(UserWarning):
    """A prompt had more tokens than the text encoder takes; the rest was dropped."""


class NonFiniteImageError(RuntimeError):
    """The model produced NaN or infinite values (typically fp16/bf16 overflow)."""


@dataclasses.dataclass
class Generation:
    """A request's images, with what the caller may want to report."""

    images: np.ndarray  # [N, H, W, 3] uint8, or float32 in [0, 1]; or a jax.Array of latents, left on the devices
    finite: np.ndarray  # [N] bool: False where the model produced NaN/inf
    devices: list[str]  # the device that rendered each image
    truncated_prompts: list[str]
    seconds: float  # the whole call's time, compilation included

    def part(self, start: int, stop: int, request: Request) -> "Generation":
        """Images start..stop-1 of a merged batch: `request`'s share."""
        texts = set(request.prompts) | set(request.negative_prompts)
        return Generation(
            self.images[start:stop], self.finite[start:stop], self.devices[start:stop],
            [p for p in self.truncated_prompts if p in texts], self.seconds,
        )

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
        self.base_params = params  # as loaded; `params` is them with the active LoRAs applied
        self.params = params
        self.loras: dict[str, float] = {}  # the active LoRAs: {source: scale}
        self._lora_files: dict[str, lora.Lora] = {}
        self.tokenizers = list(tokenizers)
        self.mesh = mesh
        self.dtype = jnp.dtype(dtype)
        self.max_steps = max_steps
        self.name = name
        self.refiner: Pipeline | None = None  # continues requests with `refine_from` (`set_refiner`)
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
        config: str | None = None,
        scheduler: dict | None = None,
        unet: str | None = None,
    ) -> "Pipeline":
        """Loads an SDXL or SD 1.x/2.x checkpoint: a diffusers folder or Hub repo, or a single file.

        Args:
          path_or_repo_id: a folder, a Hub repo id, a built-in name ("tiny", "tiny-sd1": random
            tiny models in the SDXL and SD 1.x layouts), a `.safetensors` file in the original
            (A1111 / SGM) layout, or a Hub file "owner/name/file.safetensors"; see
            `sdxl.checkpoints.resolve`.
          dtype: parameter and activation dtype. Defaults to bfloat16 on accelerators and float32 on
            CPU. Schedulers and sampler state are float32 regardless.
          max_steps: the largest step count a call may ask for (the schedule's padded length).
          devices: the devices to shard the batch over (default: all).
          config: for a single file, the configs and tokenizers to use: a built-in name
            ("sdxl-base-1.0", "sd-1.5", "sd-2.1", "sd-2.1-base") or a diffusers folder; by default
            the published ones of the family its keys show.
          scheduler: fields that replace the checkpoint's scheduler config, e.g.
            {"prediction_type": "epsilon"} or {"_class_name": "EulerAncestralDiscreteScheduler",
            "timestep_spacing": "trailing"}; the default sampler follows the class.
          unet: a UNet weights file in diffusers' keys that replaces the checkpoint's UNet (a local
            file or "owner/name/file.safetensors" on the Hub), as SDXL-Lightning's UNets are used:
            `from_pretrained("stabilityai/stable-diffusion-xl-base-1.0", unet="ByteDance/SDXL-Lightning/
            sdxl_lightning_4step_unet.safetensors", scheduler={"timestep_spacing": "trailing"})`.
        """
        devices = list(devices or jax.devices())
        dtype = jnp.dtype(dtype or ("float32" if devices[0].platform == "cpu" else "bfloat16"))
        checkpoint = checkpoints.resolve(path_or_repo_id, dtype=dtype, config=config, scheduler=scheduler, unet=unet)
        spec = checkpoint.spec
        tokenizers = [load_tokenizer(checkpoint.folder / name) for name in spec.tokenizer_names]
        mesh = Mesh(np.array(devices), (BATCH_AXIS,))
        replicated = NamedSharding(mesh, PartitionSpec())
        params = checkpoint.load(dtype, lambda a: place(a, replicated))
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

    def padded_batch(self, num_images: int) -> int:
        """The batch that `num_images` images compile and run as: a multiple of the device count."""
        return -(-num_images // self.num_devices) * self.num_devices

    def schedule(self, sampler: str, steps: int) -> Schedule:
        """The sampler's noise schedule for `steps` steps, padded to `max_steps`."""
        return _padded_schedule(sampler, self.spec.scheduler, steps, self.max_steps)

    def set_refiner(self, refiner: "Pipeline | None") -> None:
        """Makes `refiner` (an SDXL refiner, loaded on the same devices) the model that finishes
        requests with `refine_from`, as diffusers' "ensemble of expert denoisers": this model runs
        the schedule down to that fraction of the noise, and the refiner continues the latents,
        which stay on the devices. Both models' weights stay on every device.

        Raises:
          CheckpointError: the refiner cannot continue this model's latents: other latent channels,
            scaling or VAE downscaling, another training schedule, other devices, or an inpainting UNet.
        """
        if refiner is not None:
            self._check_refiner(refiner)
        self.refiner = refiner

    def _check_refiner(self, refiner: "Pipeline") -> None:
        mine, theirs = self.spec, refiner.spec
        checks = {
            "latent channels": (mine.vae.latent_channels, theirs.vae.latent_channels),
            "VAE downscaling": (mine.vae.downscale_factor, theirs.vae.downscale_factor),
            "latent scaling": (
                (mine.vae.scaling_factor, mine.vae.latents_mean, mine.vae.latents_std),
                (theirs.vae.scaling_factor, theirs.vae.latents_mean, theirs.vae.latents_std),
            ),
            "training timesteps": (mine.scheduler.num_train_timesteps, theirs.scheduler.num_train_timesteps),
            "devices": (list(self.mesh.devices.flat), list(refiner.mesh.devices.flat)),
        }
        for what, (base_value, refiner_value) in checks.items():
            if base_value != refiner_value:
                raise checkpoints.CheckpointError(
                    f"the refiner {refiner.name} cannot continue {self.name}'s latents: its {what} differ "
                    f"({refiner_value} vs {base_value})"
                )
        if theirs.is_inpainting:
            raise checkpoints.CheckpointError(f"the refiner {refiner.name} is an inpainting model")

    def validated(self, request: Request) -> Request:
        """The request checked against this model and converted (`Request.validated`). Raises ValueError."""
        if request.refine_from is not None and self.refiner is None:
            raise ValueError("no refiner is loaded to refine with (start the demo or the CLI with --refiner)")
        return request.validated(self.spec, max_steps=self.max_steps)

    # Compiling: every program is compiled once, on first use or ahead of time by `warmup`.

    def _program(
        self,
        sampler: str | None,
        height: int,
        width: int,
        output: str = "uint8",
        guided: bool = True,
        start_from: str = "noise",
        inpaint: bool = False,
    ) -> GenerateProgram:
        """The program for a sampler (None: the model's default sampler), size, output, guidance and
        starting point (`sdxl.program.START_FROM`, with or without a mask)."""
        sampler = self.spec.default_sampler if sampler is None else sampler
        # An LCM UNet takes the guidance scale as an embedding, with no unconditional pass (as diffusers).
        guided = guided and self.spec.unet.time_cond_proj_dim is None
        factors = previews.factors_for(self.spec, self.name)
        return GenerateProgram(
            self.spec, sampler, height, width, self.dtype, output, guided, start_from, inpaint, factors
        )

    def _request_program(self, request: Request, output: str = "uint8") -> GenerateProgram:
        return self._program(request.sampler, request.height, request.width, **program_variant(request, output))

    def _compiled_stage(
        self, stage: str, program: GenerateProgram, batch: int, with_noise: bool
    ) -> jax.stages.Compiled:
        """One of the program's stages (`sdxl.program.STAGES`), compiled once."""
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
        inputs = self._abstract_inputs(program, batch, with_noise)
        if stage in ("whole", "prepare"):
            args = (inputs,)
        else:
            state, invariants = self._compiled_stage("prepare", program, batch, with_noise).out_info
            step = inputs.num_steps
            args = (invariants, state, inputs, step, step) if stage == "denoise" else (state,)
        # `prepare` keeps the invariants as computed: the text's keys split by image, kernels on every device.
        shardings = (self._sharded, None) if stage == "prepare" else self._sharded
        fn = jax.jit(getattr(program, stage), out_shardings=shardings)
        # The mesh in context lets kernels XLA cannot partition (splash attention) split the batch.
        with jax.set_mesh(self.mesh):
            return fn.trace(self.params, *args).lower(lowering_platforms=platforms)

    def _abstract_inputs(self, program: GenerateProgram, batch: int, with_noise: bool) -> Inputs:
        def sharded(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self._sharded)

        def replicated(x):
            return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=self._replicated)

        spec = self.spec
        latents = sharded((batch, *spec.latent_shape(program.height, program.width)), np.float32)
        pixels = (batch, program.height, program.width)
        images = {
            "noise": {},
            "image": {"image": sharded((*pixels, 3), np.float32), "from_noise": replicated(np.bool_(False))},
            "latents": {"image": latents},
        }[program.start_from]
        time_ids = len(spec.time_ids(program.height, program.width, 0.0))
        return Inputs(
            ids=sharded((batch, 2, len(spec.text_encoders), spec.max_tokens), np.int32),
            zero_negative=sharded((batch,), np.bool_),
            time_ids=sharded((batch, 2, time_ids), np.float32) if spec.is_sdxl else None,
            seeds=sharded((batch,), np.uint32),
            image_index=sharded((batch,), np.uint32),
            guidance_scale=sharded((batch,), np.float32),
            schedule=jax.tree.map(replicated, self.schedule(program.sampler, 1)),
            num_steps=replicated(np.int32(1)),
            first_step=replicated(np.int32(0)),
            stop_step=replicated(np.int32(1)),
            noise=latents if with_noise else None,
            mask=sharded((*pixels, 1), np.float32) if program.inpaint else None,
            **images,
        )

    def compiled(
        self,
        height: int,
        width: int,
        num_images: int | None = None,
        sampler: str | None = None,
        stage: str = "whole",
        **variant,
    ) -> jax.stages.Compiled:
        """The whole-generation program for a size and batch, compiled on first request, or one of the
        stages that progress reports run ("prepare", "denoise", "finish").

        Args:
          variant: `GenerateProgram`'s other fields, by default uint8 output, classifier-free
            guidance, from text: `output` ("uint8", "float", "latents"), `guided` (False: the
            variant for batches that need no guidance), `start_from` ("noise", "image", "latents")
            and `inpaint`.
        """
        program = self._program(sampler, height, width, **variant)
        return self._compiled_stage(stage, program, self.padded_batch(num_images or self.num_devices), False)

    def lowered(
        self,
        height: int,
        width: int,
        num_images: int | None = None,
        sampler: str | None = None,
        platforms: tuple[str, ...] | None = None,
    ) -> jax.stages.Lowered:
        """The whole-generation program, lowered for `platforms` (default: the devices'), not compiled.

        Lowering for another platform needs none of its devices: a CPU host can check that the program
        it would run on a TPU lowers (the splash kernels go through Mosaic at this point).
        """
        program = self._program(sampler, height, width)
        batch = self.padded_batch(num_images or self.num_devices)
        return self._lowered_stage("whole", program, batch, False, platforms)

    def warmup(
        self,
        height: int,
        width: int,
        num_images: int | None = None,
        sampler: str | None = None,
        *,
        progress: bool = False,
        **variant,
    ) -> float:
        """Compiles ahead of time for one size and batch; returns the seconds it took.

        Args:
          progress: compile the stage programs that `render(..., on_step=...)` uses, instead of the
            single whole-generation program.
          variant: which program (`compiled`): e.g. `guided=False` for requests with guidance
            scales at most 1, `start_from="image"` for image-to-image.
        """
        start = time.perf_counter()
        for stage in _stages(progress):
            self.compiled(height, width, num_images, sampler, stage, **variant)
        return time.perf_counter() - start

    def is_compiled(
        self,
        height: int,
        width: int,
        num_images: int,
        sampler: str | None = None,
        *,
        progress: bool = False,
        **variant,
    ) -> bool:
        """Whether `warmup` with the same arguments has nothing left to compile."""
        program = self._program(sampler, height, width, **variant)
        batch = self.padded_batch(num_images)
        return all((stage, program, batch, False) in self._executables for stage in _stages(progress))

    def programs_of(self, request: Request, num_images: int | None = None) -> list[tuple["Pipeline", dict]]:
        """The programs a request (at `num_images`, by default its own count) runs, as (pipeline,
        `warmup` arguments): one, or with `refine_from` this model's and the refiner's."""
        sampler = self.spec.default_sampler if request.sampler is None else request.sampler
        size = dict(height=request.height, width=request.width, num_images=num_images or len(request), sampler=sampler)
        if request.refine_from is None:
            return [(self, size | program_variant(request))]
        return [
            (self, size | program_variant(request, output="latents")),
            (self.refiner, size | dict(guided=request.guided, start_from="latents")),
        ]

    def warmup_request(self, request: Request, num_images: int | None = None, *, progress: bool = False) -> float:
        """`warmup` for the programs `request` runs (`programs_of`); returns the seconds it took."""
        return sum(pipe.warmup(**kwargs, progress=progress) for pipe, kwargs in self.programs_of(request, num_images))

    def is_compiled_for(self, request: Request, num_images: int | None = None, *, progress: bool = False) -> bool:
        """Whether `warmup_request` with the same arguments has nothing left to compile."""
        programs = self.programs_of(request, num_images)
        return all(pipe.is_compiled(**kwargs, progress=progress) for pipe, kwargs in programs)

    # LoRAs

    def set_loras(self, loras: Mapping[str, float]) -> float:
        """Makes `loras` ({source: scale}) the active LoRAs, in place of the previous ones ({} clears
        them), as diffusers' `set_adapters(names, adapter_weights)`; returns the seconds it took.

        The weights change, the compiled programs do not: switching never recompiles, and the layers
        no active LoRA touches are the loaded arrays themselves, so clearing restores them exactly.
        Each source's file is read once (`lora.locate`: a local .safetensors file, a Hub repo id, or
        "owner/name/file.safetensors").

        Raises:
          CheckpointError: a source is missing or does not fit the model; the active LoRAs stay as they were.
        """
        wanted = {str(source): float(scale) for source, scale in loras.items()}
        if wanted == self.loras:
            return 0.0
        start = time.perf_counter()
        for source in wanted:
            if source not in self._lora_files:
                self._lora_files[source] = lora.read(lora.locate(source), self.spec, name=source)
        layers = [(self._lora_files[source], scale) for source, scale in wanted.items()]
        self.params = jax.block_until_ready(lora.apply(self.base_params, layers, self._place_replicated))
        self.loras = wanted
        return time.perf_counter() - start

    def _place_replicated(self, array: np.ndarray) -> jax.Array:
        return place(array, self._replicated)

    # Running

    def _tokenize(self, prompts: Sequence[str]) -> tuple[np.ndarray, list[str]]:
        """[N, E, T] ids for every text encoder, and the prompts that were truncated. Each distinct
        prompt is tokenized once: a batch usually repeats one prompt for all its images."""
        distinct = list(dict.fromkeys(prompts))
        per_encoder, truncated = [], set()
        for tokenizer in self.tokenizers:
            ids, cut = tokenize(tokenizer, distinct, self.spec.max_tokens)
            per_encoder.append(ids)
            truncated.update(p for p, c in zip(distinct, cut) if c)
        row = {p: i for i, p in enumerate(distinct)}
        ids = np.stack(per_encoder, axis=1)[[row[p] for p in prompts]]
        return ids, [p for p in distinct if p in truncated]

    def steps_run(self, request: Request) -> tuple[int, int]:
        """The steps first..stop-1 of the request's schedule that run, as diffusers picks them: a
        strength skips the first steps (`get_timesteps`), `denoising_start` the steps at or above
        its timestep cutoff, and `denoising_end` stops before the steps below its own.

        Raises:
          ValueError: no step is left to run.
        """
        steps = request.steps
        timesteps = np.asarray(self.schedule(request.sampler, steps).timesteps)[:steps]
        train_steps = self.spec.scheduler.num_train_timesteps

        def cutoff(fraction: float) -> int:
            return int(round(train_steps - fraction * train_steps))

        first, stop = 0, steps
        if request.start_from == "image":
            first = steps - min(int(steps * request.strength), steps)
        elif request.denoising_start is not None:
            first = steps - int((timesteps < cutoff(request.denoising_start)).sum())
        if request.denoising_end is not None:
            stop = first + int((timesteps[first:] >= cutoff(request.denoising_end)).sum())
        if stop <= first:
            raise ValueError(
                f"denoising_start {request.denoising_start} and denoising_end {request.denoising_end} leave none of "
                f"the {steps} steps to run; move them apart or add steps"
            )
        return first, stop

    def tokenized(self, request: Request) -> Request:
        """The request with its prompts tokenized (`Request.tokens`), each distinct one once: done where
        it is made, so the device queue's one worker never spends its time on text."""
        positive, truncated = self._tokenize(request.prompts)
        negative, truncated_negative = self._tokenize(request.negative_prompts)
        ids = np.stack([negative, positive], axis=1).astype(np.int32)
        return dataclasses.replace(request, tokens=(ids, tuple(dict.fromkeys(truncated + truncated_negative))))

    def read_prompt(self, prompt: str) -> str:
        """The part of `prompt` the text encoders read (`spec.max_tokens` tokens): what a saved
        image's parameters should record."""
        return kept_text(self.tokenizers[0], prompt, self.spec.max_tokens)

    def _inputs(self, request: Request, batch: int) -> tuple[Inputs, list[str]]:
        """The request's arrays on the mesh, padded to `batch` images; and the truncated prompts."""
        pad = batch - len(request)

        def sharded(values, dtype):
            if isinstance(values, jax.Array):  # already on the devices (a base model's latents)
                values = values.astype(dtype)
                if pad:
                    values = jnp.concatenate([values, jnp.repeat(values[-1:], pad, axis=0)])
                return jax.device_put(values, self._sharded)
            values = np.asarray(values, dtype=dtype)
            if pad:
                values = np.concatenate([values, np.repeat(values[-1:], pad, axis=0)])
            return place(values, self._sharded)

        def replicated(value):
            return place(np.asarray(value), self._replicated)

        spec, n = self.spec, len(request)
        if request.tokens is None:
            request = self.tokenized(request)
        ids, truncated = request.tokens
        zero_negative = [spec.force_zeros_for_empty_prompt and not p for p in request.negative_prompts]
        time_ids = None
        if spec.is_sdxl:
            score, negative_score = request.aesthetic_scores
            pair = [spec.time_ids(request.height, request.width, s) for s in (negative_score, score)]
            time_ids = sharded(np.broadcast_to(np.array(pair, np.float32), (n, *np.shape(pair))), np.float32)
        first, stop = self.steps_run(request)
        start = {}
        if request.start_from == "image":
            pixels = request.images if request.images.dtype != np.uint8 else request.images / np.float32(255)
            # diffusers' inpainting starts from noise alone at strength 1; its image-to-image never does.
            from_noise = request.masks is not None and request.strength == 1
            start = {"image": sharded(pixels * 2 - 1, np.float32), "from_noise": replicated(from_noise)}
        elif request.start_from == "latents":
            start = {"image": sharded(request.start_latents, np.float32)}
        inputs = Inputs(
            ids=sharded(ids, np.int32),
            zero_negative=sharded(zero_negative, np.bool_),
            time_ids=time_ids,
            seeds=sharded(request.seeds, np.uint32),
            image_index=sharded(request.image_index, np.uint32),
            guidance_scale=sharded(request.guidance_scales, np.float32),
            schedule=jax.tree.map(lambda a: place(a, self._replicated), self.schedule(request.sampler, request.steps)),
            num_steps=replicated(np.int32(request.steps)),
            first_step=replicated(np.int32(first)),
            stop_step=replicated(np.int32(stop)),
            noise=None if request.noise is None else sharded(request.noise, np.float32),
            mask=None if request.masks is None else sharded(request.masks[..., None], np.float32),
            **start,
        )
        return inputs, list(truncated)

    def render(
        self,
        request: Request,
        *,
        output: str = "uint8",
        on_step: Callable[[int], None] | None = None,
        on_preview: Callable[[int, np.ndarray], None] | None = None,
        steps_per_report: int = 1,
    ) -> Generation:
        """Renders a request's images in one compiled call (or a chain of them, for progress).

        Args:
          output: "uint8" images, "float" (float32 in [0, 1]), or "latents": the sampler's latents
            [N, h, w, C], undecoded and left on the devices, for a refiner to continue
            (`Request.start_latents`).
          on_step: called with the number of finished steps (of those that run: fewer than the
            request's steps for image-to-image), every `steps_per_report` steps. The loop then runs
            as a chain of compiled calls; the next is always queued on the devices before the host
            waits for the last, so the devices never idle for the report.
          on_preview: called with the same step count and [N, h, w, 3] uint8 previews of the
            images (`sdxl.previews`), at the latents' size, as the steps are reported.

        Raises:
          ValueError: a value of the request is out of range.
        """
        request = self.validated(request)
        if request.refine_from is not None:
            return self._render_refined(request, output, on_step, on_preview, steps_per_report)
        n, batch = len(request), self.padded_batch(len(request))
        start = time.perf_counter()
        if request.loras is not None:
            self.set_loras(dict(request.loras))
        inputs, truncated = self._inputs(request, batch)
        program = self._request_program(request, output)
        stage = functools.partial(
            self._compiled_stage, program=program, batch=batch, with_noise=request.noise is not None
        )
        if on_step is None and on_preview is None:
            images, finite = stage("whole")(self.params, inputs)
        else:
            evaluations = SAMPLERS[request.sampler].evaluations
            first, stop = self.steps_run(request)
            reports = _ProgressReports(on_step, on_preview, stop - first, evaluations(first), n)
            images, finite = _run_in_stages(
                stage, self.params, inputs, evaluations(first), evaluations(stop), reports, steps_per_report
            )
        images = images[:n] if output == "latents" else _fetch(images)[:n]
        return Generation(images, _fetch(finite)[:n], self.devices_of(n), truncated, time.perf_counter() - start)

    def _render_refined(self, request: Request, output: str, on_step, on_preview, steps_per_report) -> Generation:
        """This model down to `request.refine_from` of the noise (`denoising_end`), then the refiner from
        there (`denoising_start`) on the latents, which never leave the devices. The request's LoRAs
        are this model's; the refiner keeps its own. The reports count both runs' steps as one."""
        handing_off = dataclasses.replace(request, refine_from=None, denoising_end=request.refine_from)
        start, stop = self.steps_run(handing_off)

        def continued(report):
            return None if report is None else (lambda done, *preview: report(stop - start + done, *preview))

        first = self.render(handing_off, output="latents", on_step=on_step, on_preview=on_preview,
                            steps_per_report=steps_per_report)
        refining = dataclasses.replace(
            request, refine_from=None, images=None, masks=None, start_latents=first.images,
            denoising_start=request.refine_from, loras=None, tokens=None,  # the refiner's own tokenizers
        )
        second = self.refiner.render(
            refining, output=output, on_step=continued(on_step), on_preview=continued(on_preview),
            steps_per_report=steps_per_report,
        )
        second.seconds += first.seconds
        second.truncated_prompts = list(dict.fromkeys(first.truncated_prompts + second.truncated_prompts))
        return second

    def generate(
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str] = "",
        *,
        seed: int = 0,
        steps: int = DEFAULT_STEPS,
        guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
        height: int | None = None,
        width: int | None = None,
        num_images: int | None = None,
        sampler: str | None = None,
        latents: np.ndarray | None = None,
        image=None,
        mask_image=None,
        strength: float | None = None,
        denoising_start: float | None = None,
        denoising_end: float | None = None,
        aesthetic_score: float = DEFAULT_AESTHETIC_SCORES[0],
        negative_aesthetic_score: float = DEFAULT_AESTHETIC_SCORES[1],
        refine_from: float | None = None,
        padding_mask_crop: int | None = None,
        output_type: str = "pil",
    ):
        """Generates images; image i depends only on (seed, i), whatever the device count.

        Text-to-image, or with `image` image-to-image (diffusers' StableDiffusion[XL]Img2ImgPipeline),
        with `image` and `mask_image` inpainting (StableDiffusion[XL]InpaintPipeline: with an
        inpainting UNet, or with any other, which keeps the unmasked region after every step).

        Args:
          prompt, negative_prompt: a string (used for every image) or a list (one per image). An
            empty negative prompt means "none", and is treated as diffusers treats a missing one:
            SDXL (force_zeros_for_empty_prompt) uses zero conditioning, SD 1.x/2.x encodes "".
          height, width: default to the image's size, else the model's native resolution (1024
            for SDXL, 512 for SD 1.x).
          num_images: defaults to the prompt or image list's length, else one image per device.
          sampler: a name in `sampling.SAMPLERS` ("euler", "euler_ancestral", "dpmpp_2m",
            "dpmpp_2m_karras", "ddim", "pndm", "lcm", "tcd"); by default the one that reproduces
            the checkpoint's scheduler (`ModelSpec.default_sampler`). Each sampler compiles once.
          latents: [N, C, h, w] noise in diffusers' layout, replacing the seeded noise: the starting
            noise, or the noise added to the image's latents.
          image: a PIL image or an [H, W, 3] array (uint8, or floats in [0, 1]) for every image, or
            a list of them (or an [N, H, W, 3] array), one per image. Its size is the output's, and
            must be one the model renders (a multiple of `spec.latent_factor`). Or the latents a
            base model returned (`output_type="latent"`), which `denoising_start` continues.
          mask_image: for inpainting, a PIL image or array (or one per image): white (> 0.5) is
            repainted, black kept.
          strength: how far the image is noised, 0 (not at all) to 1 (entirely): the last
            int(steps * strength) steps run. Defaults as diffusers': image-to-image 0.3 for SDXL
            and 0.8 for SD 1.x/2.x, inpainting 0.9999 for SDXL and 1 for SD 1.x/2.x.
          denoising_end: stop at this fraction of the schedule and return latents for a refiner
            (with `output_type="latent"`).
          denoising_start: continue a base model's latents (`image`) from this fraction.
          aesthetic_score, negative_aesthetic_score: the SDXL refiner's conditioning.
          refine_from: finish with the refiner (`set_refiner`) from this fraction of the noise: both
            runs of the handoff above in one call.
          padding_mask_crop: diffusers' inpainting of a crop around the mask, pasted back; not
            implemented (a ValueError says so).
          output_type: "pil" for PIL images, "np" for a float32 [N, H, W, 3] array in [0, 1], or
            "latent": the latents as a jax.Array [N, h, w, C], left on the devices.

        Raises:
          ValueError: an argument is out of range.
          NonFiniteImageError: the output contains NaN/inf.

        Warns:
          PromptTruncatedWarning: a prompt was longer than the text encoder's 77 tokens.
        """
        if output_type not in ("pil", "np", "latent"):
            raise ValueError(f'output_type must be "pil", "np" or "latent", got {output_type!r}')
        if padding_mask_crop is not None:
            raise ValueError(
                "padding_mask_crop is not implemented: crop the image and the mask around the masked region "
                "(plus a margin) to a size the model renders, inpaint that, and paste the result back"
            )
        start_latents = None
        if isinstance(image, jax.Array) and image.ndim == 4 and image.shape[-1] == self.spec.vae.latent_channels:
            start_latents, image = image, None
        image, mask_image = _per_image(image, images.pixels), _per_image(mask_image, images.mask)
        if num_images is None:
            lists = [p for p in (prompt, negative_prompt) if not isinstance(p, str)]
            given = [len(a) for a in (latents, start_latents, image) if a is not None and len(a) > 1]
            num_images = len(lists[0]) if lists else (given[0] if given else self.num_devices)
        image, mask_image = (_repeated(a, num_images) for a in (image, mask_image))
        size = None if image is None else image.shape[1:3]
        f = self.spec.latent_factor
        if size is not None and (size[0] % f or size[1] % f):
            fitting = f"{max(f, size[1] // f * f)}x{max(f, size[0] // f * f)}"
            raise ValueError(
                f"the image is {size[1]}x{size[0]} (width x height); this model renders sizes in multiples of {f}: "
                f"crop or resize it, to {fitting} for example"
            )
        if start_latents is not None:
            size = tuple(d * self.spec.vae.downscale_factor for d in start_latents.shape[1:3])
        native = (self.spec.native_size,) * 2
        if strength is None:
            strength = default_strength(self.spec, inpainting=mask_image is not None)
        request = Request.from_prompt(
            prompt, negative_prompt, num_images=num_images, seed=seed, guidance_scale=guidance_scale, steps=steps,
            height=(size or native)[0] if height is None else height,
            width=(size or native)[1] if width is None else width,
            sampler=sampler,
            noise=None if latents is None else np.asarray(latents, np.float32).transpose(0, 2, 3, 1),
        )
        request = dataclasses.replace(
            request, images=image, masks=mask_image, strength=strength, denoising_start=denoising_start,
            denoising_end=denoising_end, start_latents=start_latents,
            aesthetic_scores=(aesthetic_score, negative_aesthetic_score), refine_from=refine_from,
        )
        output = {"pil": "uint8", "np": "float", "latent": "latents"}[output_type]
        result = self.render(request, output=output)
        result.raise_if_not_finite()
        for p in result.truncated_prompts:
            message = f"prompt truncated to {self.spec.max_tokens} tokens: {p!r}"
            warnings.warn(PromptTruncatedWarning(message), stacklevel=2)
        if output_type != "pil":
            return result.images
        from PIL import Image

        return [Image.fromarray(image) for image in result.images]


def program_variant(request: Request, output: str = "uint8") -> dict:
    """The program a request needs, as `Pipeline.compiled`'s `variant` arguments."""
    return dict(output=output, guided=request.guided, start_from=request.start_from, inpaint=request.masks is not None)


def _repeated(stack: np.ndarray | None, n: int) -> np.ndarray | None:
    """One image or mask for all `n` images: [1, ...] repeated to [n, ...]."""
    return stack if stack is None or len(stack) != 1 else np.repeat(stack, n, axis=0)


def _per_image(given, read) -> np.ndarray | None:
    """An image or mask for every image ([1, ...]) or a list or stack of them ([N, ...]), each read by `read`."""
    if given is None:
        return None
    if isinstance(given, list | tuple) or (isinstance(given, np.ndarray) and given.ndim == 4):
        return np.stack([read(item) for item in given])
    return read(given)[None]


def _stages(progress: bool) -> tuple[str, ...]:
    return ("prepare", "denoise", "finish") if progress else ("whole",)


class _ProgressReports:
    """Reports model evaluations as steps done since the first that runs: one each, but for PLMS's
    second step, which takes two (its last report is then the step count again, which is not
    repeated); with the previews of the first `n` images."""

    def __init__(self, on_step, on_preview, steps: int, first: int, n: int):
        self.on_step, self.on_preview, self.steps, self.first, self.n = on_step, on_preview, steps, first, n
        self.reported = 0

    def __call__(self, evaluations: int, preview: jax.Array | None = None) -> None:
        done = min(evaluations - self.first, self.steps)
        if done <= self.reported:
            return
        self.reported = done
        if self.on_step is not None:
            self.on_step(done)
        if self.on_preview is not None and preview is not None:
            self.on_preview(done, _fetch(preview)[: self.n])


def _run_in_stages(stage, params, inputs: Inputs, first: int, evaluations: int, on_step, steps_per_report: int):
    """The whole program's work as prepare, denoise over `steps_per_report` model evaluations at a
    time (from `first`), finish; `on_step` hears the evaluations done."""
    state, invariants = stage("prepare")(params, inputs)
    denoise = stage("denoise")
    replicated = inputs.num_steps.sharding
    in_flight = []  # (steps done when it finishes, its carry, its previews)
    carry = state.carry
    for start in range(first, evaluations, steps_per_report):
        stop = min(start + steps_per_report, evaluations)
        bounds = [place(np.int32(i), replicated) for i in (start, stop)]
        carry, preview = denoise(params, invariants, state.replace(carry=carry), inputs, *bounds)
        in_flight.append((stop, carry, preview))
        if len(in_flight) > 1:
            done, finished, preview = in_flight.pop(0)
            jax.block_until_ready(finished)
            on_step(done, preview)
    images = stage("finish")(params, state.replace(carry=carry))
    jax.block_until_ready(carry)
    on_step(evaluations)
    return images


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
