"""XLA compilation: the persistent on-disk cache, and counting compilations."""

import logging
import os
import threading
from pathlib import Path

import jax
from jax import monitoring
from jax._src import compilation_cache, compiler, distributed

from ..config import cache_root

log = logging.getLogger(__name__)

# Recorded by JAX around every backend compilation, including ones answered from the persistent
# cache: it counts "a new executable was needed", which is what a recompilation is.
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Recorded when the persistent cache answers one of those.
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

# JAX's own write of a cache entry, made after a miss; `enable_compilation_cache` puts `_write_entry`
# in its place. Private to JAX (no public API reaches it), so tests/test_compilation.py checks both
# things `_write_entry` adds.
_jax_cache_write = compiler._cache_write


def default_cache_dir() -> Path:
    return cache_root() / "xla"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Turns on JAX's persistent compilation cache in `path`, so a restart skips XLA compilation.

    Every executable is cached, however quick it was to compile: the generate function for each
    image size is the one that matters, and the small ones cost nothing to keep. An entry that
    cannot be read is replaced by the fresh compile, and every process of a multi-host run writes
    its own entries (`_write_entry`).
    """
    path = Path(path) if path is not None else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compiler._cache_write = _write_entry
    return path


def disable_compilation_cache() -> None:
    """Turns JAX's persistent compilation cache off again, as it was before `enable_compilation_cache` (nothing
    to do when it is off): later compiles neither read nor write entries."""
    if jax.config.jax_compilation_cache_dir is None:
        return
    jax.config.update("jax_compilation_cache_dir", None)
    compiler._cache_write = _jax_cache_write
    compilation_cache.reset_cache()


def _write_entry(cache_key: str, compile_time_secs: float, module_name: str, backend, executable,
                 host_callbacks) -> None:
    """JAX's write of a cache entry after a miss, with two differences.

    JAX skips a key whose file exists, so an entry it could not read (cut short by a crash or a full
    disk) stayed: each start warned, compiled and left it again. JAX writes only after a miss, so
    such a file is removed first, and the fresh compile replaces it.

    JAX writes from process 0 only (against contention on a shared filesystem), so the other
    processes of a multi-host run missed at every start: each host has a disk of its own, and on CPU
    their keys differ from process 0's anyway (each process's devices have a topology fingerprint of
    their own). Each process writes its own entries; each reads or compiles on its own, waiting for
    no other.
    """
    entry = Path(jax.config.jax_compilation_cache_dir) / f"{cache_key}-cache"  # the layout of JAX's LRUCache
    entry.unlink(missing_ok=True)
    _jax_cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
    if (distributed.global_state.process_id != 0 and not host_callbacks
            and compile_time_secs >= jax.config.jax_persistent_cache_min_compile_time_secs):
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as e:  # as in JAX: a cache that cannot be written slows the next start, no more
            log.warning("could not write the compilation cache entry of %s: %s: %s", module_name, type(e).__name__, e)


class CompileCounter:
    """Counts XLA compilations (and their seconds) while active, and those the persistent cache answered.

    with CompileCounter() as compiles:
        pipe.generate(...)
    assert compiles.count == 0
    """

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self.cached = 0  # of `count`, read from the persistent cache
        self._lock = threading.Lock()

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with self._lock:
                self.count += 1
                self.seconds += duration

    def _on_event(self, event: str, **_) -> None:
        if event == _CACHE_HIT_EVENT:
            with self._lock:
                self.cached += 1

    def __enter__(self) -> "CompileCounter":
        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_duration_listener(self._on_duration)
        monitoring.unregister_event_listener(self._on_event)
