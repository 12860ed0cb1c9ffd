"""`Pipeline`: a checkpoint loaded onto a device mesh, and requests prepared and rendered with it.

A pipeline holds the current `LoadedModel` (`sdxl.engine.model`: the parameters on the devices, the
tokenizers, and what is loaded with them) and the compiled programs of its mesh. Its setters (`set_loras`,
`set_refiner`, `load_ip_adapter`, `load_textual_inversion`, ...) make a new snapshot the current one
(`sdxl.engine.loading`); `prepare` (`sdxl.engine.preparing`) makes a `Request` what the devices take,
against the current snapshot, which the prepared request keeps; `render` (`sdxl.engine.rendering`) runs
it with that snapshot, whatever was loaded since, and changes nothing. `generate` (`sdxl.engine.generate`)
is the same in diffusers' terms.
"""

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from .. import checkpoints
from . import loading, residency
from .checks import number
from .compiled import Executables
from .generate import generate
from .model import LoadedModel
from .preparing import prepare
from .prepared import PreparedRequest
from .program import GenerateProgram
from .rendering import Generation, NonFiniteImageError, render
from .request import LORA_SCALE_RANGE, Limits, Request
from .upscaler import Upscaler

__all__ = ["Generation", "NonFiniteImageError", "Pipeline"]


class Pipeline:
    """Stable Diffusion (XL) on a device mesh, each program compiled once.

    pipe = Pipeline.from_pretrained("stabilityai/stable-diffusion-xl-base-1.0")
    images = pipe.generate("a photo of an astronaut riding a horse", seed=0)
    """

    generate = generate

    def __init__(self, model: LoadedModel, executables: Executables | None = None):
        """A pipeline whose current snapshot is `model` (`sdxl.engine.loading.load`'s, or another's
        `replace`d). `executables`: the compiled programs to use, shared with other pipelines on the same
        mesh (each program names its model, so one cache serves several); default a cache of its own."""
        self._model = model
        self._lock = threading.RLock()  # over replacing `_model`: one setter at a time
        self.executables = executables or Executables(model.mesh)

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
        prediction_type: str | None = None,
        rescale_betas_zero_snr: bool | None = None,
        weights_dtype: str | None = None,
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
          prediction_type: what the UNet predicts, "epsilon", "v_prediction" or "sample", for a checkpoint
            that does not say (a diffusers folder says it in its scheduler config; a single file with a
            `v_pred` key, or its model spec metadata); default what it says, else epsilon.
          rescale_betas_zero_snr: True for a model trained with zero terminal SNR whose checkpoint does not
            say (a single file's `ztsnr` key does): Lin et al.'s rescaled noise schedule, with "trailing"
            steps unless `scheduler` gives another timestep_spacing (`sampling.schedulers.ZERO_TERMINAL_SNR`);
            False: the checkpoint's schedule as trained without it.
          weights_dtype: how the UNet's and ControlNets' large weights are stored on the devices, computed
            in `dtype` all the same (`sdxl.models.quantization`): "default" (in `dtype`), "fp8_e4m3fn"
            ("fp8"), "fp8_e5m2" (as ComfyUI's weight_dtype and Forge's `--unet-in-fp8-e4m3fn`, with a
            scale per output channel) or "int8" (symmetric, a scale per output channel): half the bytes
            of bfloat16 for 99% of the UNet's. Opt-in, "int8_compute" and "fp8_e4m3fn_compute" (ComfyUI's
            "fp8_e4m3fn_fast") store alike and also multiply in 8 bits in the Linear layers and 3x3
            convolutions, their inputs quantized on the fly.
        """
        scheduler = loading.scheduler_overrides(scheduler, prediction_type, rescale_betas_zero_snr)
        model = loading.load(path_or_repo_id, dtype=dtype, max_steps=max_steps, devices=devices, config=config,
                             scheduler=scheduler, unet=unet, vae=vae, controlnet=controlnet, vae_tiling=vae_tiling,
                             weights_dtype=weights_dtype)
        return cls(model, executables)

    # The current snapshot, and what it holds

    @property
    def model(self) -> LoadedModel:
        """The loaded model as it is now: what `prepare` prepares requests against."""
        return self._model

    def _replace_model(self, change: Callable[[LoadedModel], LoadedModel]) -> None:
        """Makes `change(current snapshot)` the current one; concurrent setters apply in turn."""
        with self._lock:
            self._model = change(self._model)

    spec = property(lambda self: self._model.spec)
    params = property(lambda self: self._model.params, doc="The current snapshot's parameters, as loaded.")
    prompts = property(lambda self: self._model.prompts)
    mesh = property(lambda self: self._model.mesh)
    dtype = property(lambda self: self._model.dtype)
    weights_dtype = property(lambda self: self._model.weights_dtype)
    max_steps = property(lambda self: self._model.max_steps)
    name = property(lambda self: self._model.name)
    weights_file = property(lambda self: self._model.weights_file)
    vae_name = property(lambda self: self._model.vae_name)
    vae_tiling = property(lambda self: self._model.vae_tiling)
    preview_factors = property(lambda self: self._model.preview_factors)
    controlnets = property(lambda self: self._model.controlnets)
    ip_adapters = property(lambda self: self._model.ip_adapters)
    loras = property(lambda self: dict(self._model.loras), doc="The active LoRAs: {source: scale}.")
    lora_files = property(lambda self: dict(self._model.lora_files), doc="The LoRA files read, by source.")
    refiner = property(lambda self: self._model.refiner, doc="The refiner's snapshot (`set_refiner`), or None.")
    upscalers = property(lambda self: dict(self._model.upscalers))
    limits = property(lambda self: self._model.limits, doc="What the current snapshot allows a request.")
    num_devices = property(lambda self: self._model.num_devices)
    device_description = property(lambda self: self._model.device_description)

    def devices_of(self, num_images: int) -> list[str]:
        return self._model.devices_of(num_images)

    def padded_batch(self, num_images: int) -> int:
        """The batch that `num_images` images compile and run as: a multiple of the device count."""
        return self._model.padded_batch(num_images)

    # What loads with the model

    def set_refiner(self, refiner: "Pipeline | None") -> None:
        """Makes `refiner` (an SDXL refiner on the same devices) finish requests with `refine_from`,
        as diffusers' "ensemble of expert denoisers": this model runs the schedule down to that
        fraction of the noise, and the refiner continues the latents, which stay on the devices. The
        refiner holds this model's arrays in place of its equal ones (`loading.with_refiner`).

        Raises:
          CheckpointError: the refiner cannot continue this model's latents.
        """
        if refiner is None:
            self._replace_model(lambda model: model.replace(refiner=None))
            return
        with self._lock, refiner._lock:
            self._model, refiner._model = loading.with_refiner(self._model, refiner._model)

    def hold_once(self, others: Sequence["Pipeline"]) -> list[str]:
        """Holds the arrays of `others`' components in place of this model's equal ones (by value: two
        fine-tunes of one base often share a VAE and text encoders), so that the devices hold them once;
        returns the components now shared."""
        models = [other.model for other in others]
        self._replace_model(lambda model: loading.held_once(model, models))
        return [name for name, tree in self._model.params.items()
                if any(model.params.get(name) is tree for model in models)]

    def move_with(self, placement) -> None:
        """Makes the current snapshot and those that follow move with `placement` (`sdxl.engine.residency`)."""
        self._replace_model(lambda model: model.replace(placement=placement))

    def add_upscaler(self, source: str) -> str:
        """Reads a model upscaler (ESRGAN, Real-ESRGAN: `sdxl.engine.upscaler`) from a local file or a Hub
        file "owner/name/file.safetensors" for hires fixes and `upscale`, its weights left off the devices
        until first used; returns the name requests give it (the file's stem).

        Raises:
          CheckpointError: the file is missing, unsafe or of an architecture not supported.
        """
        upscaler = Upscaler.from_file(checkpoints.locate_file(source), dtype=self.dtype)
        self._replace_model(lambda model: model.replace(upscalers={**model.upscalers, upscaler.name: upscaler}))
        return upscaler.name

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
        self._replace_model(lambda model: loading.with_ip_adapters(
            model, pretrained_model_name_or_path_or_dict, subfolder, weight_name, image_encoder_folder))

    def set_ip_adapter_scale(self, scale) -> None:
        """The scales requests take when they give none, as diffusers': a number for every layer, or a
        dict of blocks (`sdxl.engine.image_prompts.layer_scales`: InstantStyle's `STYLE_ONLY`), for
        every adapter, or a list with one per adapter.

        Raises:
          ValueError: a scale out of range or a block the UNet lacks, or another count.
        """
        self._replace_model(lambda model: model.replace(ip_adapter_scales=loading.ip_adapter_scales(model, scale)))

    def ip_adapter_scales(self, scale=None) -> tuple:
        """One scale per loaded adapter, from `set_ip_adapter_scale`'s forms, checked; None: the set ones.

        Raises:
          ValueError: a scale out of range or a block the UNet lacks, or another count.
        """
        return loading.ip_adapter_scales(self._model, scale)

    def unload_ip_adapter(self) -> None:
        """Unloads the IP-Adapters and their image encoder, as diffusers' `unload_ip_adapter`."""
        self._replace_model(loading.without_ip_adapters)

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
        self._replace_model(lambda model: loading.with_embeddings(model, paths, tokens))

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

        def with_loras(model: LoadedModel) -> LoadedModel:
            model = model.reading(wanted)  # each file checked now, at scale 0 too: a prompt's tag may turn it up
            if model.placement is None or model.placement.where == residency.DEVICES:  # else when it moves in
                model.params_with(tuple(sorted((source, scale) for source, scale in wanted.items() if scale)))
            return model.replace(loras=wanted)

        self._replace_model(with_loras)
        return time.perf_counter() - start

    def params_with(self, loras: tuple[tuple[str, float], ...]) -> dict:
        """The current parameters with `loras` ((source, scale), sorted, none at 0) applied, on the devices.

        Raises:
          CheckpointError: a source is missing or does not fit the model.
        """
        return self._model.reading(source for source, _ in loras).params_with(loras)

    # Requests: each is prepared once (checked, tokenized, its programs named, its run planned), then rendered.

    def prepare(self, request: Request, *, limits: Limits | None = None, output_type: str = "pil") -> PreparedRequest:
        """`request` as the devices take it, prepared against the current snapshot, which it keeps and
        renders with (`sdxl.engine.preparing.prepare` says what it does, and takes and raises)."""
        return prepare(self._model, request, limits=limits, output_type=output_type)

    def programs_for(self, request: Request, num_images: int | None = None) -> tuple[GenerateProgram, ...]:
        """The programs `request` runs (`prepare`), at `num_images` images (default its own count)."""
        prepared = self.prepare(request)
        return prepared.programs if num_images is None else prepared.programs_at(self.padded_batch(num_images))

    # Programs: each compiled once, for this pipeline's mesh (a refiner's too).

    def compiled(self, program: GenerateProgram, stage: str = "whole"):
        """A program's stage, compiled on first use."""
        return self.executables.compiled(program, stage)

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
        request = Request.from_prompt("", num_images=n, steps=1, height=height, width=width, sampler=sampler)
        return self.compile(self.programs_for(request), progress=progress)

    def lowered(self, program: GenerateProgram, stage: str = "whole", platforms: tuple[str, ...] | None = None):
        """A program's stage lowered for `platforms` (default: the devices'), not compiled: a CPU host
        can check that the program it would run on a TPU lowers (splash kernels go through Mosaic here)."""
        return self.executables.lowered(program, stage, platforms)

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
        if isinstance(request, Request):
            prepared = self.prepare(request, output_type=output_type or "pil")
        elif output_type is not None:
            raise ValueError("a prepared request renders as it was prepared: give output_type to `prepare`")
        else:
            prepared = request
        return render(prepared, self.executables, on_step, on_preview, steps_per_report)
