"""Stable Diffusion XL in JAX: Flax models, strict checkpoint loading, one sharded compiled generate."""

from .compilation import CompileCounter, enable_compilation_cache
from .pipeline import NonFiniteImageError, Pipeline, PromptTruncatedWarning
from .weights import CheckpointError

__all__ = [
    "CheckpointError",
    "CompileCounter",
    "NonFiniteImageError",
    "Pipeline",
    "PromptTruncatedWarning",
    "enable_compilation_cache",
]
