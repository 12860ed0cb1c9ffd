"""ControlNet Union (xinsir's ControlNet++) against diffusers' StableDiffusionXLControlNetUnionPipeline:
whole generations in several modes; the mode as a traced input; the checks on modes; which of a
folder's two weight sets loads, locally and from the Hub."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from diffusers import ControlNetUnionModel, StableDiffusionXLControlNetUnionPipeline
from PIL import Image

from fake_hub import FakeHub, fake_repo, hub_at
from reference import diffusers_images, randomize_, sdxl_pipeline
from sdxl.checkpoints import CheckpointError, controlnets
from sdxl.engine.compilation import CompileCounter
from sdxl.engine.controls import Control
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.request import Request
from sdxl.models.controlnet_union import CONTROL_MODES, control_mode

HEIGHT, WIDTH = 64, 96
STEPS = 5
PROMPTS = ["a lighthouse on a cliff", "two cats asleep on a sofa"]
NEGATIVES = ["grainy", "oversaturated, text"]
XINSIR = "xinsir/controlnet-union-sdxl-1.0"
PROMAX = "diffusion_pytorch_model_promax.safetensors"


def _union(ref, folder, seed: int, modes: int = 8) -> ControlNetUnionModel:
    """A random Union of `modes` modes for `ref`'s UNet, every layer random (the zero-initialised
    ones, the task embedding and the transformer too), saved to `folder`. Its transformer is as wide
    as the UNet's first block, as the model needs."""
    width = ref.unet.config.block_out_channels[0]
    layout = ControlNetUnionModel.from_unet(
        ref.unet, conditioning_embedding_out_channels=(4, 8, 8, 16), load_weights_from_unet=False
    )
    union = ControlNetUnionModel.from_config(
        layout.config, num_control_type=modes, num_trans_channel=width, num_proj_channel=width, num_trans_head=4
    )
    randomize_(union, seed)
    union.save_pretrained(folder, safe_serialization=True)
    return union


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdxl")
    ref = sdxl_pipeline(folder)
    union = _union(ref, folder / "union", seed=40)
    pipe = Pipeline.from_pretrained(folder, dtype="float32", max_steps=STEPS, controlnet=str(folder / "union"))
    return folder, ref, union, pipe


def _control_image(seed: int) -> Image.Image:
    """Depth-like: a gradient with a few flat blocks."""
    rng = np.random.default_rng(seed)
    pixels = np.broadcast_to(np.linspace(0, 200, WIDTH)[None, :, None], (HEIGHT, WIDTH, 3)).copy()
    for _ in range(3):
        top, left = rng.integers(0, HEIGHT - 16), rng.integers(0, WIDTH - 24)
        pixels[top : top + 16, left : left + 24] = rng.integers(0, 256)
    return Image.fromarray(pixels.astype(np.uint8))


def _latents(seed: int = 7) -> np.ndarray:
    return torch.randn((2, 4, HEIGHT // 8, WIDTH // 8), generator=torch.Generator().manual_seed(seed)).numpy()


def _ours(pipe, image, mode, **settings) -> np.ndarray:
    return pipe.generate(PROMPTS, NEGATIVES, steps=STEPS, guidance_scale=settings.pop("guidance_scale", 5.0),
                         height=HEIGHT, width=WIDTH, latents=_latents(), output_type="np", control_image=image,
                         control_mode=mode, **settings)


def _theirs(ref_pipe, image, mode: int, images=(0, 1), **settings) -> np.ndarray:
    """diffusers' images of PROMPTS with the same latents, the `images` given in one call."""
    i = list(images)
    return diffusers_images(
        ref_pipe, prompt=[PROMPTS[k] for k in i], negative_prompt=[NEGATIVES[k] for k in i], num_inference_steps=STEPS,
        guidance_scale=settings.pop("guidance_scale", 5.0), height=HEIGHT, width=WIDTH,
        latents=torch.from_numpy(_latents()[i]), control_image=[image], control_mode=[mode], **settings,
    )


@pytest.mark.oracle
def test_the_model_matches_diffusers_however_the_rows_are_grouped(sdxl):
    """Residuals for a batch of 4 rows whose transformer attends across 1, 2 or all 4 rows, as diffusers'
    model does for a batch of that many (float32 within 2e-5); the groupings differ by more than 1e-4."""
    _, ref, union, pipe = sdxl
    rng = np.random.default_rng(0)
    config = ref.unet.config
    pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    arrays = dict(sample=rng.standard_normal((4, 4, 8, 8)), cond=rng.random((4, 3, 64, 64)), text=rng.standard_normal(
        (4, pooled)), context=rng.standard_normal((4, 5, config.cross_attention_dim)), ids=rng.random((4, 6)) * 1000)
    ours_by_rows = {}
    for rows in (1, 2, 4):
        theirs = []
        for start in range(0, 4, rows):
            part = {name: torch.tensor(a[start : start + rows], dtype=torch.float32) for name, a in arrays.items()}
            control_type = torch.zeros(rows, 8).index_fill_(1, torch.tensor([3]), 1.0)
            added = {"text_embeds": part["text"], "time_ids": part["ids"]}
            with torch.no_grad():
                down, mid = union(part["sample"], torch.tensor(400.0), part["context"], [part["cond"]], control_type,
                                  [3], conditioning_scale=0.8, added_cond_kwargs=added, return_dict=False)
            theirs.append([r.numpy().transpose(0, 2, 3, 1) for r in (*down, mid)])
        theirs = [np.concatenate(parts) for parts in zip(*theirs)]
        model = pipe.controlnets[0].config.model()
        down, mid = model.apply(
            {"params": pipe.params["controlnets"][0]}, arrays["sample"].transpose(0, 2, 3, 1), np.full(4, 400.0),
            arrays["context"], arrays["cond"].transpose(0, 2, 3, 1), np.full(4, 0.8), np.full(4, 3, np.int32),
            text_embeds=arrays["text"], time_ids=arrays["ids"], rows_per_image=rows,
        )
        ours_by_rows[rows] = [np.asarray(r) for r in (*down, mid)]
        diff = max(np.abs(a - b).max() for a, b in zip(ours_by_rows[rows], theirs))
        print(f"Union residuals, {rows} row(s) per image: max abs diff vs diffusers {diff:.2e}")
        assert diff <= 2e-5
    for a, b in ((1, 2), (2, 4)):
        assert max(np.abs(x - y).max() for x, y in zip(ours_by_rows[a], ours_by_rows[b])) > 1e-4


@pytest.mark.oracle
def test_union_generations_match_diffusers_in_each_mode(sdxl):
    """Each image as diffusers renders it alone: its transformer attends across the rows of the batch
    (`sdxl.models.controlnet_union`'s docstring), which for one image are that image's own."""
    _, ref, union, pipe = sdxl
    ref_pipe = StableDiffusionXLControlNetUnionPipeline(**ref.components, controlnet=union)
    cases = [
        ("depth", {}),
        ("canny", dict(controlnet_conditioning_scale=0.7, control_guidance_end=0.6)),
        ("tile", dict(controlnet_conditioning_scale=1.3, control_guidance_start=0.4)),
        ("openpose", dict(guidance_scale=1.0, control_guidance_end=0.8)),  # no guidance: one row per image
    ]
    got = {}
    for name, settings in cases:
        mode, image = control_mode(name), _control_image(len(got))
        got[name] = _ours(pipe, image, name, **settings)
        expected = np.concatenate([_theirs(ref_pipe, image, mode, images=[k], **settings) for k in range(2)])
        diff = np.abs(got[name] - expected).max()
        print(f"Union mode {mode} ({name}) {settings}: max abs diff vs diffusers {diff:.2e}")
        assert got[name].shape == expected.shape and diff <= 1e-4
    together = _theirs(ref_pipe, _control_image(0), control_mode("depth"))
    print(f"diffusers' two images in one call differ from ours by {np.abs(got['depth'] - together).max():.2e}")
    assert np.abs(got["depth"] - got["canny"]).mean() > 1e-2  # it steers


@pytest.mark.compiles
def test_modes_are_traced_per_image(sdxl):
    """Changing the mode reuses the compiled program, and one call can mix modes, each image as alone."""
    _, _, _, pipe = sdxl
    image = _control_image(5)
    _ours(pipe, image, 0)
    with CompileCounter() as compiles:
        depth, segment = _ours(pipe, image, "depth"), _ours(pipe, image, 5)
        request = Request.from_prompt(PROMPTS, NEGATIVES, num_images=2, steps=STEPS, height=HEIGHT, width=WIDTH,
                                      noise=_latents().transpose(0, 2, 3, 1))
        controls = tuple((Control.of(image, WIDTH, HEIGHT, fit="resize", mode=mode),) for mode in ("depth", 5))
        mixed = pipe.render(dataclasses.replace(request, controls=controls), output_type="np").images
    assert compiles.count == 0
    assert np.abs(depth - segment).mean() > 1e-3
    np.testing.assert_allclose(mixed, np.stack([depth[0], segment[1]]), atol=1e-6)


def test_a_missing_or_unknown_mode_is_refused_in_a_sentence(sdxl, tmp_path):
    folder, ref, _, pipe = sdxl
    image = _control_image(1)
    refusals = [
        (None, "is a ControlNet Union: say what its control image is with a control mode .*0 openpose"),
        ("sketch", "a control mode is one of 0 openpose, 1 depth, 2 hed/pidi/scribble/ted/softedge"),
        (8, "a control mode is one of .*7 repaint/inpaint/outpaint"),
        ([1, 3], "several conditions to one ControlNet Union at once .* not supported"),
    ]
    for mode, message in refusals:
        with pytest.raises(ValueError, match=message):
            _ours(pipe, image, mode)
    _union(ref, tmp_path / "six", seed=41, modes=6)
    six = Pipeline.from_pretrained(folder, dtype="float32", max_steps=STEPS, controlnet=str(tmp_path / "six"))
    with pytest.raises(ValueError, match="knows 6 control modes .*5 segment\\), not mode 6 tile"):
        _ours(six, image, "tile")
    assert [control_mode(n) for n in ("openpose", "ted", "MLSD", "7")] == [0, 2, 3, 7]
    assert len(CONTROL_MODES) == 8


def _xinsir_folder(ref, folder):
    """xinsir's repo layout: the 6-mode model and config, and ProMax's 8-mode ones beside them."""
    _union(ref, folder, seed=42, modes=6)
    _union(ref, folder / "promax", seed=43, modes=8)
    (folder / "promax" / "diffusion_pytorch_model.safetensors").rename(folder / PROMAX)
    (folder / "promax" / "config.json").rename(folder / "config_promax.json")
    (folder / "promax").rmdir()
    return folder


def test_a_folder_with_both_weight_sets_loads_the_plain_one_and_promax_when_named(sdxl, tmp_path):
    _, ref, _, pipe = sdxl
    folder = _xinsir_folder(ref, tmp_path / "xinsir")
    plain = controlnets.resolve(str(folder), pipe.spec, dtype="float32")
    promax = controlnets.resolve(str(folder / PROMAX), pipe.spec, dtype="float32")
    assert plain.files == (folder / "diffusion_pytorch_model.safetensors",) and plain.config.num_control_type == 6
    assert promax.files == (folder / PROMAX,) and promax.config.num_control_type == 8
    assert promax.load(np.float32, np.asarray)["task_embedding"]["embedding"].shape == (8, 32)
    (folder / "config_promax.json").unlink()  # ProMax's weights with the 6-mode config: refused before loading
    with pytest.raises(CheckpointError, match="a ControlNet Union of 8 modes, but its config \\(config.json\\)"):
        controlnets.resolve(str(folder / PROMAX), pipe.spec, dtype="float32")
    values = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**values, "_class_name": "ControlNetXSAdapter"}))
    with pytest.raises(CheckpointError, match="only ControlNetModel and ControlNetUnionModel ControlNets"):
        controlnets.resolve(str(folder), pipe.spec, dtype="float32")


def test_the_hub_repo_fetches_the_plain_weights_and_the_promax_file_its_own_config(sdxl, tmp_path, monkeypatch):
    _, ref, _, pipe = sdxl
    folder = _xinsir_folder(ref, tmp_path / "xinsir")
    repo = fake_repo(["README.md"], {p.name: p.read_bytes() for p in folder.iterdir()})
    with FakeHub({XINSIR: repo}) as fake, hub_at(fake, tmp_path / "hf", monkeypatch):
        plain = controlnets.resolve(XINSIR, pipe.spec, dtype="float32")
        assert sorted(fake.downloaded(XINSIR)) == ["config.json", "diffusion_pytorch_model.safetensors"]
        promax = controlnets.resolve(f"{XINSIR}/{PROMAX}", pipe.spec, dtype="float32")
        assert "config_promax.json" in fake.downloaded(XINSIR)
    assert fake.errors == []
    assert plain.config.num_control_type == 6 and promax.config.num_control_type == 8
    assert promax.load(np.float32, np.asarray)["task_embedding"]["embedding"].shape == (8, 32)
