"""`python -m sdxl bench --topology`: the demo's programs compiled for a TPU slice on this CPU host by
libtpu's compiler (Mosaic's for the splash kernels), with their bytes and FLOPs on one chip."""

import json

import jax
import numpy as np
import pytest

pytest.importorskip("libtpu", reason="libtpu compiles for TPU slices on this host: pip install -r requirements-dev.txt")

from sdxl.__main__ import main  # noqa: E402
from sdxl.bench import ip_adapter, speed, topology  # noqa: E402
from sdxl.models import quantization  # noqa: E402

pytestmark = pytest.mark.tpu

CHIPS, IMAGES_PER_CHIP, SIZE = 4, 2, 64
# Inpainting, guided: the one program that reads every kind of input (prompts, an image, a mask), and
# whose stages run every model (the text encoders, the VAE's encoder and decoder, the UNet).
PROGRAM = "inpaint"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The CLI's report and Markdown for the tiny model on a v5e-4 (four compiles, about a minute here)."""
    out = tmp_path_factory.mktemp("topology")
    args = ["bench", "--model", "tiny", "--topology", "v5e:2x2", "--height", str(SIZE), "--width", str(SIZE)]
    args += ["--steps", "4", "--batch", str(CHIPS * IMAGES_PER_CHIP), "--programs", PROGRAM]
    assert main([*args, "--json", str(out / "report.json"), "--markdown", str(out / "BENCHMARKS.md")]) == 0
    return json.loads((out / "report.json").read_text()), (out / "BENCHMARKS.md").read_text()


def _program(report: dict, name: str, stage: str) -> dict:
    return next(p for p in report["programs"] if (p["program"], p["stage"]) == (name, stage))


def test_every_stage_compiles_for_the_slice_with_its_splash_kernels(compiled):
    """On this CPU host, attention is traced for the mesh's TPU chips: splash, which only Mosaic compiles."""
    report, _ = compiled
    assert report["compiled"] and report["device"] == "TPU v5 lite"
    assert (report["chips"], report["images_per_chip"]) == (CHIPS, IMAGES_PER_CHIP)
    assert [(p["program"], p["stage"]) for p in report["programs"]] == [
        (PROGRAM, stage) for stage in ("whole", "prepare", "denoise", "finish")
    ]
    # The UNet's attention, the VAE encoder's (in prepare) and decoder's.
    assert all(p["attention"] == ["splash"] for p in report["programs"])


def test_each_chip_holds_the_parameters_and_its_share_of_the_batch(compiled):
    report, _ = compiled
    params = topology.model_spec("tiny").abstract_params()
    param_bytes = sum(np.prod(p.shape) * 2 for p in jax.tree.leaves(params))  # bfloat16, replicated
    whole = _program(report, PROGRAM, "whole")
    # The arguments: every parameter, plus this chip's prompts, images and masks, and the schedule. TPU
    # layouts pad small arrays to whole tiles, which the tiny model's many biases feel.
    assert param_bytes <= whole["argument_bytes"] < 1.5 * param_bytes
    assert whole["output_bytes"] >= IMAGES_PER_CHIP * SIZE * SIZE * 3  # uint8 images
    # On the chip: the loaded weights, whichever program runs, and the largest program's own buffers.
    assert report["weight_bytes_per_chip"] == param_bytes
    assert report["bytes_per_chip"] == param_bytes + max(p["beside_weights_bytes"] for p in report["programs"])
    assert whole["beside_weights_bytes"] >= whole["output_bytes"] + whole["temp_bytes"] - whole["alias_bytes"]
    assert report["bytes_per_chip"] >= whole["bytes"] - (whole["argument_bytes"] - param_bytes)  # tiles' padding
    assert report["hbm_bytes_per_chip"] == 16 * 2**30 and report["fits"]


def test_unet_flops_per_step_are_one_chips_share_of_the_batch(compiled):
    """A step is one UNet evaluation on the chip's 2 latents per image (guidance): about the UNet's
    FLOPs at that batch as the host counts them. Were the batch not split it would be 4x; unguided, 0.5x.
    About: XLA counts the TPU program after its rewrites, and a splash kernel only by what it declares
    (0.79x the host's count here; 0.84x with XLA's attention)."""
    report, _ = compiled
    latent = SIZE // 8
    config = topology.model_spec("tiny").unet
    one_chip = speed.unet_flops(config, 2 * IMAGES_PER_CHIP, latent, latent, 77, jax.numpy.bfloat16)
    assert 0.65 < report["unet_flops_per_step"] / one_chip < 1.25


def test_the_markdown_row_says_it_was_compiled_not_run(compiled):
    _, markdown = compiled
    assert markdown.startswith(topology.TOPOLOGY_MARKDOWN_HEADER)
    assert "compiled for v5e:2x2 on this CPU, not run" in markdown


def test_a_refiner_shares_each_chip_with_the_model(tmp_path):
    """Loaded beside the model, a refiner's weights are on each chip whichever program runs, the
    components they share (the published pair's VAE and second text encoder) once; the refiner's own
    program runs from the model's latents."""
    out = tmp_path / "report.json"
    args = ["bench", "--model", "tiny", "--refiner", "tiny-refiner", "--topology", "v5e:2x2", "--height", str(SIZE),
            "--width", str(SIZE), "--batch", str(CHIPS), "--programs", topology.REFINE, "--stages", "whole"]
    assert main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(p["program"], p["stage"]) for p in report["programs"]] == [(topology.REFINE, "whole")]
    base, refiner = (topology.model_spec(m) for m in ("tiny", "tiny-refiner"))
    assert topology.shared_components(refiner, base) == report["shared_components"] == ["text_encoder_2", "vae"]
    refiner_unet = 2 * sum(leaf.size for leaf in jax.tree.leaves(refiner.abstract_params()["unet"]))
    assert topology.param_bytes(refiner, "bfloat16", base) == refiner_unet
    assert report["weight_bytes_per_chip"] == topology.param_bytes(base, "bfloat16") + refiner_unet
    assert report["compiled"] and _program(report, topology.REFINE, "whole")["attention"] == ["splash"]
    beside = max(p["beside_weights_bytes"] for p in report["programs"])
    assert report["bytes_per_chip"] == report["weight_bytes_per_chip"] + beside
    assert report["refiner"] == "tiny-refiner"


def _whole(tmp_path, program: str, *options: str) -> dict:
    """The report of one program of the tiny model compiled whole, one image per chip."""
    out = tmp_path / "report.json"
    args = ["bench", "--model", "tiny", "--topology", "v5e:2x2", "--height", str(SIZE), "--width", str(SIZE),
            "--batch", str(CHIPS), "--programs", program, "--stages", "whole", *options]
    assert main([*args, "--json", str(out), "--markdown", str(tmp_path / "BENCHMARKS.md")]) == 0
    return json.loads(out.read_text())


def test_the_hires_pass_compiles_at_the_upscaled_size_and_the_report_says_it(tmp_path):
    """A hires fix's second pass: the report's size is the first pass's, and says the pass's too."""
    report = _whole(tmp_path, "hires", "--hires-scale", "1.5")
    assert (report["height"], report["width"]) == (SIZE, SIZE)
    assert report["hires"] == {"scale": 1.5, "height": 96, "width": 96}
    assert report["compiled"] and report["largest_program"] == "hires whole"
    assert f"{SIZE}x{SIZE} (hires pass x1.5: 96x96), 1 |" in (tmp_path / "BENCHMARKS.md").read_text()


def test_an_ip_adapter_program_holds_the_adapters_weights_beside_the_models(tmp_path):
    """Text-to-image with an image prompt: the image encoder and the adapter's weights count on each chip."""
    report = _whole(tmp_path, "ip", "--ip-adapter", "plus")
    spec = topology.model_spec("tiny")
    adapter = sum(ip_adapter.param_bytes(ip_adapter.adapter_config("plus", spec), spec, "bfloat16").values())
    assert adapter > 0 and report["weight_bytes_per_chip"] == topology.param_bytes(spec, "bfloat16") + adapter
    assert report["compiled"] and report["largest_program"] == "ip whole"


def test_8_bit_weights_and_several_checkpoints_count_on_each_chip(tmp_path):
    """Two checkpoints of int8 weights: each chip holds both checkpoints' weights, a byte per weight
    the mode quantizes (and a float32 scale per output channel), and the program's own buffers once. The
    program takes the int8 weights as they are loaded, and holds no bfloat16 copy of them: its buffers
    beside the weights are the default mode's."""
    spec = topology.model_spec("tiny")
    report = _whole(tmp_path, "text", "--weights-dtype", "int8", "--checkpoints", "2")
    default = _whole(tmp_path, "text")
    unet = quantization.abstract(jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, np.float32),
                                              spec.abstract_params()["unet"]), "int8")
    quantized = [leaf for leaf in jax.tree.leaves(unet, is_leaf=lambda x: isinstance(x, quantization.Quantized))
                 if isinstance(leaf, quantization.Quantized)]
    saved = sum(leaf.values.size - 4 * leaf.scale.size for leaf in quantized)  # 2 bytes less, 4 more per scale
    assert quantized and topology.param_bytes(spec, "bfloat16", weights_dtype="int8") == (
        topology.param_bytes(spec, "bfloat16") - saved)
    assert report["weight_bytes_per_chip"] == 2 * topology.param_bytes(spec, "bfloat16", weights_dtype="int8")
    assert (report["checkpoints"], report["weights_dtype"]) == (2, "int8")
    whole, default_whole = _program(report, "text", "whole"), _program(default, "text", "whole")
    assert whole["argument_bytes"] < default_whole["argument_bytes"] - saved / 2
    assert whole["beside_weights_bytes"] <= default_whole["beside_weights_bytes"]
    assert report["bytes_per_chip"] == report["weight_bytes_per_chip"] + whole["beside_weights_bytes"]
    assert "2 checkpoints of tiny bfloat16, int8 weights" in (tmp_path / "BENCHMARKS.md").read_text()
    # int8 weights are converted before they are multiplied: no dot or convolution takes 8-bit operands.
    assert whole["products"] > 0 and whole["products_8_bit"] == default_whole["products_8_bit"] == 0


@pytest.mark.parametrize("mode", quantization.COMPUTE_MODES)
def test_the_compute_modes_multiply_on_8_bit_operands_on_the_chip(tmp_path, capsys, mode):
    """The program compiled for the TPU keeps both operands of a dot or convolution in 8 bits for each weight
    the mode keeps quantized (the tiny UNet's are read once, in the denoising loop's body), and no other."""
    spec = topology.model_spec("tiny")
    stored = quantization.abstract(jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, np.float32),
                                                spec.abstract_params()["unet"]), mode)
    read = jax.eval_shape(lambda tree: quantization.dequantized(tree, np.float32, mode), stored)
    kept = [leaf for leaf in jax.tree.leaves(read, is_leaf=lambda x: isinstance(x, quantization.Quantized))
            if isinstance(leaf, quantization.Quantized)]
    whole = _program(_whole(tmp_path, "text", "--weights-dtype", mode), "text", "whole")
    assert len(kept) > 20 and whole["products_8_bit"] == len(kept) < whole["products"]
    assert f"{len(kept)} of {whole['products']} dots and convolutions in 8 bits" in capsys.readouterr().out


def test_an_unknown_stage_is_refused_before_compiling(capsys):
    args = ["bench", "--model", "tiny", "--topology", "v5e:2x2", "--stages", "whole,decode"]
    assert main(args) == 2
    assert "unknown stages ['decode']; choose from whole, prepare, denoise, finish" in capsys.readouterr().err
