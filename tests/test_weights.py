import json
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors.numpy import load_file, save_file

from sdxl.checkpoints import ModelSpec, load_weights, random_models
from sdxl.checkpoints.weights import CheckpointError, SafetensorsFile
from sdxl.engine.mesh import place
from sdxl.engine.pipeline import Pipeline

UNET = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return random_models.write_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def folder(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "checkpoint")


def _edit_unet(folder, edit):
    tensors = load_file(folder / UNET)
    edit(tensors)
    save_file(tensors, folder / UNET)


def test_pristine_checkpoint_loads_with_exact_values(folder):
    pipe = Pipeline.from_pretrained(folder, dtype="float32")
    stored = load_file(folder / UNET)
    kernel = np.asarray(pipe.params["unet"]["conv_in"]["kernel"])
    np.testing.assert_array_equal(kernel, stored["conv_in.weight"].transpose(2, 3, 1, 0))
    linear = np.asarray(pipe.params["unet"]["time_embedding"]["linear_1"]["weight"])
    np.testing.assert_array_equal(linear, stored["time_embedding.linear_1.weight"])  # PyTorch's [out, in], as stored


def test_missing_key_is_named(folder):
    _edit_unet(folder, lambda t: t.pop("conv_in.bias"))
    with pytest.raises(CheckpointError, match=r"missing key: conv_in\.bias") as error:
        Pipeline.from_pretrained(folder, dtype="float32")
    assert "diffusion_pytorch_model.safetensors" in str(error.value)


def test_unexpected_key_is_named_with_its_file(folder):
    _edit_unet(folder, lambda t: t.update({"extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected key: extra\.weight in diffusion_pytorch_model\.safetensors"):
        Pipeline.from_pretrained(folder, dtype="float32")


def test_wrong_shape_is_named_with_both_shapes(folder):
    _edit_unet(folder, lambda t: t.update({"conv_out.bias": np.zeros(5, np.float32)}))
    with pytest.raises(CheckpointError, match=r"wrong shape: conv_out\.bias .*stored \(5,\), model needs \(4,\)"):
        Pipeline.from_pretrained(folder, dtype="float32")


def test_pickled_only_folder_is_refused_without_unpickling(folder):
    (folder / UNET).unlink()
    (folder / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(CheckpointError, match=r"unet: only pickled weights \(diffusion_pytorch_model\.bin\)"):
        Pipeline.from_pretrained(folder, dtype="float32")


def test_truncated_file_is_named(folder):
    path = folder / UNET
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"diffusion_pytorch_model\.safetensors: truncated"):
        Pipeline.from_pretrained(folder, dtype="float32")


def test_missing_model_index_is_explained(folder):
    (folder / "model_index.json").unlink()
    with pytest.raises(CheckpointError, match="no model_index.json"):
        Pipeline.from_pretrained(folder, dtype="float32")


def test_fp16_variant_is_preferred_for_bfloat16_and_plain_weights_for_float32(folder):
    tensors = load_file(folder / UNET)
    half = {k: (v + 1).astype(np.float16) for k, v in tensors.items()}  # distinguishable values
    save_file(half, folder / "unet" / "diffusion_pytorch_model.fp16.safetensors")
    full = Pipeline.from_pretrained(folder, dtype="float32").params["unet"]["conv_out"]["bias"]
    bf16 = Pipeline.from_pretrained(folder, dtype="bfloat16").params["unet"]["conv_out"]["bias"]
    np.testing.assert_array_equal(np.asarray(full), tensors["conv_out.bias"])
    np.testing.assert_allclose(np.asarray(bf16, np.float32), tensors["conv_out.bias"] + 1, atol=1e-2)


def test_bfloat16_tensors_are_read(tmp_path):
    import ml_dtypes

    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}}).encode()
    data = values.astype(ml_dtypes.bfloat16).tobytes()
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    np.testing.assert_array_equal(SafetensorsFile(path).tensor("w").astype(np.float32), values)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # read straight into place; read and converted
def test_cpu_devices_adopt_the_loaded_arrays_without_a_copy(pristine, dtype):
    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("batch",)), PartitionSpec())
    host_and_device = []

    def put(array):  # as Pipeline.from_pretrained places them
        host_and_device.append((array, place(array, replicated)))
        return host_and_device[-1][1]

    load_weights(pristine, ModelSpec.from_folder(pristine).abstract_params(), np.dtype(dtype), put)
    assert len(host_and_device) > 100
    for host, device in host_and_device:
        assert len(device.addressable_shards) == 4
        for shard in device.addressable_shards:  # one buffer, shared by the 4 devices
            assert shard.data.unsafe_buffer_pointer() == host.ctypes.data
