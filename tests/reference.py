"""Reference (PyTorch diffusers/transformers) pipelines built from our tiny configs, for parity tests."""

from pathlib import Path

import torch
from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from sdxl import tiny
from sdxl.tokenizer import write_byte_level_tokenizer


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


def sdxl_pipeline(folder: Path, configs: dict = tiny.CONFIGS, seed: int = 0) -> StableDiffusionXLPipeline:
    """A random diffusers SDXL pipeline with `configs`, saved (safetensors) to `folder`."""
    tokenizer_dir = folder / "_tokenizer_source"
    write_byte_level_tokenizer(tokenizer_dir)
    tokenizer = CLIPTokenizer.from_pretrained(tokenizer_dir)
    pipe = StableDiffusionXLPipeline(
        vae=AutoencoderKL(**_without_class(configs["vae/config.json"])),
        text_encoder=CLIPTextModel(CLIPTextConfig(**_without_class(configs["text_encoder/config.json"]))),
        text_encoder_2=CLIPTextModelWithProjection(
            CLIPTextConfig(**_without_class(configs["text_encoder_2/config.json"]))
        ),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=UNet2DConditionModel(**_without_class(configs["unet/config.json"])),
        scheduler=EulerDiscreteScheduler(**_without_class(configs["scheduler/scheduler_config.json"])),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    for i, name in enumerate(["unet", "vae", "text_encoder", "text_encoder_2"]):
        randomize_(getattr(pipe, name), seed + i)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe
