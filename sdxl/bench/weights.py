"""`bench --compare-weights MODES`: the benchmark's batch rendered by the model loaded again with its
weights stored in 8 bits (`sdxl.models.quantization.WEIGHT_DTYPES`: fp8_e4m3fn, fp8_e5m2, int8, and the
modes that also compute in 8 bits), each mode's calls timed in turn with the baseline's, and each one's
parameters' bytes per device against the baseline's.

Each mode is a pipeline of its own on the same devices, whose first call compiles its program (the
stored dtypes are the program's argument types) and is not timed.
"""

from collections.abc import Callable
from pathlib import Path

import jax

from ..engine.pipeline import Pipeline
from ..engine.request import Request
from ..models.quantization import weights_dtype_name
from .loading import load_on_devices


def call_name(mode: str) -> str:
    """The name of a mode's calls among the benchmark's timed ones."""
    return f"weights {mode}"


def param_bytes_per_device(pipe: Pipeline) -> int:
    """The bytes of every loaded parameter on one device (they are replicated: each holds them all)."""
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(pipe.params))


def modes_of(text: str | None) -> tuple[str, ...]:
    """`--compare-weights`' comma-separated modes, by their canonical names, the default mode left out.

    Raises:
      ValueError: a mode that is not one of `quantization.WEIGHT_DTYPES`.
    """
    return tuple(mode for mode in dict.fromkeys(map(weights_dtype_name, (text or "").split(",") if text else ()))
                 if mode != "default")


def first_runs(folder: Path, dtype: str, max_steps: int, num_devices: int | None, request: Request, modes,
               log: Callable[[str], None]) -> tuple[dict[str, Callable[[], object]], dict[str, int]]:
    """Each mode's pipeline, loaded and its program compiled by a first call of `request`: ({call name: a
    call}, {mode: its parameters' bytes per device})."""
    calls, param_bytes = {}, {}
    for mode in modes:
        log(f"loading the model with {mode} weights, and compiling its program")
        pipe = load_on_devices(folder, dtype, max_steps, num_devices, weights_dtype=mode)
        prepared = pipe.prepare(request)
        pipe.render(prepared)
        calls[call_name(mode)] = lambda pipe=pipe, prepared=prepared: pipe.render(prepared)
        param_bytes[mode] = param_bytes_per_device(pipe)
    return calls, param_bytes


def speed(request: Request, timings: dict, median_s: Callable, param_bytes: dict[str, int]) -> dict:
    """Each mode's images/s and time against the baseline's ("ours"), and every mode's parameters' bytes
    per device ("default" the baseline's)."""
    batch, ours = len(request), median_s(timings["ours"])
    result = {}
    for mode, nbytes in param_bytes.items():
        result[f"weights_{mode}_param_bytes_per_device"] = nbytes
        if mode != "default":
            result[f"weights_{mode}_images_per_s"] = batch / median_s(timings[call_name(mode)])
            result[f"weights_{mode}_cost"] = median_s(timings[call_name(mode)]) / ours
    return result
