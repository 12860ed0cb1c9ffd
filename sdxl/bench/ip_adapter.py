"""What an IP-Adapter costs: the published adapters' shapes (no weights), their bytes and FLOPs.

The configs are facts of h94/IP-Adapter's files (Apache 2.0): the image encoders are its
`models/image_encoder` (OpenCLIP ViT-H/14, 632M parameters) and `sdxl_models/image_encoder`
(OpenCLIP ViT-bigG/14, 1.84B), as their `config.json`s give them; the projections are those the
adapters' weights have: `ip-adapter_sdxl` projects ViT-bigG's 1280-wide image embedding to 4
tokens, `ip-adapter-plus_sdxl_vit-h` resamples ViT-H's 1280-wide penultimate states to 16 tokens
(a Resampler of 4 layers, 20 heads of 64, a 4x feed-forward), each token 2048 wide, SDXL's
cross-attention width.
"""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..checkpoints import random_models
from ..checkpoints.ip_adapters import IPAdapterConfig, abstract_params
from ..checkpoints.spec import ModelSpec
from ..config import config_from_dict
from ..engine.image_prompts import ImagePrompt
from ..engine.request import Request
from ..models.clip_vision import CLIPVisionConfig
from ..models.ip_adapter import ImageProjectionConfig
from .workload import batch_request

VIT_H = CLIPVisionConfig(hidden_size=1280, intermediate_size=5120, projection_dim=1024, num_hidden_layers=32,
                         num_attention_heads=16, image_size=224, patch_size=14, hidden_act="gelu")
VIT_BIGG = CLIPVisionConfig(hidden_size=1664, intermediate_size=8192, projection_dim=1280, num_hidden_layers=48,
                            num_attention_heads=16, image_size=224, patch_size=14, hidden_act="gelu")
# By kind, as `--ip-adapter` names them: SDXL's plain adapter reads ViT-bigG, its Plus ones ViT-H.
ADAPTERS = {
    "plain": (VIT_BIGG, ImageProjectionConfig("plain", 1280, 2048, num_tokens=4)),
    "plus": (VIT_H, ImageProjectionConfig("plus", 1280, 2048, num_tokens=16, hidden_dim=1280, depth=4, heads=20,
                                          ff_dim=5120)),
}


def adapter_config(kind: str, spec: ModelSpec) -> IPAdapterConfig:
    """The published SDXL adapter of `kind` ("plain", "plus") for SDXL's width; for the random models
    (tiny, medium), `random_models.write_ip_adapter`'s tiny one of that kind.

    Raises:
      ValueError: an unknown kind.
    """
    if kind not in ADAPTERS:
        raise ValueError(f"unknown IP-Adapter kind {kind!r}; choose from {', '.join(ADAPTERS)}")
    if spec.unet.cross_attention_dim == ADAPTERS[kind][1].cross_attention_dim:
        return IPAdapterConfig(*ADAPTERS[kind])
    encoder = config_from_dict(CLIPVisionConfig, random_models.IP_ADAPTER_ENCODER)
    return IPAdapterConfig(encoder, random_models.ip_adapter_projection(kind, spec.unet.cross_attention_dim))


def param_bytes(config: IPAdapterConfig, spec: ModelSpec, dtype) -> dict[str, int]:
    """The adapter's parameters on each device (replicated), in `dtype`: the image encoder's, the
    projection's, and the key and value weights it adds to the UNet's cross-attention."""
    tree = abstract_params(config, spec.abstract_params()["unet"])
    return {part: jnp.dtype(dtype).itemsize * sum(leaf.size for leaf in jax.tree.leaves(tree[part]))
            for part in ("image_encoder", "image_proj", "unet")}


def first_run(pipe, scratch: Path, request: Request) -> tuple:
    """The benchmark's batch with an image prompt per image, through a random Plus IP-Adapter of the
    model's UNet shape (`random_models.write_ip_adapter`: its image encoder is a tiny one, so what is
    timed is the adapter's work at every step), loaded into `pipe`; and what the adapter adds: its
    compile time and its parameters' bytes per device. Returns (prepared request, that)."""
    folder = random_models.write_ip_adapter(scratch / "ip-adapter", pipe.spec.unet, kinds=("plus",))
    pipe.load_ip_adapter(str(folder), subfolder="sdxl_models", weight_name=random_models.IP_ADAPTER_FILES["plus"])
    picture = ImagePrompt.of(np.full((request.height, request.width, 3), 128, np.uint8))
    prompted = pipe.prepare(dataclasses.replace(
        batch_request(len(request), request.height, request.width, request.steps),
        image_prompts=((picture,),) * len(request)))
    compile_s = pipe.compile(prompted.programs)
    pipe.render(prompted)
    return prompted, dict(
        ip_adapter_compile_s=compile_s,
        ip_adapter_param_bytes_per_device=sum(a.addressable_shards[0].data.nbytes
                                              for a in jax.tree.leaves(pipe.params["ip_adapters"])),
    )
