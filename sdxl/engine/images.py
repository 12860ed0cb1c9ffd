"""Images in and out: the images and masks users give (PIL images, arrays) as the arrays a `Request`
carries, and PNGs that carry their generation parameters, and contact sheets.

diffusers' image processor reads a PIL image's pixels as they are and a mask as its greyscale
("L") version, binarized at one half; `pixels` and `mask` do the same, and refuse what they cannot
read with a sentence that says why.
"""

import collections
import hashlib
import math
import threading
from collections.abc import Callable, Hashable
from pathlib import Path

import numpy as np
from PIL import Image, PngImagePlugin


# Modes PIL converts to RGB without losing what the picture shows; 16- and 32-bit modes would be
# clipped, not scaled, so they are refused.
_CONVERTIBLE_MODES = ("RGB", "RGBA", "RGBX", "RGBa", "L", "LA", "La", "P", "PA", "1", "CMYK", "YCbCr", "LAB", "HSV")


def pixels(image) -> np.ndarray:
    """[H, W, 3] pixels of a PIL image or an array: uint8, or float32 in [0, 1] for a float array.

    Raises:
      ValueError: a mode or shape that is not an RGB or greyscale picture.
    """
    if isinstance(image, Image.Image):
        if image.mode not in _CONVERTIBLE_MODES:
            raise ValueError(f"images in mode {image.mode} (16-bit or float) are not supported: save 8-bit RGB")
        # diffusers' load_image does the same: an alpha channel is dropped, not composited.
        return np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=-1)
    if array.ndim != 3 or array.shape[-1] not in (3, 4):
        raise ValueError(f"an image array must be [height, width, 3] (RGB), got shape {array.shape}")
    array = array[..., :3]
    if array.dtype == np.uint8:
        return array
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"an image array must hold uint8 or floats in [0, 1], got {array.dtype}")
    return array.astype(np.float32)


def resized(image: np.ndarray, height: int, width: int, *, crop: bool = False) -> np.ndarray:
    """[H, W, C] pixels (uint8, or float32 in [0, 1]) at height x width, resized with Lanczos as
    diffusers' image processors resize the PIL images they are given; unchanged at that size. With
    `crop`, first centre-cropped to that aspect ratio (A1111's "Crop and Resize")."""
    if image.shape[:2] == (height, width):
        return image
    box = crop_box(image.shape[1], image.shape[0], width, height) if crop else None
    if image.dtype == np.uint8:
        return np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.LANCZOS, box=box))
    channels = [Image.fromarray(image[..., c], "F").resize((width, height), Image.Resampling.LANCZOS, box=box)
                for c in range(image.shape[-1])]
    return np.clip(np.stack([np.asarray(c) for c in channels], axis=-1), 0, 1)


def crop_box(width: int, height: int, to_width: int, to_height: int) -> tuple[float, float, float, float]:
    """The centred box of a width x height picture with to_width x to_height's aspect ratio, as PIL's
    `resize(box=...)` takes it: the largest such box."""
    scale = min(width / to_width, height / to_height)
    crop_w, crop_h = to_width * scale, to_height * scale
    return (width - crop_w) / 2, (height - crop_h) / 2, (width + crop_w) / 2, (height + crop_h) / 2


def checked_pixels(images) -> np.ndarray:
    """Images (any shape) as uint8, or float32 in [0, 1] (as diffusers takes arrays).

    Raises:
      ValueError: floats outside [0, 1], or not finite.
    """
    images = np.asarray(images)
    if images.dtype == np.uint8:
        return images
    images = images.astype(np.float32)
    if not np.isfinite(images).all() or images.min() < 0 or images.max() > 1:
        raise ValueError("images given as floats must lie in [0, 1]")
    return images


# A bound on what one uploaded or opened image may decode to: SDXL's largest bucket is 1.6
# megapixels, the largest size here (MAX_SIZE squared) 16.8; PIL's own bound is 89.
MAX_IMAGE_PIXELS = 4096 * 4096


def read_image(source) -> Image.Image:
    """Opens an image file (a path or a binary file), refusing before it decodes one whose header
    claims more than `MAX_IMAGE_PIXELS` (a decompression bomb: a small file that decodes to
    gigabytes) or that PIL cannot read.

    Raises:
      ValueError: one sentence naming the problem.
    """
    limit = f"{MAX_IMAGE_PIXELS / 1e6:.1f} megapixels at most are read"
    try:
        image = Image.open(source)
    except Image.DecompressionBombError as e:  # PIL's own bound (the demo lowers it to twice ours)
        raise ValueError(f"the image is far too large: {limit}") from e
    except OSError as e:
        raise ValueError(f"cannot read the image: {e}") from e
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"the image is {width}x{height}, {width * height / 1e6:.0f} megapixels: {limit}")
    try:
        image.load()
    except (OSError, Image.DecompressionBombError) as e:
        raise ValueError(f"cannot read the image: {e}") from e
    return image


def mask(image) -> np.ndarray:
    """[H, W] bool, True where the image is repainted: a PIL image's greyscale (as diffusers' mask
    processor, "L") or an array's values, above one half.

    Raises:
      ValueError: a mask that is not one greyscale or RGB picture.
    """
    if isinstance(image, Image.Image):
        if image.mode not in _CONVERTIBLE_MODES:
            raise ValueError(f"masks in mode {image.mode} are not supported: save an 8-bit greyscale image")
        return np.asarray(image.convert("L")) >= 128  # diffusers: x / 255 >= 0.5
    array = np.asarray(image)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim == 3 and array.shape[-1] in (3, 4):  # as PIL's "L": ITU-R 601-2 luma
        array = array[..., :3].astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
    if array.ndim != 2:
        raise ValueError(f"a mask array must be [height, width], got shape {np.shape(image)}")
    if np.asarray(image).dtype == np.uint8:
        return array >= 127.5
    return np.asarray(array, np.float32) >= 0.5


def image_count(n: int) -> str:
    """"1 image", "4 images": how the CLI and the demo report a result."""
    return f"{n} image{'' if n == 1 else 's'}"


def model_label(model: str, unet: str | None) -> str:
    """How a result names its model: the checkpoint, and the UNet file that replaced its UNet."""
    return f"{model} + {Path(unet).name}" if unet else model


def save_png(image: Image.Image, path: Path, parameters: str) -> Path:
    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", parameters)
    image.save(path, pnginfo=info)
    return Path(path)


def contact_sheet(images: list[Image.Image]) -> Image.Image:
    """Lays images out in a near-square sheet (all images must share one size)."""
    columns = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    width, height = images[0].size
    sheet = Image.new("RGB", (columns * width, rows * height))
    for i, image in enumerate(images):
        sheet.paste(image, ((i % columns) * width, (i // columns) * height))
    return sheet


def to_pil(images: np.ndarray) -> list[Image.Image]:
    return [Image.fromarray(image) for image in images]


def unit(pixels: np.ndarray) -> np.ndarray:
    """Images as float32 in [0, 1], from uint8 or already so."""
    return pixels / np.float32(255) if pixels.dtype == np.uint8 else pixels


def stacked(maps: list[np.ndarray]) -> np.ndarray:
    """[N, H, W, C] float32 in [0, 1] of each image's map (`unit`); a view of one where all images share
    it (a request's usual case, and a placeholder's)."""
    if all(m is maps[0] for m in maps):
        return np.broadcast_to(unit(maps[0])[None], (len(maps), *maps[0].shape))
    return np.stack([unit(m) for m in maps])


class MadeFromPictures:
    """The last `size` arrays made from pictures (a control map, an image encoder's input), kept by the
    picture's content and how each was made, so that asking again (another request of the same picture:
    a grid's every cell) costs a hash. What it keeps is read-only: every request that asks shares it."""

    def __init__(self, size: int):
        self.size = size
        self._made: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, picture: np.ndarray, how: Hashable, make: Callable[[], np.ndarray]) -> np.ndarray:
        """What `make()` makes of `picture` the way `how` says, made once while it is kept."""
        digest = hashlib.blake2b(np.ascontiguousarray(picture).data, digest_size=16).hexdigest()
        key = (digest, picture.shape, picture.dtype.str, how)
        with self._lock:
            if key in self._made:
                self._made.move_to_end(key)
                return self._made[key]
        made = make()
        made.flags.writeable = False
        with self._lock:
            self._made[key] = made
            while len(self._made) > self.size:
                self._made.popitem(last=False)
        return made
