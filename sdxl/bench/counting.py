"""FLOPs are counted on programs lowered for this host's CPU, with XLA's own kernels.

XLA's cost analysis sees into no custom call (cuDNN's attention, Pallas' kernels), and on a GPU it
analyses no lowered program at all (JAX 0.11 answers None). Traced over a mesh of one CPU device
with XLA's attention (whatever SDXL_ATTENTION says), and in 16-bit types XLA's direct convolutions,
the count is the model's work, the same whichever platform runs it.
"""

import contextlib
import os
from collections.abc import Iterator

import jax

from ..engine.mesh import batch_mesh

PLATFORMS = ("cpu",)


def host_mesh() -> jax.sharding.Mesh:
    return batch_mesh(jax.devices("cpu")[:1])


@contextlib.contextmanager
def xla_attention() -> Iterator[None]:
    """Traces in this block take XLA's attention, even where SDXL_ATTENTION names another kernel."""
    chosen = os.environ.get("SDXL_ATTENTION")
    os.environ["SDXL_ATTENTION"] = "xla"
    try:
        yield
    finally:
        if chosen is None:
            del os.environ["SDXL_ATTENTION"]
        else:
            os.environ["SDXL_ATTENTION"] = chosen


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Traces in this block pick the kernels of the host's CPU (`sdxl.models.attention.target_platform`),
    XLA's attention included."""
    with xla_attention(), jax.set_mesh(host_mesh()):
        yield


def lowered(fn, *args) -> jax.stages.Lowered:
    """`jax.jit(fn)` lowered for the host, on `args` (arrays or shapes)."""
    with on_host():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=PLATFORMS)


def flops(stage) -> float:
    """XLA's FLOP count of a lowered or compiled program."""
    analysis = stage.cost_analysis()
    return float((analysis[0] if isinstance(analysis, list) else analysis)["flops"])  # older JAX: one dict per module
