"""The Gradio demo end to end: `python app.py` in a subprocess, driven by gradio_client and a browser.

Everything runs on 127.0.0.1 with 4 forced CPU devices and the Hub switched off, so the default SDXL
model falls back to the built-in tiny one (native 128x128, presets 128x128, 144x112, 112x144, 160x96,
96x160; 4 images per request, one per device).

Each server is launched with the fewest images per core its tests need (--max-images-per-core): at launch a
demo compiles, in the background, every batch size up to that bound, and on this 2-core machine those compiles
take the CPU from the tests.
"""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError
from gradio_client.utils import Status, StatusUpdate
from PIL import Image, PngImagePlugin
from safetensors.numpy import load_file, save_file

from sdxl.serving.models import Model
from sdxl.bench.soak import free_port, running_app
from sdxl.checkpoints import lora, resolve
from sdxl.checkpoints.random_models import write_checkpoint, write_controlnet, write_ip_adapter, write_upscaler

# gradio_client reads these in this process: no telemetry calls to the Hub from the tests.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
STARTUP_TIMEOUT = 300  # seconds: load + compile + warm-up on a slow 2-core machine
CALL_TIMEOUT = 180  # seconds for one request, compilation of a new size included
# Seconds the browser tests give a page's round trip (a queued event such as Reuse, a layout): CI's two cores,
# shared with the other test worker, made 30 too few (a pass costs none of it: a wait ends once its condition holds).
PAGE_TIMEOUT = 90
COMPARE_SEEDS = "One prompt, consecutive seeds"  # app.COMPARE_SEEDS; not imported, the app is a subprocess
COMPARE_MODELS = "One prompt and seed, each model"  # app.COMPARE_MODELS
COMPARE_PROMPTS = "One prompt per line, same seed"  # app.COMPARE_PROMPTS
# A loaded server, as the page sees it: every request that carries event data (a gallery's select, queued or not)
# reaches it two seconds late, after a click sent right behind it.
LATE_SELECTS = """(() => {
  const send = window.fetch.bind(window);
  window.fetch = async (url, init) => {
    if (String(init?.body).includes('"event_data":{')) {
      await new Promise((resolve) => setTimeout(resolve, 2000));
    }
    return send(url, init);
  };
})();"""
FAST = dict(prompt="a lighthouse at dusk", steps=3)  # steps are a runtime input: no recompilation

_servers: list["Server"] = []  # every server this module started, for the failure log


@dataclasses.dataclass
class Server:
    process: subprocess.Popen
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _app_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SDXL_", "GRADIO_SERVER_"))}
    return env | dict(
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(tmp / "hf-cache"),  # empty: the default model is surely not there, even if it is in ~/.cache
        GRADIO_TEMP_DIR=str(tmp / "gradio"),
        GRADIO_ANALYTICS_ENABLED="False",
        PYTHONUNBUFFERED="1",
    )


@contextlib.contextmanager
def serve(tmp: Path, cache_dir: Path, *args: str, images_per_core: int = 1):
    """Runs `python app.py ARGS --max-images-per-core IMAGES_PER_CORE` until the block ends; yields once the page
    answers."""
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / "server.log"
    args = ("--cache-dir", str(cache_dir), *args, "--max-images-per-core", str(images_per_core))
    with running_app(list(args), log, _app_env(tmp), STARTUP_TIMEOUT) as (process, url):
        server = Server(process, url, log)
        _servers.append(server)
        yield server


@pytest.fixture(scope="module")
def cache_dir(xla_cache) -> Path:
    """The session's compilation cache (conftest) for every server: the NaN server reuses the main one's programs,
    and the default demo those of test_soak's."""
    return xla_cache


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache_dir):
    """The demo with the random tiny model (fast, and its sizes are many), one LoRA for it, off
    (scale 0) unless a request turns it up, the tiny refiner, a random ControlNet that steers the
    requests that give a control image, two random IP-Adapters that the requests with an image prompt
    steer through, and a random 2x model upscaler. Up to 2 images per core: requests merge into batches of 8
    (its one background-compiled batch size beyond a request's 4), and a grid of 8 cells is one call."""
    tmp = tmp_path_factory.mktemp("app")
    spec = resolve("tiny").spec
    style = lora.write_random(tmp / "style.safetensors", spec)
    controlnet = write_controlnet(tmp / "tiny-canny", spec)
    adapters = write_ip_adapter(tmp / "ip", spec.unet, kinds=("plain", "plus")) / "sdxl_models"
    upscaler = write_upscaler(tmp / "tiny-x2.safetensors")
    with serve(tmp, cache_dir, "--model", "tiny", "--lora", f"{style}:0", "--refiner", "tiny-refiner",
               "--controlnet", str(controlnet), "--upscaler", str(upscaler), "--ip-adapter",
               str(adapters / "ip-adapter.safetensors"), "--ip-adapter",
               str(adapters / "ip-adapter-plus.safetensors"), images_per_core=2) as running:
        yield running


@pytest.fixture(scope="module")
def shapes_server(tmp_path_factory, cache_dir):
    """The demo as started by default: no --model, so the SDXL repo id falls back to `shapes` offline. One image
    per core, all its tests ask for."""
    with serve(tmp_path_factory.mktemp("shapes-app"), cache_dir) as running:
        yield running


@pytest.fixture(scope="module")
def models_server(tmp_path_factory, cache_dir):
    """The demo serving two models, as users compare checkpoints: the built-in shapes model (the default) and
    the random tiny one, taking turns on the devices (the other waits in host memory). One image per core."""
    with serve(tmp_path_factory.mktemp("models-app"), cache_dir, "--model", "shapes", "--model", "tiny",
               "--models-on-devices", "1") as running:
        yield running


@pytest.fixture(autouse=True)
def _server_log_on_failure(request):
    """Prints what the servers logged during a failed test (pytest shows it with the failure): that alone, so that
    an excerpt of a CI log still holds the failure's own lines, which earlier tests' refusals had pushed out."""
    failed_before = request.session.testsfailed  # counts the call phase before teardown runs
    logged = {running.log: len(running.output()) for running in _servers}
    yield
    if request.session.testsfailed > failed_before:
        for running in _servers:
            during = running.output()[logged.get(running.log, 0):]
            if during:
                print(f"\n----- output of {running.url} ({running.log}) during the test -----\n{during[-8000:]}")


@pytest.fixture(scope="module")
def downloads(tmp_path_factory) -> str:
    """Where gradio_client saves the images it receives (its default is a shared /tmp/gradio)."""
    return str(tmp_path_factory.mktemp("downloads"))


@pytest.fixture(scope="module")
def client(server, downloads) -> Client:
    return Client(server.url, verbose=False, download_files=downloads)


def _generate(client: Client, **kwargs) -> tuple[list[dict], str]:
    return client.submit(**(FAST | kwargs), api_name="/generate").result(timeout=CALL_TIMEOUT)


def _pixels(gallery: list[dict]) -> list[np.ndarray]:
    return [np.asarray(Image.open(item["image"]).convert("RGB")) for item in gallery]


def _assert_serving(client: Client) -> None:
    gallery, status = _generate(client, seed=1)
    assert len(gallery) == 4 and "4 images" in status, status


@pytest.mark.server
def test_startup_line_and_fallback_notice(shapes_server):
    output = shapes_server.output()
    startup = (r"^startup: load [\d.]+ s, compile [\d.]+ s \(\d+ of \d+ programs from the cache\), warm-up [\d.]+ s, "
               r"total [\d.]+ s$")
    assert re.search(startup, output, re.M), output
    assert "Running on local URL" in output
    with urllib.request.urlopen(shapes_server.url + "config", timeout=10) as response:
        config = response.read().decode()
    notice = "Showing the built-in shapes model instead"
    assert notice in config and '"elem_id":"model-notice"' in config
    assert "HF_HUB_OFFLINE=1" in config and "stabilityai/stable-diffusion-xl-base-1.0" in config
    assert "a large yellow triangle at the top on a purple background" in config  # its examples
    with urllib.request.urlopen(shapes_server.url, timeout=10) as response:
        assert notice in response.read().decode()


@pytest.mark.server
def test_generate_preset_size_with_png_parameters(client):
    prompt = "a red fox sleeping in fresh snow"
    gallery, status = _generate(client, prompt=prompt, seed=1234, width=144, height=112)
    assert len(gallery) == 4
    assert status.startswith("4 images in "), status
    for i, item in enumerate(gallery):
        image = Image.open(item["image"])
        assert image.format == "PNG" and image.size == (144, 112)
        parameters = image.info["parameters"]
        assert parameters.startswith(prompt + "\n"), parameters
        assert f"Seed: 1234, Image index: {i}, Size: 144x112, Model: tiny" in parameters, parameters
        assert item["caption"].startswith(f"seed 1234 · image {i} · "), item["caption"]
    pixels = _pixels(gallery)
    assert all(p.std() > 0 for p in pixels)
    assert len({p.tobytes() for p in pixels}) == 4, "the 4 images of a request must differ (index in the noise)"


@pytest.mark.server
def test_same_seed_same_images_other_seed_different(client):
    first = _pixels(_generate(client, seed=7)[0])
    again = _pixels(_generate(client, seed=7)[0])
    other = _pixels(_generate(client, seed=8)[0])
    for a, b, c in zip(first, again, other, strict=True):
        np.testing.assert_array_equal(a, b)
        assert np.abs(a.astype(int) - c.astype(int)).mean() > 1, "another seed must give other images"


@pytest.mark.server
def test_compare_consecutive_seeds(client):
    gallery, status = client.submit(
        mode=COMPARE_SEEDS, prompts="a castle floating above the clouds", seed=41, num_seeds=3, steps=3,
        api_name="/compare",
    ).result(timeout=CALL_TIMEOUT)
    assert status.startswith("3 images in "), status
    # Captions say what differs: the seed (every image is image 0 of its seed), then the core.
    assert [item["caption"] for item in gallery] == ["seed 41 · CPU 0", "seed 42 · CPU 1", "seed 43 · CPU 2"]
    for seed, item in zip((41, 42, 43), gallery):
        assert f"Seed: {seed}, Image index: 0," in Image.open(item["image"]).info["parameters"]
    assert len({p.tobytes() for p in _pixels(gallery)}) == 3


@pytest.mark.server
def test_a_launched_lora_applies_at_the_scale_a_request_gives(client):
    plain, _ = _generate(client, seed=5)
    styled, status = _generate(client, seed=5, lora_style=0.75)
    assert np.abs(_pixels(plain)[0].astype(int) - _pixels(styled)[0]).mean() > 5
    assert 'LoRAs: "style:0.75"' in Image.open(styled[0]["image"]).info["parameters"]
    assert "LoRAs" not in Image.open(plain[0]["image"]).info["parameters"]
    again, _ = _generate(client, seed=5)  # turning it off restores the base weights exactly
    assert [p.tobytes() for p in _pixels(again)] == [p.tobytes() for p in _pixels(plain)]


@pytest.mark.server
def test_uploads_are_bounded(server):
    """Gradio's upload endpoint refuses files over 8 MB, a large phone photo (issue 21, hole 4)."""
    def upload(size: int) -> int:
        boundary = "sdxlboundary"
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"x.bin\"\r\n"
                f"Content-Type: application/octet-stream\r\n\r\n")
        body = head.encode() + b"x" * size + f"\r\n--{boundary}--\r\n".encode()
        request = urllib.request.Request(server.url + "gradio_api/upload", data=body, method="POST",
                                         headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code

    assert upload(1000) == 200
    assert upload(9 * 2**20) == 413


def _picture(path: Path, width: int = 160, height: int = 120) -> str:
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[:, : width // 2] = (220, 40, 30)
    Image.fromarray(pixels).save(path)
    return str(path)


@pytest.mark.server
def test_image_to_image_and_inpainting_over_http(client, tmp_path):
    """An upload of another size is fitted to the nearest preset (and says so); a mask inpaints; the
    PNGs record the strength."""
    from gradio_client import handle_file

    # 160x150 is nearest the square preset: its programs compile in the background from the launch.
    picture = handle_file(_picture(tmp_path / "in.png", 160, 150))
    mask = np.zeros((150, 160), np.uint8)
    mask[20:100, 40:140] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    common = dict(prompt="a lighthouse", steps=4, seed=2, image=picture, api_name="/image_to_image")
    edited, status = client.submit(**common, mask=None, strength=0.5).result(timeout=CALL_TIMEOUT)
    assert len(edited) == 4 and "cropped and resized to 128x128" in status, status
    first = Image.open(edited[0]["image"])
    assert first.size == (128, 128) and "Denoising strength: 0.5" in first.info["parameters"]
    inpainted, _ = client.submit(**common, mask=handle_file(str(tmp_path / "mask.png")), strength=0.5).result(
        timeout=CALL_TIMEOUT)
    assert np.abs(_pixels(inpainted)[0].astype(int) - _pixels(edited)[0]).max() > 10, "the mask must matter"


@pytest.mark.server
def test_bad_uploads_are_named_and_the_server_keeps_serving(client, tmp_path):
    """A decompression bomb (a small PNG that claims 400 megapixels), a 16-bit image, an empty mask,
    a strength of 0, no image, and a path outside Gradio's uploads: each one sentence."""
    from gradio_client import handle_file

    bomb = tmp_path / "bomb.png"
    Image.new("1", (20_000, 20_000)).save(bomb)  # a few kilobytes
    deep = tmp_path / "deep.png"
    Image.fromarray(np.zeros((112, 144), np.uint16)).save(deep)
    Image.fromarray(np.zeros((120, 160), np.uint8)).save(tmp_path / "empty-mask.png")
    picture = handle_file(_picture(tmp_path / "in.png"))
    cases = [
        (dict(image=handle_file(str(bomb))), "the image is far too large: 16.8 megapixels at most are read"),
        (dict(image=handle_file(str(deep))), "16-bit or float"),
        (dict(image=picture, mask=handle_file(str(tmp_path / "empty-mask.png"))), "the mask is empty"),
        (dict(image=picture, strength=0), "leaves no step to run"),
        (dict(image=None), "upload an image to start from"),
    ]
    for kwargs, message in cases:
        with pytest.raises(AppError) as error:
            client.submit(**(dict(prompt="a fox", steps=4, mask=None) | kwargs), api_name="/image_to_image").result(
                timeout=CALL_TIMEOUT)
        assert message in str(error.value), (kwargs, error.value)
    outside = {"path": "/etc/passwd", "meta": {"_type": "gradio.FileData"}}
    with pytest.raises(Exception) as error:
        client.submit(prompt="a fox", image=outside, mask=None, api_name="/image_to_image").result(
            timeout=CALL_TIMEOUT)
    assert "root:" not in str(error.value)
    _assert_serving(client)


def _control_picture(path: Path) -> str:
    """A red square with a white one inside, on black: Canny finds both squares' edges."""
    pixels = np.zeros((128, 128, 3), np.uint8)
    pixels[24:104, 24:104] = (200, 60, 60)
    pixels[48:80, 48:80] = 255
    Image.fromarray(pixels).save(path)
    return str(path)


@pytest.mark.server
def test_a_control_image_steers_over_http_and_a_grid_over_its_scale_is_one_call(client, tmp_path):
    """/generate with a control image: its PNGs record the ControlNet as A1111's extension does; a grid
    over the scale is one device call whose scale-0 cell is the unsteered image; a file that is no
    image is refused with a sentence."""
    from gradio_client import handle_file

    control = handle_file(_control_picture(tmp_path / "control.png"))
    plain, _ = _generate(client, seed=5)
    steered, status = _generate(client, seed=5, control_image=control, control_scale=0.7, control_end=0.8)
    assert len(steered) == 4 and status.startswith("4 images in "), status
    parameters = Image.open(steered[0]["image"]).info["parameters"]
    assert ('ControlNet 0: "Module: canny, Model: tiny-canny, Weight: 0.7, Threshold A: 100, Threshold B: 200, '
            'Guidance Start: 0, Guidance End: 0.8"') in parameters, parameters
    assert np.abs(_pixels(steered)[0].astype(int) - _pixels(plain)[0]).mean() > 2, "the control image must steer"
    _, cells, status = client.submit(**FAST, seed=5, control_image=control, x_axis="control_scale",
                                     x_values="0, 0.7", y_axis="", y_values="", control_end=0.8,
                                     api_name="/grid").result(timeout=CALL_TIMEOUT)
    assert "2 images" in status and "1 device call" in status, status
    off, on = _pixels(cells)
    assert np.abs(off.astype(int) - _pixels(plain)[0]).max() <= 2, "scale 0 steers nothing"
    assert np.abs(on.astype(int) - _pixels(steered)[0]).max() <= 2, "a cell is image 0 of /generate"
    (tmp_path / "not-an-image.png").write_text("hello")
    with pytest.raises(AppError, match="the control image: cannot read the image"):
        _generate(client, control_image=handle_file(str(tmp_path / "not-an-image.png")))
    with pytest.raises(AppError, match="preprocessor must be one of canny, none, got 'sobel'"):
        _generate(client, control_image=control, control_preprocessor="sobel")


@pytest.mark.server
def test_an_image_prompt_steers_over_http_and_a_grid_over_its_scale_is_one_call(client, tmp_path):
    """/generate with an image prompt for the second IP-Adapter: its PNGs record it as A1111's extension
    records an IP-Adapter unit; a grid over the scale is one call whose scale-0 cell is the unsteered image."""
    from gradio_client import handle_file

    picture = handle_file(_control_picture(tmp_path / "prompt.png"))
    plain, _ = _generate(client, seed=5)
    steered, status = _generate(client, seed=5, ip_adapter_image=picture, ip_adapter="ip-adapter-plus",
                                ip_adapter_scale=1.5)
    assert len(steered) == 4 and status.startswith("4 images in "), status
    parameters = Image.open(steered[0]["image"]).info["parameters"]
    assert 'ControlNet 0: "Module: ip-adapter_clip_h, Model: ip-adapter-plus, Weight: 1.5,' in parameters, parameters
    assert np.abs(_pixels(steered)[0].astype(int) - _pixels(plain)[0]).mean() > 1, "the picture must steer"
    _, cells, status = client.submit(**FAST, seed=5, ip_adapter_image=picture, x_axis="ip_adapter_scale",
                                     x_values="0, 1.5", y_axis="", y_values="", ip_adapter="ip-adapter-plus",
                                     api_name="/grid").result(timeout=CALL_TIMEOUT)
    assert "2 images" in status and "1 device call" in status, status
    off, on = _pixels(cells)
    assert np.abs(off.astype(int) - _pixels(plain)[0]).max() <= 2, "scale 0 steers nothing"
    assert np.abs(on.astype(int) - _pixels(steered)[0]).max() <= 2, "a cell is image 0 of /generate"
    with pytest.raises(AppError, match="IP-Adapter must be one of ip-adapter, ip-adapter-plus"):
        _generate(client, ip_adapter_image=picture, ip_adapter="faceid")


@pytest.mark.server
def test_previews_stream_to_a_client_that_asks_and_predict_gets_the_result(client):
    job = client.submit(prompt="a lighthouse", steps=40, seed=4, api_name="/generate")
    gallery, status = job.result(timeout=CALL_TIMEOUT)
    outputs = job.outputs()
    previews = [gallery for gallery, _ in outputs[:-1]]
    assert previews and all(item["caption"].startswith("preview · step") for g in previews for item in g), outputs
    assert Image.open(previews[-1][0]["image"]).size == (16, 16)  # the latents' size: 128 / 8
    assert len(gallery) == 4 and gallery[0]["caption"].startswith("seed 4") and "4 images" in status
    assert client.predict(prompt="a lighthouse", steps=3, api_name="/generate")[1].startswith("4 images")


@pytest.mark.server
def test_the_refiner_finishes_images_when_switched_on(client):
    plain, _ = _generate(client, seed=6)
    refined, status = _generate(client, seed=6, refine=True, refine_from=0.6)
    assert "4 images" in status
    assert "Refiner: tiny-refiner, Refiner switch at: 0.6" in Image.open(refined[0]["image"]).info["parameters"]
    assert np.abs(_pixels(refined)[0].astype(int) - _pixels(plain)[0]).max() > 10


@pytest.mark.server
def test_a_hires_fix_renders_bigger_images_and_names_itself(client):
    # Both at 2x: one second pass's programs (256x256) serve the latents' upscale and the picture's.
    gallery, status = _generate(client, seed=7, hires=True, hires_scale=2, hires_steps=1, hires_strength=0.5)
    assert "4 images" in status
    image = Image.open(gallery[0]["image"])
    assert image.size == (256, 256)
    assert "Denoising strength: 0.5, Hires upscale: 2, Hires steps: 1, Hires upscaler: Latent" in image.info[
        "parameters"]
    gallery, _ = _generate(client, seed=7, hires=True, hires_upscaler="tiny-x2", hires_scale=2, hires_steps=1)
    assert Image.open(gallery[0]["image"]).size == (256, 256), "the launched model upscaler"


@pytest.mark.server
def test_the_upscale_tab_upscales_an_upload_and_refuses_bad_factors(client, tmp_path):
    from gradio_client import handle_file

    picture = handle_file(_picture(tmp_path / "in.png"))
    upscaled, said = client.predict(picture, "tiny-x2", 2, api_name="/upscale")
    assert Image.open(upscaled).size == (320, 240) and said.startswith("160x120 to 320x240 with tiny-x2 in "), said
    lanczos, _ = client.predict(picture, "Lanczos", 1.5, api_name="/upscale")
    assert Image.open(lanczos).size == (240, 180)
    with pytest.raises(AppError, match="upscale factor must be a number from 1 to 4, got 9"):
        client.predict(picture, "Lanczos", 9, api_name="/upscale")
    with pytest.raises(AppError, match="upload an image to upscale"):
        client.predict(None, "Lanczos", 2, api_name="/upscale")


@pytest.mark.server
def test_a_grid_is_one_device_call_with_its_cells_in_order(client):
    """prompt x seed: 8 cells (the most this server renders at once) in one call; a steps axis is one call per
    value and never recompiles; the grid image holds the cells, in order, under their labels; its PNG has every
    cell's parameters."""
    sheet, cells, status = client.submit(
        prompt="a red cube", x_axis="seed", x_values="1-4", y_axis="prompt", y_values="red, blue", steps=3,
        api_name="/grid").result(timeout=CALL_TIMEOUT)
    assert status.startswith("8 images in ") and "1 device call on" in status, status
    grid_image = Image.open(sheet)
    parameters = json.loads(grid_image.info["grid"])
    assert len(parameters) == 8 and parameters[4].startswith("a blue cube\n") and "Seed: 1," in parameters[4]
    pixels = np.asarray(grid_image.convert("RGB"))
    width, height = 128, 128
    left, top = pixels.shape[1] - 4 * width, pixels.shape[0] - 2 * height
    for i, cell in enumerate(_pixels(cells)):
        row, column = divmod(i, 4)
        np.testing.assert_array_equal(pixels[top + row * height:top + (row + 1) * height,
                                             left + column * width:left + (column + 1) * width], cell)
    single, _ = _generate(client, prompt="a blue cube", seed=1, steps=3)
    assert np.abs(_pixels(single)[0].astype(int) - _pixels(cells)[4]).max() <= 1, "a cell is image 0 of /generate"
    _, _, status = client.submit(prompt="a red cube", x_axis="steps", x_values="2, 4", y_axis="", y_values="",
                                 api_name="/grid").result(timeout=CALL_TIMEOUT)
    assert "2 device calls" in status and "compiling" not in status, status
    with pytest.raises(AppError, match="seed axis: seed must be an integer"):
        client.submit(prompt="a cube", x_axis="seed", x_values="1, x", api_name="/grid").result(timeout=CALL_TIMEOUT)
    with pytest.raises(AppError, match="65 cells; at most 64"):
        client.submit(prompt="a cube", x_axis="seed", x_values="1-13", y_axis="steps", y_values="1-5",
                      api_name="/grid").result(timeout=CALL_TIMEOUT)


@pytest.mark.server
def test_one_image_is_counted_in_the_singular(client):  # what a one-core demo says every time
    _, status = client.submit(
        mode=COMPARE_SEEDS, prompts="a castle", seed=1, num_seeds=1, steps=1, api_name="/compare"
    ).result(timeout=CALL_TIMEOUT)
    assert status.startswith("1 image in "), status


def _bad(endpoint: str, message: str, **kwargs):
    label = ",".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "mode")
    return pytest.param(endpoint, kwargs, message, id=f"{endpoint.strip('/')}:{label}")


@pytest.mark.server
@pytest.mark.parametrize(
    ("endpoint", "kwargs", "message"),
    [
        _bad("/generate", "please enter a prompt", prompt=""),
        _bad("/generate", "please enter a prompt", prompt="   "),
        _bad("/generate", "prompt is 1000000 characters long; at most 2000 are taken", prompt="x" * 10**6),
        _bad("/generate", "seed must be an integer from 0 to 4294967295, got -1", seed=-1),
        _bad("/generate", "seed must be an integer from 0 to 4294967295, got 4294967296", seed=2**32),
        _bad("/generate", "seed must be an integer from 0 to 4294967295, got 1.5", seed=1.5),
        _bad("/generate", "seed must be an integer from 0 to 4294967295, got 'abc'", seed="abc"),
        _bad("/generate", "steps must be an integer from 1 to 100, got 'abc'", steps="abc"),
        _bad("/generate", "guidance scale must be a number from 0 to 20, got 'abc'", guidance_scale="abc"),
        _bad("/generate", "images per core must be an integer from 1 to 2, got 'abc'", images_per_core="abc"),
        _bad("/generate", "width must be a multiple of 16 from 16 to 4096, got 'abc'", width="abc"),
        _bad("/generate", "width must be a multiple of 16 from 16 to 4096, got 100", width=100),
        _bad("/generate", "steps must be an integer from 1 to 100, got 0", steps=0),
        _bad("/generate", "steps must be an integer from 1 to 100, got 101", steps=101),
        _bad("/generate", "steps must be an integer from 1 to 100, got 2.5", steps=2.5),
        _bad("/generate", "guidance scale must be a number from 0 to 20, got 25", guidance_scale=25),
        _bad("/generate", "size 160x160 is not one of this model's sizes: 128x128, 144x112", width=160, height=160),
        _bad("/generate", "unknown style 'Watercolour'; choose one of: No style, ", style="Watercolour"),
        _bad("/generate", "unknown sampler 'unipc'; choose one of: euler (Euler), ", sampler="unipc"),
        _bad("/generate", "images per core must be an integer from 1 to 2, got 3", images_per_core=3),
        _bad("/generate", "prompt must be text, got list ['a fox', 'a cat']", prompt=["a fox", "a cat"]),
        _bad("/generate", "must be a number from -4 to 4, got 9", lora_style=9),
        _bad("/compare", "compare mode must be one of 'One prompt per line, same seed', ", mode=None, prompts="a fox"),
        _bad("/compare", "prompts must be text (one per line), got list", prompts=["a fox"]),
        _bad("/compare", "seeds 4294967295..4294967296 go past 4294967295",
             mode=COMPARE_SEEDS, prompts="a fox", seed=2**32 - 1, num_seeds=2),
        _bad("/compare", "enter from 1 to 8 prompts, one per line (got 0)", prompts="\n \n"),
    ],
)
def test_bad_input_is_an_error_and_the_server_keeps_serving(client, endpoint, kwargs, message):
    defaults = dict(steps=3) | (FAST if endpoint == "/generate" else {})
    with pytest.raises(AppError) as error:
        client.submit(**(defaults | kwargs), api_name=endpoint).result(timeout=CALL_TIMEOUT)
    assert message in str(error.value)
    _assert_serving(client)


def _post(server: Server, route: str, payload: dict) -> tuple[int, dict, dict]:
    """(HTTP status, JSON answer, headers) of a raw POST to the demo's API, /gradio_api/ROUTE."""
    request = urllib.request.Request(server.url + "gradio_api/" + route, data=json.dumps(payload).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT) as response:
            return response.status, json.load(response), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e), dict(e.headers)


def _generate_values(**kwargs) -> list:
    """/generate's 39 values in order, for raw HTTP (the server has one LoRA and one ControlNet, whose
    settings come before A1111's and the hires fix's; then its IP-Adapters' image prompt's, the model and
    the CFG rescale)."""
    values = dict(prompt="a lighthouse", negative_prompt="", style="No style", seed=0, guidance_scale=5, steps=3,
                  width=128, height=128, images_per_core=1, sampler="euler", emphasis="original", refine=False,
                  refine_from=0.8, lora_style=0, control_image=None, control_preprocessor="canny", canny_low=100,
                  canny_high=200, control_scale=1, control_start=0, control_end=1, noise_source="jax", ensd=0,
                  variation_seed=0, variation_strength=0, schedule_type="", clip_skip=1, sdxl_clip_l_skip=False,
                  hires=False, hires_upscaler="Latent", hires_scale=1.5, hires_steps=0, hires_strength=0.7,
                  ip_adapter_image=None, ip_adapter="ip-adapter",
                  ip_adapter_scale=0.6, ip_adapter_layers="all", model="tiny", guidance_rescale=0)
    return list((values | kwargs).values())


def _refusals(log: str) -> list[str]:
    return re.findall(r"^(?:Invalid request|Queue full|refused a request to \S+): .*$", log, re.MULTILINE)


@pytest.mark.server
def test_raw_http_errors_say_what_is_wrong_with_a_fitting_status(server):
    """Issue 21, hole 5: too few values, an unknown endpoint and a bad value on /run/ each get a
    sentence and a 4xx status, and one log line, not a traceback; /run/ answers with the final images."""
    logged = len(server.output())
    takes = ("/generate takes 39 values, in this order: prompt, negative_prompt, style, seed, guidance_scale, "
             "steps, width, height, images_per_core, sampler, emphasis, refine, refine_from, lora_style, "
             "control_image, control_preprocessor, canny_low, canny_high, control_scale, control_start, control_end, "
             "noise_source, ensd, variation_seed, variation_strength, schedule_type, clip_skip, sdxl_clip_l_skip, "
             "hires, hires_upscaler, hires_scale, hires_steps, hires_strength, ip_adapter_image, ip_adapter, "
             "ip_adapter_scale, ip_adapter_layers, model, guidance_rescale; got 1")
    assert _post(server, "run/generate", {"data": ["a fox"]})[:2] == (422, {"error": takes})
    assert _post(server, "call/generate", {"data": ["a fox"]})[:2] == (422, {"error": takes})
    assert _post(server, "run/nope", {"data": []})[:2] == (404, {
        "error": "there is no API endpoint /nope; this demo's are /generate, /image_to_image, /compare, /grid, "
                 "/upscale"})
    status, answer, _ = _post(server, "run/generate", {"data": _generate_values(steps=300)})
    assert (status, answer["error"]) == (422, "steps must be an integer from 1 to 100, got 300")
    status, answer, _ = _post(server, "run/generate", {"data": _generate_values(steps=40, seed=3)})
    gallery, text = answer["data"]
    assert status == 200 and [item["caption"][:7] for item in gallery] == ["seed 3 "] * 4, "not the previews"
    assert text.startswith("4 images in ")
    log = server.output()[logged:]
    assert "Traceback" not in log and len(_refusals(log)) == 4, log


@pytest.mark.server
def test_a_full_queue_on_run_is_503_with_retry_after(server):
    """Raw HTTP calls count by address against the per-user bound (4 waiting): of seven at once, those
    over it get 503, a sentence and Retry-After; the others their images."""
    def call(steps):  # other step counts never merge: one request per batch, so that the others wait
        return _post(server, "run/generate", {"data": _generate_values(steps=steps)})

    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        answers = list(pool.map(call, range(30, 37)))
    refused = [(answer, headers) for status, answer, headers in answers if status == 503]
    assert refused and len(refused) + sum(status == 200 for status, _, _ in answers) == 7, answers
    for answer, headers in refused:
        assert answer["error"] == "you already have 4 requests waiting; one must finish before you add another"
        assert headers["retry-after"] == "10"


# A client with four long requests, run with `python -c URL DOWNLOADS` and killed once it prints.
# 8 images each, the server's most: every request is a batch of its own, so one renders (for seconds) while three
# wait.
# It prints once each request's handler has reported back (its request is then in the device queue:
# PROGRESS, or ITERATING for its "no change" yields) and one request is rendering. A status shows only
# the latest update, so it collects what each job has shown.
CLIENT_TO_KILL = """
import sys, time
from gradio_client import Client
from gradio_client.utils import Status
client = Client(sys.argv[1], verbose=False, download_files=sys.argv[2])
jobs = [client.submit(prompt="a lighthouse", steps=100, seed=s, images_per_core=2, api_name="/generate")
        for s in range(4)]
served, rendering = [False] * len(jobs), False
deadline = time.monotonic() + 120
while not (all(served) and rendering) and time.monotonic() < deadline:
    time.sleep(0.05)
    for i, status in enumerate(job.status() for job in jobs):
        served[i] |= status.code in (Status.PROGRESS, Status.ITERATING)
        rendering |= any(unit.desc == "Denoising" for unit in status.progress_data or [])
print("rendering" if all(served) and rendering else [job.status() for job in jobs], flush=True)
time.sleep(600)
"""


@pytest.mark.server
def test_a_client_that_goes_away_has_its_work_given_up(server, downloads):
    """Issue 21, hole 2: a client killed with four long requests in the queue. The running batch stops at its
    next progress report, those waiting leave the queue, and the next user is served. Gradio tells each handler
    of the gone client at that handler's next update, one after another: under load one told late may start, or
    finish, first (on CI the fourth of four once went untold for two minutes), so the test asks for two given up."""
    logged = len(server.output())
    process = subprocess.Popen([sys.executable, "-c", CLIENT_TO_KILL, server.url, downloads], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline() == "rendering\n"
    finally:
        process.kill()
        process.wait()
    given_up = []
    deadline = time.monotonic() + 120
    while len(given_up) < 2:
        assert time.monotonic() < deadline, server.output()[logged:]
        time.sleep(0.5)
        given_up = re.findall(r"^gave up a (?:waiting request|batch) of", server.output()[logged:], re.M)
    batches = re.findall(r"gave up a batch of \d+ images at step (\d+) of 100", server.output()[logged:])
    assert batches and all(int(step) < 100 for step in batches)
    _assert_serving(Client(server.url, verbose=False, download_files=downloads))


@pytest.mark.server
def test_a_long_weighted_prompt_is_read_whole_and_one_over_the_limit_is_refused(client):
    """A prompt of several chunks compiles its program in the background while it waits, and says so;
    nothing is cut. One over 8 chunks gets a sentence with its length."""
    job = client.submit(**(FAST | dict(prompt="(word:1.2) " * 100, seed=3)), api_name="/generate")
    gallery, status = job.result(timeout=CALL_TIMEOUT)
    assert len(gallery) == 4 and "4 images" in status and "compiling" in status, status
    assert Image.open(gallery[0]["image"]).info["parameters"].startswith("(word:1.2) (word:1.2)")

    async def updates():
        return [update async for update in job]

    statuses = [u for u in asyncio.run(updates()) if isinstance(u, StatusUpdate)]
    assert not [u for u in statuses if u.code == Status.LOG], "no warning: nothing was cut"
    descriptions = [unit.desc or "" for update in statuses for unit in update.progress_data or []]
    assert any("prompts of up to 8 chunks" in d for d in descriptions), descriptions
    with pytest.raises(AppError, match="the prompt is 1200 tokens in 16 chunks of 75, over the limit of 8 chunks"):
        client.predict(**(FAST | dict(prompt="ab " * 600)), api_name="/generate")


@pytest.mark.server
def test_concurrent_clients(server, downloads):
    """8 users at once: batched on the device queue, each gets its own 4 images, nothing fails."""
    seeds = range(100, 108)
    # Requests merge only into compiled batch sizes; the app compiles 8 after it starts.
    deadline = time.monotonic() + 300
    while "background compile of batch 8: " not in server.output():
        assert time.monotonic() < deadline, server.output()
        time.sleep(0.5)
    assert "failed" not in server.output()
    with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
        users = list(pool.map(lambda _: Client(server.url, verbose=False, download_files=downloads), seeds))
    # Submitted within milliseconds: while the first request renders, the others queue up and batch.
    jobs = [user.submit(**(FAST | dict(seed=seed)), api_name="/generate") for user, seed in zip(users, seeds)]
    deadline = time.monotonic() + 300
    results = [job.result(timeout=max(1.0, deadline - time.monotonic())) for job in jobs]
    assert any("batched with other requests" in status for _, status in results), [s for _, s in results]
    digests = set()
    for seed, (gallery, status) in zip(seeds, results):
        assert len(gallery) == 4 and status.startswith("4 images in "), status
        assert all(item["caption"].startswith(f"seed {seed} · ") for item in gallery)
        digests.add(hashlib.sha256(b"".join(p.tobytes() for p in _pixels(gallery))).hexdigest())
    assert len(digests) == len(seeds), "every user's images must be their own"


@pytest.mark.server
def test_one_user_cannot_take_the_queue(server, downloads):
    """A user with six requests gets four queued and a clear refusal; another user's single request,
    which cannot merge with theirs (another size), is rendered after at most one of theirs."""
    greedy, modest = (Client(server.url, verbose=False, download_files=downloads) for _ in range(2))
    # Each of theirs has its own step count: none merge, so none has a merged batch compiled in the background.
    many = dict(prompt="a lighthouse", width=144, height=112)

    def finished(job):  # (the error, or None) and when the job ended
        try:
            job.result(timeout=CALL_TIMEOUT)
            return None, time.monotonic()
        except AppError as e:
            return str(e), time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(7) as pool:
        greedy_jobs = [pool.submit(finished, greedy.submit(**(many | dict(seed=s, steps=30 + s)), api_name="/generate"))
                       for s in range(6)]
        time.sleep(1.0)  # all six have reached the device queue
        modest_job = pool.submit(finished, modest.submit(**(FAST | dict(seed=9)), api_name="/generate"))
        outcomes = [job.result() for job in greedy_jobs]
        modest_error, modest_done = modest_job.result()
    assert modest_error is None
    refusals = [error for error, _ in outcomes if error]
    assert refusals and all("you already have 4 requests waiting" in r for r in refusals), outcomes
    served = sorted(done for error, done in outcomes if error is None)
    assert sum(done < modest_done for done in served) <= 2, (served, modest_done)  # one running, one at most
    _assert_serving(greedy)  # and the greedy user is served again once their requests are done


@pytest.fixture(scope="module")
def few_step_server(tmp_path_factory, cache_dir):
    """The demo of a few-step model (tiny with a UNet file named as SDXL-Lightning's 2-step one, random) and,
    beside it, a model whose VAE gives NaN (of tiny's architecture: --unet replaces its UNet too, and it runs
    tiny's programs); and the second model's name. One image per core."""
    tmp = tmp_path_factory.mktemp("few-step-app")
    distilled = write_checkpoint(tmp / "distilled", seed=3)
    unet = tmp / "sdxl_lightning_2step_unet.safetensors"
    (distilled / "unet/diffusion_pytorch_model.safetensors").rename(unet)
    nan = write_checkpoint(tmp / "nan-vae")
    vae = nan / "vae" / "diffusion_pytorch_model.safetensors"
    save_file({name: np.full_like(value, np.nan) for name, value in load_file(vae).items()}, vae)
    with serve(tmp / "app", cache_dir, "--model", "tiny", "--model", str(nan), "--unet", str(unet)) as running:
        yield running, str(nan)


@pytest.mark.server
def test_a_few_step_model_gets_its_own_defaults(few_step_server, downloads):
    running, _ = few_step_server
    few_step = Client(running.url, verbose=False, download_files=downloads)
    info = few_step.view_api(return_format="dict", print_info=False)
    parameters = info["named_endpoints"]["/generate"]["parameters"]
    defaults = {p["parameter_name"]: p["parameter_default"] for p in parameters}
    assert (defaults["steps"], defaults["guidance_scale"]) == (2, 0)
    gallery, status = few_step.predict(prompt="a lighthouse", api_name="/generate")
    page = urllib.request.urlopen(running.url, timeout=30).read().decode()
    assert status.startswith("4 images in")
    parameters = Image.open(gallery[0]["image"]).info["parameters"]
    assert "Steps: 2, Sampler: Euler, Schedule type: diffusers, CFG scale: 0," in parameters
    assert "Model: tiny + sdxl_lightning_2step_unet.safetensors" in parameters
    assert "SDXL-Lightning 2-step UNet" in page


@pytest.mark.server
def test_nan_output_is_an_error_and_the_queue_keeps_going(few_step_server, downloads):
    running, nan = few_step_server
    nan_client = Client(running.url, verbose=False, download_files=downloads)
    for seed in (0, 1):  # the second call shows the queue is not stuck after the first failure
        with pytest.raises(AppError, match="NaN/inf"):
            nan_client.submit(**(FAST | dict(seed=seed, model=nan)), api_name="/generate").result(
                timeout=CALL_TIMEOUT)


@pytest.mark.server
def test_corrupt_checkpoint_stops_the_launch_with_the_reason(tmp_path, cache_dir):
    model = write_checkpoint(tmp_path / "truncated")
    unet = model / "unet" / "diffusion_pytorch_model.safetensors"
    unet.write_bytes(unet.read_bytes()[:5000])
    launch = subprocess.run(
        [sys.executable, str(REPO / "app.py"), "--port", str(free_port()), "--cache-dir", str(cache_dir),
         "--model", str(model)],
        cwd=REPO, env=_app_env(tmp_path), capture_output=True, text=True, timeout=STARTUP_TIMEOUT,
    )
    assert launch.returncode == 2, launch.stdout + launch.stderr
    assert launch.stderr.strip().splitlines()[-1].startswith(f"error: {unet}: truncated or corrupt (header claims")
    assert "Traceback" not in launch.stderr


@pytest.mark.parametrize(
    "args, env, message",
    [
        (
            ["--max-images-per-core", "0"], {},
            "argument --max-images-per-core: must be an integer of at least 1, got '0'",
        ),
        (["--port", "99999"], {}, "argument --port: must be an integer from 1 to 65535, got '99999'"),
        ([], {"SDXL_MAX_QUEUE": "many"}, "argument --max-queue: must be an integer of at least 1, got 'many'"),
    ],
)
def test_bad_launch_options_are_refused_before_loading(monkeypatch, capsys, args, env, message):
    """app.py's `main` with bad options, run in this process: it reads its options first, so it exits before it
    loads anything (the next test launches app.py as a process of its own)."""
    import app

    monkeypatch.setattr(sys, "argv", [str(REPO / "app.py"), *args])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        app.main()
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and err.strip().endswith(message), err
    assert "loading" not in out and "startup" not in out


@pytest.mark.server
def test_a_refiner_that_cannot_continue_the_model_is_refused_before_loading(tmp_path):
    launch = subprocess.run(
        [sys.executable, str(REPO / "app.py"), "--model", "tiny", "--refiner", "tiny-sd1"],
        cwd=REPO, env=_app_env(tmp_path), capture_output=True, text=True, timeout=STARTUP_TIMEOUT,
    )
    message = ("error: the refiner tiny-sd1 cannot continue tiny's latents: its latent scaling differ "
               "((0.18215, None, None) vs (0.13025, None, None))")
    assert launch.returncode == 2 and launch.stderr.strip().endswith(message), launch.stderr
    assert "loading" not in launch.stdout and "startup" not in launch.stdout


@pytest.mark.server
def test_sd1_layout_model_serves_its_own_presets(tmp_path, cache_dir, downloads):
    with serve(tmp_path / "app", cache_dir, "--model", "tiny-sd1") as running:
        sd1_client = Client(running.url, verbose=False, download_files=downloads)
        job = sd1_client.submit(**(FAST | dict(prompt="a lighthouse", width=144, height=112)), api_name="/generate")
        gallery, status = job.result(timeout=CALL_TIMEOUT)
    assert status.startswith("4 images in")
    assert [Image.open(item["image"]).size for item in gallery] == [(144, 112)] * 4
    assert all("Model: tiny-sd1" in Image.open(item["image"]).text["parameters"] for item in gallery)


@contextlib.contextmanager
def _browser(tmp_path: Path):
    """Headless Chromium at 1280x800 with a fresh profile; yields it (pages from `new_page`)."""
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium) for the browser test"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=PAGE_TIMEOUT * 1000)
    with sync_playwright() as p:
        # Playwright takes the fresh profile folder (--user-data-dir) as launch_persistent_context's argument.
        browser = p.chromium.launch_persistent_context(
            tmp_path / "chromium-profile",
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
            viewport={"width": 1280, "height": 800},
        )
        browser.set_default_timeout(PAGE_TIMEOUT * 1000)
        try:
            yield browser
        finally:
            browser.close()


def _artifacts() -> Path:
    artifacts = REPO / "artifacts"
    artifacts.mkdir(exist_ok=True)
    return artifacts


def _steered_in_browser(server, tmp_path, panel: str, upload: str, shown: str, send: str, screenshot: str,
                        **screenshot_options) -> tuple[str, bytes]:
    """In the browser: opens the accordion titled `panel`, uploads a picture to the image input `upload`
    (its id), waits for the image `shown` (a selector), generates at 144x112, and takes a screenshot (`screenshot`,
    in artifacts/); then the button `send` (its id) puts the second image in `upload`. Returns the first image's
    PNG parameters and the bytes of `shown` before the send."""
    from playwright.sync_api import expect

    picture = _control_picture(tmp_path / "picture.png")
    with _browser(tmp_path) as browser:
        page = browser.new_page()
        page.add_init_script(LATE_SELECTS)
        page.goto(server.url, wait_until="load")
        expect(page.locator("#generate")).to_be_visible()
        page.get_by_text(panel, exact=True).click()
        page.locator(f"#{upload} input[type=file]").set_input_files(picture)
        expect(page.locator(shown)).to_have_count(1)
        page.locator("#prompt textarea").fill("a lighthouse")
        page.get_by_text("Advanced", exact=True).click()
        page.get_by_role("combobox", name="Size").click()
        page.get_by_role("option", name="144×112", exact=True).click()
        page.locator("#generate").click()  # right after the size is chosen: it renders at that size
        expect(page.locator("#status")).to_contain_text("4 images in", timeout=CALL_TIMEOUT * 1000)
        page.locator(f"#{upload}").scroll_into_view_if_needed()
        page.screenshot(path=str(_artifacts() / screenshot), **screenshot_options)
        source = page.locator(shown).get_attribute("src")
        first = page.locator("#gallery img").first.get_attribute("src")
        second, uploaded = page.locator("#gallery img").nth(1).get_attribute("src"), page.locator(
            f"#{upload} img").get_attribute("src")
        page.locator("#gallery .thumbnail-item").nth(1).click()
        page.locator(f"#{send}").click()
        expect(page.locator(f"#{upload} img")).not_to_have_attribute("src", uploaded)
        sent = page.locator(f"#{upload} img").get_attribute("src")

    def fetched(url: str) -> bytes:
        with urllib.request.urlopen(urllib.parse.urljoin(server.url, url), timeout=30) as response:
            return response.read()

    assert np.array_equal(*(np.asarray(Image.open(io.BytesIO(fetched(url))).convert("RGB")) for url in (sent, second)))
    image = Image.open(io.BytesIO(fetched(first)))
    assert image.size == (144, 112)
    return image.info["parameters"], fetched(source)


@pytest.mark.server
@pytest.mark.browser
def test_browser_controlnet(server, tmp_path):
    """The ControlNet panel: an uploaded picture shows its Canny map, and Generate steers with it."""
    parameters, made = _steered_in_browser(server, tmp_path, "ControlNet", "control-image", "#control-map img",
                                           "send-control", "app-controlnet.png", full_page=True)
    edges = np.asarray(Image.open(io.BytesIO(made)).convert("L"))
    assert set(np.unique(edges)) == {0, 255} and (edges == 255).mean() < 0.2, "a map of thin edges"
    assert 'ControlNet 0: "Module: canny, Model: tiny-canny, Weight: 1' in parameters, parameters


@pytest.mark.server
@pytest.mark.browser
def test_browser_image_prompt(server, tmp_path):
    """The Image prompt panel (two adapters: the first takes the picture, the other sits out), and
    Generate steers with it."""
    parameters, _ = _steered_in_browser(server, tmp_path, "Image prompt", "ip-adapter-image",
                                        "#ip-adapter-image img", "send-ip-adapter", "app-ip-adapter.png")
    assert "ip-adapter-plus" not in parameters, "the adapter that sits out is not recorded"
    assert 'ControlNet 0: "Module: ip-adapter_clip_h, Model: ip-adapter, Weight: 0.6,' in parameters, parameters


@pytest.mark.server
@pytest.mark.browser
def test_browser_generate(shapes_server, tmp_path):
    """A first visit, offline: the shapes model draws what the prompt typed into the page says."""
    from playwright.sync_api import expect
    from test_shapes import score

    artifacts = _artifacts()
    with _browser(tmp_path) as browser:
        page = browser.new_page()
        # Not "networkidle": the page keeps a heartbeat connection open for its session's state.
        page.goto(shapes_server.url, wait_until="load")
        expect(page.locator("#generate")).to_be_visible()
        # On a 1280x800 window the prompt, the button and the top of the gallery need no scrolling.
        for element in ("#prompt textarea", "#generate", "#gallery"):
            box = page.locator(element).bounding_box()
            assert box and 0 <= box["y"] and box["y"] + min(box["height"], 40) <= 800, (element, box)
        expect(page.locator("#model-notice")).to_contain_text("Showing the built-in shapes model instead")
        page.locator("#prompt textarea").fill("a red circle on a blue background")
        expect(page.locator("#prompt-length")).to_contain_text("tokens, 1 chunk")
        page.get_by_text("Advanced").click()
        page.get_by_label("Randomize seed").uncheck()
        page.get_by_label("Seed", exact=True).fill("0")
        page.locator("#prompt textarea").press("Control+Enter")  # the keyboard shortcut generates
        expect(page.locator("#gallery img")).to_have_count(4, timeout=CALL_TIMEOUT * 1000)
        expect(page.locator("#status")).to_contain_text("4 images")
        expect(page.locator("#generation-info textarea")).to_have_value(re.compile(r"Seed: 0,"))
        page.wait_for_function("() => [...document.querySelectorAll('#gallery img')].every("
                               "(img) => img.complete && img.naturalWidth > 0)")
        page.screenshot(path=str(artifacts / "app.png"), full_page=True)
        sources = [img.get_attribute("src") for img in page.locator("#gallery img").all()]
        # The session's history holds the four; a PNG dropped on the page brings its settings back.
        page.get_by_text("History (this session)").click()
        expect(page.locator("#history img")).to_have_count(4)
        png = tmp_path / "made-here.png"
        with urllib.request.urlopen(urllib.parse.urljoin(shapes_server.url, sources[2]), timeout=30) as response:
            png.write_bytes(response.read())
        page.locator("#prompt textarea").fill("")
        page.get_by_label("Seed", exact=True).fill("77")
        page.locator("#reuse-png input[type=file]").set_input_files(str(png))
        expect(page.locator("#prompt textarea")).to_have_value("a red circle on a blue background")
        expect(page.get_by_label("Seed", exact=True)).to_have_value("0")
        page.get_by_role("tab", name="Image to image").click()
        expect(page.locator("#image-editor")).to_be_visible()
        page.screenshot(path=str(artifacts / "app-image-tab.png"), full_page=True)
    assert Image.open(artifacts / "app.png").size[0] == 1280  # artifacts/app.png: look at it
    scores = []
    for source in sources:
        with urllib.request.urlopen(urllib.parse.urljoin(shapes_server.url, source), timeout=30) as response:
            scores.append(score(np.asarray(Image.open(io.BytesIO(response.read())).convert("RGB"))))
    right = [(s["color"], s["background"], s["shape"]) == ("red", "blue", "circle") for s in scores]
    assert sum(right) >= 3, scores  # the model's accuracy is measured in test_shapes; here, the page's


@pytest.mark.server
@pytest.mark.browser
def test_browser_first_five_minutes(shapes_server, tmp_path):
    """Issue 29, on the real page: what a first visitor tripped over, checked by element sizes and
    positions (1 send after an upload, 2 the gallery's size, 4 grid labels, 5 the drop zone, 6 errors,
    8 history and reuse)."""
    from playwright.sync_api import expect

    def box(selector: str) -> dict:
        found = page.locator(selector).first.bounding_box()
        assert found, selector
        return found

    def inside(inner: dict, outer: dict, slack: float = 1.0) -> bool:
        return (inner["x"] >= outer["x"] - slack and inner["y"] >= outer["y"] - slack
                and inner["x"] + inner["width"] <= outer["x"] + outer["width"] + slack
                and inner["y"] + inner["height"] <= outer["y"] + outer["height"] + slack)

    upload = tmp_path / "blue.png"
    Image.new("RGB", (64, 64), (30, 60, 220)).save(upload)
    with _browser(tmp_path) as browser:
        page = browser.new_page()
        page.add_init_script(LATE_SELECTS)  # a click acts on the image the page shows selected, however late its select
        page.goto(shapes_server.url, wait_until="load")
        expect(page.locator("#generate")).to_be_visible()
        # 9: one line of notice above the controls; the details behind a disclosure.
        assert box("#model-notice")["height"] <= 60 and box("#prompt textarea")["y"] < 400
        # 5: the drop zone shows its whole prompt.
        expect(page.locator("#reuse-png")).to_contain_text("Click to Upload")
        settled = lambda: inside(box("#reuse-png .upload-container .wrap"), box("#reuse-png"))  # noqa: E731
        deadline = time.monotonic() + PAGE_TIMEOUT
        while not settled() and time.monotonic() < deadline:  # a loaded page's columns move while the gallery lays out
            page.wait_for_timeout(100)
        assert settled(), (box("#reuse-png .upload-container .wrap"), box("#reuse-png"))
        # 1 (the setup): a picture uploaded to the image editor before anything is sent there.
        page.get_by_role("tab", name="Image to image").click()
        page.locator("#image-editor input[type=file]").set_input_files(str(upload))
        page.get_by_role("tab", name="Generate").click()
        # 7: Send with nothing selected says so and stays on the tab.
        page.locator("#send").click()
        expect(page.locator(".toast-body").filter(has_text="select an image first")).to_have_count(1)
        expect(page.get_by_role("tab", name="Generate")).to_have_attribute("aria-selected", "true")
        page.locator("#prompt textarea").fill("a red circle on a blue background")
        page.locator("#generate").click()
        expect(page.locator("#gallery img")).to_have_count(4, timeout=CALL_TIMEOUT * 1000)
        # 2: the gallery is as tall as its row of four thumbnails, not a mostly empty box.
        thumbnails = box("#gallery .grid-container")
        assert box("#gallery")["height"] <= thumbnails["height"] + 60, (box("#gallery"), thumbnails)
        # 6: an empty prompt is one message; the images and the status stay.
        page.locator("#prompt textarea").fill("")
        page.locator("#generate").click()
        expect(page.locator(".toast-body").filter(has_text="please enter a prompt")).to_have_count(1)
        expect(page.locator("#gallery img")).to_have_count(4)
        expect(page.locator("#status")).to_contain_text("4 images")
        assert "Error" not in page.locator("#gallery").inner_text() + page.locator("#status").inner_text()
        page.locator("#prompt textarea").fill("a red circle on a blue background")
        # 2: a selected image is shown whole, its caption inside the gallery.
        page.locator("#gallery .thumbnail-item").first.click()
        expect(page.locator("#gallery .preview")).to_be_visible()
        assert inside(box("#gallery .preview img"), box("#gallery"))
        assert inside(box("#gallery .preview .caption"), box("#gallery"))
        # 1: sent after the upload, the picture shows in the editor within seconds, with the prompt.
        page.locator("#send").click()  # queued (its refusal is a toast), so under load it waits its turn
        expect(page.get_by_role("tab", name="Image to image")).to_have_attribute("aria-selected", "true")
        expect(page.locator("#image-prompt textarea")).to_have_value("a red circle on a blue background")
        page.wait_for_timeout(3000)
        assert "processing" not in page.locator("#image-editor").inner_text()
        page.screenshot(path=str(_artifacts() / "app-sent.png"), full_page=True)
        # 4: long column labels over 64-px cells stay in their columns; 8: a grid's cells reach the history.
        page.get_by_role("tab", name="Grid").click()
        page.locator("#grid-prompt textarea").fill("a red circle on a blue background")
        for axis, name in (("X axis", "prompt"), ("Y axis", "seed")):
            page.get_by_label(axis).click()
            page.get_by_role("option", name=name, exact=True).click()
            expect(page.get_by_role("option")).to_have_count(0)  # the list closed before the next opens
        page.get_by_label("X values").fill("a red circle on a blue background, a green square on a white background")
        page.get_by_label("Y values").fill("1, 2")
        page.locator("#grid-run").click()
        expect(page.locator("#status")).to_contain_text("4 images", timeout=CALL_TIMEOUT * 1000)
        source = page.locator("#grid-image img").get_attribute("src")
        with urllib.request.urlopen(urllib.parse.urljoin(shapes_server.url, source), timeout=30) as response:
            sheet = np.asarray(Image.open(io.BytesIO(response.read())).convert("L"))
        left, top = sheet.shape[1] - 2 * 64, sheet.shape[0] - 2 * 64
        for boundary in (left, left + 64):  # no label's ink on a column's edge
            assert sheet[:top, boundary].min() == 255, f"a label crosses x={boundary}"
        assert (sheet[:top, left:] < 128).any(), "the labels are drawn"
        page.get_by_text("History (this session)").click()
        expect(page.locator("#history .thumbnail-item")).to_have_count(8)
        page.locator("#history .thumbnail-item").first.click()
        page.get_by_role("button", name="Reuse the selected result's settings").click()
        expect(page.locator("#reuse-report")).to_contain_text("Filled in: the prompts, seed 1")
        expect(page.get_by_label("Seed", exact=True)).to_be_visible()  # Advanced opened
        expect(page.get_by_label("Seed", exact=True)).to_have_value("1")
        # On a phone the results come right under the tabs, and Generate scrolls them into view (issue 44).
        page.set_viewport_size({"width": 390, "height": 844})
        page.get_by_role("tab", name="Generate").click()
        page.locator("#prompt textarea").fill("a green square on a white background")
        page.locator("#generate").click()
        expect(page.locator("#status")).not_to_contain_text("device call")  # the grid's is gone
        expect(page.locator("#status")).to_contain_text("4 images in", timeout=CALL_TIMEOUT * 1000)
        page.wait_for_timeout(1000)  # the smooth scroll's end
        gallery = box("#gallery")
        assert -10 <= gallery["y"] <= 844 - 100, gallery  # on screen (scrolled to its top, to a pixel)
        page.screenshot(path=str(_artifacts() / "app-phone.png"), full_page=True)


# The two-model server's tests come last: it then finds its two models' programs in the compilation cache,
# compiled by the servers of each model alone.
@pytest.mark.server
def test_several_models_each_draw_as_their_demo_alone(models_server, client, downloads):
    """`model` names the model a request draws with; a grid over it puts each model's cells in calls of their own,
    each cell image 0 of /generate with that model and seed. One model at a time is on the devices: tiny waits
    in host memory, and moves in when asked for."""
    assert re.search(r"^model tiny \(.*, in host memory until a request needs it$", models_server.output(), re.M)
    several = Client(models_server.url, verbose=False, download_files=downloads)
    parameters = several.view_api(print_info=False, return_format="dict")["named_endpoints"]["/generate"]["parameters"]
    assert "model" in [parameter["parameter_name"] for parameter in parameters]
    same = dict(seed=1, guidance_scale=5, sampler="euler")  # the API's defaults are the page's: the first model's
    tiny, status = _generate(several, model="tiny", **same)
    assert status.startswith("4 images in ") and "s of it moving the model onto the devices" in status, status
    assert re.search(r"^moved tiny onto the devices in [\d.]+ s, shapes to host memory$", models_server.output(), re.M)
    assert Image.open(tiny[0]["image"]).info["parameters"].count("Model: tiny") == 1
    assert tiny[0]["caption"].startswith("tiny · seed 1")
    alone, _ = _generate(client, **same)  # the demo of tiny (with other things loaded, none of them in use)
    for ours, theirs in zip(_pixels(tiny), _pixels(alone)):
        np.testing.assert_array_equal(ours, theirs)
    shapes, _ = _generate(several, seed=1)
    assert _pixels(shapes)[0].shape == (64, 64, 3), "no model named: the first, at its own size"
    with pytest.raises(AppError, match="no model 'sdxl' is loaded; the loaded ones are shapes, tiny"):
        _generate(several, model="sdxl")
    sheet, cells, status = several.submit(**FAST, x_axis="model", x_values="shapes, tiny", y_axis="seed",
                                          y_values="1, 2", api_name="/grid").result(timeout=CALL_TIMEOUT)
    assert "4 images" in status and "2 device calls" in status, status
    for (model, seed), cell in zip([("shapes", 1), ("tiny", 1), ("shapes", 2), ("tiny", 2)], _pixels(cells)):
        single, _ = _generate(several, seed=seed, model=model)
        np.testing.assert_array_equal(cell, _pixels(single)[0])
    compared, status = several.submit(mode=COMPARE_MODELS, prompts=FAST["prompt"], seed=2, steps=FAST["steps"],
                                      api_name="/compare").result(timeout=CALL_TIMEOUT)
    assert "2 images" in status, status
    for model, picture in zip(("shapes", "tiny"), _pixels(compared)):  # each /generate's image 0 of that model
        np.testing.assert_array_equal(picture, _pixels(_generate(several, seed=2, model=model)[0])[0])
    _generate(several, seed=3)  # switching back: the first model's own again


@pytest.mark.browser
def test_browser_model_grid(models_server, tmp_path):
    """Two models compared as A1111 users compare checkpoints: the Model choice at the top, and a model x seed
    grid, on a laptop's window and a phone's."""
    from playwright.sync_api import expect

    with _browser(tmp_path) as browser:
        page = browser.new_page()
        page.goto(models_server.url, wait_until="load")
        expect(page.locator("#model")).to_be_visible()
        page.get_by_label("Model", exact=True).click()
        page.get_by_role("option", name="tiny", exact=True).click()
        page.get_by_text("Advanced").click()
        expect(page.get_by_label("Size")).to_have_value("128×128")  # its sizes came with it
        page.get_by_label("Model", exact=True).click()
        page.get_by_role("option", name="shapes", exact=True).click()
        expect(page.get_by_label("Size")).to_have_value("64×64")
        page.get_by_role("tab", name="Grid").click()
        page.locator("#grid-prompt textarea").fill("a red circle on a blue background")
        for axis, name in (("X axis", "model"), ("Y axis", "seed")):
            page.get_by_label(axis).click()
            page.get_by_role("option", name=name, exact=True).click()
            expect(page.get_by_role("option")).to_have_count(0)
        page.get_by_label("X values").fill("shapes, tiny")
        page.get_by_label("Y values").fill("1, 2")
        page.locator("#grid-run").click()
        expect(page.locator("#status")).to_contain_text("4 images", timeout=CALL_TIMEOUT * 1000)
        expect(page.locator("#status")).to_contain_text("2 device calls")
        expect(page.locator("#gallery")).to_contain_text("model tiny")
        page.screenshot(path=str(_artifacts() / "model-grid.png"), full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        page.screenshot(path=str(_artifacts() / "model-grid-phone.png"), full_page=True)


@pytest.mark.browser
def test_browser_a_civitai_picture_draws_what_it_can(shapes_server, tmp_path):
    """A PNG from Civitai names a LoRA, an upscaler and a size this demo lacks: it draws anyway, and says what it left
    out, beside the picture and in its info. A pasted parameters text fills the form. A lone picture shows whole.
    A picture too big for the image editor is refused with a sentence, and the next request is served."""
    from playwright.sync_api import expect

    civitai = tmp_path / "civitai.png"
    text = ("a red circle on a blue background <lora:detail_tweaker:0.5>\nNegative prompt: blurry\nSteps: 12, "
            "Sampler: Euler, CFG scale: 2.5, Seed: 7, Size: 832x1216, Model: juggernautXL_v9, Denoising strength: 0.4, "
            "Hires upscale: 1.5, Hires upscaler: 4x-UltraSharp, Lora hashes: \"detail_tweaker: 3b4e5f6a7b8c\"")
    info = PngImagePlugin.PngInfo()
    info.add_text("parameters", text)
    Image.new("RGB", (832, 1216), (30, 40, 200)).save(civitai, pnginfo=info)
    big = tmp_path / "big.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (3200, 3200, 3), dtype=np.uint8)).save(big)
    assert big.stat().st_size > 20 * 2**20
    with _browser(tmp_path) as browser:
        page = browser.new_page()
        page.goto(shapes_server.url, wait_until="load")
        expect(page.locator("#generate")).to_be_visible()
        page.locator("#reuse-png input[type=file]").set_input_files(str(civitai))
        report = page.locator("#reuse-report")
        expect(report).to_contain_text("the LoRA detail_tweaker is not loaded")
        expect(report).to_contain_text("the hires upscaler 4x-UltraSharp is not loaded: Lanczos in its place")
        expect(report).to_contain_text("size 832x1216 is not this model's: its nearest, 64x64, in its place")
        page.locator("#generate").click()
        expect(page.locator("#status")).to_contain_text("Failed to find networks: detail_tweaker",
                                                        timeout=CALL_TIMEOUT * 1000)
        expect(page.locator("#gallery img")).to_have_count(4)
        expect(report).to_contain_text("the LoRA detail_tweaker is not loaded")  # it stays
        expect(page.locator("#generation-info textarea")).to_have_value(re.compile(
            r"Seed: 7,.*Hires upscaler: Lanczos.*Left out: \"Failed to find networks: detail_tweaker\"", re.S))
        page.screenshot(path=str(_artifacts() / "civitai.png"))
        # A1111's way with a text: pasted in the prompt, then read.
        page.locator("#prompt textarea").fill(text.replace("Seed: 7", "Seed: 99"))
        expect(page.locator("#prompt-length")).to_contain_text("This holds a picture's settings")
        page.locator("#read-settings").click()
        expect(page.get_by_label("Seed", exact=True)).to_have_value("99")
        expect(page.locator("#prompt textarea")).to_have_value(
            "a red circle on a blue background <lora:detail_tweaker:0.5>")
        # A lone picture (Compare's one prompt) is shown whole, its caption too, on a laptop's window and a phone's.
        page.get_by_role("tab", name="Compare").click()
        # The Seeds slider is there for the one mode that reads it, which takes one prompt.
        expect(page.locator("#compare-seeds")).to_be_hidden()
        page.get_by_label(COMPARE_SEEDS).check()
        expect(page.locator("#compare-seeds")).to_be_visible()
        expect(page.locator("#compare-prompts")).to_contain_text("Prompt")
        expect(page.locator("#compare-prompts")).not_to_contain_text("one per line")
        page.screenshot(path=str(_artifacts() / "compare-seeds.png"))
        page.get_by_label(COMPARE_PROMPTS).check()
        expect(page.locator("#compare-seeds")).to_be_hidden()
        page.get_by_label("Prompts (one per line) or one prompt").fill("a large red circle on a blue background")
        page.get_by_role("button", name="Compare", exact=True).click()
        expect(page.locator("#status")).to_contain_text("1 image in", timeout=CALL_TIMEOUT * 1000)
        for width, height in ((1280, 800), (390, 844)):
            page.set_viewport_size({"width": width, "height": height})
            page.wait_for_timeout(500)
            gallery, thumbnail, caption = (page.locator(selector).bounding_box() for selector in (
                "#gallery", "#gallery .thumbnail-item", "#gallery .caption-label"))
            bottom = gallery["y"] + gallery["height"]
            for inner in (thumbnail, caption):
                assert gallery["y"] <= inner["y"] and inner["y"] + inner["height"] <= bottom, (width, gallery, inner)
            assert thumbnail["height"] <= 0.6 * height + 2, "within the window"
            page.locator("#gallery").screenshot(path=str(_artifacts() / f"lone-picture-{width}.png"))
        page.set_viewport_size({"width": 1280, "height": 800})
        # A picture over the upload limit, in the image editor: a sentence, not a silent wait (nor a timed test).
        page.get_by_role("tab", name="Image to image").click()
        page.locator("#image-editor input[type=file]").set_input_files(str(big))
        expect(page.locator("#image-note")).to_contain_text("this demo takes pictures of up to 8.0 MB")
        page.get_by_role("tab", name="Generate").click()
        page.locator("#prompt textarea").fill("a green square on a white background")
        page.locator("#generate").click()
        expect(page.locator("#status")).to_contain_text("4 images in", timeout=CALL_TIMEOUT * 1000)


def test_the_page_builds_for_one_image_a_call():
    """One device and --max-images-per-core 1: sliders with nothing to choose are hidden, not a crash
    (Gradio's slider needs two ends)."""
    import jax

    import app
    from sdxl.serving.demo import DemoService
    from sdxl.engine.pipeline import Pipeline

    pipe = Pipeline.from_pretrained("tiny", devices=jax.devices()[:1])
    blocks = app.create_demo(app.Handlers(DemoService([Model("tiny", pipe)], max_images_per_core=1)))
    hidden = {getattr(c, "label", None) for c in blocks.blocks.values() if getattr(c, "visible", True) is False}
    assert {"Images per core", "Seeds"} <= hidden
    # What Send and Reuse act on is read in the page with the click (the browser tests check it under late selects),
    # and a gallery's select only shows its info: nothing waits on a select that a loaded server answers late.
    picks = [fn for fn in blocks.fns.values() if fn.name == "picked"]  # Send, Send to Upscale, Reuse, Reuse (history)
    assert len(picks) == 4 and all(fn.js and "thumbnail-item.selected" in fn.js for fn in picks)
    assert {fn.name for fn in blocks.fns.values() if any(t[1] == "select" for t in fn.targets)} == {"selected_info"}
    # So is the size a Generate reads: the width and height follow the Size choice in the page, each label its own.
    size = next(block for block in blocks.blocks.values() if getattr(block, "label", None) == "Size")
    (follow,) = [fn for fn in blocks.fns.values() if (size._id, "change") in fn.targets]
    table = json.loads(re.fullmatch(r"\(label\) => \((\{.*\})\)\[label\]", follow.js).group(1))
    assert follow.fn is None and table == {label: [*map(int, re.findall(r"\d+", label))] for label, _ in size.choices}
