"""Model upscaler files: ESRGAN's RRDBNet (`sdxl.models.esrgan`) and Real-ESRGAN's SRVGGNetCompact
(`sdxl.models.srvgg`), as `.safetensors` or as PyTorch's `.pth`, their architecture read off their keys
and shapes as spandrel reads it.

PyTorch files are read without PyTorch and without running their pickle: an unpickler that knows only
the few names a state dict of tensors is made of builds numpy arrays from the zip's storages, and
refuses anything else (a pickle can call any importable function while it loads).
"""

import collections
import pickle
import re
import zipfile
from collections.abc import Iterable
from pathlib import Path

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np

from ..models.esrgan import ESRGANConfig, RRDBNet
from ..models.srvgg import SRVGGConfig, SRVGGNetCompact
from .weights import CheckpointError, SafetensorsFile, StoredTensor, load_stored

# The one way to bring any other PyTorch file here: PyTorch's own safe loader, once.
CONVERT = (
    "python -c \"import sys, torch, safetensors.torch as st; d = torch.load(sys.argv[1], weights_only=True); "
    "st.save_file(d.get('params_ema') or d.get('params') or d, sys.argv[2])\" MODEL.pth MODEL.safetensors"
)

# The containers that training code wraps a state dict in (BasicSR's EMA weights first, as spandrel).
WRAPPERS = ("params_ema", "params", "state_dict")

# The tensor storages a state dict's pickle names, by their `torch.<name>` class.
STORAGE_DTYPES = {
    "FloatStorage": np.dtype(np.float32),
    "HalfStorage": np.dtype(np.float16),
    "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
    "DoubleStorage": np.dtype(np.float64),
    "LongStorage": np.dtype(np.int64),
    "IntStorage": np.dtype(np.int32),
    "ShortStorage": np.dtype(np.int16),
    "CharStorage": np.dtype(np.int8),
    "ByteStorage": np.dtype(np.uint8),
    "BoolStorage": np.dtype(np.bool_),
}


def original_esrgan_keys(num_upsample: int) -> list[tuple[str, str]]:
    """The original ESRGAN layout (xinntao/ESRGAN's first RRDBNet, which 4x-UltraSharp, NMKD Siax and
    ESRGAN_4x keep) as (stored key pattern, module key) pairs, one per module of `RRDBNet`.

    The original is one `nn.Sequential`: conv, the shortcut around the RRDBs and their conv, then one
    (Upsample, conv, LeakyReLU) triple per 2x stage, hence its upsampling convs at 3, 6, 9.
    """
    n = num_upsample
    return [
        (r"model\.0", "conv_first"),
        (r"model\.1\.sub\.(\d+)\.RDB(\d)\.conv(\d)\.0", r"body.\1.rdb\2.conv\3"),
        (r"model\.1\.sub\.\d+", "conv_body"),
        *((rf"model\.{3 * i}", f"conv_up{i}") for i in range(1, n + 1)),
        (rf"model\.{3 * n + 2}", "conv_hr"),
        (rf"model\.{3 * n + 4}", "conv_last"),
    ]


def _rename(key: str, table: list[tuple[str, str]]) -> str:
    """A stored key's module key by `table`; a key no pattern matches stays as it is (and is then reported)."""
    for pattern, name in table:
        match = re.fullmatch(rf"{pattern}\.(weight|bias)", key)
        if match:
            return f"{match.expand(name)}.{match.group(match.re.groups)}"
    return key


def _sequence_length(keys: Iterable[str], prefix: str) -> int:
    """1 + the largest i of the keys `{prefix}.{i}.*` (spandrel's `get_seq_len`), 0 without any."""
    indices = [int(m.group(1)) for k in keys if (m := re.match(rf"{re.escape(prefix)}\.(\d+)\.", k))]
    return max(indices, default=-1) + 1


def _shape(shapes: dict[str, tuple[int, ...]], key: str, where: str) -> tuple[int, ...]:
    if key not in shapes:
        raise CheckpointError(f"{where}: looks like an upscaler but has no tensor {key}")
    return shapes[key]


def _esrgan_config(shapes: dict[str, tuple[int, ...]], where: str) -> ESRGANConfig:
    """An RRDBNet's config from its shapes, in BasicSR's names."""
    num_feat, in_channels = _shape(shapes, "conv_first.weight", where)[:2]
    image_channels = _shape(shapes, "conv_last.weight", where)[0]
    # BasicSR's scale-2 and scale-1 models pixel-unshuffle their input by 2 and 4.
    unshuffle = {1: 1, 4: 2, 16: 4}.get(in_channels // image_channels if in_channels % image_channels == 0 else 0)
    if unshuffle is None:
        raise CheckpointError(
            f"{where}: an ESRGAN whose first conv sees {in_channels} channels and whose last makes "
            f"{image_channels}, which no pixel-unshuffle (1, 2 or 4) explains"
        )
    return ESRGANConfig(
        image_channels=image_channels,
        num_feat=num_feat,
        num_block=_sequence_length(shapes, "body"),
        num_grow_ch=_shape(shapes, "body.0.rdb1.conv1.weight", where)[0],
        num_upsample=sum(f"conv_up{i}.weight" in shapes for i in range(1, len(shapes))),
        unshuffle=unshuffle,
    )


def _srvgg_config(shapes: dict[str, tuple[int, ...]], where: str) -> SRVGGConfig:
    num_feat, image_channels = _shape(shapes, "body.0.weight", where)[:2]
    last = _sequence_length(shapes, "body") - 1  # body.{2 * num_conv + 2}
    shuffled = _shape(shapes, f"body.{last}.weight", where)[0]  # image_channels * scale**2
    scale = round((shuffled / image_channels) ** 0.5)
    if image_channels * scale**2 != shuffled:
        raise CheckpointError(
            f"{where}: an SRVGGNetCompact whose last conv makes {shuffled} channels from {image_channels}-channel "
            "images, which is no pixel shuffle of them"
        )
    return SRVGGConfig(image_channels=image_channels, num_feat=num_feat, num_conv=(last - 2) // 2, scale=scale)


def detect(shapes: dict[str, tuple[int, ...]], where: str, dtype) -> tuple[nn.Module, dict[str, str]]:
    """The network a state dict holds, from its keys and shapes, and {stored key: module key}.

    Args:
      shapes: {stored key: shape} of every tensor.
      where: the file, for messages.
      dtype: the network's computation dtype.

    Raises:
      CheckpointError: the keys are no layout this module knows, or their shapes contradict it.
    """
    same = {key: key for key in shapes}
    if "model.0.weight" in shapes and "model.1.sub.0.RDB1.conv1.0.weight" in shapes:
        table = original_esrgan_keys((_sequence_length(shapes, "model") - 5) // 3)
        names = {key: _rename(key, table) for key in shapes}
        renamed = {names[key]: shape for key, shape in shapes.items()}
        return RRDBNet(_esrgan_config(renamed, where), dtype), names
    if "conv_first.weight" in shapes and "body.0.rdb1.conv1.weight" in shapes:
        return RRDBNet(_esrgan_config(shapes, where), dtype), same
    if "body.0.weight" in shapes and "body.1.weight" in shapes:
        return SRVGGNetCompact(_srvgg_config(shapes, where), dtype), same
    found = ", ".join(sorted(shapes)[:4]) or "no tensors"
    raise CheckpointError(
        f"{where}: not an upscaler this package runs (ESRGAN in the original or BasicSR layout, or "
        f"Real-ESRGAN's SRVGGNetCompact); its {len(shapes)} tensors begin {found}"
    )


class StateDictFile:
    """A state dict held in memory (a PyTorch file's), read through `SafetensorsFile`'s interface, so
    that `weights.load_stored` checks and converts it alike."""

    def __init__(self, path: Path, tensors: dict[str, np.ndarray]):
        self.path = Path(path)
        self._tensors = tensors
        self._order = {key: i for i, key in enumerate(tensors)}

    def keys(self) -> Iterable[str]:
        return self._tensors.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self._tensors[key].shape

    def dtype(self, key: str) -> np.dtype:
        return self._tensors[key].dtype

    def offset(self, key: str) -> int:
        return self._order[key]

    def tensor(self, key: str, buffer: bytearray | None = None) -> np.ndarray:
        return self._tensors[key]


class _StorageType:
    """What the unpickler gives for `torch.FloatStorage` and its kin: their dtype, and nothing callable."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype


def _rebuild_tensor(storage: np.ndarray, offset: int, size: tuple, stride: tuple, *_) -> np.ndarray:
    """`torch._utils._rebuild_tensor_v2`: a tensor as a strided view of its storage, bounds checked, copied."""
    if not all(isinstance(v, int) and v >= 0 for v in (offset, *size, *stride)):
        raise CheckpointError(f"a tensor of size {size}, stride {stride} at offset {offset} is malformed")
    if 0 in size:
        return np.zeros(size, storage.dtype)
    end = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
    if end > storage.size:
        raise CheckpointError(f"a tensor of size {size} reaches element {end} of a storage of {storage.size}")
    view = np.lib.stride_tricks.as_strided(storage[offset:], size, [s * storage.itemsize for s in stride])
    return np.ascontiguousarray(view)


class _StateDictUnpickler(pickle.Unpickler):
    """Unpickles `data.pkl` of a PyTorch zip file, allowing only what a state dict of tensors needs."""

    def __init__(self, archive: zipfile.ZipFile, prefix: str, where: str):
        super().__init__(archive.open(f"{prefix}data.pkl"))
        self.archive, self.prefix, self.where = archive, prefix, where
        order = archive.read(f"{prefix}byteorder").decode() if f"{prefix}byteorder" in archive.namelist() else "little"
        self.byteorder = {"little": "<", "big": ">"}[order]
        self.storages: dict[str, np.ndarray] = {}

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        raise CheckpointError(
            f"{self.where}: refusing to unpickle {module}.{name}: only plain state dicts of tensors are read "
            f"from PyTorch files; convert it once with {CONVERT}"
        )

    def persistent_load(self, pid):
        match pid:
            case ("storage", _StorageType(dtype=dtype), str(key), _, int(numel)):
                if key not in self.storages:
                    data = self.archive.read(f"{self.prefix}data/{key}")
                    if len(data) < numel * dtype.itemsize:
                        raise CheckpointError(f"{self.where}: storage {key} is truncated")
                    stored = np.frombuffer(data, dtype.newbyteorder(self.byteorder), numel)
                    self.storages[key] = stored.astype(dtype)
                return self.storages[key]
        raise CheckpointError(f"{self.where}: unexpected persistent record {pid!r:.80}")


def read_torch_zip(path: Path) -> dict[str, np.ndarray]:
    """A PyTorch zip file's state dict (unwrapped from `WRAPPERS`), as numpy arrays.

    Raises:
      CheckpointError: the pickle names anything but tensors and containers, or is no state dict.
    """
    where = str(path)
    with zipfile.ZipFile(path) as archive:
        pickles = [n for n in archive.namelist() if n.endswith("data.pkl")]
        if len(pickles) != 1:
            raise CheckpointError(f"{where}: a zip file, but not one PyTorch checkpoint ({len(pickles)} data.pkl)")
        prefix = pickles[0][: -len("data.pkl")]
        try:
            state = _StateDictUnpickler(archive, prefix, where).load()
        except CheckpointError:
            raise
        except Exception as e:  # a malformed pickle fails in many ways; each means the same here
            raise CheckpointError(f"{where}: unreadable PyTorch pickle ({type(e).__name__}: {e})") from e
    while isinstance(state, dict) and (wrapper := next((w for w in WRAPPERS if w in state), None)):
        state = state[wrapper]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, np.ndarray) for k, v in state.items()
    ):
        raise CheckpointError(f"{where}: holds no state dict of tensors; convert it once with {CONVERT}")
    return dict(state)


def open_file(path: Path) -> SafetensorsFile | StateDictFile:
    """An upscaler's weights: a safetensors file, or a PyTorch zip file read into memory.

    Raises:
      CheckpointError: no such file, or PyTorch's legacy (pre-1.6, not zip) format, which is read only by
        unpickling it whole.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    if zipfile.is_zipfile(path):
        return StateDictFile(path, read_torch_zip(path))
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: not a safetensors file nor a PyTorch zip file; convert it once with {CONVERT}")
    return SafetensorsFile(path)


def load(path: Path, dtype) -> tuple[nn.Module, dict]:
    """An upscaler file's network and its parameters, as numpy arrays on the host.

    Args:
      path: a `.safetensors`, `.pth` or `.pt` file.
      dtype: the parameters' and the computation's dtype.

    Raises:
      CheckpointError: the file is unreadable, of an unknown architecture, or its keys or shapes do not
        all match the network detected.
    """
    file = open_file(path)
    network, names = detect({key: tuple(file.shape(key)) for key in file.keys()}, str(path), dtype)
    stored: dict[str, StoredTensor] = {}
    for key in file.keys():
        if names[key] in stored:
            raise CheckpointError(f"{path}: {key} and {stored[names[key]].key} are the same tensor {names[key]}")
        stored[names[key]] = StoredTensor(file, key)
    sample = jax.ShapeDtypeStruct((1, 8, 8, network.config.image_channels), dtype)
    abstract = jax.eval_shape(network.init, jax.random.key(0), sample)["params"]
    return network, load_stored(stored, abstract, dtype=dtype, where=str(path))
