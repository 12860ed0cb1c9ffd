"""Scaled dot-product attention with the best kernel each backend has.

- TPU: Pallas' splash attention, a flash-attention kernel: the [T, S] logits stay in VMEM, tile by
  tile, instead of going to HBM. SDXL's 64x64 level at 1024x1024 attends over 4096 tokens, whose
  float32 logits are 640 MiB per image and layer.
- GPU in bfloat16 or float16: cuDNN's flash attention, through `jax.nn.dot_product_attention`.
- Everything else (CPU; float32 on a GPU, which cuDNN's kernel does not take): XLA's attention.

The backend is the platform of the devices the program is traced for: those of the mesh in context
(`jax.set_mesh`), else the host's. So a CPU host that compiles for a TPU topology's mesh (`python -m
sdxl bench --topology`) traces the TPU's kernels, as the TPU would.

`SDXL_ATTENTION=xla|splash|cudnn` overrides the choice when a model is traced; `xla` is the
fallback should a kernel misbehave on some accelerator. Lowered for anything but a TPU, `splash`
runs the same kernel in Pallas' interpreter: far too slow to serve, but it is how the tests check
the splash path's numbers on a CPU; they also lower the whole SDXL program for a TPU, which puts
every kernel through Pallas' Mosaic lowering, and for a GPU, which shows the cuDNN call each device
makes. Neither accelerator kernel has run on an accelerator in this project's tests (none was
available).
"""

import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from ..config import kernel_override

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("xla", "splash", "cudnn")
# Splash tiles the query and key sequences in blocks of a multiple of the TPU's 128 lanes.
SPLASH_LANES = 128
SPLASH_MAX_BLOCK = 512


def target_platform() -> str:
    """The platform being traced for: the devices' of the mesh in context, else the host's backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return jax.default_backend() if device is None else device.platform


def implementation(dtype, head_dim: int) -> str:
    """The kernel for the target platform, or the one SDXL_ATTENTION names; XLA where it can't take the shape."""
    chosen = kernel_override("SDXL_ATTENTION", IMPLEMENTATIONS)
    if not chosen:
        chosen = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn", "rocm": "cudnn"}.get(target_platform(), "xla")
    # cuDNN's flash attention takes 16-bit inputs and heads up to 128 wide: not the VAE's 512-wide head.
    cudnn_takes = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim <= 128 and head_dim % 8 == 0
    if chosen == "cudnn" and not cudnn_takes:
        return "xla"
    return chosen


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_lengths: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(D)) v.  [B, T, H, D], [B, S, H, D] x2 -> [B, T, H, D].

    `kv_lengths` [B] int32: each image attends to its first `kv_lengths[b]` keys only (a prompt
    shorter than the batch's longest); None: to all.
    """
    kernel = implementation(q.dtype, q.shape[-1])
    arrays = (q, k, v) if kv_lengths is None else (q, k, v, kv_lengths)
    if kernel == "cudnn":
        try:
            with _kernel_scope("cudnn"):
                return _data_parallel(_cudnn_attention, *arrays)
        except (NotImplementedError, RuntimeError) as error:  # an old cuDNN, or a GPU it does not support
            log.warning("cuDNN attention unavailable (%s); using XLA's", error)
            kernel = "xla"
    with _kernel_scope(kernel):
        if kernel == "splash":
            return _data_parallel(_splash_attention, *arrays)
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths, implementation="xla")


def _kernel_scope(kernel: str):
    """The named scope each attention call runs in: the compiled program's op names then say which
    kernel it took (`kernels_in`), fallbacks included."""
    return jax.named_scope(f"{kernel}_attention")


def kernels_in(compiled: jax.stages.Compiled) -> set[str]:
    """The attention kernels a compiled program calls."""
    return set(re.findall(rf"/({'|'.join(IMPLEMENTATIONS)})_attention/", compiled.as_text()))


def _cudnn_attention(q, k, v, kv_lengths=None):
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths, implementation="cudnn")


def _data_parallel(attention, *arrays):
    """Runs `attention` on each device's share of the batch.

    Neither kernel partitions well by itself. XLA cannot partition a Pallas kernel: given the batch
    sharded, it would gather it onto every device. JAX's partitioning rule for the cuDNN call wants
    the query, key and value sharded alike, which sharding propagation does not promise, and it
    decides only when XLA compiles, on a GPU. So under a mesh (`jax.set_mesh`) the kernel runs in a
    `shard_map` over the batch, split across all the mesh's axes as the pipeline splits it: each
    device calls the plain kernel on its share.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or arrays[0].shape[0] % mesh.size:
        return attention(*arrays)
    spec = PartitionSpec(mesh.axis_names)
    return jax.shard_map(attention, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(*arrays)


def _padded_length(length: int) -> tuple[int, int]:
    """(padded length, block): the smallest block-multiple >= length, blocks of 128 to 512."""
    block = min(SPLASH_MAX_BLOCK, -(-length // SPLASH_LANES) * SPLASH_LANES)
    return -(-length // block) * block, block


def _splash_attention(q, k, v, kv_lengths=None):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    batch, q_length, heads, head_dim = q.shape
    kv_length = k.shape[1]
    q_padded, block_q = _padded_length(q_length)
    kv_padded, block_kv = _padded_length(kv_length)
    mask = splash.MultiHeadMask([splash.FullMask((q_padded, kv_padded))] * heads)
    blocks = splash.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv)
    # Padding keys (and each image's keys past its length) get segment 1 and real queries segment 0,
    # so no real query attends to them.
    if kv_lengths is None:
        kv_lengths = jnp.full((batch,), kv_length, jnp.int32)
    q_segments = jnp.asarray(np.arange(q_padded) >= q_length, jnp.int32)
    kv_segments = (jnp.arange(kv_padded)[None] >= kv_lengths[:, None]).astype(jnp.int32)  # [B, padded S]

    def heads_major(x, length):  # [B, L, H, D] -> [B, H, padded L, D]
        return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    def attend(interpret: bool):
        kernel = splash.make_splash_mha_single_device(mask, block_sizes=blocks, interpret=interpret)
        return jax.vmap(lambda q, k, v, kv: kernel(q, k, v, segment_ids=splash.SegmentIds(q=q_segments, kv=kv)))

    q = heads_major(q * jnp.asarray(1 / math.sqrt(head_dim), q.dtype), q_padded)  # splash does not scale
    # Decided by the platform the program is lowered for, not the host's: a CPU host can lower
    # (and the tests do) a TPU program, whose kernel Mosaic must compile.
    out = jax.lax.platform_dependent(
        q, heads_major(k, kv_padded), heads_major(v, kv_padded), kv_segments, tpu=attend(False), default=attend(True)
    )
    return out.transpose(0, 2, 1, 3)[:, :q_length]
