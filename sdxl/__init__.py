"""Stable Diffusion XL in JAX: Flax models, strict checkpoint loading, one sharded compiled generate."""

from .checkpoints import CheckpointError
from .engine import control_maps, images
from .engine.compilation import CompileCounter, enable_compilation_cache
from .engine.controls import Control
from .engine.hires import Hires
from .engine.image_prompts import STYLE_AND_LAYOUT, STYLE_ONLY, ImagePrompt
from .engine.infotext import read_parameters
from .engine.pipeline import Generation, NonFiniteImageError, Pipeline
from .engine.prepared import PreparedRequest
from .engine.request import Request
from .engine.upscaler import Upscaler

__all__ = [
    "CheckpointError",
    "CompileCounter",
    "Control",
    "Generation",
    "Hires",
    "ImagePrompt",
    "NonFiniteImageError",
    "Pipeline",
    "PreparedRequest",
    "Request",
    "STYLE_AND_LAYOUT",
    "STYLE_ONLY",
    "Upscaler",
    "control_maps",
    "enable_compilation_cache",
    "images",
    "read_parameters",
]
