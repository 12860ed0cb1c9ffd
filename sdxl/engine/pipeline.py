"""A checkpoint loaded onto a device mesh, and requests rendered on it.

`Pipeline` owns the loaded model (parameters replicated over the mesh, the active LoRAs, an optional
refiner) and renders a `Request`: it picks the `GenerateProgram` the request needs, builds its
inputs (`sdxl.engine.inputs`), runs the compiled program (`sdxl.engine.compiled`) and fetches the images. Each
device renders its share of the images with no communication. `generate` (`sdxl.engine.generate`) is the
same in diffusers' terms.
"""

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from .. import checkpoints
from ..checkpoints import ModelSpec, controlnets as controlnet_checkpoints, lora
from ..checkpoints.controlnets import ControlNetCheckpoint
from ..checkpoints.tokenizer import load_tokenizer
from ..models.controlnet_union import describe_mode, describe_modes
from ..models.previews import factors_for
from ..prompts import syntax as prompt_syntax
from ..prompts.tokens import Prompts
from ..sampling.samplers import SAMPLERS
from . import inputs, mesh as meshes
from .compiled import Executables, ProgressReports, run_in_stages
from .generate import generate
from .program import GenerateProgram
from .request import Request


class NonFiniteImageError(RuntimeError):
    """The model produced NaN or infinite values (typically fp16/bf16 overflow)."""


@dataclasses.dataclass
class Generation:
    """A request's images, with what the caller may want to report."""

    images: np.ndarray  # [N, H, W, 3] uint8, or float32 in [0, 1]; or a jax.Array of latents, left on the devices
    finite: np.ndarray  # [N] bool: False where the model produced NaN/inf
    devices: list[str]  # the device that rendered each image
    seconds: float  # the whole call's time, compilation included

    def part(self, start: int, stop: int) -> "Generation":
        """Images start..stop-1 of a merged batch: one request's share."""
        return Generation(self.images[start:stop], self.finite[start:stop], self.devices[start:stop], self.seconds)

    def raise_if_not_finite(self) -> None:
        if not self.finite.all():
            bad = ", ".join(str(i) for i in np.flatnonzero(~self.finite))
            raise NonFiniteImageError(
                f"image(s) {bad} came out as NaN/inf: the model overflowed (try float32, or another checkpoint)"
            )


class Pipeline:
    """Stable Diffusion (XL) on a device mesh, each program compiled once.

    pipe = Pipeline.from_pretrained("stabilityai/stable-diffusion-xl-base-1.0")
    images = pipe.generate("a photo of an astronaut riding a horse", seed=0)
    """

    generate = generate

    def __init__(
        self, spec: ModelSpec, params: dict, tokenizers: Sequence, *, mesh: Mesh, dtype, max_steps: int = 100,
        name: str = "", preview_factors: tuple | None = None, controlnets: Sequence[ControlNetCheckpoint] = (),
    ):
        self.spec = spec
        # The ControlNets a request's control images steer through, in order; `params["controlnets"]` their weights.
        self.controlnets = tuple(controlnets)
        self.base_params = params  # as loaded; `params` is them with the active LoRAs applied
        self.params = params
        self.loras: dict[str, float] = {}  # the active LoRAs: {source: scale}
        self.lora_files: dict[str, lora.Lora] = {}  # every LoRA read (`set_loras`), by source
        self.prompts = Prompts(spec, tokenizers)
        self.mesh = mesh
        self.dtype = jnp.dtype(dtype)
        self.max_steps = max_steps
        self.name = name
        self.preview_factors = preview_factors or factors_for(spec)
        self.executables = Executables(mesh)
        self.refiner: Pipeline | None = None  # continues requests with `refine_from` (`set_refiner`)

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
        controlnet: str | Sequence[str] | None = None,
    ) -> "Pipeline":
        """Loads an SDXL or SD 1.x/2.x checkpoint: a diffusers folder or Hub repo, or a single file.

        Args:
          path_or_repo_id: a folder, a Hub repo id, a built-in name ("shapes"; "tiny", "tiny-sd1":
            random tiny models), a `.safetensors` file in the original (A1111 / SGM) layout, or a
            Hub file "owner/name/file.safetensors" (`sdxl.checkpoints.resolve`).
          dtype: parameters' and activations' dtype: default bfloat16 on accelerators, float32 on CPU.
            Schedulers and sampler state are float32 regardless.
          max_steps: the most steps a call may ask for (the schedules' padded length).
          devices: the devices to split batches over (default: all).
          config: for a single file, its configs and tokenizers: a built-in name ("sdxl-base-1.0",
            "sd-1.5", "sd-2.1", "sd-2.1-base") or a diffusers folder; default the family's published one.
          scheduler: fields replacing the checkpoint's scheduler config, e.g. {"timestep_spacing": "trailing"};
            the default sampler follows its class.
          unet: a UNet weights file in diffusers' keys replacing the checkpoint's, as SDXL-Lightning's
            are used (a local file or "owner/name/file.safetensors").
          controlnet: a ControlNet (a diffusers folder, a Hub repo id, or a .safetensors file: see
            `sdxl.checkpoints.controlnets`; a ControlNet Union too) or a list of them (diffusers'
            MultiControlNet), checked against the model before their weights are fetched.
        """
        devices = list(devices or jax.devices())
        dtype = jnp.dtype(dtype or ("float32" if devices[0].platform == "cpu" else "bfloat16"))
        checkpoint = checkpoints.resolve(path_or_repo_id, dtype=dtype, config=config, scheduler=scheduler, unet=unet)
        sources = [] if controlnet is None else [controlnet] if isinstance(controlnet, str) else list(controlnet)
        controlnets = [controlnet_checkpoints.resolve(source, checkpoint.spec, dtype=dtype) for source in sources]
        tokenizers = [load_tokenizer(checkpoint.folder / name) for name in checkpoint.spec.tokenizer_names]
        mesh = meshes.batch_mesh(devices)
        replicated = meshes.replicated(mesh)

        def put(array):
            return meshes.place(array, replicated)

        params = checkpoint.load(dtype, put)
        if controlnets:
            params["controlnets"] = tuple(c.load(dtype, put) for c in controlnets)
        return cls(checkpoint.spec, params, tokenizers, mesh=mesh, dtype=dtype, max_steps=max_steps,
                   name=str(path_or_repo_id), preview_factors=checkpoint.preview_factors, controlnets=controlnets)

    @property
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    def device_description(self) -> str:
        device = self.mesh.devices.flat[0]
        return f"{self.num_devices}× {getattr(device, 'device_kind', device.platform)}"

    def devices_of(self, num_images: int) -> list[str]:
        """Which device renders each image of an `num_images` batch (the batch is split in order), by its
        place in the mesh: "CPU 0" to "CPU 3" (JAX's ids number a second host's from 2048, say)."""
        per_device = self.padded_batch(num_images) // self.num_devices
        platform = self.mesh.devices.flat[0].platform.upper()
        return [f"{platform} {i // per_device}" for i in range(num_images)]

    def padded_batch(self, num_images: int) -> int:
        """The batch that `num_images` images compile and run as: a multiple of the device count."""
        return -(-num_images // self.num_devices) * self.num_devices

    def set_refiner(self, refiner: "Pipeline | None") -> None:
        """Makes `refiner` (an SDXL refiner on the same devices) finish requests with `refine_from`,
        as diffusers' "ensemble of expert denoisers": this model runs the schedule down to that
        fraction of the noise, and the refiner continues the latents, which stay on the devices.

        Raises:
          CheckpointError: the refiner cannot continue this model's latents.
        """
        if refiner is not None:
            self._check_refiner(refiner)
            refiner.executables = self.executables  # programs are keyed by their model: one cache serves both
            self._share_equal_components(refiner)
        self.refiner = refiner

    def _share_equal_components(self, refiner: "Pipeline") -> None:
        """Gives the refiner this model's arrays for each component whose weights it has too, so that
        the devices hold them once: the published SDXL refiner's VAE and second text encoder are the
        base's, 1.45 GiB per device in bfloat16 (on a 16 GiB TPU v5e, the difference between fitting
        and not). Compared on the devices, in one program, value for value."""
        for name, theirs in refiner.base_params.items():
            mine = self.base_params.get(name)
            if name == "controlnets" or mine is None or refiner.params[name] is not theirs:
                continue
            shapes = [jax.tree.map(lambda a: (a.shape, a.dtype), tree) for tree in (mine, theirs)]
            if jax.tree.structure(mine) != jax.tree.structure(theirs) or shapes[0] != shapes[1]:
                continue
            if bool(_all_equal(mine, theirs)):
                refiner.base_params = refiner.params = {**refiner.base_params, name: mine}

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
        """The request checked against this model and converted (`Request.validated`), with the LoRAs its
        prompts' tags name (`<lora:NAME:SCALE>`) at their scales. Raises ValueError."""
        if request.refine_from is not None and self.refiner is None:
            raise ValueError("no refiner is loaded to refine with (start the demo or the CLI with --refiner)")
        self._check_controls(request)
        request = request.validated(self.spec, max_steps=self.max_steps)
        tags = {tuple(prompt_syntax.lora_tags(prompt)[1]) for prompt in request.prompts}
        if tags == {()}:
            return self._checked_modes(request)
        if len(tags) > 1:
            raise ValueError("the prompts of one request name different LoRA tags; give each its own request")
        scales = {}  # a LoRA tagged twice applies twice, as in webui: the scales add
        for name, scale in tags.pop():
            scales[name] = scales.get(name, 0.0) + scale
        loaded = {lora.display_name(source): source for source in self.lora_files}
        loras = dict(self.loras if request.loras is None else request.loras)
        for name, scale in scales.items():
            if name not in loaded:
                known = f"the loaded ones: {', '.join(sorted(loaded))}" if loaded else "no LoRA is loaded"
                raise ValueError(f"the prompt names the LoRA {name!r}, which is not loaded; {known}")
            loras[loaded[name]] = scale
        request = dataclasses.replace(request, loras=tuple(loras.items()))
        return self._checked_modes(request.validated(self.spec, max_steps=self.max_steps))

    def _check_controls(self, request: Request) -> None:
        """Raises ValueError unless the request has a control image for each ControlNet, or none."""
        if not request.controls:
            return
        if not self.controlnets:
            raise ValueError("no ControlNet is loaded to steer with a control image (start with --controlnet)")
        if request.controls != len(self.controlnets):
            names = ", ".join(c.name for c in self.controlnets)
            raise ValueError(
                f"{len(self.controlnets)} ControlNets are loaded ({names}): give one control image for each, "
                f"not {request.controls}"
            )
        for image, controlnet in zip(request.control_images, self.controlnets):
            channels = controlnet.config.conditioning_channels
            if np.ndim(image) != 4 or np.shape(image)[-1] != channels:
                raise ValueError(
                    f"{controlnet.name} takes {channels}-channel control images, got shape {np.shape(image)}"
                )

    def _checked_modes(self, request: Request) -> Request:
        """The validated `request`, unless a ControlNet Union has no control mode for an image, or one
        it was not trained on. Raises ValueError."""
        for k, checkpoint in enumerate(self.controlnets if request.controls else ()):
            count = getattr(checkpoint.config, "num_control_type", None)  # a Union's
            modes = {per_image[k] for per_image in request.control_modes}
            if count is None or not modes:
                continue
            if None in modes:
                raise ValueError(
                    f"{checkpoint.name} is a ControlNet Union: say what its control image is with a control mode "
                    f"(control_mode=), one of {describe_modes(count)}"
                )
            if max(modes) >= count:
                raise ValueError(
                    f"{checkpoint.name} knows {count} control modes ({describe_modes(count)}), not mode "
                    f"{describe_mode(max(modes))}"
                )
        return request

    def tokenized(self, request: Request) -> Request:
        tokens = self.prompts.tokens(request.prompts, request.negative_prompts, request.emphasis)
        return dataclasses.replace(request, tokens=tokens)

    # Programs: every request runs one or two (`programs_for`), each compiled once.

    def program_for(self, request: Request, num_images: int | None = None, output_type: str = "pil") -> GenerateProgram:
        """The program that renders `request` (at `num_images`, by default its own count) on this model."""
        spec = self.spec
        tokens = (request if request.tokens is not None else self.tokenized(request)).tokens
        return GenerateProgram(
            spec, request.sampler or spec.default_sampler, request.height, request.width,
            self.padded_batch(num_images or len(request)), self.dtype, self.max_steps, output_type,
            # An LCM UNet takes the guidance scale as an embedding, with no unconditional pass (as diffusers).
            guided=request.guided and spec.unet.time_cond_proj_dim is None,
            start_from=request.start_from, inpaint=request.masks is not None, given_noise=request.noise is not None,
            chunks=tokens.num_chunks, preview_factors=self.preview_factors,
            controlnets=tuple(c.config for c in self.controlnets) if request.controls else (),
        )

    def programs_for(self, request: Request, num_images: int | None = None, output_type: str = "pil"):
        """The programs a request runs: one, or with `refine_from` this model's and then the refiner's."""
        if request.refine_from is None:
            return [self.program_for(request, num_images, output_type)]
        base, refining = self._handoff(request)
        return [self.program_for(base, num_images, "latent"),
                self.refiner.program_for(refining, num_images, output_type)]

    def compile(self, programs: Sequence[GenerateProgram], *, progress: bool = False) -> float:
        """Compiles what rendering with these programs runs (with `progress`: the staged programs that
        `render(..., on_step=...)` runs); returns the seconds it took."""
        start = time.perf_counter()
        for program in programs:
            self.executables.compile(program, progress)
        return time.perf_counter() - start

    def is_compiled(self, programs: Sequence[GenerateProgram], *, progress: bool = False) -> bool:
        return all(self.executables.has(program, progress) for program in programs)

    def warmup(self, height: int, width: int, num_images: int | None = None, sampler: str | None = None, *,
               progress: bool = False) -> float:
        """Compiles text-to-image at one size ahead of time (with guidance, uint8 images); returns the seconds."""
        n = num_images or self.num_devices
        request = Request.from_prompt("", num_images=n, height=height, width=width, sampler=sampler)
        return self.compile(self.programs_for(request), progress=progress)

    def lowered(self, program: GenerateProgram, stage: str = "whole", platforms: tuple[str, ...] | None = None):
        """A program's stage lowered for `platforms` (default: the devices'), not compiled: a CPU host
        can check that the program it would run on a TPU lowers (splash kernels go through Mosaic here)."""
        return self.executables.lowered(program, stage, platforms)

    # LoRAs

    def set_loras(self, loras: Mapping[str, float]) -> float:
        """Makes `loras` ({source: scale}) the active LoRAs, in place of the previous ones ({} clears
        them), as diffusers' `set_adapters(names, adapter_weights)`; returns the seconds it took.

        The weights change, the programs do not: switching never recompiles, and the layers no active
        LoRA touches are the loaded arrays themselves, so clearing restores them exactly. Each file is
        read once (`lora.locate`: a local .safetensors file, a Hub repo id, or "owner/name/file.safetensors").

        Raises:
          CheckpointError: a source is missing or does not fit the model; the active LoRAs stay as they were.
        """
        wanted = {str(source): float(scale) for source, scale in loras.items()}
        if wanted == self.loras:
            return 0.0
        start = time.perf_counter()
        for source in wanted:
            if source not in self.lora_files:
                self.lora_files[source] = lora.read(lora.locate(source), self.spec, name=source)
        layers = [(self.lora_files[source], scale) for source, scale in wanted.items()]
        replicated = meshes.replicated(self.mesh)
        self.params = jax.block_until_ready(lora.apply(self.base_params, layers, lambda a: meshes.place(a, replicated)))
        self.loras = wanted
        return time.perf_counter() - start

    # Rendering

    def steps_run(self, request: Request) -> tuple[int, int]:
        """The steps first..stop-1 of the request's schedule that run (`sdxl.engine.inputs.steps_run`)."""
        return inputs.steps_run(self.program_for(request), request)

    def render(
        self,
        request: Request,
        *,
        output_type: str = "pil",
        on_step: Callable[[int], bool | None] | None = None,
        on_preview: Callable[[int, np.ndarray], None] | None = None,
        steps_per_report: int = 1,
    ) -> Generation | None:
        """Renders a request's images in one compiled call, or in a chain of them that reports progress.

        Args:
          output_type: "pil" for uint8 images, "np" for float32 in [0, 1], or "latent": the sampler's
            latents [N, h, w, C], undecoded and left on the devices, for a refiner to continue.
          on_step: called with the number of finished steps (of those that run) every
            `steps_per_report` steps; returning False gives the rendering up, and `render` returns None.
          on_preview: called with the same step count and [N, h, w, 3] uint8 previews of the images
            (`sdxl.models.previews`), at the latents' size.

        Raises:
          ValueError: a value of the request is out of range.
        """
        request = self.validated(request)
        if request.refine_from is not None:
            return self._render_refined(request, output_type, on_step, on_preview, steps_per_report)
        start, n = time.perf_counter(), len(request)
        if request.loras is not None:
            self.set_loras(dict(request.loras))
        if request.tokens is None:
            request = self.tokenized(request)
        program = self.program_for(request, output_type=output_type)
        first, stop = inputs.steps_run(program, request)
        arrays = inputs.placed(inputs.host_inputs(program, request, (first, stop)), self.mesh)
        # The ControlNets' weights are the program's only when control images steer this request.
        params = self.params if program.controlnets else {k: v for k, v in self.params.items() if k != "controlnets"}
        if on_step is None and on_preview is None:
            images, finite = self.executables.compiled(program, "whole")(params, arrays)
        else:
            evaluations = SAMPLERS[program.sampler].evaluations
            report = ProgressReports(on_step, on_preview, stop - first, evaluations(first), n)
            stage = lambda name: self.executables.compiled(program, name)  # noqa: E731
            rendered = run_in_stages(stage, params, arrays, evaluations(first), evaluations(stop), report,
                                     steps_per_report)
            if rendered is None:
                return None
            images, finite = rendered
        images = images[:n] if output_type == "latent" else meshes.fetch(images)[:n]
        return Generation(images, meshes.fetch(finite)[:n], self.devices_of(n), time.perf_counter() - start)

    def _handoff(self, request: Request) -> tuple[Request, Request]:
        """A request with `refine_from` as its two parts: this model's down to that fraction of the
        noise (`denoising_end`), and the refiner's from there (`denoising_start`; its latents, the
        `start_latents`, come from the first part). The LoRAs, tokens and ControlNets are this model's."""
        base = dataclasses.replace(request, refine_from=None, denoising_end=request.refine_from)
        refining = dataclasses.replace(
            request, refine_from=None, images=None, masks=None, denoising_start=request.refine_from, loras=None,
            tokens=None, control_images=None, control_scales=None, control_starts=None, control_ends=None,
            control_modes=None,
        )
        return base, refining

    def _render_refined(self, request: Request, output_type: str, on_step, on_preview, steps_per_report):
        """This model down to `refine_from`, then the refiner on the latents, which never leave the
        devices. The reports count both runs' steps as one."""
        base, refining = self._handoff(request)
        start, stop = self.steps_run(base)

        def continued(report):
            return None if report is None else (lambda done, *preview: report(stop - start + done, *preview))

        first = self.render(base, output_type="latent", on_step=on_step, on_preview=on_preview,
                            steps_per_report=steps_per_report)
        if first is None:
            return None
        second = self.refiner.render(
            dataclasses.replace(refining, start_latents=first.images), output_type=output_type,
            on_step=continued(on_step), on_preview=continued(on_preview), steps_per_report=steps_per_report,
        )
        if second is not None:
            second.seconds += first.seconds
        return second


@jax.jit
def _all_equal(a, b) -> jax.Array:
    """Whether two parameter trees of the same shapes hold the same values (one program for all leaves)."""
    return jnp.all(jnp.stack([jnp.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]))
