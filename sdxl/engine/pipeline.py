"""A checkpoint loaded onto a device mesh, and requests rendered on it.

`Pipeline` owns the loaded model (parameters replicated over the mesh, the LoRAs it has read, an
optional refiner). `prepare` makes a `Request` what the devices take (`sdxl.engine.prepared`), and
`render` renders a prepared request: it builds its inputs (`sdxl.engine.inputs`), runs its compiled
program (`sdxl.engine.compiled`) with the parameters of its LoRAs, and fetches the images. Each
device renders its share of the images with no communication. `generate` (`sdxl.engine.generate`)
is the same in diffusers' terms.

A pipeline's state changes only through its setters (`set_loras`, `set_refiner`); rendering reads it.
"""

import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from .. import checkpoints
from ..checkpoints import ModelSpec, controlnets as controlnet_checkpoints, embeddings, lora
from ..checkpoints import ip_adapters as ip_adapter_checkpoints
from ..checkpoints.ip_adapters import IPAdapterConfig
from ..checkpoints.controlnets import ControlNetCheckpoint
from ..checkpoints.tokenizer import load_tokenizer
from ..models.previews import factors_for
from ..models.vae import tile_sizes
from ..prompts.tokens import Prompts
from ..sampling import kdiffusion, methods, noise
from ..sampling.brownian import BrownianNoise
from . import hires as hires_fix, inputs, mesh as meshes
from .checks import number
from .compiled import Executables, ProgressReports, run_in_stages
from .generate import generate
from .image_prompts import IPAdapter, layer_scales
from .latent_upscale import upscale_latents
from .upscaler import Upscaler
from .prepared import PreparedRequest
from .program import OUTPUT_TYPES, GenerateProgram
from .request import LORA_SCALE_RANGE, Limits, Request


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
        executables: Executables | None = None, vae_name: str | None = None, vae_tiling: bool = False,
    ):
        """`vae_name`: the separate VAE loaded in place of the checkpoint's, None for its own.
        `vae_tiling`: see `from_pretrained`.
        `executables`: the compiled programs to use, shared with other pipelines on the same mesh
        (each program names its model, so one cache serves several); default a cache of its own."""
        self.spec = spec
        # The ControlNets a request's control images steer through, in order; `params["controlnets"]` their weights.
        self.controlnets = tuple(controlnets)
        self.params = params  # as loaded
        self.loras: dict[str, float] = {}  # the active LoRAs, for requests that name none: {source: scale}
        self.lora_files: dict[str, lora.Lora] = {}  # every LoRA read, by source
        self._applied: tuple[tuple, dict] = ((), params)  # the LoRAs last applied, and the parameters with them
        self._lock = threading.RLock()  # over `lora_files` and `_applied`: requests prepare while others render
        self.prompts = Prompts(spec, tokenizers)
        self.mesh = mesh
        self.dtype = jnp.dtype(dtype)
        self.max_steps = max_steps
        self.name = name
        self.vae_name = vae_name
        self.vae_tiling = vae_tiling
        self.preview_factors = preview_factors or factors_for(spec)
        self.executables = executables or Executables(mesh)
        self.refiner: Pipeline | None = None  # continues requests with `refine_from` (`set_refiner`)
        self.upscalers: dict[str, Upscaler] = {}  # the model upscalers a hires fix may name, by name (`add_upscaler`)
        # The IP-Adapters a request's image prompts steer through, in order (`load_ip_adapter`), with
        # the scales requests that give none take; `params["ip_adapters"]` their weights.
        self.ip_adapters: tuple[IPAdapter, ...] = ()
        self._ip_adapter_scales: tuple = ()

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
        vae: str | None = None,
        controlnet: str | Sequence[str] | None = None,
        executables: Executables | None = None,
        vae_tiling: bool = False,
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
          vae: a VAE replacing the checkpoint's (`sdxl.checkpoints.vaes`): a diffusers folder, a Hub
            repo id ("madebyollin/sdxl-vae-fp16-fix"), or a .safetensors file in diffusers' or the
            original layout, local or "owner/name/file.safetensors"; `vae_name` then names it.
          controlnet: a ControlNet (a diffusers folder, a Hub repo id, or a .safetensors file: see
            `sdxl.checkpoints.controlnets`; a ControlNet Union too) or a list of them (diffusers'
            MultiControlNet), checked against the model before their weights are fetched.
          executables: compiled programs shared with another pipeline on the same devices (a refiner
            with its base model: `base.executables`).
          vae_tiling: decode and encode pictures of more pixels than the VAE's tile (its config's
            sample_size squared: SDXL's 1024x1024) in overlapping tiles, as diffusers' pipelines after
            `enable_vae_tiling()` (`sdxl.models.vae.tiled_decode`), so that a 2048x2048 picture needs
            the VAE memory of a 1024x1024 one. The tiles' blending changes such pictures a little.
        """
        devices = list(devices or jax.devices())
        dtype = jnp.dtype(dtype or ("float32" if devices[0].platform == "cpu" else "bfloat16"))
        checkpoint = checkpoints.resolve(
            path_or_repo_id, dtype=dtype, config=config, scheduler=scheduler, unet=unet, vae=vae
        )
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
                   name=str(path_or_repo_id), preview_factors=checkpoint.preview_factors, controlnets=controlnets,
                   executables=executables, vae_name=None if checkpoint.vae is None else checkpoint.vae.name,
                   vae_tiling=vae_tiling)

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

    @property
    def limits(self) -> Limits:
        """What this pipeline allows a request: its model, schedules, ControlNets, LoRAs and refiner."""
        with self._lock:
            names = {lora.display_name(source): source for source in self.lora_files}
        return Limits(self.spec, self.max_steps, self.controlnets, names, tuple(self.loras.items()),
                      None if self.refiner is None else self.refiner.name, upscalers=tuple(self.upscalers),
                      ip_adapters=self.ip_adapters)

    def set_refiner(self, refiner: "Pipeline | None") -> None:
        """Makes `refiner` (an SDXL refiner on the same devices) finish requests with `refine_from`,
        as diffusers' "ensemble of expert denoisers": this model runs the schedule down to that
        fraction of the noise, and the refiner continues the latents, which stay on the devices.

        Raises:
          CheckpointError: the refiner cannot continue this model's latents.
        """
        if refiner is not None:
            self._check_refiner(refiner)
            refiner._hold(self._equal_components(refiner))
        self.refiner = refiner

    def _equal_components(self, refiner: "Pipeline") -> dict:
        """This model's arrays for each component whose weights the refiner has too, so that the devices
        hold them once: the published SDXL refiner's VAE and second text encoder are the base's, 1.45
        GiB per device in bfloat16 (on a 16 GiB TPU v5e, the difference between fitting and not).
        Compared on the devices, in one program, value for value."""
        equal = {}
        for name, theirs in refiner.params.items():
            mine = self.params.get(name)
            if name in ("controlnets", "ip_adapters") or mine is None or mine is theirs:
                continue
            shapes = [jax.tree.map(lambda a: (a.shape, a.dtype), tree) for tree in (mine, theirs)]
            if jax.tree.structure(mine) != jax.tree.structure(theirs) or shapes[0] != shapes[1]:
                continue
            if bool(_all_equal(mine, theirs)):
                equal[name] = mine
        return equal

    def _hold(self, components: dict) -> None:
        """Holds `components` in place of its own equal ones (`set_refiner`); drops applied LoRAs."""
        with self._lock:
            self.params = {**self.params, **components}
            self._applied = ((), self.params)

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

    # Requests: each is prepared once (checked, tokenized, its programs named), then rendered.

    def prepare(self, request: Request, *, limits: Limits | None = None, output_type: str = "pil") -> PreparedRequest:
        """`request` as the devices take it: checked against `limits` (default this pipeline's: the
        demo narrows them to its sizes), its LoRAs read, its prompts tokenized, its programs named.

        Args:
          output_type: "pil" for uint8 images, "np" for float32 in [0, 1], or "latent": the sampler's
            latents [N, h, w, C], undecoded and left on the devices, for a refiner to continue.

        Raises:
          ValueError: a value of the request is out of range, in one sentence.
          CheckpointError: a LoRA file it names cannot be read.
        """
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {', '.join(OUTPUT_TYPES)}, got {output_type!r}")
        request = request.validated(limits or self.limits)
        self._read_loras(source for source, _ in request.loras)
        if request.hires is not None:
            first = self._prepared(dataclasses.replace(request, hires=None),
                                   "latent" if request.hires.in_latents else "np")
            drawn = dict(noise=first.request.noise, step_noise=first.request.step_noise)
            # The request as asked (its PNG parameters name the hires fix): its arrays are its first pass's.
            return dataclasses.replace(first, request=dataclasses.replace(request, **drawn),
                                       hires=self._second_pass(request, output_type))
        if request.refine_from is None:
            return self._prepared(request, output_type)
        base, refining = _handoff(request)
        base = self._prepared(base, "latent")
        # The refiner continues the base's noise: a stochastic sampler's draws go on where it stopped.
        drawn = dict(noise=base.request.noise, step_noise=base.request.step_noise)
        refined = self.refiner._prepared(dataclasses.replace(refining, **drawn), output_type)
        # The request as asked (its PNG parameters name the refiner): its arrays are its base part's.
        return dataclasses.replace(base, request=dataclasses.replace(request, **drawn), refined=refined)

    def _second_pass(self, request: Request, output_type: str) -> PreparedRequest:
        """A validated request's hires pass (`sdxl.engine.hires`): its first pass's settings but for
        what the hires fix changes, its noise drawn afresh at the new size, and the start (upscaled
        latents or pictures) left to fill when the first pass has rendered."""
        hires, n = request.hires, len(request)
        total, first = hires.second_pass_steps(request.steps)
        height, width = hires.size(request.height, request.width, self.spec)
        given = {name: (value,) * n for name, value in (
            ("prompts", hires.prompt), ("negative_prompts", hires.negative_prompt),
            ("guidance_scales", hires.guidance_scale)) if value is not None}
        second = dataclasses.replace(
            request, steps=total, height=height, width=width, sampler=hires.sampler,
            schedule_type=hires.schedule_type, noise=None, step_noise=None, hires=None, **given,
        )
        # Its prompts' edits count its own steps on from the first pass's (webui's hires scheduling).
        edit_steps = (_edit_steps(request, request.steps), _edit_steps(second, total - first))
        start = ("clean_latents" if hires.in_latents else "image", first)
        return self._prepared(second, output_type, start=start, edit_steps=edit_steps)

    def _prepared(
        self, request: Request, output_type: str, start: tuple[str, int] | None = None,
        edit_steps: tuple[int, int] | None = None,
    ) -> PreparedRequest:
        """A validated request prepared for this model's program, with the noise its source draws on
        the host (`with_drawn_noise`); `start`, a hires pass's (where it starts from, its first step),
        which runs to its schedule's end, and `edit_steps`, the (first pass, hires pass) step counts its
        prompts' edits are scheduled over."""
        steps, hires_steps = edit_steps or (_edit_steps(request, request.steps), None)
        spec = self.spec
        tokens = self.prompts.tokens(
            request.prompts, request.negative_prompts, request.emphasis, steps=steps, hires_steps=hires_steps
        )
        drawn = request.noise_source != "jax"
        a1111 = request.schedule_type != methods.DIFFUSERS
        program = GenerateProgram(
            spec, request.sampler, request.height, request.width, self.padded_batch(len(request)), self.dtype,
            self.max_steps, output_type,
            # An LCM UNet takes the guidance scale as an embedding, with no unconditional pass (as diffusers).
            guided=request.guided and spec.unet.time_cond_proj_dim is None,
            start_from=request.start_from if start is None else start[0], inpaint=request.masks is not None,
            given_noise=drawn or request.noise is not None,
            given_step_noise=drawn and methods.loop(request.sampler, a1111).stochastic,
            chunks=tokens.num_chunks, conditionings=tokens.num_conditionings, preview_factors=self.preview_factors,
            controlnets=tuple(c.config for c in self.controlnets) if request.controls else (),
            a1111=a1111, vae_tiling=self._tiles_vae(request.height, request.width),
            ip_adapters=tuple(a.config for a in self.ip_adapters) if request.image_prompts else (),
            embedding_rows=self._embedding_rows(tokens),
        )
        if start is None:
            steps = inputs.steps_run(program, request)
        else:
            steps = start[1], inputs.schedule_length(program, request)
        if drawn and request.noise is None:
            request = with_drawn_noise(request, program, steps)
        return PreparedRequest(request, tokens, program, steps)

    def _tiles_vae(self, height: int, width: int) -> bool:
        """Whether the VAE tiles a picture of this size (`vae_tiling`): it has more pixels than a tile."""
        tile, _ = tile_sizes(self.spec.vae)
        return self.vae_tiling and height * width > tile * tile

    def programs_for(self, request: Request, num_images: int | None = None) -> tuple[GenerateProgram, ...]:
        """The programs `request` runs (`prepare`), at `num_images` images (default its own count)."""
        prepared = self.prepare(request)
        return prepared.programs if num_images is None else prepared.programs_at(self.padded_batch(num_images))

    # Programs: each compiled once, by the pipeline whose model it runs (a refiner's by the refiner).

    def compiled(self, program: GenerateProgram, stage: str = "whole"):
        """A program's stage, compiled (on first use) by the pipeline whose model it runs."""
        return self._running(program).executables.compiled(program, stage)

    def compile(self, programs: Sequence[GenerateProgram], *, progress: bool = False) -> float:
        """Compiles what rendering with these programs runs (with `progress`: the staged programs that
        `render(..., on_step=...)` runs); returns the seconds it took."""
        start = time.perf_counter()
        for program in programs:
            self._running(program).executables.compile(program, progress)
        return time.perf_counter() - start

    def is_compiled(self, programs: Sequence[GenerateProgram], *, progress: bool = False) -> bool:
        return all(self._running(program).executables.has(program, progress) for program in programs)

    def _running(self, program: GenerateProgram) -> "Pipeline":
        """This pipeline, or for a program of the refiner's model the refiner."""
        return self.refiner if self.refiner is not None and program.spec != self.spec else self

    def warmup(self, height: int, width: int, num_images: int | None = None, sampler: str | None = None, *,
               progress: bool = False) -> float:
        """Compiles text-to-image at one size ahead of time (with guidance, uint8 images); returns the seconds."""
        n = num_images or self.num_devices
        request = Request.from_prompt("", num_images=n, steps=1, height=height, width=width, sampler=sampler)
        return self.compile(self.programs_for(request), progress=progress)

    def lowered(self, program: GenerateProgram, stage: str = "whole", platforms: tuple[str, ...] | None = None):
        """A program's stage lowered for `platforms` (default: the devices'), not compiled: a CPU host
        can check that the program it would run on a TPU lowers (splash kernels go through Mosaic here)."""
        return self._running(program).executables.lowered(program, stage, platforms)

    def add_upscaler(self, source: str) -> str:
        """Reads a model upscaler (ESRGAN, Real-ESRGAN: `sdxl.engine.upscaler`) from a local file or a Hub
        file "owner/name/file.safetensors" for hires fixes and `upscale`, its weights left off the devices
        until first used; returns the name requests give it (the file's stem).

        Raises:
          CheckpointError: the file is missing, unsafe or of an architecture not supported.
        """
        upscaler = Upscaler.from_file(checkpoints.locate_file(source), dtype=self.dtype)
        self.upscalers[upscaler.name] = upscaler
        return upscaler.name

    # IP-Adapters

    def load_ip_adapter(
        self,
        pretrained_model_name_or_path_or_dict: str | Sequence[str],
        subfolder: str | Sequence[str] | None,
        weight_name: str | Sequence[str],
        image_encoder_folder: str | None = "image_encoder",
    ) -> None:
        """Loads IP-Adapters in place of any loaded, with diffusers' arguments and their meaning: a local
        folder or Hub repo in h94/IP-Adapter's layout ("h94/IP-Adapter", subfolder "sdxl_models",
        weight_name "ip-adapter_sdxl.safetensors"), lists for several; the CLIP image encoder they share
        from `image_encoder_folder`, inside `subfolder` unless it has a "/" (None: keep the loaded one).
        Each adapter's scale is 1 until `set_ip_adapter_scale`. Programs without image prompts are
        unchanged; those with them compile once per set of adapters.

        Raises:
          CheckpointError: an adapter or encoder that is missing, pickled, a FaceID one, or not this
            model's family, before its weights are fetched where that can be told.
        """
        found = ip_adapter_checkpoints.resolve(
            pretrained_model_name_or_path_or_dict, subfolder, weight_name, self.spec.unet,
            image_encoder_folder=image_encoder_folder,
        )
        encoder = found.image_encoder
        if encoder is None:
            if not self.ip_adapters:
                raise checkpoints.CheckpointError("no image encoder is loaded: give image_encoder_folder")
            encoder_config, encoder_params = self.ip_adapters[0].config.encoder, self.params["ip_adapters"][0][
                "image_encoder"]
            for adapter in found.adapters:
                ip_adapter_checkpoints.check_encoder(adapter.projection, encoder_config, adapter.name)
        replicated = meshes.replicated(self.mesh)

        def put(array):
            return meshes.place(array, replicated)

        if encoder is not None:
            encoder_config, encoder_params = encoder.config, encoder.load(self.dtype, put)
        adapters, params = [], []
        for checkpoint in found.adapters:
            weights = checkpoint.load(self.spec.unet, self.dtype, put)
            adapters.append(IPAdapter(weights.name, IPAdapterConfig(encoder_config, weights.projection)))
            params.append({"image_encoder": encoder_params, "image_proj": weights.image_proj,
                           "unet": ip_adapter_checkpoints.unet_tree(weights.layers)})
        with self._lock:
            self.params = {**self.params, "ip_adapters": tuple(params)}
            self._applied = ((), self.params)
        self.ip_adapters = tuple(adapters)
        self._ip_adapter_scales = (1.0,) * len(adapters)

    def set_ip_adapter_scale(self, scale) -> None:
        """The scales requests take when they give none, as diffusers': a number for every layer, or a
        dict of blocks (`sdxl.engine.image_prompts.layer_scales`: InstantStyle's `STYLE_ONLY`), for
        every adapter, or a list with one per adapter.

        Raises:
          ValueError: a scale out of range or a block the UNet lacks, or another count.
        """
        self._ip_adapter_scales = self.ip_adapter_scales(scale)

    def ip_adapter_scales(self, scale=None) -> tuple:
        """One scale per loaded adapter, from `set_ip_adapter_scale`'s forms, checked; None: the set ones.

        Raises:
          ValueError: a scale out of range or a block the UNet lacks, or another count.
        """
        if scale is None:
            return self._ip_adapter_scales
        k = len(self.ip_adapters)
        scales = list(scale) if isinstance(scale, list | tuple) else [scale] * k
        if len(scales) != k:
            raise ValueError(f"{k} IP-Adapter(s) are loaded: give one scale, or a list of {k}, not {len(scales)}")
        for one in scales:
            layer_scales(self.spec.unet, one)
        return tuple(scales)

    def unload_ip_adapter(self) -> None:
        """Unloads the IP-Adapters and their image encoder, as diffusers' `unload_ip_adapter`."""
        with self._lock:
            self.params = {k: v for k, v in self.params.items() if k != "ip_adapters"}
            self._applied = ((), self.params)
        self.ip_adapters, self._ip_adapter_scales = (), ()

    # Textual-inversion embeddings

    def load_textual_inversion(
        self, pretrained_model_name_or_path: str | os.PathLike | Sequence, token: str | Sequence | None = None
    ) -> None:
        """Loads textual-inversion embeddings from safetensors files (`sdxl.checkpoints.embeddings`), one
        path or a list, as diffusers' method of that name: each is named in prompts by `token` (a list: one
        per path), by default its file's stem, as in webui. A name already loaded takes the new vectors.
        Requests without embeddings keep their programs; the first with one compiles once per block of
        `embeddings.ROW_BLOCK` vectors loaded.

        Raises:
          CheckpointError: a file that is missing, pickled, or not an embedding of this model's encoders.
          ValueError: another number of tokens than paths, or a name that is no word of a prompt.
        """
        single = isinstance(pretrained_model_name_or_path, str | os.PathLike)
        paths = [pretrained_model_name_or_path] if single else list(pretrained_model_name_or_path)
        tokens = [token] * len(paths) if token is None or isinstance(token, str) else list(token)
        if len(tokens) != len(paths) or (isinstance(token, str) and not single):
            raise ValueError(f"give one token per embedding file: {len(paths)} file(s), {len(tokens)} token(s)")
        loaded = {embedding.name: embedding for embedding in self.prompts.embeddings}
        for path, name in zip(paths, tokens):
            embedding = embeddings.read(path, self.spec, name)
            loaded.pop(embedding.name, None)
            loaded[embedding.name] = embedding
        replicated = meshes.replicated(self.mesh)
        tables = tuple(meshes.place(table.astype(self.dtype), replicated)
                       for table in embeddings.table(list(loaded.values()), self.spec))
        with self._lock:
            self.prompts.set_embeddings(list(loaded.values()))
            self.params = {**self.params, "embeddings": tables}
            self._applied = ((), self.params)

    def _embedding_rows(self, tokens) -> int:
        """The vector rows a prompt's program reads: the loaded tables' when one of its ids is past the
        vocabulary, else none (and the program is the one without embeddings)."""
        if "embeddings" not in self.params or not (tokens.ids >= self.spec.text_encoders[0].vocab_size).any():
            return 0
        return self.params["embeddings"][0].shape[0]

    # LoRAs

    def set_loras(self, loras: Mapping[str, float]) -> float:
        """Makes `loras` ({source: scale}) the active LoRAs, those of requests that name none, in place
        of the previous ones ({} clears them), as diffusers' `set_adapters(names, adapter_weights)`;
        returns the seconds it took to read and apply them.

        The weights change, the programs do not: switching never recompiles, and the layers no active
        LoRA touches are the loaded arrays themselves, so clearing restores them exactly. Each file is
        read once (`lora.locate`: a local .safetensors file, a Hub repo id, or "owner/name/file.safetensors").

        Raises:
          CheckpointError: a source is missing or does not fit the model; the active LoRAs stay as they were.
          ValueError: a scale outside `LORA_SCALE_RANGE`.
        """
        wanted = {str(source): number(scale, f"LoRA scale of {source}", *LORA_SCALE_RANGE)
                  for source, scale in loras.items()}
        if wanted == self.loras:
            return 0.0
        start = time.perf_counter()
        self._read_loras(wanted)  # each file checked now, at scale 0 too: a prompt's tag may turn it up
        self.params_with(tuple(sorted((source, scale) for source, scale in wanted.items() if scale)))
        self.loras = wanted
        return time.perf_counter() - start

    def params_with(self, loras: tuple[tuple[str, float], ...]) -> dict:
        """The parameters with `loras` ((source, scale), sorted, none at 0: a validated request's)
        applied, on the devices. The last set's are kept, so the requests of one LoRA set apply it once.

        Raises:
          CheckpointError: a source is missing or does not fit the model.
        """
        with self._lock:
            applied, params = self._applied
            if applied != loras:
                self._read_loras(source for source, _ in loras)
                layers = [(self.lora_files[source], scale) for source, scale in loras]
                replicated = meshes.replicated(self.mesh)
                params = jax.block_until_ready(lora.apply(self.params, layers, lambda a: meshes.place(a, replicated)))
                self._applied = (loras, params)
            return params

    def _read_loras(self, sources) -> None:
        with self._lock:
            for source in sources:
                if source not in self.lora_files:
                    self.lora_files[source] = lora.read(lora.locate(source), self.spec, name=source)

    # Rendering

    def render(
        self,
        request: Request | PreparedRequest,
        *,
        output_type: str | None = None,
        on_step: Callable[[int], bool | None] | None = None,
        on_preview: Callable[[int, np.ndarray], None] | None = None,
        steps_per_report: int = 1,
    ) -> Generation | None:
        """Renders a request's images in one compiled call, or in a chain of them that reports progress.

        Args:
          request: a prepared request, rendered as it is; or a `Request`, prepared first (`prepare`).
          output_type: for a `Request`, "pil" (the default), "np" or "latent" (`prepare`).
          on_step: called with the number of finished steps (of those that run, a refiner's after the
            base's) every `steps_per_report` steps; returning False gives the rendering up, and
            `render` returns None.
          on_preview: called with the same step count and [N, h, w, 3] uint8 previews of the images
            (`sdxl.models.previews`), at the latents' size.

        Raises:
          ValueError: a value of a `Request` is out of range.
        """
        start = time.perf_counter()
        if isinstance(request, Request):
            prepared = self.prepare(request, output_type=output_type or "pil")
        elif output_type is not None:
            raise ValueError("a prepared request renders as it was prepared: give output_type to `prepare`")
        else:
            prepared = request
        result = self._render_part(prepared, on_step, on_preview, steps_per_report)
        if result is not None and prepared.refined is not None:
            result = self._refined(prepared, result.images, on_step, on_preview, steps_per_report)
        if result is not None and prepared.hires is not None:
            result = self._hires_pass(prepared, result.images, on_step, on_preview, steps_per_report)
        if result is not None:
            result.seconds = time.perf_counter() - start
        return result

    def _render_part(self, prepared: PreparedRequest, on_step, on_preview, steps_per_report) -> Generation | None:
        """One program's run: this model's part of a prepared request."""
        request, program = prepared.request, prepared.program
        n = len(request)
        arrays = inputs.placed(inputs.host_inputs(prepared), self.mesh)
        params = self.params_with(request.loras)
        # The ControlNets' and IP-Adapters' weights are the program's only when they steer this request.
        unused = {name for name, used in (("controlnets", program.controlnets), ("ip_adapters", program.ip_adapters),
                                          ("embeddings", program.embedding_rows)) if not used}
        params = {k: v for k, v in params.items() if k not in unused}
        if on_step is None and on_preview is None:
            images, finite = self.executables.compiled(program, "whole")(params, arrays)
        else:
            first, stop = prepared.steps
            evaluations = program.method.evaluations
            report = ProgressReports(on_step, on_preview, stop - first, evaluations(first), n)
            stage = lambda name: self.executables.compiled(program, name)  # noqa: E731
            rendered = run_in_stages(stage, params, arrays, evaluations(first), evaluations(stop), report,
                                     steps_per_report)
            if rendered is None:
                return None
            images, finite = rendered
        images = images[:n] if program.output_type == "latent" else meshes.fetch(images)[:n]
        return Generation(images, meshes.fetch(finite)[:n], self.devices_of(n), 0.0)

    def _refined(self, prepared: PreparedRequest, latents, on_step, on_preview, steps_per_report):
        """The refiner's part, from the latents this model left on the devices; its reports count on
        from this model's steps."""
        refined = prepared.refined
        refined = dataclasses.replace(refined, request=dataclasses.replace(refined.request, start_latents=latents))
        return self.refiner._render_part(refined, *_counting_on(prepared, on_step, on_preview), steps_per_report)

    def _hires_pass(self, prepared: PreparedRequest, first_pass, on_step, on_preview, steps_per_report):
        """The hires fix's second pass, from the first pass's result upscaled: its latents on the
        devices, or its pictures on the host (`sdxl.engine.hires`); its reports count on from the first
        pass's steps."""
        request, second, spec = prepared.request, prepared.hires, self.spec
        hires, f = request.hires, spec.vae.downscale_factor
        up_height, up_width = hires.upscaled_latent_size(request.height, request.width, spec)
        rows, columns = hires.crop(request.height, request.width, spec)
        height, width = second.request.height // f, second.request.width // f
        if hires.in_latents:
            latents = _upscaled_latents(first_pass, up_height, up_width, hires.upscaler)
            start = dict(start_latents=latents[:, rows // 2: rows // 2 + height, columns // 2: columns // 2 + width])
        else:
            # webui makes its first pass's pictures uint8 by truncation, not rounding.
            pictures = hires_fix.upscaled_pictures((first_pass * 255).astype(np.uint8), up_height * f, up_width * f,
                                                   hires.upscaler, self.upscalers)
            top, left = rows // 2 * f, columns // 2 * f
            start = dict(images=pictures[:, top: top + height * f, left: left + width * f])
        second = dataclasses.replace(second, request=dataclasses.replace(second.request, **start))
        return self._render_part(second, *_counting_on(prepared, on_step, on_preview), steps_per_report)


def with_drawn_noise(request: Request, program: GenerateProgram, steps: tuple[int, int]) -> Request:
    """`request` with the noise its source draws on the host (`sdxl.sampling.noise.drawn`): the starting
    noise, and for a stochastic sampler the draws after it, where the tools it comes from draw them:
    the sampler's draws from the first step that runs (`steps`: first, stop) to the schedule's end. An
    SDE sampler on A1111's schedules draws from A1111's Brownian trees (`sdxl.sampling.brownian`)."""
    height, width, channels = program.spec.latent_shape(request.height, request.width)
    shape, method, (first, _) = (channels, height, width), program.method, steps
    length = inputs.schedule_length(program, request)
    total = method.draws(length) if method.stochastic else 0
    skipped = method.draws(first) if method.stochastic else 0  # image-to-image skips the first steps' draws
    label = methods.SAMPLER_NAMES[request.sampler]
    trees = program.a1111 and kdiffusion.SAMPLERS[label].brownian and not request.batch_noise
    start, after = noise.drawn(
        request.noise_source, shape, request.seeds, request.image_index,
        later_draws=0 if trees else total - skipped, batch_noise=request.batch_noise,
        variation_seed=request.variation_seed, variation_strength=request.variation_strength, ensd=request.ensd,
    )
    if trees:  # the trees span the whole schedule, as A1111 builds them; the draws are those of the steps run
        sigmas = np.asarray(inputs.schedule(program, request).sigmas)[: length + 1]
        seeds = [noise.a1111_seeds(seed, [index], request.variation_seed, request.variation_strength)[0][0]
                 for seed, index in zip(request.seeds, request.image_index)]
        tree = BrownianNoise(request.noise_source, shape, seeds, sigmas[sigmas > 0].min(), sigmas.max())
        after = kdiffusion.brownian_draws(label, sigmas, tree)[:, skipped:]
    step_noise = None
    if method.stochastic:  # Restart's short runs draw none
        step_noise = np.zeros((len(request), total, height, width, channels), np.float32)
        step_noise[:, skipped:] = after.transpose(0, 1, 3, 4, 2)
    return dataclasses.replace(request, noise=start.transpose(0, 2, 3, 1), step_noise=step_noise)


def _counting_on(prepared: PreparedRequest, *reports) -> list:
    """Progress reports for the part that continues `prepared`: counting on from its steps."""
    first, stop = prepared.steps
    return [None if report is None else (lambda done, *preview, report=report: report(stop - first + done, *preview))
            for report in reports]


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _upscaled_latents(latents: jax.Array, height: int, width: int, upscaler: str) -> jax.Array:
    return upscale_latents(latents, height, width, upscaler)


def _handoff(request: Request) -> tuple[Request, Request]:
    """A validated request with `refine_from` as its two parts: the base model's down to that fraction
    of the noise (`denoising_end`), and the refiner's from there (`denoising_start`; its latents, the
    `start_latents`, come from the first part when it renders). The LoRAs, ControlNets and IP-Adapters are the
    base's."""
    base = dataclasses.replace(request, refine_from=None, denoising_end=request.refine_from)
    refining = dataclasses.replace(request, refine_from=None, images=None, masks=None,
                                   denoising_start=request.refine_from, loras=(), controls=None, image_prompts=None)
    return base, refining


@jax.jit
def _all_equal(a, b) -> jax.Array:
    """Whether two parameter trees of the same shapes hold the same values (one program for all leaves)."""
    return jnp.all(jnp.stack([jnp.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]))


def _edit_steps(request: Request, steps: int) -> int:
    """The step count a prompt's edits are scheduled over for `steps` steps of the request's sampler: its
    model evaluations, as webui's `total_steps` (twice the steps for a second-order sampler)."""
    return int(methods.loop(request.sampler, request.schedule_type != methods.DIFFUSERS).evaluations(steps))
