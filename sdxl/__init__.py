"""Stable Diffusion XL in JAX: Flax models, strict checkpoint loading, one sharded compiled generate."""

from .checkpoints import CheckpointError
from .engine.compilation import CompileCounter, enable_compilation_cache
from .engine.pipeline import Generation, NonFiniteImageError, Pipeline
from .engine.request import Request

__all__ = [
    "CheckpointError",
    "CompileCounter",
    "Generation",
    "NonFiniteImageError",
    "Pipeline",
    "Request",
    "enable_compilation_cache",
]
