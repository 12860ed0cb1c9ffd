"""XLA compilation: the persistent on-disk cache, and counting compilations."""

import os
import threading
from pathlib import Path

import jax
from jax import monitoring

from ..config import cache_root

# Recorded by JAX around every backend compilation, including ones answered from the persistent
# cache: it counts "a new executable was needed", which is what a recompilation is.
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def default_cache_dir() -> Path:
    return cache_root() / "xla"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Turns on JAX's persistent compilation cache in `path`, so a restart skips XLA compilation.

    Every executable is cached, however quick it was to compile: the generate function for each
    image size is the one that matters, and the small ones cost nothing to keep.
    """
    path = Path(path) if path is not None else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


class CompileCounter:
    """Counts XLA compilations (and their seconds) while active.

    with CompileCounter() as compiles:
        pipe.generate(...)
    assert compiles.count == 0
    """

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with self._lock:
                self.count += 1
                self.seconds += duration

    def __enter__(self) -> "CompileCounter":
        monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_duration_listener(self._on_event)
