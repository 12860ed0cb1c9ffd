"""The built-in tiny models: small random checkpoints in the SDXL and SD 1.x layouts, written on first use.

Each has the real diffusers layout (model_index.json, unet/, vae/, text_encoder*/, tokenizer*/,
scheduler/, safetensors weights) and is loaded through the same `from_pretrained` path as a
downloaded checkpoint, so the demo, the CLI and the tests run end to end with no download:

- "tiny": SDXL's layout. Two text encoders (the second with a projection and plain gelu), their
  penultimate states as context, the pooled text and size ids as extra conditioning, linear
  attention projections, and SDXL's scheduler config.
- "tiny-sd1": SD 1.x's layout. One quick_gelu encoder whose last state is the context, no extra
  conditioning, convolutional attention projections, one head count for every level, and
  stable-diffusion-v1-5's (PNDM) scheduler config. Like a checkpoint saved without its safety
  checker, its model_index.json lists `safety_checker` and `feature_extractor` as null.

Both are 128 pixels native and share the tiny VAE. Their images are noise-like patterns: the weights
are random.
"""

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from .checkpoint import BUILTIN_CONFIGS
from .config import cache_root, read_json
from .weights import write_params

# Bump when the configs or the weight recipe change, so stale caches are not reused.
VERSION = 4
NATIVE_SIZE = 128

_TEXT_ENCODER = {  # CLIP ViT-L's text encoder in miniature: SD 1.x's only encoder, SDXL's first
    "architectures": ["CLIPTextModel"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-05,
    "projection_dim": 32,
    "bos_token_id": 512,
    "eos_token_id": 513,
    "pad_token_id": 513,
}
_TEXT_ENCODER_2 = {**_TEXT_ENCODER, "architectures": ["CLIPTextModelWithProjection"], "hidden_act": "gelu"}


def _vae(scaling_factor: float) -> dict:
    return {
        "_class_name": "AutoencoderKL",
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
        "block_out_channels": [8, 16, 16, 16],
        "layers_per_block": 1,
        "latent_channels": 4,
        "norm_num_groups": 4,
        "sample_size": NATIVE_SIZE,
        "scaling_factor": scaling_factor,
    }


_UNET = {
    "_class_name": "UNet2DConditionModel",
    "sample_size": NATIVE_SIZE // 8,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": [32, 64],
    "layers_per_block": 1,
    "norm_num_groups": 8,
}
_COMPONENTS = {
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
}

SDXL_CONFIGS = {
    "model_index.json": {
        **_COMPONENTS,
        "_class_name": "StableDiffusionXLPipeline",
        "force_zeros_for_empty_prompt": True,
        "scheduler": ["diffusers", "EulerDiscreteScheduler"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
    },
    "unet/config.json": {
        **_UNET,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
        "cross_attention_dim": 2 * _TEXT_ENCODER["hidden_size"],
        "attention_head_dim": [2, 4],
        "transformer_layers_per_block": [1, 2],
        "use_linear_projection": True,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 8,
        "projection_class_embeddings_input_dim": _TEXT_ENCODER_2["projection_dim"] + 6 * 8,
    },
    "vae/config.json": _vae(scaling_factor=0.13025),
    "text_encoder/config.json": _TEXT_ENCODER,
    "text_encoder_2/config.json": _TEXT_ENCODER_2,
    "scheduler/scheduler_config.json": read_json(BUILTIN_CONFIGS / "sdxl-base-1.0/scheduler/scheduler_config.json"),
}

SD1_CONFIGS = {
    "model_index.json": {
        **_COMPONENTS,
        "_class_name": "StableDiffusionPipeline",
        "scheduler": ["diffusers", "PNDMScheduler"],
        "safety_checker": [None, None],
        "feature_extractor": [None, None],
        "requires_safety_checker": False,
    },
    "unet/config.json": {
        **_UNET,
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
        "cross_attention_dim": _TEXT_ENCODER["hidden_size"],
        "attention_head_dim": 4,
        "use_linear_projection": False,
    },
    "vae/config.json": _vae(scaling_factor=0.18215),
    "text_encoder/config.json": _TEXT_ENCODER,
    # stable-diffusion-v1-5's, as published: a PNDM config that names no timestep spacing.
    "scheduler/scheduler_config.json": {
        "_class_name": "PNDMScheduler",
        "_diffusers_version": "0.6.0",
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "beta_start": 0.00085,
        "num_train_timesteps": 1000,
        "set_alpha_to_one": False,
        "skip_prk_steps": True,
        "steps_offset": 1,
        "trained_betas": None,
        "clip_sample": False,
    },
}

MODELS = {"tiny": SDXL_CONFIGS, "tiny-sd1": SD1_CONFIGS}


def random_tensor(rng: np.random.Generator, path: tuple[str, ...], shape: tuple[int, ...]) -> np.ndarray:
    """Random values for one parameter: fan-in scaled kernels, small biases, unit-ish norm scales.

    Biases and norm scales are random too, so a loader that mixed them up would be caught.
    """
    if path[-1] == "kernel":  # conv, HWIO
        return rng.standard_normal(shape, np.float32) / np.sqrt(np.prod(shape[:-1]), dtype=np.float32)
    if path[-1] == "weight":  # linear, [out, in]
        return rng.standard_normal(shape, np.float32) / np.sqrt(shape[1], dtype=np.float32)
    if path[-1] == "embedding":
        return rng.standard_normal(shape, np.float32) * 0.5
    if path[-1] == "scale":
        return 1 + 0.1 * rng.standard_normal(shape, np.float32)
    return 0.1 * rng.standard_normal(shape, np.float32)


def write_checkpoint(folder: Path, configs: dict = SDXL_CONFIGS, *, dtype="float32", seed: int = 0) -> Path:
    """Writes a random checkpoint in the diffusers layout, one tensor at a time.

    The host never holds more than one tensor, so this also writes full-size checkpoints (SDXL's
    2.6B-parameter UNet) for benchmarks.

    Args:
      configs: {relative path: JSON dict} for model_index.json and every component's config, e.g.
        `SDXL_CONFIGS` or `SD1_CONFIGS`. The model family follows from them.
      dtype: the stored dtype ("float32", "float16" or "bfloat16").
      seed: seeds the weights.

    Returns:
      `folder`.
    """
    from .pipeline import ModelSpec
    from .tokenizer import write_byte_level_tokenizer

    folder = Path(folder)
    for name, config in configs.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(config, indent=2))
    spec = ModelSpec.from_folder(folder)
    for i, (component, abstract) in enumerate(sorted(spec.abstract_params().items())):
        # diffusers names its models' files one way, transformers another.
        library = configs["model_index.json"][component][0]
        filename = "model.safetensors" if library == "transformers" else "diffusion_pytorch_model.safetensors"
        draw = functools.partial(random_tensor, np.random.default_rng([seed, i]))
        write_params(folder / component / filename, abstract, jnp.dtype(dtype), draw)
    for encoder in spec.text_encoder_names:
        write_byte_level_tokenizer(folder / encoder.replace("text_encoder", "tokenizer"), spec.max_tokens)
    return folder


def ensure_checkpoint(name: str = "tiny") -> Path:
    """The folder of the built-in model `name` (a key of `MODELS`), written on first use."""
    return ensure_cached(f"{name}-v{VERSION}", MODELS[name])


def ensure_cached(folder_name: str, configs: dict) -> Path:
    """A random checkpoint with `configs` in the project cache, written (atomically) on first use."""
    folder = cache_root() / folder_name
    if (folder / "model_index.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{folder_name}-", dir=folder.parent))
    try:
        write_checkpoint(staging, configs)
        os.replace(staging, folder)
    except OSError:
        if not (folder / "model_index.json").is_file():  # not just another process winning the race
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
