"""What the other features cost beside the benchmark's plain batch: a hires pass's memory, a model
upscaler's speed, A1111's noise drawn on the host, LoRA switches."""

import dataclasses
import functools
import statistics
from pathlib import Path

import numpy as np

from ..checkpoints import lora, random_models
from ..engine.compilation import CompileCounter
from ..engine.hires import Hires
from ..engine.memory import bytes_beside_weights
from ..engine.request import Request
from ..engine.upscaler import Upscaler
from .workload import timed

LORA_RANK = 32  # a common rank for SDXL LoRAs
HIRES = Hires(scale=2, upscaler="Latent", strength=0.5)  # a hires fix of the benchmark's steps (0.5: as many again)


def hires_memory(pipe, prepared) -> dict:
    """The hires pass's compiled program against the first pass's: the bytes each holds beside the
    weights, as the launch's fit check counts them (`memory.bytes_beside_weights`)."""
    first, second = (bytes_beside_weights(pipe.compiled(program)) for program in prepared.programs)
    return {"hires_bytes": second, "base_bytes": first, "hires_bytes_ratio": second / first}


def time_upscaler(scratch: Path, height: int, width: int, runs: int) -> dict:
    """Images/s of a random 4x SRVGGNetCompact of realesr-general-x4v3's shape (64 features, 32 convs)
    on height x width pictures (to 4x that), whole or in its tiles, compile excluded."""
    upscaler = Upscaler.from_file(random_models.write_upscaler(scratch / "realesr-general-x4v3.safetensors", scale=4,
                                                               num_feat=64, num_conv=32))
    picture = np.random.default_rng(0).integers(0, 256, (height, width, 3), np.uint8)
    upscaler.upscale(picture)  # compiles
    seconds = statistics.median(timed(lambda: upscaler.upscale(picture))[0] for _ in range(runs))
    return {"upscaler_images_per_s": 1 / seconds, "upscaler_from": f"{width}x{height}",
            "upscaler_to": f"{4 * width}x{4 * height}"}


def time_noise_draws(pipe, request: Request, runs: int, call_s: float) -> dict:
    """Host seconds to prepare a request whose noise A1111's NV and CPU sources draw (`with_drawn_noise`)
    for an ancestral sampler (the starting noise and one draw per step, each image from its own
    generator, ENSD on), and with NV for DPM++ 2M SDE from A1111's Brownian trees (the most drawn); and
    each against one of the benchmark's calls. It is drawn when a request is prepared, before it waits
    for the devices."""
    result = {}
    for key, settings in (("nv", dict(sampler="euler_ancestral", noise_source="nv", ensd=31337)),
                          ("cpu", dict(sampler="euler_ancestral", noise_source="cpu", ensd=31337)),
                          ("sde_nv", dict(sampler="dpmpp_2m_sde", schedule_type="Karras", noise_source="nv"))):
        draw = functools.partial(pipe.prepare, dataclasses.replace(request, **settings))
        seconds = statistics.median(timed(draw)[0] for _ in range(runs))
        result |= {f"noise_{key}_s": seconds, f"noise_{key}_cost": seconds / call_s}
    return result


def time_lora_switches(pipe, scratch: Path, request: Request) -> dict:
    """Seconds to switch to a random rank-32 LoRA over every UNet and text encoder layer (reading its
    file first), to change its scale, and to clear it; and the compilations renders with it needed
    (the first switch also compiles the update for each distinct layer shape, which it includes)."""
    path = str(lora.write_random(scratch / "lora.safetensors", pipe.spec, rank=LORA_RANK, dtype="float16"))
    request = dataclasses.replace(request, loras=None)  # with the active LoRAs
    first = pipe.set_loras({path: 1.0})
    with CompileCounter() as compiles:
        pipe.render(request)
    rescale = pipe.set_loras({path: 0.5})
    with compiles:
        pipe.render(request)
    clear = pipe.set_loras({})
    return dict(lora_first_s=first, lora_scale_s=rescale, lora_clear_s=clear, lora_recompiles=compiles.count,
                lora_layers=sum(len(layers) for layers in lora.targets(pipe.spec).values()))
