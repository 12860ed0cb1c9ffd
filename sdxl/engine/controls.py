"""A ControlNet's part in one image: `Control`, a per-image input of a `Request`.

`Control.of` is the one way the demo, the CLI and `generate` make one: the picture a user gives is
fitted to the output's size and made a control map (`sdxl.engine.control_maps`), once per picture,
size and preprocessor however often it is asked (the demo's live map, its check and its request, a
grid's every cell). `Control.checked` is the one check of a control against the ControlNet it steers.
"""

import dataclasses

import numpy as np

from ..models.controlnet_union import control_mode, describe_mode, describe_modes
from . import images
from .checks import number
from .control_maps import DEFAULT_CANNY_THRESHOLDS, Preprocessor

# A ControlNet's conditioning scale: A1111's ControlNet extension offers 0 to 2; beyond 4 images break up.
CONTROL_SCALE_RANGE = (0.0, 4.0)
# How a picture meets the output's size: "crop" centre-crops it to the output's aspect ratio, then
# resizes (A1111's "Crop and Resize", the demo's and the CLI's); "resize" resizes it as it is
# (diffusers', `generate`'s). Either with Lanczos.
FITS = ("crop", "resize")
MAPS_KEPT = 16  # control maps kept for pictures asked for again (a map at SDXL's size is 3 MiB)


def default_control_scale(spec, *, image: bool, inpainting: bool) -> float:
    """The ControlNet scale diffusers' ControlNet pipelines default to: 1 from text, 0.8 for
    image-to-image, for inpainting 1 with SDXL and 0.5 with SD 1.x/2.x."""
    if inpainting:
        return 1.0 if spec.is_sdxl else 0.5
    return 0.8 if image else 1.0


@dataclasses.dataclass(frozen=True, eq=False)
class Control:
    """How one ControlNet steers one image: its control map, how strongly (diffusers'
    `controlnet_conditioning_scale`) and between which fractions of the steps that run
    (`control_guidance_start`, `control_guidance_end`), and for a ControlNet Union what the map is."""

    map: np.ndarray  # [height, width, C] uint8, or float32 in [0, 1], at the output's size
    made_by: Preprocessor = Preprocessor()  # how `map` was made from a picture, for the PNG parameters
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    mode: int | str | None = None  # a Union's control mode (`controlnet_union.CONTROL_MODES`); checked: its index

    @classmethod
    def of(cls, picture, width: int, height: int, *, preprocessor: str = "none",
           canny_thresholds=DEFAULT_CANNY_THRESHOLDS, fit: str = "crop", scale: float = 1.0, start: float = 0.0,
           end: float = 1.0, mode: int | str | None = None) -> "Control":
        """The control a picture (a PIL image, or an [H, W, 3] array: uint8 or floats in [0, 1]) makes at
        `width` x `height`: fitted to that size (`FITS`), then its `preprocessor`'s map there, so that
        Canny's edges are one pixel wide as the canny models were trained.

        Raises:
          ValueError: an unreadable picture, an unknown preprocessor or fit, thresholds out of range.
        """
        if fit not in FITS:
            raise ValueError(f"fit must be one of {', '.join(FITS)}, got {fit!r}")
        made_by = Preprocessor(preprocessor, tuple(canny_thresholds))
        return cls(_map(images.pixels(picture), int(width), int(height), made_by, fit), made_by, scale, start, end,
                   mode)

    def checked(self, controlnet, height: int, width: int) -> "Control":
        """This control with its numbers checked and its mode an index, for `controlnet` (a loaded
        `ControlNetCheckpoint`: its name and config) at an output of `width` x `height`. A plain
        ControlNet has no mode: one given is dropped.

        Raises:
          ValueError: in one sentence, naming the value and what is allowed.
        """
        channels = controlnet.config.conditioning_channels
        shape = np.shape(self.map)
        if len(shape) != 3 or shape[:2] != (height, width):
            raise ValueError(f"a control map must be [height, width, C] = {[height, width, 'C']}, got shape {shape}")
        if shape[2] != channels:
            raise ValueError(f"{controlnet.name} takes {channels}-channel control images, got shape {shape}")
        start, end = (number(getattr(self, f), f"ControlNet {f}", 0.0, 1.0) for f in ("start", "end"))
        if start >= end:
            raise ValueError(f"a ControlNet's start ({start:g}) must be below its end ({end:g})")
        scale = number(self.scale, "ControlNet scale", *CONTROL_SCALE_RANGE)
        return dataclasses.replace(self, map=images.checked_pixels(self.map), scale=scale, start=start, end=end,
                                   mode=_checked_mode(self.mode, controlnet))


def _checked_mode(mode, controlnet) -> int | None:
    count = getattr(controlnet.config, "num_control_type", None)  # a Union's
    if count is None:
        return None
    if mode is None:
        raise ValueError(f"{controlnet.name} is a ControlNet Union: say what its control image is with a control "
                         f"mode (control_mode=), one of {describe_modes(count)}")
    index = control_mode(mode)
    if index >= count:
        raise ValueError(f"{controlnet.name} knows {count} control modes ({describe_modes(count)}), not mode "
                         f"{describe_mode(index)}")
    return index


class ControlKind:
    """The ControlNets' kind of conditioning (`sdxl.engine.conditionings.Kind`): per image, one
    `Control` per loaded ControlNet (`Request.controls`)."""

    field, units, unit_name, value_name = "controls", "controlnets", "ControlNet", "control image"
    none_loaded = "no ControlNet is loaded to steer with a control image (start with --controlnet)"

    def checked(self, control: Control, controlnet, height: int, width: int, spec) -> Control:
        return control.checked(controlnet, height, width)

    def host_arrays(self, controls: tuple[tuple[Control, ...], ...], program) -> dict:
        """Each ControlNet's maps [N, H, W, C], and [N, K] each image's scales, starts and ends, and
        where a ControlNet is a Union, modes."""
        arrays = {
            "control_images": tuple(images.stacked([c.map for c in column]) for column in zip(*controls)),
            **{f"control_{name}s": np.array([[getattr(c, name) for c in per] for per in controls], np.float32)
               for name in ("scale", "start", "end")},
        }
        if program.control_modes:  # a plain ControlNet's column is unread
            arrays["control_modes"] = np.array([[0 if c.mode is None else c.mode for c in per] for per in controls],
                                               np.int32)
        return arrays

    def placeholder(self, program) -> tuple[Control, ...]:
        """A zero map per ControlNet: views of one zero, so that a large batch allocates nothing."""
        return tuple(Control(np.broadcast_to(np.float32(0), (program.height, program.width, c.conditioning_channels)))
                     for c in program.controlnets)


CONTROLS = ControlKind()
_maps = images.MadeFromPictures(MAPS_KEPT)


def _map(picture: np.ndarray, width: int, height: int, made_by: Preprocessor, fit: str) -> np.ndarray:
    """`made_by`'s map of `picture` fitted to width x height; the last `MAPS_KEPT` kept (`MadeFromPictures`)."""
    return _maps.get(picture, (width, height, made_by, fit),
                     lambda: made_by(images.resized(picture, height, width, crop=fit == "crop")))
