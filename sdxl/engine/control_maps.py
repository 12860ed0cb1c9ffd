"""Control maps: what a ControlNet reads, made from a picture (its preprocessors).

- "canny": Canny's edges, white on black, by OpenCV's `cv2.Canny` on the RGB picture, with A1111's
  ControlNet extension's default thresholds. The canny ControlNets (lllyasviel's, diffusers' SDXL
  ones) were trained on exactly these maps, made by exactly this call, so the map is OpenCV's rather
  than a re-implementation that would differ at the thresholds' edges.
- "none": the picture is the map already (a depth map, an OpenPose skeleton, lines drawn by hand).

Maps that need a model of their own (depth estimators, pose detectors) are made elsewhere (docs/controlnet.md,
"Control maps"), then given with "none".
"""

import dataclasses

import numpy as np

from .checks import integer

PREPROCESSORS = ("canny", "none")
DEFAULT_CANNY_THRESHOLDS = (100, 200)  # low, high: A1111's ControlNet extension's defaults


@dataclasses.dataclass(frozen=True)
class Preprocessor:
    """How a picture becomes a control map: one of `PREPROCESSORS`, with Canny's thresholds. A request
    carries it so that its PNG parameters say how its maps were made (`infotext`)."""

    name: str = "none"
    canny_thresholds: tuple[int, int] = DEFAULT_CANNY_THRESHOLDS

    def __call__(self, picture: np.ndarray) -> np.ndarray:
        return control_map(picture, self.name, self.canny_thresholds)

    def infotext(self) -> dict:
        """Its fields as A1111's ControlNet extension writes them: "Module", and for Canny its
        thresholds as "Threshold A" and "Threshold B"."""
        if self.name != "canny":
            return {"Module": self.name}
        low, high = self.canny_thresholds
        return {"Module": "canny", "Threshold A": low, "Threshold B": high}


def default_preprocessor(controlnet_name: str) -> str:
    """The preprocessor a ControlNet most likely wants, from its name: "canny" for a canny one (they
    are trained on exactly `canny`'s maps) or a Union (its canny mode is the one map made here), else
    "none" (the picture is the map)."""
    return "canny" if "canny" in controlnet_name.lower() or "union" in controlnet_name.lower() else "none"


def control_map(picture: np.ndarray, preprocessor: str, canny_thresholds=DEFAULT_CANNY_THRESHOLDS) -> np.ndarray:
    """`preprocessor`'s map of a [H, W, 3] picture (uint8, or float in [0, 1]): for "none" the
    picture as it is, for "canny" [H, W, 3] uint8 edges.

    Raises:
      ValueError: an unknown preprocessor or thresholds out of range.
    """
    if preprocessor not in PREPROCESSORS:
        raise ValueError(f"preprocessor must be one of {', '.join(PREPROCESSORS)}, got {preprocessor!r}")
    if preprocessor == "none":
        return picture
    if picture.dtype != np.uint8:
        picture = np.round(np.clip(picture, 0, 1) * 255).astype(np.uint8)
    return canny(picture, *canny_thresholds)


def canny(picture: np.ndarray, low, high) -> np.ndarray:
    """[H, W, 3] uint8 edges (255 on 0) of a uint8 RGB picture, by `cv2.Canny(picture, low, high)`, the
    one channel repeated three times as the ControlNets read it.

    Raises:
      ValueError: thresholds outside 1..255, or low above high.
    """
    import cv2  # OpenCV's headless wheel; imported here so that the rest of the package starts without it

    edges = cv2.Canny(np.ascontiguousarray(picture), *checked_thresholds(low, high))
    return np.repeat(edges[..., None], 3, axis=-1)


def checked_thresholds(low, high) -> tuple[int, int]:
    """Canny's thresholds as integers from 1 to 255, low not above high. Raises ValueError."""
    low, high = integer(low, "Canny's low threshold", 1, 255), integer(high, "Canny's high threshold", 1, 255)
    if low > high:
        raise ValueError(f"Canny's low threshold ({low}) must not be above its high threshold ({high})")
    return low, high


def parse_thresholds(text: str) -> tuple[int, int]:
    """"LOW,HIGH" (the CLI's --canny) as checked thresholds. Raises ValueError."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"--canny takes LOW,HIGH (two thresholds from 1 to 255), got {text!r}")
    return checked_thresholds(*(part.strip() for part in parts))
