"""The device mesh: one axis over every device, along which a batch of images is split.

Parameters are replicated; per-image arrays are sharded by image, so each device renders its share
with no communication. The same code runs on one device, many, and several hosts' devices.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

BATCH_AXIS = "batch"


def batch_mesh(devices: Sequence[jax.Device]) -> Mesh:
    return Mesh(np.array(list(devices)), (BATCH_AXIS,))


def by_image(mesh: Mesh) -> NamedSharding:
    """Arrays whose first axis is the image: split over the devices."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def place(array, sharding: NamedSharding) -> jax.Array:
    """A host array that every process holds alike, as a global array; each process fills its own devices.

    Not `jax.device_put`: given devices of several processes, it first checks that they all passed
    the same value, with a collective per array. The loader places arrays from a thread pool, in an
    order that differs between hosts, so those collectives mismatched (and gloo aborted).
    An array already on the devices (a base model's latents) is resharded as it is.
    """
    if isinstance(array, jax.Array):
        return jax.device_put(array, sharding)
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def placing_replicated(mesh: Mesh):
    """`place` for arrays every device of `mesh` holds whole (parameters), as one function of the array."""
    sharding = replicated(mesh)
    return lambda array: place(array, sharding)


def fetch(array: jax.Array) -> np.ndarray:
    """A global array's values on this host, all of them (every process gets every image)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)


def interleave(negative: jax.Array, positive: jax.Array) -> jax.Array:
    """[B, ...] x2 -> [2B, ...] as (neg_0, pos_0, neg_1, pos_1, ...).

    Keeping each image's two guidance branches adjacent keeps them on the same device, so the
    batched CFG call needs no cross-device traffic.
    """
    return jnp.stack([negative, positive], axis=1).reshape(-1, *negative.shape[1:])
