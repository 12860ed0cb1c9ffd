"""Whether a batch fits the devices: the compiled programs' own memory analysis against each device's
memory, checked before a batch that cannot fit is ever run.

What a program needs on one device beside what is loaded there (every model's weights, which its
allocator reports as in use) is what XLA's `memory_analysis` says it holds while it runs, less the
weights: this device's share of its other arguments (latents, text states), its outputs and its
temporaries, less the outputs that reuse donated inputs' buffers. A TPU's
compiler refuses a program larger than its memory outright ("RESOURCE_EXHAUSTED ... exceeds
available HBM"); a GPU's compiles it and fails when it allocates. Either way the demo and the CLI
find out here, and say what does fit. A hires fix's second pass, at its bigger size, is one more
program to check; where not even one image fits with it, the sentence says what fits without it.

Devices that do not report their memory (the CPU) are not checked.
"""

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ..checkpoints import CheckpointError
from .compiled import stages
from .program import GenerateProgram

GIB = 2**30


class DoesNotFitError(CheckpointError):
    """The model, at the batch asked for, needs more memory than a device has. `fitting`: the most
    images per device that fit as asked otherwise, or None where not even 1 does."""

    def __init__(self, message: str, fitting: int | None = None):
        super().__init__(message)
        self.fitting = fitting


def bytes_beside_weights(compiled: jax.stages.Compiled) -> int:
    """What a compiled stage (its weights its first argument) holds on one device beside the weights."""
    memory = compiled.memory_analysis()
    (args, _), (shardings, _) = compiled.args_info, compiled.input_shardings
    # An argument the program never reads has no sharding (None), and no buffer in the program.
    infos, tree = jax.tree.flatten(args[1:])
    inputs = sum(math.prod(sharding.shard_shape(info.shape)) * np.dtype(info.dtype).itemsize
                 for info, sharding in zip(infos, tree.flatten_up_to(shardings[1:])) if sharding is not None)
    return inputs + memory.output_size_in_bytes + memory.temp_size_in_bytes - memory.alias_size_in_bytes


def device_memory(pipe) -> tuple[int, int] | None:
    """(bytes one of the pipeline's devices can hold, bytes in use there now: the loaded weights), or
    None where the device does not say (the CPU)."""
    stats = pipe.mesh.devices.flat[0].memory_stats() or {}
    return (stats["bytes_limit"], stats.get("bytes_in_use", 0)) if "bytes_limit" in stats else None


def bytes_needed(pipe, programs: Sequence[GenerateProgram], in_use: int, *, progress: bool = True) -> int | None:
    """The most bytes one device holds running any of `programs`: what is loaded (`in_use`, their weights
    among it) and what a stage needs beside it; None where the compiler refused one for want of
    memory. Each stage compiles, and stays compiled for the run that follows."""
    needed = 0
    for program in programs:
        for stage in stages(progress):
            try:
                compiled = pipe.compiled(program, stage)  # a refiner's program by the refiner
            except jax.errors.JaxRuntimeError as e:
                if "RESOURCE_EXHAUSTED" in str(e):
                    return None
                raise
            needed = max(needed, in_use + bytes_beside_weights(compiled))
    return needed


def check_fits(pipe, batch_programs: Callable[[int], list[GenerateProgram]], per_device: int,
               setting: Callable[[int], str], *, progress: bool = True) -> None:
    """Raises DoesNotFitError unless the programs of `per_device` images on each device fit its memory,
    in a sentence naming the largest count that does, as the user sets it.

    Args:
      batch_programs: the programs a batch of n images per device runs, for n from `per_device` down
        (a hires fix's second pass among them: `PreparedRequest.programs_at`).
      setting: how the user asks for n images per device ("--max-images-per-core 4"), for the sentence.
    """
    memory = device_memory(pipe)
    if memory is None:
        return
    limit, in_use = memory
    needed = _needed_down_to_fit(pipe, batch_programs, per_device, in_use, limit, progress)
    asked = needed[per_device]
    if asked is not None and asked <= limit:
        return
    device = pipe.mesh.devices.flat[0]
    size = "more than the compiler could place" if asked is None else f"{asked / GIB:.2f} GiB"
    fitting = first_fitting = _largest_fitting(needed, limit)
    # A hires fix's second pass: the one program of a request at another size than its first pass's.
    one = batch_programs(1)
    hires_sizes = sorted({_size(p) for p in one} - {_size(one[0])})
    if fitting:
        advice = _fit(fitting, setting)
    elif hires_sizes:
        def first_pass(n: int) -> list[GenerateProgram]:
            programs = batch_programs(n)
            return [p for p in programs if _size(p) == _size(programs[0])]

        needed = _needed_down_to_fit(pipe, first_pass, per_device, in_use, limit, progress)
        fitting = _largest_fitting(needed, limit)
        passes = " and ".join(f"{width}x{height}" for width, height in hires_sizes)
        advice = (f"not even 1 per device fits with the hires fix's {passes} pass (a smaller upscale may); "
                  f"without it, {_fit(fitting, setting) if fitting else 'not even 1 either'}")
    elif pipe.refiner is not None:
        # Without the refiner: its own weights off the devices, and none of its programs.
        def alone(n: int) -> list[GenerateProgram]:
            return [p for p in batch_programs(n) if p.spec != pipe.refiner.spec]

        weights = refiner_bytes(pipe)
        needed = _needed_down_to_fit(pipe, alone, per_device, in_use - weights, limit, progress)
        fitting = _largest_fitting(needed, limit)
        advice = (f"not even 1 per device fits beside the refiner's {weights / GIB:.2f} GiB; without --refiner, "
                  + (_fit(fitting, setting) if fitting else "not even 1 either"))
    else:
        advice = "not even 1 per device fits: choose a smaller size, bfloat16, or devices with more memory"
    raise DoesNotFitError(
        f"{setting(per_device)} needs {size} on each {getattr(device, 'device_kind', device.platform)}, "
        f"which holds {limit / GIB:.2f} GiB; {advice}", first_fitting
    )


def _needed_down_to_fit(pipe, batch_programs, per_device: int, in_use: int, limit: int, progress: bool) -> dict:
    """`bytes_needed` for n images per device, from `per_device` down to the first n that fits."""
    needed = {}
    for n in range(per_device, 0, -1):
        needed[n] = bytes_needed(pipe, batch_programs(n), in_use, progress=progress)
        if needed[n] is not None and needed[n] <= limit:
            break
    return needed


def _size(program: GenerateProgram) -> tuple[int, int]:
    """(width, height), as sizes are written ("2048x2048")."""
    return program.width, program.height


def _largest_fitting(needed: dict, limit: int) -> int | None:
    return next((n for n, size in needed.items() if size is not None and size <= limit), None)


def _fit(n: int, setting: Callable[[int], str]) -> str:
    return f"{n} per device fit{'s' if n == 1 else ''}: {setting(n)}"


def refiner_bytes(pipe) -> int:
    """What the refiner's own weights take on one device: the arrays it does not share with the model."""
    held = {id(a) for a in jax.tree.leaves(pipe.params)}
    own = {id(a): a for a in jax.tree.leaves(pipe.refiner.params)
           if id(a) not in held and isinstance(a, jax.Array)}  # not those waiting in host memory
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in own.values())
