"""An IP-Adapter's part in one image: `ImagePrompt`, a per-image input of a `Request`.

An image prompt is a picture that the UNet attends to beside the text, through an IP-Adapter
(`sdxl.checkpoints.ip_adapters`), at a scale: one number for every layer, or diffusers'
per-block dict (`set_ip_adapter_scale`), which InstantStyle uses to transfer a picture's style and
not its layout (`STYLE_ONLY`). Scales are inputs of the compiled program, per image and per layer
(`layer_scales`), so that a sweep over them never recompiles.
"""

import dataclasses
from collections.abc import Mapping

import numpy as np

from ..checkpoints.ip_adapters import IPAdapterConfig
from ..models.unet import UNetConfig, attention_layers
from . import images
from .clip_inputs import clip_image_inputs
from .checks import number

# diffusers takes any scale; beyond 2 the picture swamps the prompt and images break up.
IP_ADAPTER_SCALE_RANGE = (0.0, 2.0)
# What the CLI and the demo start from: diffusers' docs' usual, at which the text still counts (at 1 the
# picture mostly wins).
IP_ADAPTER_SCALE = 0.6
# InstantStyle's block scales for SDXL: the picture's style (up_blocks.0.attentions.1) and not its
# layout; `STYLE_AND_LAYOUT` adds the layer that carries its layout (down_blocks.2.attentions.1).
STYLE_ONLY = {"up": {"block_0": [0.0, 1.0, 0.0]}}
STYLE_AND_LAYOUT = {"down": {"block_2": [0.0, 1.0]}, "up": {"block_0": [0.0, 1.0, 0.0]}}
# The layers a picture steers, as the CLI and the demo offer them: every one, or InstantStyle's.
SCALE_PRESETS = {"all": None, "style": STYLE_ONLY, "style-and-layout": STYLE_AND_LAYOUT}
PIXELS_KEPT = 16  # encoder inputs kept for pictures asked for again


@dataclasses.dataclass(frozen=True)
class IPAdapter:
    """A loaded IP-Adapter (`Pipeline.load_ip_adapter`): its name and its program's config."""

    name: str
    config: IPAdapterConfig

    @property
    def image_size(self) -> int:
        return self.config.encoder.image_size

    def encoder_pixels(self, picture: np.ndarray) -> np.ndarray:
        """[S, S, 3] float32: `picture` as the adapter's image encoder takes it (`clip_inputs`)."""
        return clip_image_inputs([picture], self.image_size)[0]


def layer_scales(config: UNetConfig, scale: float | Mapping) -> np.ndarray:
    """The scale at each of the UNet's spatial transformers (`unet.attention_layers`' order), float32
    [L], as diffusers' `set_ip_adapter_scale` sets them: one number everywhere, or a dict of blocks,
    where what it leaves out is 0. {"down": 0.5} is every down block's transformers; {"up":
    {"block_0": [0.0, 1.0, 0.0]}} the three of up_blocks.0 one by one; {"mid": 1.0} the mid block's.

    Raises:
      ValueError: a scale out of range, or a block the UNet has no transformers in, in one sentence.
    """
    layers = attention_layers(config)
    if not isinstance(scale, Mapping):
        return np.full(len(layers), _scale(scale), np.float32)
    unknown = set(scale) - {"down", "mid", "up"}
    if unknown:
        raise ValueError(f"IP-Adapter block scales are keyed by down, mid and up, not {', '.join(sorted(unknown))}")
    per_layer = dict.fromkeys(layers, 0.0)
    if "mid" in scale:
        mid = scale["mid"]
        if isinstance(mid, list | tuple):
            if len(mid) != 1:
                raise ValueError(f"the mid block has one transformer: give it one scale, not {len(mid)}")
            mid = mid[0]
        per_layer["mid_block.attentions.0"] = _scale(mid)
    for side in ("down", "up"):
        if side not in scale:
            continue
        # The blocks with transformers, by index: "1", "2" (SDXL's down blocks).
        blocks = dict.fromkeys(name.split(".")[1] for name in layers if name.startswith(f"{side}_blocks."))
        per_block = config.layers_per_block + (side == "up")
        given = scale[side]
        if not isinstance(given, Mapping):
            given = {f"block_{i}": given for i in blocks}
        for block, value in given.items():
            index = str(block).removeprefix("block_")
            if index not in blocks:
                have = ", ".join(f"block_{i}" for i in blocks)
                raise ValueError(f"the UNet's {side} blocks with transformers are {have}, not {block}")
            values = list(value) if isinstance(value, list | tuple) else [value] * per_block
            if len(values) == 1:
                values *= per_block
            if len(values) != per_block:
                raise ValueError(f"{side}.{block} has {per_block} transformers: give one scale or {per_block}, "
                                 f"not {len(values)}")
            for j, v in enumerate(values):
                per_layer[f"{side}_blocks.{index}.attentions.{j}"] = _scale(v)
    return np.array([per_layer[name] for name in layers], np.float32)


def preset_scale(config: UNetConfig, preset: str, scale) -> float | dict:
    """`scale` on the layers of `preset` (`SCALE_PRESETS`): the number itself for "all", else the
    preset's blocks times it, as `set_ip_adapter_scale` takes it.

    Raises:
      ValueError: an unknown preset, a scale out of range, or a preset of blocks that `config`'s UNet
        lacks (InstantStyle's are SDXL's), in one sentence.
    """
    if preset not in SCALE_PRESETS:
        raise ValueError(f"the IP-Adapter layers are one of {', '.join(SCALE_PRESETS)}, not {preset!r}")
    scale = _scale(scale)
    if SCALE_PRESETS[preset] is None:
        return scale
    scaled = _times(SCALE_PRESETS[preset], scale)
    try:
        layer_scales(config, scaled)
    except ValueError:
        raise ValueError(f"the {preset} preset scales SDXL's blocks (InstantStyle's), which this model's UNet lacks: "
                         "steer all layers") from None
    return scaled


def presets_of(config: UNetConfig) -> list[str]:
    """The `SCALE_PRESETS` whose blocks `config`'s UNet has ("all" always)."""
    found = []
    for preset in SCALE_PRESETS:
        try:
            preset_scale(config, preset, 1.0)
        except ValueError:
            continue
        found.append(preset)
    return found


def preset_named(scale) -> tuple[str, float] | None:
    """(preset, scale) for a scale `preset_scale` made; None for a dict of blocks of no preset."""
    if not isinstance(scale, Mapping):
        return "all", float(scale)
    for preset, blocks in SCALE_PRESETS.items():
        if blocks is not None and _times(blocks, 1.0).keys() == scale.keys():
            value = max(_leaves(scale))
            if _times(blocks, value) == _times(scale, 1.0):
                return preset, value
    return None


def _times(scale, factor: float):
    """A block scale (nested dicts, lists, numbers) with every number times `factor`, as floats."""
    if isinstance(scale, Mapping):
        return {key: _times(value, factor) for key, value in scale.items()}
    if isinstance(scale, list | tuple):
        return [_times(value, factor) for value in scale]
    return float(scale) * factor


def _leaves(scale) -> list[float]:
    if isinstance(scale, Mapping):
        return [v for value in scale.values() for v in _leaves(value)]
    if isinstance(scale, list | tuple):
        return [v for value in scale for v in _leaves(value)]
    return [float(scale)]


def _scale(value) -> float:
    return number(value, "IP-Adapter scale", *IP_ADAPTER_SCALE_RANGE)


@dataclasses.dataclass(frozen=True, eq=False)
class ImagePrompt:
    """How one IP-Adapter steers one image: its picture, and the adapter's scale, one number or
    diffusers' per-block dict (`layer_scales`). Checked (`checked`), it also holds what the adapter's
    image encoder takes of the picture, and the scale at each layer."""

    picture: np.ndarray  # [H, W, 3] uint8, or float32 in [0, 1], any size
    scale: float | Mapping = 1.0
    pixels: np.ndarray | None = dataclasses.field(default=None, repr=False)  # the encoder's input, [S, S, 3]
    scales: np.ndarray | None = dataclasses.field(default=None, repr=False)  # [L] float32

    @classmethod
    def of(cls, picture, scale: float | Mapping = 1.0) -> "ImagePrompt":
        """An image prompt of a PIL image or an [H, W, 3] array (uint8, or floats in [0, 1]).

        Raises:
          ValueError: an unreadable picture.
        """
        return cls(images.pixels(picture), scale)

    def checked(self, adapter, config: UNetConfig) -> "ImagePrompt":
        """This prompt checked for `adapter` (a loaded `IPAdapter`: its name and image size) on a UNet of
        `config`: its scales per layer, and the picture as the adapter's image encoder takes it.

        Raises:
          ValueError: in one sentence, naming the value and what is allowed.
        """
        scales = layer_scales(config, self.scale)
        return dataclasses.replace(self, pixels=_encoder_pixels(images.checked_pixels(self.picture), adapter),
                                   scales=scales)


class ImagePromptKind:
    """The IP-Adapters' kind of conditioning (`sdxl.engine.conditionings.Kind`): per image, one
    `ImagePrompt` per loaded IP-Adapter (`Request.image_prompts`)."""

    field, units, unit_name, value_name = "image_prompts", "ip_adapters", "IP-Adapter", "image prompt"
    none_loaded = ("no IP-Adapter is loaded to take an image prompt (load one with load_ip_adapter, or start with "
                   "--ip-adapter)")

    def checked(self, prompt: ImagePrompt, adapter, height: int, width: int, spec) -> ImagePrompt:
        return prompt.checked(adapter, spec.unet)

    def host_arrays(self, prompts: tuple[tuple[ImagePrompt, ...], ...], program) -> dict:
        """Each adapter's encoder inputs [N, S, S, 3], and each image's scales per adapter and layer [N, K, L]."""
        return {
            "image_prompt_pixels": tuple(images.stacked([p.pixels for p in column]) for column in zip(*prompts)),
            "image_prompt_scales": np.array([[p.scales for p in per] for per in prompts], np.float32),
        }

    def placeholder(self, program) -> tuple[ImagePrompt, ...]:
        """A zero picture per adapter: views of one zero, so that a large batch allocates nothing."""
        layers = len(attention_layers(program.spec.unet))

        def zeros(*shape):
            return np.broadcast_to(np.float32(0), shape)

        return tuple(ImagePrompt(zeros(1, 1, 3), pixels=zeros(c.encoder.image_size, c.encoder.image_size, 3),
                                 scales=np.zeros(layers, np.float32)) for c in program.ip_adapters)


IMAGE_PROMPTS = ImagePromptKind()
_pixels = images.MadeFromPictures(PIXELS_KEPT)


def _encoder_pixels(picture: np.ndarray, adapter) -> np.ndarray:
    """`adapter.encoder_pixels(picture)`; the last `PIXELS_KEPT` kept (`images.MadeFromPictures`)."""
    return _pixels.get(picture, adapter.image_size, lambda: adapter.encoder_pixels(picture))
