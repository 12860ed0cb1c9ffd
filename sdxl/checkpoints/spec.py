"""`ModelSpec`: everything static about a checkpoint, read from its configs, and its parameter shapes."""

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from ..config import cache_root, config_from_dict, read_json
from ..models import clip, controlnet, layers, unet, vae
from ..sampling.samplers import sampler_for_scheduler
from ..sampling.schedulers import SchedulerConfig
from .folder import read_model_index
from .weights import CheckpointError, flatten, unflatten

# The text encoders in the order the UNet's context concatenates them.
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
# The pipelines whose checkpoints this package runs: SDXL and SD 1.x/2.x, text-to-image, image-to-image
# (the SDXL refiner is published as the latter) and inpainting. Every one of them does all three here.
PIPELINE_CLASSES = (
    "StableDiffusionXLPipeline",
    "StableDiffusionPipeline",
    "StableDiffusionXLImg2ImgPipeline",
    "StableDiffusionImg2ImgPipeline",
    "StableDiffusionXLInpaintPipeline",
    "StableDiffusionInpaintPipeline",
)
# What other pipeline classes are, for the message that refuses them.
_OTHER_PIPELINES = {
    "StableDiffusionInstructPix2PixPipeline": "an instruct-pix2pix model",
    "StableDiffusionXLInstructPix2PixPipeline": "an instruct-pix2pix model",
    "StableDiffusionDepth2ImgPipeline": "a depth-to-image model",
    "StableDiffusionUpscalePipeline": "an upscaler",
    "StableDiffusionLatentUpscalePipeline": "an upscaler",
}


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
    # The sampler that matches the checkpoint's scheduler class (`sampling.sampler_for_scheduler`).
    default_sampler: str = "euler"
    # The folders of `text_encoders`, in the order the context concatenates them: SDXL base has both,
    # the SDXL refiner only text_encoder_2, SD 1.x/2.x only text_encoder.
    text_encoder_names: tuple[str, ...] = TEXT_ENCODERS
    # The SDXL refiner's conditioning: an aesthetic score in place of the target size in the time ids.
    requires_aesthetics_score: bool = False

    @property
    def is_sdxl(self) -> bool:
        """SDXL conditions on two encoders' penultimate states plus pooled text and size ids."""
        return self.unet.addition_embed_type == "text_time"

    @property
    def sampling(self) -> str:
        """How the model is sampled, for people: "epsilon prediction", "v-prediction, zero terminal SNR", ..."""
        scheduler = self.scheduler
        prediction = {"epsilon": "epsilon prediction", "v_prediction": "v-prediction",
                      "sample": "sample prediction"}[scheduler.prediction_type]
        return prediction + (", zero terminal SNR" if scheduler.rescale_betas_zero_snr else "")

    @property
    def tokenizer_names(self) -> tuple[str, ...]:
        return tuple(name.replace("text_encoder", "tokenizer") for name in self.text_encoder_names)

    @property
    def latent_factor(self) -> int:
        """Image pixels per latent pixel, times the UNet's total downsampling: sizes must divide by it."""
        return self.vae.downscale_factor * 2 ** (len(self.unet.block_out_channels) - 1)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(h, w, channels) of the latents of a height x width image (NHWC, without the batch)."""
        f = self.vae.downscale_factor
        return height // f, width // f, self.vae.latent_channels

    @property
    def is_inpainting(self) -> bool:
        """An inpainting UNet: it takes the mask and the masked image's latents after the latents."""
        return self.unet.in_channels == 2 * self.vae.latent_channels + 1

    def time_ids(self, height: int, width: int, aesthetic_score: float) -> tuple[float, ...]:
        """SDXL's size conditioning, as diffusers' `_get_add_time_ids`: (original size, crop top-left,
        target size), the refiner's (original size, crop top-left, aesthetic score)."""
        last = (aesthetic_score,) if self.requires_aesthetics_score else (height, width)
        return (height, width, 0, 0, *last)

    @property
    def native_size(self) -> int:
        """The training resolution in pixels (1024 for SDXL, 512 for SD 1.x)."""
        return self.unet.sample_size * self.vae.downscale_factor

    @property
    def max_tokens(self) -> int:
        return self.text_encoders[0].max_position_embeddings

    @classmethod
    def from_folder(cls, folder: Path, scheduler: dict | None = None) -> "ModelSpec":
        """Reads the configs of a diffusers pipeline folder, and refuses what this package cannot run.

        Only the text encoders, UNet, VAE and scheduler are read. Other entries of model_index.json
        are ignored, whether they name a component or are null: SD 1.x's `safety_checker` and
        `feature_extractor` (no safety checker runs: images come out as from a diffusers pipeline
        built with safety_checker=None), `requires_safety_checker`, `image_encoder`.

        Args:
          scheduler: fields that replace the scheduler config's (`_class_name`, `timestep_spacing`,
            `prediction_type`, ...), as diffusers users pass them to `Scheduler.from_config`.

        Raises:
          CheckpointError: a config is missing or unreadable, or names something unsupported (the
            message says what): read before any weights, so that a download can stop in time.
        """
        folder = Path(folder)
        index = read_model_index(folder)
        _check_pipeline(folder, index)
        names = tuple(n for n in TEXT_ENCODERS if index.get(n) and index[n][0] is not None)
        configs = {
            "unet": _read(folder, "unet/config.json"),
            "vae": _read(folder, "vae/config.json"),
            "scheduler": _read(folder, "scheduler/scheduler_config.json") | (scheduler or {}),
            **{name: _read(folder, f"{name}/config.json") for name in names},
        }
        try:
            spec = cls(
                unet=config_from_dict(unet.UNetConfig, configs["unet"]),
                vae=config_from_dict(vae.VAEConfig, configs["vae"]),
                text_encoders=tuple(config_from_dict(clip.CLIPTextConfig, configs[name]) for name in names),
                scheduler=config_from_dict(SchedulerConfig, configs["scheduler"]),
                force_zeros_for_empty_prompt=bool(index.get("force_zeros_for_empty_prompt", False)),
                default_sampler=sampler_for_scheduler(configs["scheduler"]),
                text_encoder_names=names,
                requires_aesthetics_score=bool(index.get("requires_aesthetics_score", False)),
            )
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{folder}: {e}") from e
        spec.check_supported(folder)
        return spec

    def check_supported(self, where) -> None:
        """Raises CheckpointError naming what in these configs this package cannot run."""
        names = self.text_encoder_names
        if not names:
            raise CheckpointError(f"{where}: model_index.json names no text encoder")
        if self.is_sdxl and names not in (TEXT_ENCODERS, TEXT_ENCODERS[1:]):
            raise CheckpointError(
                f"{where}: an SDXL UNet with only {', '.join(names)}; SDXL needs text_encoder and text_encoder_2 "
                "(base) or text_encoder_2 (the refiner)"
            )
        if not self.is_sdxl and names != TEXT_ENCODERS[:1]:
            raise CheckpointError(f"{where}: an SD 1.x/2.x UNet needs text_encoder alone, got {', '.join(names)}")
        if self.requires_aesthetics_score and not self.is_sdxl:
            raise CheckpointError(f"{where}: aesthetic-score conditioning needs an SDXL UNet")
        if self.is_sdxl:
            ids = len(self.time_ids(0, 0, 0.0))
            width = ids * self.unet.addition_time_embed_dim + self.text_encoders[-1].projection_dim
            if width != self.unet.projection_class_embeddings_input_dim:
                what = "an aesthetic score" if self.requires_aesthetics_score else "the target size"
                raise CheckpointError(
                    f"{where}: the UNet's added embedding takes {self.unet.projection_class_embeddings_input_dim} "
                    f"values, but {ids} time ids (with {what}) and the pooled text give {width}: does "
                    "model_index.json's requires_aesthetics_score fit this UNet?"
                )
        if self.unet.in_channels not in (self.vae.latent_channels, 2 * self.vae.latent_channels + 1):
            raise CheckpointError(
                f"{where}: the UNet takes {self.unet.in_channels} input channels for "
                f"{self.vae.latent_channels}-channel latents (a depth or instruct-pix2pix model?); "
                "only text-to-image and inpainting UNets are supported"
            )
        if self.vae.shift_factor:
            raise CheckpointError(f"{where}: a VAE with shift_factor={self.vae.shift_factor} is not supported")
        width = sum(config.hidden_size for config in self.text_encoders) if self.is_sdxl else None
        if width is not None and width != self.unet.cross_attention_dim:
            raise CheckpointError(
                f"{where}: the text encoders give {width}-wide states, the UNet attends to "
                f"{self.unet.cross_attention_dim}"
            )

    def abstract_params(self) -> dict:
        """The parameter tree's shapes, with nothing allocated."""
        params = {
            "unet": cached_shapes(unet.abstract_params, self.unet), "vae": cached_shapes(vae.abstract_params, self.vae)
        }
        for name, config in zip(self.text_encoder_names, self.text_encoders):
            params[name] = cached_shapes(clip.abstract_params, config)
        return params


def _read(folder: Path, path: str) -> dict:
    try:
        return read_json(folder / path)
    except FileNotFoundError as e:
        raise CheckpointError(f"{folder}: missing config file {path}") from e
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def _check_pipeline(folder: Path, index: dict) -> None:
    """Refuses a pipeline class other than SD/SDXL text-to-image, image-to-image and inpainting."""
    name = index.get("_class_name", PIPELINE_CLASSES[0])
    if name not in PIPELINE_CLASSES:
        what = _OTHER_PIPELINES.get(name, "not a Stable Diffusion pipeline")
        supported = ", ".join(PIPELINE_CLASSES)
        raise CheckpointError(f"{folder}: {name} ({what}) is not supported; this package runs {supported} checkpoints")


@functools.cache
def _model_sources_digest() -> bytes:
    """The parameter shapes follow from a config and these files."""
    digest = hashlib.sha256()
    for module in (layers, clip, unet, vae, controlnet):
        digest.update(Path(module.__file__).read_bytes())
    return digest.digest()


def cached_shapes(abstract_params: Callable, config) -> dict:
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
