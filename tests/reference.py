"""Reference (PyTorch diffusers/transformers) pipelines built from our tiny configs, for parity tests."""

import json
from pathlib import Path

import diffusers
import numpy as np
import torch
from PIL import Image
from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from sdxl.checkpoints import random_models
from sdxl.checkpoints.tokenizer import write_byte_level_tokenizer

SCHEDULER_JSON = "scheduler/scheduler_config.json"


def randomize_(module: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """Re-draws every parameter: default inits leave norms at 1 and biases at 0, and outputs tiny.

    Fan-in scaled weights keep activations O(1), so an absolute tolerance is meaningful, and
    random biases and norm scales make a loader that swapped them fail.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.ndim >= 2:
                param.copy_(noise * scale / param[0].numel() ** 0.5)
            elif name.endswith("weight"):  # norm scales
                param.copy_(1 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)


def _without_class(config: dict) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_") and k != "architectures"}


def _text_encoder(config: dict) -> CLIPTextModel | CLIPTextModelWithProjection:
    cls = CLIPTextModelWithProjection if config["architectures"] == ["CLIPTextModelWithProjection"] else CLIPTextModel
    return cls(CLIPTextConfig(**_without_class(config)))


def _components(folder: Path, configs: dict) -> dict:
    """The components the pipeline classes share, as `configs` describe them (the SDXL refiner has
    no first text encoder: None)."""
    tokenizer_dir = folder / "_tokenizer_source"
    write_byte_level_tokenizer(tokenizer_dir)
    scheduler = configs[SCHEDULER_JSON]
    first = configs.get("text_encoder/config.json")
    return {
        "vae": AutoencoderKL(**_without_class(configs["vae/config.json"])),
        "unet": UNet2DConditionModel(**_without_class(configs["unet/config.json"])),
        "text_encoder": None if first is None else _text_encoder(first),
        "tokenizer": None if first is None else CLIPTokenizer.from_pretrained(tokenizer_dir),
        # As diffusers loads a checkpoint's scheduler: the class the JSON names, from the JSON.
        "scheduler": getattr(diffusers, scheduler["_class_name"]).from_config(scheduler),
    }


def _randomize_and_save(pipe: diffusers.DiffusionPipeline, folder: Path, configs: dict, seed: int) -> None:
    names = [n for n in ("unet", "vae", "text_encoder", "text_encoder_2") if getattr(pipe, n, None) is not None]
    for i, name in enumerate(names):
        randomize_(getattr(pipe, name), seed + i)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    # diffusers writes every field of its scheduler class, defaults included (for SD 1.5's PNDM
    # config, timestep_spacing "leading"); keep the JSON as the checkpoint ships it instead.
    (folder / SCHEDULER_JSON).write_text(json.dumps(configs[SCHEDULER_JSON], indent=2))


def sdxl_pipeline(
    folder: Path, configs: dict = random_models.SDXL_CONFIGS, seed: int = 0
) -> diffusers.DiffusionPipeline:
    """A random diffusers SDXL pipeline with `configs`, saved (safetensors) to `folder`: of the
    class model_index.json names (text-to-image, image-to-image as the refiner, or inpainting)."""
    components = _components(folder, configs)
    index = configs["model_index.json"]
    cls = getattr(diffusers, index["_class_name"])
    options = {"requires_aesthetics_score": True} if index.get("requires_aesthetics_score") else {}
    pipe = cls(
        **components,
        text_encoder_2=_text_encoder(configs["text_encoder_2/config.json"]),
        tokenizer_2=CLIPTokenizer.from_pretrained(folder / "_tokenizer_source"),
        force_zeros_for_empty_prompt=index["force_zeros_for_empty_prompt"],
        add_watermarker=False,
        **options,
    )
    _randomize_and_save(pipe, folder, configs, seed)
    return pipe


def sd_pipeline(folder: Path, configs: dict = random_models.SD1_CONFIGS, seed: int = 0) -> StableDiffusionPipeline:
    """A random diffusers SD 1.x/2.x pipeline with `configs`, saved (safetensors) to `folder`.

    It has no safety checker: its model_index.json lists `safety_checker` and `feature_extractor`
    as null, as diffusers saves such a pipeline.
    """
    pipe = StableDiffusionPipeline(
        **_components(folder, configs), safety_checker=None, feature_extractor=None, requires_safety_checker=False
    )
    _randomize_and_save(pipe, folder, configs, seed)
    return pipe


def diffusers_images(pipe: diffusers.DiffusionPipeline, scheduler=None, **call_kwargs) -> np.ndarray:
    """[N, H, W, 3] float32 images in [0, 1] from a diffusers pipeline, with `scheduler` swapped in for this call."""
    original = pipe.scheduler
    pipe.scheduler = scheduler or original
    try:
        with torch.no_grad():
            return pipe(**call_kwargs, output_type="np").images
    finally:
        pipe.scheduler = original


def random_latents(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Standard normal starting latents in diffusers' layout [n, 4, height / 8, width / 8]."""
    return np.random.default_rng(seed).standard_normal((n, 4, height // 8, width // 8)).astype(np.float32)


def picture(height: int, width: int, seed: int = 1) -> Image.Image:
    """A picture to start from: a gradient with noise (smooth regions and edges) and a bright block."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:height, :width] / np.array([height, width])[:, None, None]
    pixels = np.stack([x, y, (x + y) / 2], axis=-1) * 200 + rng.integers(0, 56, (height, width, 3))
    pixels[16:40, 24:60] = (250, 40, 30)
    return Image.fromarray(pixels.astype(np.uint8))


def inpainting_mask(height: int, width: int) -> Image.Image:
    """White where a `picture` is repainted: a block that overlaps its bright one."""
    mask = np.zeros((height, width), np.uint8)
    mask[8:40, 40:88] = 255
    return Image.fromarray(mask)
