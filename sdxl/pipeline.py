"""The host side of generation: a checkpoint loaded onto a device mesh, and requests run on it.

`Pipeline` owns the parameters (replicated over a 1-D mesh of all devices), the tokenizers and the
compiled programs (one per stage of `sdxl.program`, image size, sampler and batch size).
`render(request)` tokenizes a `Request`, places its arrays with the image batch sharded over the
mesh, runs the compiled program and fetches the images: each device renders its share of the
images with no communication. `generate` is the same for one prompt, in diffusers' terms.
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

from . import checkpoints, lora
from .checkpoints import ModelSpec
from .program import GenerateProgram, Inputs
from .request import DEFAULT_GUIDANCE_SCALE, DEFAULT_STEPS, Request
from .sampling import SAMPLERS
from .schedulers import Schedule, SchedulerConfig
from .tokenizer import load_tokenizer, tokenize

BATCH_AXIS = "batch"


class PromptTruncatedWarning(UserWarning):
    """A prompt had more tokens than the text encoder takes; the rest was dropped."""


class NonFiniteImageError(RuntimeError):
    """The model produced NaN or infinite values (typically fp16/bf16 overflow)."""


@dataclasses.dataclass
class Generation:
    """A request's images, with what the caller may want to report."""

    images: np.ndarray  # [N, H, W, 3] uint8, or float32 in [0, 1]
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

    def validated(self, request: Request) -> Request:
        """The request checked against this model and converted (`Request.validated`). Raises ValueError."""
        return request.validated(self.spec, max_steps=self.max_steps)

    # Compiling: every program is compiled once, on first use or ahead of time by `warmup`.

    def _program(
        self, sampler: str | None, height: int, width: int, as_uint8: bool = True, guided: bool = True
    ) -> GenerateProgram:
        """The program for a sampler (None: the model's default sampler), size, output type and guidance."""
        sampler = self.spec.default_sampler if sampler is None else sampler
        # An LCM UNet takes the guidance scale as an embedding, with no unconditional pass (as diffusers).
        guided = guided and self.spec.unet.time_cond_proj_dim is None
        return GenerateProgram(self.spec, sampler, height, width, self.dtype, as_uint8, guided)

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
        noise = sharded((batch, *spec.latent_shape(program.height, program.width)), np.float32)
        return Inputs(
            ids=sharded((batch, 2, len(spec.text_encoders), spec.max_tokens), np.int32),
            zero_negative=sharded((batch,), np.bool_),
            seeds=sharded((batch,), np.uint32),
            image_index=sharded((batch,), np.uint32),
            guidance_scale=sharded((batch,), np.float32),
            schedule=jax.tree.map(replicated, self.schedule(program.sampler, 1)),
            num_steps=replicated(np.int32(1)),
            noise=noise if with_noise else None,
        )

    def compiled(
        self,
        height: int,
        width: int,
        num_images: int | None = None,
        sampler: str | None = None,
        stage: str = "whole",
        *,
        guided: bool = True,
    ) -> jax.stages.Compiled:
        """The whole-generation program (uint8 output) for a size and batch, compiled on first request,
        or one of the stages that progress reports run ("prepare", "denoise", "finish"); with
        classifier-free guidance, or (`guided=False`) the variant for batches that need none."""
        program = self._program(sampler, height, width, guided=guided)
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
        guided: bool = True,
    ) -> float:
        """Compiles ahead of time for one size and batch; returns the seconds it took.

        Args:
          progress: compile the stage programs that `render(..., on_step=...)` uses, instead of the
            single whole-generation program.
          guided: compile the program with classifier-free guidance (requests with a guidance
            scale above 1), else the one without (all at most 1).
        """
        start = time.perf_counter()
        for stage in _stages(progress):
            self.compiled(height, width, num_images, sampler, stage, guided=guided)
        return time.perf_counter() - start

    def is_compiled(
        self,
        height: int,
        width: int,
        num_images: int,
        sampler: str | None = None,
        *,
        progress: bool = False,
        guided: bool = True,
    ) -> bool:
        """Whether `warmup` with the same arguments has nothing left to compile."""
        program = self._program(sampler, height, width, guided=guided)
        batch = self.padded_batch(num_images)
        return all((stage, program, batch, False) in self._executables for stage in _stages(progress))

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

    def _inputs(self, request: Request, batch: int) -> tuple[Inputs, list[str]]:
        """The request's arrays on the mesh, padded to `batch` images; and the truncated prompts."""
        pad = batch - len(request)

        def sharded(values, dtype):
            values = np.asarray(values, dtype=dtype)
            if pad:
                values = np.concatenate([values, np.repeat(values[-1:], pad, axis=0)])
            return place(values, self._sharded)

        positive, truncated = self._tokenize(request.prompts)
        negative, truncated_negative = self._tokenize(request.negative_prompts)
        zero_negative = [self.spec.force_zeros_for_empty_prompt and not p for p in request.negative_prompts]
        inputs = Inputs(
            ids=sharded(np.stack([negative, positive], axis=1), np.int32),
            zero_negative=sharded(zero_negative, np.bool_),
            seeds=sharded(request.seeds, np.uint32),
            image_index=sharded(request.image_index, np.uint32),
            guidance_scale=sharded(request.guidance_scales, np.float32),
            schedule=jax.tree.map(lambda a: place(a, self._replicated), self.schedule(request.sampler, request.steps)),
            num_steps=place(np.int32(request.steps), self._replicated),
            noise=None if request.noise is None else sharded(request.noise, np.float32),
        )
        return inputs, truncated + truncated_negative

    def render(
        self,
        request: Request,
        *,
        as_uint8: bool = True,
        on_step: Callable[[int], None] | None = None,
        steps_per_report: int = 1,
    ) -> Generation:
        """Renders a request's images in one compiled call (or a chain of them, for progress).

        Args:
          as_uint8: images as uint8, else float32 in [0, 1].
          on_step: called with the number of finished steps, every `steps_per_report` steps. The
            loop then runs as a chain of compiled calls; the next is always queued on the devices
            before the host waits for the last, so the devices never idle for the report.

        Raises:
          ValueError: a value of the request is out of range.
        """
        request = self.validated(request)
        n, batch = len(request), self.padded_batch(len(request))
        start = time.perf_counter()
        if request.loras is not None:
            self.set_loras(dict(request.loras))
        inputs, truncated = self._inputs(request, batch)
        program = self._program(request.sampler, request.height, request.width, as_uint8, request.guided)
        stage = functools.partial(
            self._compiled_stage, program=program, batch=batch, with_noise=request.noise is not None
        )
        if on_step is None:
            images, finite = stage("whole")(self.params, inputs)
        else:
            evaluations = SAMPLERS[request.sampler].evaluations(request.steps)
            reports = _ProgressReports(on_step, request.steps)
            images, finite = _run_in_stages(stage, self.params, inputs, evaluations, reports, steps_per_report)
        images, finite = _fetch(images)[:n], _fetch(finite)[:n]
        return Generation(images, finite, self.devices_of(n), truncated, time.perf_counter() - start)

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
            "dpmpp_2m_karras", "ddim", "pndm"); by default the one that reproduces the checkpoint's
            scheduler (`ModelSpec.default_sampler`). Each sampler compiles once.
          latents: [N, C, h, w] noise in diffusers' layout, replacing the seeded noise.
          output_type: "pil" for PIL images, "np" for a float32 [N, H, W, 3] array in [0, 1].

        Raises:
          ValueError: an argument is out of range.
          NonFiniteImageError: the output contains NaN/inf.

        Warns:
          PromptTruncatedWarning: a prompt was longer than the text encoder's 77 tokens.
        """
        if output_type not in ("pil", "np"):
            raise ValueError(f'output_type must be "pil" or "np", got {output_type!r}')
        if num_images is None:
            lists = [p for p in (prompt, negative_prompt) if not isinstance(p, str)]
            num_images = len(lists[0]) if lists else (len(latents) if latents is not None else self.num_devices)
        request = Request.from_prompt(
            prompt, negative_prompt, num_images=num_images, seed=seed, guidance_scale=guidance_scale, steps=steps,
            height=self.spec.native_size if height is None else height,
            width=self.spec.native_size if width is None else width,
            sampler=sampler,
            noise=None if latents is None else np.asarray(latents, np.float32).transpose(0, 2, 3, 1),
        )
        result = self.render(request, as_uint8=output_type == "pil")
        result.raise_if_not_finite()
        for p in result.truncated_prompts:
            message = f"prompt truncated to {self.spec.max_tokens} tokens: {p!r}"
            warnings.warn(PromptTruncatedWarning(message), stacklevel=2)
        if output_type == "np":
            return result.images
        from PIL import Image

        return [Image.fromarray(image) for image in result.images]


def _stages(progress: bool) -> tuple[str, ...]:
    return ("prepare", "denoise", "finish") if progress else ("whole",)


class _ProgressReports:
    """Reports model evaluations as steps done: one each, but for PLMS's second step, which takes two
    (its last report is then the step count again, which is not repeated)."""

    def __init__(self, on_step: Callable[[int], None], steps: int):
        self.on_step, self.steps, self.reported = on_step, steps, 0

    def __call__(self, evaluations: int) -> None:
        done = min(evaluations, self.steps)
        if done > self.reported:
            self.reported = done
            self.on_step(done)


def _run_in_stages(stage, params, inputs: Inputs, evaluations: int, on_step, steps_per_report: int):
    """The whole program's work as prepare, denoise over `steps_per_report` model evaluations at a
    time, finish; `on_step` hears the evaluations done."""
    state, invariants = stage("prepare")(params, inputs)
    denoise = stage("denoise")
    replicated = inputs.num_steps.sharding
    in_flight = []  # (steps done when it finishes, its output)
    carry = state.carry
    for start in range(0, evaluations, steps_per_report):
        stop = min(start + steps_per_report, evaluations)
        bounds = [place(np.int32(i), replicated) for i in (start, stop)]
        carry = denoise(params, invariants, state.replace(carry=carry), inputs, *bounds)
        in_flight.append((stop, carry))
        if len(in_flight) > 1:
            done, finished = in_flight.pop(0)
            jax.block_until_ready(finished)
            on_step(done)
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
