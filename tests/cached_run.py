"""One start of a small program with the persistent compilation cache on, for test_compilation:
`python cached_run.py CACHE_DIR [PROCESS_ID PROCESS_COUNT PORT]`.

Prints one JSON line: what the program computed, how many compilations asked the cache and how many
it answered, and the warnings. With a process count, each process has 2 CPU devices, jax.distributed
joins them, and the program spans every process's devices, as the multi-host demo's do.
"""

import json
import os
import sys
import warnings


def main(cache_dir: str, process_id: str | None = None, process_count: str | None = None,
         port: str | None = None) -> None:
    if process_count is not None:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import jax.numpy as jnp
    from jax import monitoring
    from jax.sharding import NamedSharding, PartitionSpec

    from sdxl.engine.compilation import enable_compilation_cache

    counts = {"requests": 0, "hits": 0}
    events = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
              "/jax/compilation_cache/cache_hits": "hits"}

    def count(event: str, **_) -> None:
        if event in events:
            counts[events[event]] += 1

    monitoring.register_event_listener(count)
    if process_count is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"localhost:{port}", num_processes=int(process_count),
                                   process_id=int(process_id))
    enable_compilation_cache(cache_dir)
    mesh = jax.make_mesh((jax.device_count(),), ("devices",))
    sharding = NamedSharding(mesh, PartitionSpec("devices"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = jax.make_array_from_callback((16,), sharding, lambda index: jnp.arange(16.0)[index])
        total = jax.jit(lambda x: jnp.sin(x).sum())(values)
        print(json.dumps({"total": float(total), **counts, "warnings": [str(w.message) for w in caught]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
