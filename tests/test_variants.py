"""The GPU lease's variants (`sdxl.bench.variants`): each a setting this machine's JAX and our switches take.

What each keeps of the images is checked where the switch is: `SDXL_GROUP_NORM=shifted` against
diffusers' UNet (tests/test_unet.py) and torch's group_norm (tests/test_group_norm.py); `SDXL_ATTENTION=xla`
is a CPU's own kernel; a CPU ignores the XLA GPU flags.
"""

import os
import subprocess
import sys

import pytest

from sdxl.bench.variants import VARIANTS
from sdxl.models.attention import IMPLEMENTATIONS
from sdxl.models.layers import GROUP_NORM_STATISTICS

# Our switches' choices, by variable (`config.kernel_override` refuses the others).
CHOICES = {"SDXL_ATTENTION": IMPLEMENTATIONS, "SDXL_GROUP_NORM": GROUP_NORM_STATISTICS}


@pytest.mark.cli
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_each_variant_is_a_setting_this_jax_and_our_switches_take(variant):
    """An XLA flag this jaxlib does not know stops the process that starts JAX with it."""
    if variant.variable != "XLA_FLAGS":
        assert variant.value in CHOICES[variant.variable]
        return
    started = _jax_started_with(variant.value)
    assert started.returncode == 0, started.stderr


@pytest.mark.cli
def test_an_unknown_xla_flag_stops_the_process():
    """What makes the test above mean something."""
    assert _jax_started_with("--xla_gpu_no_such_flag=true").returncode != 0


def _jax_started_with(flags: str) -> subprocess.CompletedProcess:
    """A process that starts JAX with `flags` beside the test session's own XLA_FLAGS."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}"}
    return subprocess.run([sys.executable, "-c", "import jax; jax.numpy.ones(1).block_until_ready()"],
                          capture_output=True, text=True, timeout=120, env=env)
