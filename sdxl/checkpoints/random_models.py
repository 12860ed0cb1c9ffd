"""The built-in random models: checkpoints with random weights in the real diffusers layout.

Each is written on first use (into the project cache) with model_index.json, unet/, vae/,
text_encoder*/, tokenizer*/ and scheduler/ folders and safetensors weights, and loads through the
same path as a downloaded checkpoint, so the demo, the CLI, the tests and the benchmark run end to
end with no download. Their images are noise-like patterns: the weights are random.

- "tiny": SDXL's layout. Two text encoders (the second with a projection and plain gelu), their
  penultimate states as context, the pooled text and size ids as extra conditioning, linear
  attention projections, and SDXL's scheduler config.
- "tiny-sd1": SD 1.x's layout. One quick_gelu encoder whose last state is the context, no extra
  conditioning, convolutional attention projections, one head count for every level, and
  stable-diffusion-v1-5's (PNDM) scheduler config. Like a checkpoint saved without its safety
  checker, its model_index.json lists `safety_checker` and `feature_extractor` as null.
- "tiny-refiner": the SDXL refiner's layout. text_encoder_2 alone, whose states are the context,
  and an aesthetic score in place of the target size in the size ids (`requires_aesthetics_score`).
- "tiny-inpaint": "tiny" with an inpainting UNet (9 input channels: the latents, the mask and the
  masked image's latents), as `diffusers/stable-diffusion-xl-1.0-inpainting-0.1`.
- "medium": SDXL's layout at a fifth of its width, for the benchmark on a CPU.
- A folder of published configs in `BUILTIN_CONFIGS` ("sdxl-base-1.0"): full size, for the
  benchmark on accelerators (`python -m sdxl write-checkpoint`).

The tiny models are 128 pixels native and share the tiny VAE. `write_ip_adapter` writes IP-Adapters
for a UNet, with their CLIP image encoder, in h94/IP-Adapter's layout.
"""

import dataclasses
import functools
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import numpy as safetensors_numpy

from ..config import cache_root, config_from_dict, read_json
from . import single_file
from .folder import WEIGHT_COMPONENTS
from .spec import ModelSpec
from .tokenizer import write_byte_level_tokenizer
from .weights import checkpoint_key, flatten, torch_axes, write_params

# Published configs, shipped with the package (see the folder's README for their source and licence).
BUILTIN_CONFIGS = Path(__file__).parents[1] / "configs"

# Bump when the configs or the weight recipe (`random_tensor`) change, so stale caches are not reused.
VERSION = 4
MEDIUM_VERSION = 2
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


def _vae(scaling_factor: float, block_out_channels=(8, 16, 16, 16), norm_num_groups=4, sample_size=NATIVE_SIZE):
    """A 4-level VAE config (8x downscaling, as SD's and SDXL's)."""
    return {
        "_class_name": "AutoencoderKL",
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ["DownEncoderBlock2D"] * 4,
        "up_block_types": ["UpDecoderBlock2D"] * 4,
        "block_out_channels": list(block_out_channels),
        "layers_per_block": 1,
        "latent_channels": 4,
        "norm_num_groups": norm_num_groups,
        "sample_size": sample_size,
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

REFINER_CONFIGS = {
    "model_index.json": {
        **_COMPONENTS,
        "_class_name": "StableDiffusionXLImg2ImgPipeline",
        "force_zeros_for_empty_prompt": False,
        "requires_aesthetics_score": True,
        "scheduler": ["diffusers", "EulerDiscreteScheduler"],
        "text_encoder": [None, None],
        "tokenizer": [None, None],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
    },
    "unet/config.json": {
        **SDXL_CONFIGS["unet/config.json"],
        "cross_attention_dim": _TEXT_ENCODER_2["hidden_size"],
        # (original size, crop top-left, aesthetic score): 5 time ids
        "projection_class_embeddings_input_dim": _TEXT_ENCODER_2["projection_dim"] + 5 * 8,
    },
    "vae/config.json": SDXL_CONFIGS["vae/config.json"],
    "text_encoder_2/config.json": _TEXT_ENCODER_2,
    "scheduler/scheduler_config.json": SDXL_CONFIGS["scheduler/scheduler_config.json"],
}

INPAINT_CONFIGS = {
    **SDXL_CONFIGS,
    "model_index.json": {**SDXL_CONFIGS["model_index.json"], "_class_name": "StableDiffusionXLInpaintPipeline"},
    "unet/config.json": {**SDXL_CONFIGS["unet/config.json"], "in_channels": 9},
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

MEDIUM_SIZE = 256
_MEDIUM_TEXT_ENCODER = {  # CLIP ViT-L's text encoder scaled down; 64-wide heads as in SDXL
    "architectures": ["CLIPTextModel"],
    "vocab_size": 514,  # the byte-level tokenizer's
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-05,
    "projection_dim": 128,
    "bos_token_id": 512,
    "eos_token_id": 513,
    "pad_token_id": 513,
}
_MEDIUM_TEXT_ENCODER_2 = {  # ... and OpenCLIP bigG's, with its projection and plain gelu
    **_MEDIUM_TEXT_ENCODER,
    "architectures": ["CLIPTextModelWithProjection"],
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_attention_heads": 4,
    "projection_dim": 256,
    "hidden_act": "gelu",
}
# SDXL's layout at a fifth of its width: three levels, no attention at the top one, the deepest
# transformers at the bottom, 64-wide attention heads, two text encoders whose states concatenate
# into the context, and a 4-level VAE. The UNet has 34M parameters and a 256x256 image costs 0.18
# TFLOP at 10 steps: a batch of 4 takes seconds on 2 CPU cores.
MEDIUM_CONFIGS = {
    **SDXL_CONFIGS,
    "unet/config.json": {
        "_class_name": "UNet2DConditionModel",
        "sample_size": MEDIUM_SIZE // 8,
        "in_channels": 4,
        "out_channels": 4,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "block_out_channels": [64, 128, 256],
        "layers_per_block": 2,
        "norm_num_groups": 32,
        "cross_attention_dim": _MEDIUM_TEXT_ENCODER["hidden_size"] + _MEDIUM_TEXT_ENCODER_2["hidden_size"],
        "attention_head_dim": [1, 2, 4],
        "transformer_layers_per_block": [1, 1, 2],
        "use_linear_projection": True,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 64,
        "projection_class_embeddings_input_dim": _MEDIUM_TEXT_ENCODER_2["projection_dim"] + 6 * 64,
    },
    "vae/config.json": _vae(0.13025, (32, 64, 128, 128), norm_num_groups=32, sample_size=MEDIUM_SIZE),
    "text_encoder/config.json": _MEDIUM_TEXT_ENCODER,
    "text_encoder_2/config.json": _MEDIUM_TEXT_ENCODER_2,
}

# The random models by name; `configs_of` also takes the folders in `BUILTIN_CONFIGS` ("sdxl-base-1.0").
MODELS = {
    "tiny": SDXL_CONFIGS,
    "tiny-sd1": SD1_CONFIGS,
    "tiny-refiner": REFINER_CONFIGS,
    "tiny-inpaint": INPAINT_CONFIGS,
    "medium": MEDIUM_CONFIGS,
}
# The ones small enough to be written on first use by `Pipeline.from_pretrained(name)`.
ON_DEMAND = {"tiny": VERSION, "tiny-sd1": VERSION, "tiny-refiner": VERSION, "tiny-inpaint": VERSION,
             "medium": MEDIUM_VERSION}


def configs_of(name: str) -> dict:
    """{relative path: JSON} of a random model: a key of `MODELS`, or a published config folder.

    A published folder's text encoders name CLIP's real special tokens; they are set to those of the
    byte-level tokenizer a random checkpoint gets, so that the pooled text is taken at the end token.
    """
    if name in MODELS:
        return MODELS[name]
    folder = BUILTIN_CONFIGS / name
    if not folder.is_dir():
        known = sorted([*MODELS, *(p.name for p in BUILTIN_CONFIGS.iterdir())])
        raise ValueError(f"unknown config {name!r}; choose one of: {', '.join(known)}")
    # The model's configs only: a random checkpoint gets its own byte-level tokenizer files.
    names = ["model_index.json", "scheduler/scheduler_config.json", *(f"{c}/config.json" for c in WEIGHT_COMPONENTS)]
    found = {name: read_json(folder / name) for name in names if (folder / name).is_file()}
    special_tokens = {
        k: SDXL_CONFIGS["text_encoder/config.json"][k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
    }
    for path, config in found.items():
        if path.startswith("text_encoder"):
            found[path] = {**config, **special_tokens}
    return found


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
    for tokenizer in spec.tokenizer_names:
        write_byte_level_tokenizer(folder / tokenizer, spec.max_tokens)
    return folder


def write_single_file(path: Path, configs: dict, *, dtype="float16", seed: int = 0) -> Path:
    """Writes random weights for `configs` as one original-layout file (`single_file`), one tensor
    at a time: a full-size SDXL single file for the benchmark's load."""
    with tempfile.TemporaryDirectory() as scratch:
        for name, config in configs.items():
            (Path(scratch) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(scratch) / name).write_text(json.dumps(config))
        spec = ModelSpec.from_folder(Path(scratch))
    family = single_file.family_of(spec)
    shapes = {component: flatten(tree) for component, tree in spec.abstract_params().items()}
    paths = {component: {checkpoint_key(p): p for p in tree} for component, tree in shapes.items()}
    components = sorted(shapes)

    def tensor(component: str, key: str) -> np.ndarray:
        path = paths[component][key]
        rng = np.random.default_rng([seed, components.index(component), zlib.crc32(key.encode())])
        value = random_tensor(rng, path, tuple(shapes[component][path].shape))
        return value.transpose(torch_axes(path, value.ndim))

    return single_file.write_single_file(path, family, spec, tensor, dtype)


def controlnet_config(spec: ModelSpec):
    """A ControlNet config for `spec`'s UNet, as diffusers' `ControlNetModel.from_unet` makes one: the
    UNet's encoder fields, and a conditioning embedding with one stride-2 convolution per halving of
    the VAE's (diffusers' default (16, 32, 96, 256) for its 8x VAEs). For SDXL base 1.0 this is the
    published SDXL ControlNet config (`sdxl/configs/controlnet-sdxl-1.0`)."""
    from ..models.controlnet import ControlNetConfig  # the model imports the checkpoints

    fields = {f.name for f in dataclasses.fields(ControlNetConfig)}
    values = {k: v for k, v in dataclasses.asdict(spec.unet).items() if k in fields}
    halvings = spec.vae.downscale_factor.bit_length() - 1
    values.update(
        in_channels=spec.vae.latent_channels,  # it reads the latents alone, also beside an inpainting UNet
        conditioning_embedding_out_channels=(16, 32, 96, 256, 256, 256)[: halvings + 1],
    )
    return config_from_dict(ControlNetConfig, values)


def write_controlnet(folder: Path, spec: ModelSpec, *, dtype="float32", seed: int = 0) -> Path:
    """Writes a random ControlNet for `spec`'s UNet (`controlnet_config`) in the diffusers layout, one
    tensor at a time. Its zero convolutions are random too, so it steers.

    Returns:
      `folder`.
    """
    from ..models.controlnet import abstract_params

    config = controlnet_config(spec)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}
    (folder / "config.json").write_text(json.dumps({"_class_name": "ControlNetModel", **values}, indent=2))
    draw = functools.partial(random_tensor, np.random.default_rng([seed, 27]))
    write_params(folder / "diffusion_pytorch_model.safetensors", abstract_params(config), jnp.dtype(dtype), draw)
    return folder


def ensure_checkpoint(name: str = "tiny") -> Path:
    """The folder of the random model `name` (a key of `ON_DEMAND`) in the project cache, written
    (atomically) on first use."""
    folder_name = f"{name}-v{ON_DEMAND[name]}"
    folder = cache_root() / folder_name
    if (folder / "model_index.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{folder_name}-", dir=folder.parent))
    try:
        write_checkpoint(staging, MODELS[name])
        os.replace(staging, folder)
    except OSError:
        if not (folder / "model_index.json").is_file():  # not just another process winning the race
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def write_upscaler(path: Path, *, scale: int = 2, num_feat: int = 8, num_conv: int = 2, seed: int = 0) -> Path:
    """A random Real-ESRGAN SRVGGNetCompact upscaler (`sdxl.models.srvgg`) as a .safetensors file in its
    published keys: small random residuals over the nearest-upsampled picture, for tests and demos."""
    rng = np.random.default_rng(seed)
    tensors, channels = {}, 3
    for i in range(num_conv + 1):
        tensors[f"body.{2 * i}.weight"] = 0.1 * rng.standard_normal((num_feat, channels, 3, 3), np.float32)
        tensors[f"body.{2 * i}.bias"] = 0.01 * rng.standard_normal(num_feat, np.float32)
        tensors[f"body.{2 * i + 1}.weight"] = np.full(num_feat, 0.25, np.float32)  # the PReLU's slopes
        channels = num_feat
    last = 2 * num_conv + 2
    tensors[f"body.{last}.weight"] = 0.01 * rng.standard_normal((3 * scale**2, num_feat, 3, 3), np.float32)
    tensors[f"body.{last}.bias"] = np.zeros(3 * scale**2, np.float32)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors_numpy.save_file(tensors, str(path))
    return path


# A CLIP ViT image encoder in miniature, in the layout of h94/IP-Adapter's `image_encoder/config.json`.
IP_ADAPTER_ENCODER = {
    "architectures": ["CLIPVisionModelWithProjection"],
    "model_type": "clip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "projection_dim": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_channels": 3,
    "image_size": 28,
    "patch_size": 7,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-05,
}
# The random adapters' files, by kind, named as h94's are.
IP_ADAPTER_FILES = {
    "plain": "ip-adapter.safetensors",
    "plus": "ip-adapter-plus.safetensors",
    "full": "ip-adapter-full-face.safetensors",
}


def ip_adapter_projection(kind: str, cross_attention_dim: int):
    """A tiny image projection of `kind` reading `IP_ADAPTER_ENCODER`, with the sizes diffusers
    builds its classes with: 4 tokens for "plain", and a Resampler 4 layers deep of 64-wide heads
    and a 4x feed-forward."""
    from ..models.ip_adapter import ImageProjectionConfig  # the model imports the checkpoints

    encoder = IP_ADAPTER_ENCODER
    if kind == "plain":
        return ImageProjectionConfig("plain", encoder["projection_dim"], cross_attention_dim, num_tokens=4)
    if kind == "full":
        return ImageProjectionConfig("full", encoder["hidden_size"], cross_attention_dim)
    hidden = 32
    return ImageProjectionConfig(
        "plus", encoder["hidden_size"], cross_attention_dim, num_tokens=8, hidden_dim=hidden, depth=4, heads=1,
        ff_dim=4 * hidden,
    )


def write_ip_adapter(folder: Path, unet, kinds=("plain",), *, subfolder: str = "sdxl_models", seed: int = 0) -> Path:
    """Writes random IP-Adapters of `kinds` for the UNet `unet` (a UNetConfig) in h94/IP-Adapter's
    layout: `folder/subfolder/<IP_ADAPTER_FILES[kind]>`, each one file of `image_proj.*` and
    `ip_adapter.{id}.to_k_ip/to_v_ip` tensors, and the image encoder they read
    (`IP_ADAPTER_ENCODER`) in `folder/subfolder/image_encoder` as transformers saves it.

    Returns:
      `folder`.
    """
    from ..models import clip_vision, ip_adapter
    from .ip_adapters import LAYERS, PROJECTION, adapter_key_ids, layer_width

    target = Path(folder) / subfolder
    (target / "image_encoder").mkdir(parents=True, exist_ok=True)
    (target / "image_encoder/config.json").write_text(json.dumps(IP_ADAPTER_ENCODER, indent=2))
    encoder = config_from_dict(clip_vision.CLIPVisionConfig, IP_ADAPTER_ENCODER)
    _write_bare_named(
        target / "image_encoder/model.safetensors", clip_vision.abstract_params(encoder), clip_vision.BARE_TENSORS,
        np.random.default_rng([seed, 40]),
    )
    for i, kind in enumerate(kinds):
        projection = ip_adapter_projection(kind, unet.cross_attention_dim)
        layers = {
            key_id: {
                name: {"weight": np.empty((layer_width(unet, path), unet.cross_attention_dim), np.float32)}
                for name in ("to_k_ip", "to_v_ip")
            }
            for key_id, path in adapter_key_ids(unet).items()
        }
        abstract = {PROJECTION: ip_adapter.abstract_params(projection), LAYERS: layers}
        bare = tuple(f"{PROJECTION}.{key}" for key in ip_adapter.BARE_TENSORS)
        _write_bare_named(target / IP_ADAPTER_FILES[kind], abstract, bare, np.random.default_rng([seed, 41 + i]))
    return Path(folder)


def _write_bare_named(path: Path, abstract: dict, bare: tuple[str, ...], rng: np.random.Generator) -> None:
    """Random tensors (`random_tensor`) for a parameter tree in one safetensors file, the `bare` ones
    (`layers.Parameter`) under their own names, as torch stores an `nn.Parameter`."""
    tensors = {}
    for param_path, leaf in sorted(flatten(abstract).items()):
        key = checkpoint_key(param_path)
        value = random_tensor(rng, param_path, tuple(leaf.shape))
        stored = key.removesuffix(".weight") if key.removesuffix(".weight") in bare else key
        tensors[stored] = np.ascontiguousarray(value.transpose(torch_axes(param_path, value.ndim)))
    safetensors_numpy.save_file(tensors, str(path))
