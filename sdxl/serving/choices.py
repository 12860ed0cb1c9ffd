"""What the demo's page offers (`Choices`): its lists as (label, value) pairs, its sliders' ranges
and starting values, in the service's terms, so that the page lists what the service takes."""

import dataclasses
from pathlib import Path

from ..checkpoints import lora
from ..engine import infotext
from ..engine.control_maps import default_preprocessor
from ..engine.controls import default_control_scale
from ..engine.hires import IMAGE_UPSCALERS
from ..engine.image_prompts import presets_of
from ..engine.latent_upscale import LATENT_UPSCALERS
from ..engine.request import DEFAULT_REFINE_FROM, GUIDANCE_SCALE_RANGE, LORA_SCALE_RANGE, MAX_SEED, default_strength
from ..models.controlnet_union import CONTROL_MODES, describe_mode
from ..prompts.styles import NO_STYLE, STYLES
from ..prompts.syntax import A1111_EMPHASIS_NAMES, EMPHASIS_MODES
from ..sampling import kdiffusion
from ..sampling.methods import DIFFUSERS, SAMPLER_NAMES
from . import grid
from .models import union
from .results import size_label

# The Generate tab's examples for a model that has none of its own (`serving.known`): (prompt, style).
EXAMPLES = [
    ["a lighthouse on a cliff at dusk, waves crashing, warm light in the windows", "Cinematic"],
    ["a red fox sleeping in fresh snow, morning light", "Photographic"],
    ["a tiny robot watering a bonsai tree", "3D model"],
    ["a castle floating above the clouds", "Fantasy art"],
]


@dataclasses.dataclass(frozen=True)
class Choices:
    """What the page offers, in the service's terms: each list of (label, value) pairs, the ranges of
    its sliders, and their starting values."""

    models: list[tuple[str, str]]  # the served models' labels and names, the default first
    sizes: dict[str, tuple[int, int]]  # {label: (width, height)}, the model's first size first
    loras: list[tuple[str, float]]  # each launched LoRA's label and launch scale
    controlnets: list["ControlNetChoices"]
    samplers: list[tuple[str, str]]
    schedule_types: list[tuple[str, str]]  # "" first: the sampler's own
    styles: list[str]  # "No style" first
    examples: list[list[str]]  # (prompt, style)
    emphasis: list[tuple[str, str]]
    noise_sources: list[tuple[str, str]]
    hires_upscalers: list[tuple[str, str]]  # the latent ones, the image ones, then the model upscalers loaded
    upscalers: list[tuple[str, str]]  # the Upscale tab's: the model upscalers loaded, then Lanczos and Nearest
    axes: list[tuple[str, str]]  # a grid's: "none" first
    guidance_range: tuple[float, float]
    max_steps: int
    lora_scale_range: tuple[float, float]
    max_seed: int
    sampler: str
    guidance_scale: float
    steps: int
    strength: float  # image-to-image's
    control_scale: float
    refine_from: float
    ip_adapters: list[str]  # the launched IP-Adapters' labels (`ip_adapter_labels`)
    ip_adapter_layers: list[tuple[str, str]]  # the presets the UNet has blocks for, "all" first
    embeddings: str  # the launched textual-inversion embeddings and their token counts, in a line ("": none)


@dataclasses.dataclass(frozen=True)
class ControlNetChoices:
    """A launched ControlNet's part of the page: its label, the preprocessor it most likely wants, and
    for a ControlNet Union its control modes as (label, name) and the one to start with."""

    label: str
    preprocessor: str
    modes: list[tuple[str, str]]
    mode: str | None




# The schedule types as the page names them: "" for the sampler's own (`sampling.methods.schedule_type_for`).
SCHEDULE_TYPE_LABELS = [("Default: diffusers', else A1111's Automatic", ""),
                        ("diffusers (the model's scheduler)", DIFFUSERS),
                        *((label, label) for label in kdiffusion.SCHEDULE_TYPES)]
# The noise sources as the page names them: which tool's pictures each one draws again.
NOISE_SOURCE_LABELS = [("JAX (this demo's)", "jax"), ("NV (A1111 and Forge on an NVIDIA GPU)", "nv"),
                       ("CPU (A1111's CPU, ComfyUI, diffusers)", "cpu")]


def embeddings_line(models) -> str:
    """The loaded textual-inversion embeddings of `models` (`Model`s) as the page lists them, each name with
    the tokens it takes ("Embeddings: `neg` (2 tokens), ..."); "" for none."""
    embeddings = union(models, lambda model: {e.name: e for e in model.pipe.prompts.embeddings}).values()
    names = [f"`{e.name}` ({e.count} token{'' if e.count == 1 else 's'})" for e in embeddings]
    return f"Embeddings, by name in a prompt: {', '.join(names)}" if names else ""


def choices_of(service) -> Choices:
    """What a `DemoService`'s page offers: its models, the default one's sizes and defaults, and every model's
    LoRAs, ControlNets and IP-Adapters."""
    spec, names = service.pipe.spec, [lora.display_name(source) for source in service.loras]
    control_axes = [(name.replace("control", "ControlNet").replace("_", " "), name)
                    for name in grid.CONTROL_AXES] if service.controlnets else []
    ip_adapters = list(union(service.models, lambda model: dict.fromkeys(ip_adapter_labels(model.pipe))))
    controlnets = []
    for controlnet in service.controlnets:
        label = infotext.controlnet_label(controlnet.name)
        preprocessor, count = default_preprocessor(label), getattr(controlnet.config, "num_control_type", 0)
        modes = [(describe_mode(m), CONTROL_MODES[m][0]) for m in range(count)]  # a Union's
        controlnets.append(ControlNetChoices(label, preprocessor, modes, (
            "canny" if preprocessor == "canny" else "depth") if modes else None))
    return Choices(
        models=[(model.label, model.name) for model in service.models],
        sizes={size_label(w, h): (w, h) for w, h in service.sizes},
        loras=[(f"LoRA {lora.display_name(source)}", scale) for source, scale in service.loras.items()],
        controlnets=controlnets,
        samplers=[(label, name) for name, label in SAMPLER_NAMES.items()],
        schedule_types=SCHEDULE_TYPE_LABELS,
        styles=list(STYLES),
        examples=[[text, NO_STYLE] for text in service.recommended.examples] or EXAMPLES,
        emphasis=[(A1111_EMPHASIS_NAMES[mode], mode) for mode in EMPHASIS_MODES],
        noise_sources=NOISE_SOURCE_LABELS,
        hires_upscalers=[*((name, name) for name in (*LATENT_UPSCALERS, *IMAGE_UPSCALERS)),
                         *((name, name) for name in service.pipe.upscalers)],
        upscalers=[(name, name) for name in (*service.pipe.upscalers, "Lanczos", "Nearest")],
        axes=[("none", ""), *([("model", grid.MODEL_AXIS)] if len(service.models) > 1 else []),
              *((name.replace("_", " "), name) for name in grid.AXES),
              *((f"LoRA {name} scale", grid.LORA_AXIS + name) for name in names), *control_axes,
              *([("image prompt scale", grid.IP_ADAPTER_AXIS)] if ip_adapters else [])],
        guidance_range=GUIDANCE_SCALE_RANGE, max_steps=service.pipe.max_steps, lora_scale_range=LORA_SCALE_RANGE,
        max_seed=MAX_SEED, refine_from=DEFAULT_REFINE_FROM,
        sampler=spec.default_sampler, guidance_scale=service.recommended.guidance_scale,
        steps=service.recommended.steps, strength=default_strength(spec, inpainting=False),
        control_scale=default_control_scale(spec, image=False, inpainting=False),
        ip_adapters=ip_adapters, embeddings=embeddings_line(service.models), ip_adapter_layers=[
            (LAYER_LABELS[preset], preset) for preset in presets_of(spec.unet)] if ip_adapters else [],
    )


# The IP-Adapter's layer presets (`image_prompts.SCALE_PRESETS`) as the page names them.
LAYER_LABELS = {"all": "All layers", "style": "Style only", "style-and-layout": "Style and layout"}


def ip_adapter_labels(pipe) -> list[str]:
    """How the page names each loaded IP-Adapter: its file's name, or where two share one, its whole name."""
    stems = [Path(adapter.name).stem for adapter in pipe.ip_adapters]
    return [stem if stems.count(stem) == 1 else adapter.name for stem, adapter in zip(stems, pipe.ip_adapters)]
