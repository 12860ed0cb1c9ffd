"""ESRGAN and SRVGGNetCompact against spandrel, from tiny random files in every layout; the PyTorch
file reader, and that it runs nothing a pickle asks for."""

import os
import pickle
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import spandrel
import torch
from safetensors.torch import save_file
from spandrel.architectures.Compact import Compact
from spandrel.architectures.ESRGAN import ESRGAN

from sdxl.checkpoints import CheckpointError
from sdxl.checkpoints import upscalers
from sdxl.models.esrgan import RRDBNet
from sdxl.models.srvgg import SRVGGNetCompact

# spandrel builds every RRDB with 32 growth channels, whatever the file says.
GROW = 32


def randomized(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The state dict with every tensor drawn afresh (biases and PReLU slopes too, which start as constants)."""
    generator = torch.Generator().manual_seed(seed)
    return {k: 0.1 * torch.randn(v.shape, generator=generator) for k, v in state.items()}


def basicsr_rrdbnet(
    in_channels: int, num_feat: int, num_block: int, grow: int = GROW, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A random state dict in BasicSR's RRDBNet keys (basicsr/archs/rrdbnet_arch.py), as Real-ESRGAN's
    x4plus (in_channels 3), x2plus (12: unshuffled by 2) and scale-1 models (48) store it."""
    convs = {"conv_first": (num_feat, in_channels)}
    for b in range(num_block):
        for r in range(1, 4):
            for i in range(1, 6):
                convs[f"body.{b}.rdb{r}.conv{i}"] = (grow if i < 5 else num_feat, num_feat + (i - 1) * grow)
    convs |= {name: (num_feat, num_feat) for name in ("conv_body", "conv_up1", "conv_up2", "conv_hr")}
    convs["conv_last"] = (3, num_feat)
    shapes = {f"{name}.weight": (o, i, 3, 3) for name, (o, i) in convs.items()}
    shapes |= {f"{name}.bias": (o,) for name, (o, _) in convs.items()}
    return randomized({k: torch.empty(s) for k, s in shapes.items()}, seed)


def original_esrgan(scale: int, num_feat: int = 8, num_block: int = 2) -> dict[str, torch.Tensor]:
    """A random state dict of the original ESRGAN layout (spandrel's RRDBNet keeps it)."""
    model = ESRGAN(in_nc=3, out_nc=3, num_filters=num_feat, num_blocks=num_block, scale=scale)
    return randomized(model.state_dict(), seed=scale)


def srvgg(num_feat: int = 8, num_conv: int = 2, scale: int = 4) -> dict[str, torch.Tensor]:
    model = Compact(num_in_ch=3, num_out_ch=3, num_feat=num_feat, num_conv=num_conv, upscale=scale)
    return randomized(model.state_dict(), seed=7)


def save(state: dict[str, torch.Tensor], path) -> str:
    """`state` as `path`: a safetensors file, or for .pth a torch.save'd file (Real-ESRGAN's wrapper kept
    where the name says "params_ema")."""
    if str(path).endswith(".safetensors"):
        save_file(state, str(path))
    else:
        torch.save({"params_ema": state} if "params_ema" in str(path) else state, str(path))
    return str(path)


def spandrel_output(path: str, image: np.ndarray) -> tuple[np.ndarray, int]:
    """spandrel's output for an [H, W, 3] float32 image, unclipped, and its scale."""
    descriptor = spandrel.ModelLoader().load_from_file(path)
    with torch.no_grad():
        out = descriptor.model(torch.from_numpy(image).permute(2, 0, 1)[None])
    return out[0].permute(1, 2, 0).numpy(), descriptor.scale


def our_output(path: str, image: np.ndarray) -> tuple[np.ndarray, object]:
    network, params = upscalers.load(path, jnp.float32)
    return np.asarray(jax.jit(network.apply)({"params": params}, image[None]))[0], network


LAYOUTS = {
    "original-4x": (lambda: original_esrgan(4), RRDBNet, 4),
    "original-2x": (lambda: original_esrgan(2, num_block=1), RRDBNet, 2),
    "original-8x": (lambda: original_esrgan(8, num_block=1), RRDBNet, 8),
    "x4plus": (lambda: basicsr_rrdbnet(3, 8, 2), RRDBNet, 4),
    "x2plus": (lambda: basicsr_rrdbnet(12, 8, 1), RRDBNet, 2),
    "x1": (lambda: basicsr_rrdbnet(48, 8, 1), RRDBNet, 1),
    "srvgg-x4": (lambda: srvgg(), SRVGGNetCompact, 4),
}


@pytest.mark.oracle
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_spandrel(layout, tmp_path, rng):
    make, network_type, scale = LAYOUTS[layout]
    path = save(make(), tmp_path / f"{layout}.safetensors")
    image = rng.random((24, 32, 3), dtype=np.float32)
    want, want_scale = spandrel_output(path, image)
    got, network = our_output(path, image)
    assert type(network) is network_type
    assert network.config.scale == want_scale == scale
    assert got.shape == want.shape == (24 * scale, 32 * scale, 3)
    error = np.abs(got - want).max()
    print(f"{layout}: max |ours - spandrel| = {error:.2e} (outputs up to {np.abs(want).max():.2f})")
    assert error < 1e-4


@pytest.mark.oracle
@pytest.mark.parametrize("layout", ["x2plus", "x1"])
def test_unshuffle_pads_odd_sizes_as_spandrel(layout, tmp_path, rng):
    """Real-ESRGAN's unshuffling models on a picture that is no multiple of the factor: reflect-padded,
    the output cropped."""
    make, _, scale = LAYOUTS[layout]
    path = save(make(), tmp_path / f"{layout}.safetensors")
    image = rng.random((21, 30, 3), dtype=np.float32)
    want, _ = spandrel_output(path, image)
    got, _ = our_output(path, image)
    assert got.shape == want.shape == (21 * scale, 30 * scale, 3)
    assert np.abs(got - want).max() < 1e-4


@pytest.mark.oracle
@pytest.mark.parametrize("name", ["original-4x.pth", "x4plus.params_ema.pth", "srvgg-x4.pt"])
def test_pytorch_files_match_spandrel(name, tmp_path, rng):
    """torch.save'd state dicts (Real-ESRGAN's wrapped in "params_ema") read without PyTorch."""
    make, _, _ = LAYOUTS[name.split(".")[0]]
    state = make()
    first = next(iter(state))
    state[first] = state[first].half()  # one float16 storage among the float32 ones
    path = save(state, tmp_path / name)
    image = rng.random((16, 20, 3), dtype=np.float32)
    want, _ = spandrel_output(path, image)
    got, _ = our_output(path, image)
    assert np.abs(got - want).max() < 1e-4


def test_detects_counts_from_shapes(tmp_path):
    path = save(basicsr_rrdbnet(12, 16, 3, grow=8), tmp_path / "x2.safetensors")
    network, params = upscalers.load(path, jnp.float32)
    c = network.config
    assert (c.num_feat, c.num_block, c.num_grow_ch, c.unshuffle, c.scale) == (16, 3, 8, 2, 2)
    assert params["body.2"]["rdb3"]["conv5"]["kernel"].shape == (3, 3, 16 + 4 * 8, 16)
    network, _ = upscalers.load(save(srvgg(num_feat=12, num_conv=3, scale=2), tmp_path / "c.safetensors"), jnp.float32)
    assert (network.config.num_feat, network.config.num_conv, network.config.scale) == (12, 3, 2)


def test_original_layout_maps_to_basicsr_names():
    table = upscalers.original_esrgan_keys(2)
    pairs = {
        "model.0.weight": "conv_first.weight",
        "model.1.sub.22.RDB3.conv5.0.bias": "body.22.rdb3.conv5.bias",
        "model.1.sub.23.weight": "conv_body.weight",
        "model.3.weight": "conv_up1.weight",
        "model.6.bias": "conv_up2.bias",
        "model.8.weight": "conv_hr.weight",
        "model.10.weight": "conv_last.weight",
    }
    assert {key: upscalers._rename(key, table) for key in pairs} == pairs
    assert upscalers._rename("model.7.weight", upscalers.original_esrgan_keys(1)) == "conv_last.weight"


def test_unknown_keys_are_refused_in_one_sentence(tmp_path):
    path = save({"encoder.weight": torch.zeros(2, 2)}, tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match=r"not an upscaler this package runs .* 1 tensors begin encoder\.weight"):
        upscalers.load(path, jnp.float32)


def test_missing_and_extra_tensors_are_reported(tmp_path):
    state = original_esrgan(4)
    del state["model.1.sub.1.RDB2.conv3.0.bias"]
    state["model.1.sub.0.RDB1.conv1x1.weight"] = torch.zeros(GROW, 8, 1, 1)  # ESRGAN+, which we do not run
    with pytest.raises(CheckpointError) as error:
        upscalers.load(save(state, tmp_path / "broken.safetensors"), jnp.float32)
    assert "missing key: body.1.rdb2.conv3.bias" in str(error.value)
    assert "unexpected key: model.1.sub.0.RDB1.conv1x1.weight" in str(error.value)


class RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def torch_zip(path, payload: bytes) -> str:
    """A file laid out as torch.save's zip, with `payload` as its pickle."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", payload)
        archive.writestr("archive/version", "3\n")
    return str(path)


def test_a_pickle_that_runs_a_command_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    payload = pickle.dumps({"params_ema": {"conv_first.weight": RunsACommand(marker)}})
    path = torch_zip(tmp_path / "evil.pth", payload)
    with pytest.raises(CheckpointError, match=r"refusing to unpickle (posix|nt|os)\.system.*weights_only=True"):
        upscalers.load(path, jnp.float32)
    assert not marker.exists()
    pickle.loads(payload)  # the same pickle, unpickled as torch.load(weights_only=False) would, runs it
    assert marker.exists()


def test_whole_modules_and_legacy_files_are_refused(tmp_path):
    module = ESRGAN(in_nc=3, out_nc=3, num_filters=8, num_blocks=1, scale=2)
    torch.save(module, tmp_path / "module.pth")
    with pytest.raises(CheckpointError, match=r"refusing to unpickle spandrel\..*convert it once with python -c"):
        upscalers.load(tmp_path / "module.pth", jnp.float32)
    torch.save(module.state_dict(), tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match=r"not a safetensors file nor a PyTorch zip file; convert it once"):
        upscalers.load(tmp_path / "legacy.pth", jnp.float32)


def test_the_pickle_reader_keeps_views_dtypes_and_strides(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"rows": base[1:3], "transposed": base.t(), "half": base.half(), "bf16": base.bfloat16()[:, ::2]}
    torch.save(state, tmp_path / "views.pth")
    got = upscalers.read_torch_zip(tmp_path / "views.pth")
    for key, tensor in state.items():
        assert got[key].dtype.name == str(tensor.dtype).removeprefix("torch.").replace("half", "float16")
        np.testing.assert_array_equal(got[key].astype(np.float32), tensor.float().numpy())
