"""Strict loading of diffusers/transformers safetensors checkpoints into Flax parameter trees.

The Flax modules are named after the checkpoint's keys (`down_blocks.0` is a module name), so the
mapping between a checkpoint key and a parameter path is mechanical:

    down_blocks.0.resnets.1.conv1.weight  <->  params["down_blocks.0"]["resnets.1"]["conv1"]["kernel"]

Only the leaf names and the tensor layouts differ between PyTorch and Flax. Every key and every
shape is checked in both directions, and all mismatches are reported at once.
"""

import dataclasses
import json
import os
import struct
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


# jax.device_put on a CPU backend adopts a numpy array aligned to this many bytes instead of copying it
# (XLA's CPU buffers are 64-byte aligned), and replicating it over several CPU devices shares it too.
DEVICE_ALIGNMENT = 64


def nbytes(shape: tuple[int, ...], dtype) -> int:
    """The bytes of a C-contiguous array (the product in int64, which no platform's default int narrows)."""
    return np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A fresh array that a CPU backend can adopt without a copy (see `DEVICE_ALIGNMENT`)."""
    size = nbytes(shape, dtype)
    raw = np.empty(size + DEVICE_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % DEVICE_ALIGNMENT
    return raw[start : start + size].view(dtype).reshape(shape)


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not match the model it is loaded into."""


# PyTorch's pickled formats: never loaded, because unpickling can run arbitrary code.
PICKLED_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")


def refuse_pickled(source: str, what: str) -> None:
    """Raises CheckpointError when `source` names a pickled file, pointing to `what`'s safetensors file."""
    if Path(source).suffix in PICKLED_SUFFIXES:
        raise CheckpointError(
            f"{source}: a pickled file; it is never loaded because unpickling can run arbitrary code. "
            f"Use the {what}'s .safetensors file."
        )


class SafetensorsFile:
    """A safetensors file whose tensors are read one at a time, on demand.

    We parse the (simple, documented) format ourselves instead of using `safetensors.safe_open` so
    that bf16 tensors come back as numpy arrays (via ml_dtypes) and truncated files are caught
    before any tensor is read.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{self.path}: not a safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise CheckpointError(
                    f"{self.path}: truncated or corrupt (header claims {header_len} bytes, file has {size})"
                )
            try:
                header = json.loads(f.read(header_len))
            except ValueError as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from e
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        data_len = size - 8 - header_len
        self._entries = {}
        for key, entry in header.items():
            dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"{self.path}: tensor {key} has unsupported dtype {entry.get('dtype')}")
            begin, end = entry["data_offsets"]
            shape = tuple(entry["shape"])
            if end > data_len:
                raise CheckpointError(
                    f"{self.path}: truncated: tensor {key} ends at byte {end} of the data section, "
                    f"which has only {data_len} bytes"
                )
            if end - begin != nbytes(shape, dtype):
                raise CheckpointError(f"{self.path}: corrupt: tensor {key} size does not match its shape")
            self._entries[key] = (dtype, shape, 8 + header_len + begin)

    def keys(self) -> Iterable[str]:
        return self._entries.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key][1]

    def dtype(self, key: str) -> np.dtype:
        return self._entries[key][0]

    def offset(self, key: str) -> int:
        return self._entries[key][2]

    def tensor(self, key: str, buffer: bytearray | None = None) -> np.ndarray:
        """Reads one tensor, into a fresh array or, as a view that the next read overwrites, into
        `buffer` (grown to fit).

        A positioned read, not a memory map: mapped pages count as resident until unmapped, and
        each costs a page fault, which made mapping slower than copying.
        """
        dtype, shape, offset = self._entries[key]
        size = nbytes(shape, dtype)
        if buffer is None:
            array = aligned_empty(shape, dtype)
            view = memoryview(array.reshape(-1).view(np.uint8))  # bf16 has no buffer-protocol format
        else:
            if len(buffer) < size:
                buffer.extend(bytes(size - len(buffer)))
            view = memoryview(buffer)[:size]
            array = np.frombuffer(view, dtype).reshape(shape)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(offset)
            done = 0
            while done < size:
                n = f.readinto(view[done:])
                if not n:
                    raise CheckpointError(f"{self.path}: truncated while reading tensor {key}")
                done += n
        return array


def flatten(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    flat = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, prefix + (name,)))
        else:
            flat[prefix + (name,)] = value
    return flat


def unflatten(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = value
    return tree


def checkpoint_key(path: tuple[str, ...]) -> str:
    """The PyTorch state-dict key of a Flax parameter path."""
    leaf = "bias" if path[-1] == "bias" else "weight"
    return ".".join(path[:-1] + (leaf,))


def flax_axes(path: tuple[str, ...], ndim: int) -> tuple[int, ...]:
    """The permutation from PyTorch to Flax layout: conv kernels OIHW -> HWIO (`nn.Conv`'s `kernel`).

    Every other parameter, linear weights (`sdxl.models.layers.Linear`) included, keeps the stored layout.
    """
    return (2, 3, 1, 0) if path[-1] == "kernel" else tuple(range(ndim))


def torch_axes(path: tuple[str, ...], ndim: int) -> tuple[int, ...]:
    return tuple(int(a) for a in np.argsort(flax_axes(path, ndim)))


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Where one parameter's values are stored: a tensor of a safetensors file, or a view of one.

    Foreign layouts (`sdxl.checkpoints.single_file`) store some parameters differently: OpenCLIP
    fuses the query, key and value projections into one tensor (`rows`), keeps its text projection
    as [in, out] (`transpose`), and the original VAE's attention projections are 1x1 convolutions
    (`squeeze`).
    """

    file: SafetensorsFile
    key: str
    rows: tuple[int, int] | None = None  # (i, n): the i-th of n equal blocks of the first axis
    transpose: bool = False
    squeeze: bool = False  # drop the trailing 1x1 of a convolution kernel

    @property
    def plain(self) -> bool:
        return self.rows is None and not self.transpose and not self.squeeze

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.file.shape(self.key)
        if self.rows is not None:
            shape = (shape[0] // self.rows[1], *shape[1:])
        if self.squeeze:
            shape = shape[:2] if shape[2:] == (1, 1) else shape
        return shape[::-1] if self.transpose else shape

    def read(self, buffer: bytearray | None = None) -> np.ndarray:
        """The values in the stored layout, viewed as described (into `buffer` as `tensor` reads)."""
        array = self.file.tensor(self.key, buffer)
        if self.rows is not None:
            i, n = self.rows
            size = array.shape[0] // n
            array = array[i * size : (i + 1) * size]
        if self.squeeze:
            array = array.reshape(self.shape[::-1] if self.transpose else self.shape)
        return array.T if self.transpose else array


def stored_tensors(files: list[Path], rename: Callable[[str], str], ignore: Iterable[str]) -> dict[str, StoredTensor]:
    """{module key: StoredTensor} for every tensor of `files` but the `ignore`d ones.

    Raises:
      CheckpointError: two tensors map to the same module key.
    """
    stored: dict[str, StoredTensor] = {}
    ignore = set(ignore)
    for file in map(SafetensorsFile, files):
        for key in file.keys():
            if key in ignore:
                continue
            name = rename(key)
            if name in stored:
                raise CheckpointError(f"{file.path}: key {key} is stored twice")
            stored[name] = StoredTensor(file, key)
    return stored


def load_params(
    files: list[Path],
    abstract_params: dict,
    *,
    dtype,
    rename: Callable[[str], str] = lambda key: key,
    ignore: Iterable[str] = (),
    put: Callable[[np.ndarray], object] = lambda array: array,
) -> dict:
    """Loads safetensors `files` into a parameter tree shaped like `abstract_params`.

    Args:
      files: the component's safetensors files (several for a sharded checkpoint).
      abstract_params: the model's parameters as a tree of arrays or ShapeDtypeStructs
        (`jax.eval_shape(model.init, ...)["params"]`).
      dtype: the dtype every parameter is cast to.
      rename: maps a key as stored to the module's key (legacy names, optional prefixes).
      ignore: stored keys that are buffers, not parameters.
      put: places one converted tensor (see `load_stored`).

    Raises:
      CheckpointError: listing every missing, unexpected and mis-shaped key.
    """
    if not files:
        raise CheckpointError("no safetensors files given")
    where = ", ".join(str(f) for f in files)
    return load_stored(stored_tensors(files, rename, ignore), abstract_params, dtype=dtype, put=put, where=where)


def load_stored(
    stored: dict[str, StoredTensor],
    abstract_params: dict,
    *,
    dtype,
    put: Callable[[np.ndarray], object] = lambda array: array,
    where: str,
) -> dict:
    """Loads the tensors `stored` ({module key: StoredTensor}) into a tree shaped like `abstract_params`.

    Every key is checked in both directions and every shape; all mismatches are reported at once.
    `put` places one converted tensor (`pipeline.place` with a sharding, say). It is called from
    several threads. Tensors are read and converted into fresh arrays a few at a time, in file
    order, so the host never holds a second copy of the model; on a CPU backend the arrays become
    the parameters themselves (see `aligned_empty`).

    Raises:
      CheckpointError: listing every missing, unexpected and mis-shaped key of the checkpoint `where`.
    """
    abstract = flatten(abstract_params)
    expected = {checkpoint_key(path): path for path in abstract}
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    misshaped = []
    for name in sorted(set(expected) & set(stored)):
        path, source = expected[name], stored[name]
        want = tuple(abstract[path].shape)
        got = source.shape
        if len(got) != len(want) or tuple(got[a] for a in flax_axes(path, len(got))) != want:
            needed = tuple(want[a] for a in torch_axes(path, len(want)))
            misshaped.append(f"{source.key} in {source.file.path.name}: stored {got}, model needs {needed}")
    if missing or unexpected or misshaped:
        lines = [f"checkpoint {where} does not match the model:"]
        lines += [f"  missing key: {k}" for k in missing]
        lines += [f"  unexpected key: {stored[k].key} in {stored[k].file.path.name}" for k in unexpected]
        lines += [f"  wrong shape: {m}" for m in misshaped]
        raise CheckpointError("\n".join(lines))

    dtype = np.dtype(dtype)
    read_buffers = threading.local()

    def convert(name: str) -> object:
        source = stored[name]
        axes = flax_axes(expected[name], len(source.shape))
        if source.plain and source.file.dtype(source.key) == dtype and axes == tuple(range(len(axes))):
            return put(source.read())
        # Casts and conv-kernel transposes run in numpy's C loops, which release the GIL: a
        # thread per core reads and converts in parallel, each through its own reused buffer.
        if not hasattr(read_buffers, "buffer"):
            read_buffers.buffer = bytearray()
        stored_tensor = source.read(read_buffers.buffer).transpose(axes)
        converted = aligned_empty(stored_tensor.shape, dtype)
        np.copyto(converted, stored_tensor, casting="same_kind")
        return put(converted)

    def file_position(name: str) -> tuple[str, int]:
        source = stored[name]
        return str(source.file.path), source.file.offset(source.key)

    in_file_order = sorted(expected, key=file_position)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        placed = pool.map(convert, in_file_order)
        return unflatten({expected[name]: array for name, array in zip(in_file_order, placed)})


def write_params(
    path: Path, abstract_params: dict, dtype, tensor: Callable[[tuple[str, ...], tuple[int, ...]], np.ndarray]
) -> None:
    """Writes a PyTorch-layout safetensors file for a parameter tree, one tensor at a time (the
    inverse of `load_params`), so the host never holds more than one tensor.

    Args:
      abstract_params: the tree's shapes (Flax layout).
      dtype: the stored dtype.
      tensor: `tensor(path, shape)` gives one parameter's values in Flax layout; it is called in
        sorted key order.
    """
    entries = sorted((checkpoint_key(p), p, tuple(leaf.shape)) for p, leaf in flatten(abstract_params).items())
    dtype = np.dtype(dtype)
    stored_dtype = {v: k for k, v in SAFETENSORS_DTYPES.items()}[dtype]
    header, offset = {}, 0
    for key, param_path, shape in entries:
        size = nbytes(shape, dtype)
        stored_shape = [shape[a] for a in torch_axes(param_path, len(shape))]
        header[key] = {"dtype": stored_dtype, "shape": stored_shape, "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format aligns the data section to 8 bytes
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for _, param_path, shape in entries:
            value = tensor(param_path, shape)
            f.write(np.ascontiguousarray(value.transpose(torch_axes(param_path, value.ndim)), dtype).tobytes())
