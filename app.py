"""Gradio demo: Stable Diffusion XL in JAX, one image per accelerator core.

python app.py [--model M] [--lora FILE[:SCALE] ...] [--refiner R] [--host H] [--port P] [--mcp] [--share]

Every option also reads an environment variable (SDXL_MODEL, SDXL_HOST, ...), for Spaces. This file
builds the page and wires its events; what a click submits, and what the page says of it, is the
service's (`sdxl.serving.demo`, `sdxl.serving.results`).
"""

import contextlib
import functools
import inspect
import json
import logging
import random
import time
from pathlib import Path

import gradio as gr
from PIL import Image
from starlette.middleware import Middleware

from sdxl import CheckpointError, NonFiniteImageError
from sdxl.engine import images
from sdxl.engine.image_prompts import IP_ADAPTER_SCALE_RANGE
from sdxl.engine.request import CLIP_SKIP_RANGE
from sdxl.serving import endpoints, launch, results
from sdxl.serving.demo import UPSCALE_RANGE, DemoService, Submission
from sdxl.serving.forms import (
    COMPARE_PROMPTS, COMPARE_SEEDS, IP_ADAPTER_FIELDS, ControlForm, Settings, path_of, picture_and_mask,
)
from sdxl.serving.http_errors import HttpErrors, owner, route
from sdxl.serving.options import demo_parser
from sdxl.serving.queue import QueueFullError

# Uploads decode to at most this many pixels: PIL refuses twice as many, and warns above it.
Image.MAX_IMAGE_PIXELS = images.MAX_IMAGE_PIXELS

log = logging.getLogger("sdxl.demo")
# The titles of errors for the user, and the HTTP status each gives an answer on /run/.
INVALID_REQUEST, QUEUE_FULL, NO_IMAGE = "Invalid request", "Queue full", "No image"
ERROR_STATUS = {INVALID_REQUEST: 422, QUEUE_FULL: 503, NO_IMAGE: 500}
CACHE_EXPIRY = (600, 3600)  # Gradio's delete_cache: (every, older than), seconds
MAX_UPLOAD = "8mb"  # Gradio's upload endpoint takes any file; a phone's photo is 2-5 MB
AXIS_VALUES_HINT = "comma-separated or one per line; ranges like 1-4; a prompt value found in the prompt replaces it"
PAGE = Path(__file__).parent / "assets" / "page"  # the page's style sheet and scripts
KEEPALIVE_SECONDS = 1.0  # a handler that waits yields "no change" this often


class Handlers:
    """The events' handlers, over the service. A tab's fields arrive by name (`**form`); its button
    first runs `check` (the submission built, a bad value one message), then `submit(tab)`'s handler,
    which renders the checked submission with progress and previews, and answers."""

    def __init__(self, service: DemoService):
        self.service = service

    def check(self, tab: str):
        """The check a tab's button runs first: its submission built and kept, or one message."""

        def check(request: gr.Request, **form) -> None:
            with _said():
                self.service.check(tab, _owner(request), form)

        return check

    def submit(self, tab: str, fields: list[str]):
        """The handler of a tab's button, whose form has `fields`: the gallery and status (for a grid,
        first its sheet)."""

        def handler(request: gr.Request, progress=gr.Progress(), **form):
            with _said():
                submission = self.service.checked(tab, _owner(request), form)
            yield from _routed(request, self._rendered(submission, _owner(request), progress))

        optional = ["mask", "ip_adapter_image", "model", "width", "height",
                    *(names["picture"] for names in self.service.control_parameters)]
        return _described(handler, tab, fields, optional)

    def reuse(self, file) -> tuple[dict[str, object], str]:
        """The form's fields (by name) that a PNG made here or by A1111 (or a text file of its settings) fills
        in, and a sentence saying what, which the page keeps under the drop zone. A file without settings
        is said so, and the fields keep what they hold."""
        path = path_of(file)
        try:
            text = Path(path).read_text(errors="replace") if path.lower().endswith(".txt") else _png_parameters(path)
        except OSError as e:
            return {}, f"Cannot reuse that file's settings: {e}"
        return self.reuse_text(text)

    def reuse_text(self, text) -> tuple[dict[str, object], str]:
        """The fields a pasted parameters text (A1111's "Read generation parameters") fills in, and what it says."""
        try:
            return self.service.reused(text if isinstance(text, str) else "")
        except ValueError as e:
            return {}, f"Cannot reuse those settings: {e}"

    @staticmethod
    def parameters_of(path: str | None) -> str:
        """A picture's generation info (its PNG's parameters text): "" for none."""
        try:
            return _png_parameters(path_of(path)) if path else ""
        except OSError:
            return ""

    def upscale(self, picture, upscaler, factor) -> tuple[Image.Image, str]:
        with _said():
            return self.service.upscale(picture, upscaler, factor)

    upscale.__doc__ = endpoints.docstring("upscale", ["picture", "upscaler", "factor"])

    def prompt_length(self, text, emphasis, model=None, negative: bool = False) -> str:
        return self.service.prompt_length(text, emphasis, negative=negative, model=model)

    def model_defaults(self, name):
        """The size, steps, guidance and sampler the page starts a model with: its first size and its own."""
        model = self.service.model(name)
        labels = [results.size_label(*size) for size in model.sizes]
        return (gr.Dropdown(choices=labels, value=labels[0]), model.settings.steps, model.settings.guidance_scale,
                model.pipe.spec.default_sampler)

    def control_map(self, picture, *settings):
        """The map a ControlNet panel's picture makes at the chosen size, as the request will make it."""
        with _said():
            return None if picture is None else Image.fromarray(self.service.control_map(picture, *settings))

    def _rendered(self, submission: Submission, owner: str | None, progress: gr.Progress):
        """Yields previews, and "no change" after a second without (Gradio notices a client that has
        gone only when its handler yields; closing this gives the requests up), then the answer."""
        quiet_since = time.monotonic()
        with _said(), contextlib.closing(results.rendered(self.service, submission, owner)) as shown:
            for next_shown in shown:
                if next_shown.answer is not None:
                    yield next_shown.answer
                    continue
                progress(next_shown.progress[0], desc=next_shown.progress[1], unit=next_shown.progress[2])
                if next_shown.previews is not None or time.monotonic() - quiet_since > KEEPALIVE_SECONDS:
                    yield gr.skip() if next_shown.previews is None else next_shown.previews
                    quiet_since = time.monotonic()


def _png_parameters(path: str) -> str:
    """A picture's "parameters" text ("" for none). Raises OSError where it is no picture."""
    with Image.open(path) as picture:
        return picture.info.get("parameters", "")


@contextlib.contextmanager
def _said():
    """A refusal as the user's error: its sentence in the page or the API's answer, under a title that
    `HttpErrors` turns into the HTTP status of /run/'s answer; one line in the log."""
    try:
        yield
    except (QueueFullError, NonFiniteImageError, ValueError) as e:
        title = {QueueFullError: QUEUE_FULL, NonFiniteImageError: NO_IMAGE}.get(type(e), INVALID_REQUEST)
        log.info("%s: %s", title, e)
        raise gr.Error(str(e), title=title, print_exception=False) from e


def _routed(request: gr.Request | None, updates):
    """A handler's updates as its route takes them: /run/ answers with the first value yielded, so
    there only the last is yielded."""
    if route(getattr(getattr(request, "url", None), "path", "")) == "run":
        *_, last = updates
        yield last
    else:
        yield from updates


def _owner(request: gr.Request | None) -> str | None:
    """Whose call it is (`http_errors.owner`): its browser session or client, or for raw HTTP its address."""
    path = getattr(getattr(request, "url", None), "path", "")
    headers = getattr(request, "headers", None) or {}
    return owner(path, getattr(request, "session_hash", None), headers.get("x-forwarded-for"),
                 getattr(getattr(request, "client", None), "host", None))


def _described(handler, endpoint: str, fields: list[str], optional: list[str]):
    """`handler` (a generator taking `**form`) as the API and the MCP tools describe it: named after
    `endpoint`, its docstring saying what it and each of `fields` is (`sdxl.serving.endpoints`), and its
    signature naming the fields, those in `optional` defaulting to None (Gradio's API makes a parameter
    optional only where the handler's signature gives it a default, and a control image or a mask,
    which have no initial value, must be optional)."""
    @functools.wraps(handler)
    def described(*args, **kwargs):
        yield from handler(*args, **kwargs)

    signature = inspect.signature(handler)
    *named, form = signature.parameters.values()
    keywords = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                  **({"default": None} if name in optional else {})) for name in fields]
    described.__signature__ = signature.replace(parameters=[*named, *keywords, form])
    described.__name__ = described.__qualname__ = endpoint
    described.__doc__ = endpoints.docstring(endpoint, fields)
    return described


def _by_the_service(field):
    """Gradio checks a number's bounds and a choice's options before the handler runs, with messages
    that do not name the field, and text sent for a number reaches the client as a generic error.
    The values go unchanged to the service's checks instead, whose sentences name the field.
    (Replaced on the instance: Gradio writes a .pyi stub beside a module that subclasses a component.)"""
    field.preprocess = lambda payload: payload
    return field


def _length_line(elem_id: str) -> gr.Markdown:
    """The line under a prompt box that says how long the prompt is."""
    return gr.Markdown("", elem_id=elem_id, elem_classes="prompt-length")


def _header(service: DemoService) -> None:
    recommended = service.recommended
    models = ", ".join(f"`{model.label}` ({model.pipe.spec.sampling})" for model in service.models)
    gr.Markdown(f"# SDXL on JAX\n{models} on {service.pipe.device_description}: one image per core.")
    defaults = (f"{recommended.note}: the defaults below are {recommended.steps} step(s) at guidance "
                f"{recommended.guidance_scale:g}." if recommended.note else "")
    if service.notice:  # one line above the controls; the reason and the way to real models behind it
        gr.Markdown(f"**Showing the built-in {service.model_label} model instead** of the one asked for: "
                    "it draws coloured shapes from a few English words (try the examples).", elem_id="model-notice")
        with gr.Accordion("Why, and how to get SDXL", open=False, elem_id="model-notice-details"):
            gr.Markdown(f"{service.notice}\n\n{defaults}")
    elif defaults:
        gr.Markdown(defaults, elem_id="model-settings")
    if service.launch_notes:
        gr.Markdown("\n\n".join(service.launch_notes), elem_id="launch-notes", elem_classes="prompt-length")


def _model_choice(service: DemoService) -> gr.Dropdown:
    """The model every tab draws with, as A1111's checkpoint selector: shown where several are served."""
    choices = service.choices.models
    return gr.Dropdown(choices, value=choices[0][1], label="Model", elem_id="model", visible=len(choices) > 1,
                       info="the models served: every tab draws with the one chosen here")


def _generate_tab(service: DemoService) -> dict:
    choices, c = service.choices, {}
    with gr.Tab("Generate", id="generate-tab"):
        c["prompt"] = gr.Textbox("", label="Prompt", placeholder=service.recommended.placeholder, lines=2,
                                 elem_id="prompt", info="Ctrl+Enter generates; (word:1.2) weighs a word, BREAK starts "
                                 "a new chunk")
        c["prompt_length"] = _length_line("prompt-length")
        c["negative"] = gr.Textbox("", label="Negative prompt", placeholder="What to avoid (optional)")
        c["negative_length"] = _length_line("negative-length")
        if choices.embeddings:
            gr.Markdown(choices.embeddings, elem_id="embeddings", elem_classes="prompt-length")
        c["style"] = gr.Dropdown(choices.styles, value=choices.styles[0], label="Style")
        c["read_settings"] = gr.Button("↙ Read the settings pasted in the prompt", size="sm", elem_id="read-settings",
                                       variant="secondary")
        c["run"] = gr.Button("Generate", variant="primary", elem_id="generate")
        gr.Examples(choices.examples, inputs=[c["prompt"], c["style"]])
    return c


def _image_tab(service: DemoService) -> dict:
    c = {}
    with gr.Tab("Image to image", id="image-tab"):
        c["editor"] = gr.ImageEditor(
            label="Image: upload one, or send one from the gallery; paint over what to repaint", type="pil",
            sources=["upload", "clipboard"], layers=False, elem_id="image-editor", height=320,
            brush=gr.Brush(colors=["#ffffff"], color_mode="fixed"),
        )
        c["image_prompt"] = gr.Textbox("", label="Prompt", lines=2, elem_id="image-prompt")
        c["image_prompt_length"] = _length_line("image-prompt-length")
        c["strength"] = gr.Slider(0.05, 1, value=service.choices.strength, step=0.05, label="Strength",
                                  info="how much changes: low keeps the picture, 1 redraws it (inpainting: only where "
                                  "painted)")
        c["image_run"] = gr.Button("Generate from image", variant="primary", elem_id="image-generate")
    return c


def _compare_tab(service: DemoService) -> dict:
    styles, c = service.choices.styles, {}
    with gr.Tab("Compare"):
        c["mode"] = gr.Radio(list(service.compare_modes), value=COMPARE_PROMPTS, label="Compare")
        c["compare_prompts"] = gr.Textbox("", label=_prompts_label(COMPARE_PROMPTS), lines=4, elem_id="compare-prompts")
        c["compare_negative"] = gr.Textbox("", label="Negative prompt")
        c["compare_style"] = gr.Dropdown(styles, value=styles[0], label="Style")
        # A slider's range needs two ends, even where one image a call hides it.
        c["num_seeds"] = gr.Slider(1, max(2, service.max_images), value=service.pipe.num_devices, step=1,
                                   label="Seeds", visible=_seeds_shown(service, COMPARE_PROMPTS),
                                   elem_id="compare-seeds")
        c["compare_run"] = gr.Button("Compare", variant="primary")
    return c


def _prompts_label(mode: str) -> str:
    """Compare's text box's label: several prompts are compared in one mode, the others take one."""
    return "Prompts (one per line) or one prompt" if mode == COMPARE_PROMPTS else "Prompt"


def _seeds_shown(service: DemoService, mode: str) -> bool:
    """Whether Compare's Seeds slider is shown: only consecutive seeds read it, and one image a call leaves nothing
    to choose."""
    return mode == COMPARE_SEEDS and service.max_images > 1


def _grid_tab(service: DemoService) -> dict:
    c = {}
    with gr.Tab("Grid"):
        c["grid_prompt"] = gr.Textbox("", label="Prompt", lines=2, elem_id="grid-prompt")
        c["grid_prompt_length"] = _length_line("grid-prompt-length")
        for axis, value, values in (("x", "seed", "1-4"), ("y", "guidance_scale", "3, 7")):
            with gr.Row():
                c[f"{axis}_axis"] = gr.Dropdown(service.choices.axes, value=value, label=f"{axis.upper()} axis")
                c[f"{axis}_values"] = gr.Textbox(values, label=f"{axis.upper()} values", info=AXIS_VALUES_HINT)
        c["grid_run"] = gr.Button("Make grid", variant="primary", elem_id="grid-run")
    return c


def _upscale_tab(service: DemoService) -> dict:
    choices, c = service.choices, {}
    with gr.Tab("Upscale", id="upscale-tab"):
        c["upscale_in"] = gr.Image(label="Image: upload one, or send one from the gallery", type="filepath",
                                   sources=["upload", "clipboard"], elem_id="upscale-in", height=320)
        with gr.Row():
            c["upscaler"] = gr.Dropdown(choices.upscalers, value=choices.upscalers[0][1], label="Upscaler",
                                        info="a resize, or a model upscaler loaded at launch: an ESRGAN-family "
                                        ".safetensors file (4x-UltraSharp, RealESRGAN_x4plus: OpenModelDB lists "
                                        "them) given as python app.py --upscaler FILE")
            c["upscale_by"] = gr.Slider(*UPSCALE_RANGE, value=2, step=0.25, label="Upscale by")
        c["upscale_run"] = gr.Button("Upscale", variant="primary", elem_id="upscale-run")
        c["upscaled"] = gr.Image(label="Upscaled", type="pil", format="png", interactive=False, elem_id="upscaled")
        c["upscale_status"] = gr.Markdown(elem_id="upscale-status")
    return c


def _control_panel(service: DemoService) -> tuple[gr.Accordion, list[dict]]:
    """For each launched ControlNet, its picture, preprocessor and the map they make, a Union's control
    mode, and its scale, start and end, by `ControlForm` field (and "map")."""
    panels = []
    with gr.Accordion("ControlNet", open=False, elem_id="controlnet") as accordion:
        gr.Markdown("Steer every tab's images with edges, a depth map or a pose: upload a picture or send one "
                    "from the gallery. Canny draws its edges; a depth map or an OpenPose skeleton is given as it "
                    "is. It steers from Start to End, fractions of the steps, with Scale's strength. Clear the "
                    "picture to generate without it.", elem_classes="prompt-length")
        for k, controlnet in enumerate(service.choices.controlnets):
            suffix, fields, canny = f"-{k}" if k else "", {}, controlnet.preprocessor == "canny"
            with gr.Group():
                with gr.Row():
                    fields["picture"] = gr.Image(label=f"Control image · {controlnet.label}", type="filepath",
                                                 format="png", height=220, sources=["upload", "clipboard"],
                                                 elem_id=f"control-image{suffix}")
                    fields["map"] = gr.Image(label="Control map", format="png", height=220, interactive=False,
                                             elem_id=f"control-map{suffix}")
                fields["preprocessor"] = gr.Radio([("Canny edges", "canny"), ("None: the picture is the map", "none")],
                                                  value=controlnet.preprocessor, label="Preprocessor")
                with gr.Row():
                    for field, which in (("canny_low", "low"), ("canny_high", "high")):
                        fields[field] = gr.Slider(1, 255, value=getattr(ControlForm, field), step=1,
                                                  label=f"Canny {which} threshold", visible=canny)
                if controlnet.modes:
                    fields["mode"] = gr.Dropdown(controlnet.modes, value=controlnet.mode, label="Control mode",
                                                 info="what the control map is (a ControlNet Union)")
                with gr.Row():
                    fields["scale"] = gr.Slider(0, 2, value=service.choices.control_scale, step=0.05, label="Scale")
                    fields["start"] = gr.Slider(0, 1, value=0, step=0.05, label="Start")
                    fields["end"] = gr.Slider(0, 1, value=1, step=0.05, label="End")
            panels.append(fields)
    return accordion, panels


def _image_prompt_panel(service: DemoService) -> dict:
    """The image prompt (IP-Adapter) every tab takes, by `Settings` field (and its accordion)."""
    choices, default, c = service.choices, Settings(), {}
    with gr.Accordion("Image prompt", open=False, elem_id="ip-adapter") as c["ip_adapter_panel"]:
        gr.Markdown("Steer every tab's images with a picture's subject or style (IP-Adapter): upload one or send "
                    "one from the gallery. Style only takes its look and not its layout (InstantStyle). Clear the "
                    "picture to generate without it.", elem_classes="prompt-length")
        c["ip_adapter_image"] = gr.Image(label="Image prompt", type="filepath", format="png", height=220,
                                         sources=["upload", "clipboard"], elem_id="ip-adapter-image")
        c["ip_adapter"] = gr.Dropdown(choices.ip_adapters, value=choices.ip_adapters[0], label="IP-Adapter",
                                      info="the one that takes the picture", visible=len(choices.ip_adapters) > 1)
        with gr.Row():
            c["ip_adapter_scale"] = gr.Slider(*IP_ADAPTER_SCALE_RANGE, value=default.ip_adapter_scale, step=0.05,
                                              label="Scale", info="how much the picture counts beside the prompt")
            c["ip_adapter_layers"] = gr.Radio(choices.ip_adapter_layers, value=default.ip_adapter_layers,
                                              label="Layers", visible=len(choices.ip_adapter_layers) > 1)
    return c


def _hires_panel(service: DemoService) -> dict:
    """The hires fix, for the text-to-image tabs (Generate, Compare, Grid), by name."""
    choices, default, c = service.choices, Settings(), {}
    with gr.Accordion("Hires fix", open=False, elem_id="hires") as c["hires_panel"]:
        c["hires"] = gr.Checkbox(label="Hires fix", value=False, info="render, upscale, then render again at the "
                                 "bigger size, as AUTOMATIC1111 (Generate, Compare and Grid)")
        with gr.Row():
            c["hires_upscaler"] = gr.Dropdown(choices.hires_upscalers, value=default.hires_upscaler, label="Upscaler",
                                              info="Latent ones resize the latents; the others the picture")
            c["hires_scale"] = gr.Slider(1, 4, value=default.hires_scale, step=0.05, label="Upscale by")
        with gr.Row():
            c["hires_steps"] = gr.Slider(0, choices.max_steps, value=default.hires_steps, step=1,
                                         label="Hires steps", info="0: as many as the first pass")
            c["hires_strength"] = gr.Slider(0.05, 1, value=default.hires_strength, step=0.05,
                                            label="Denoising strength", info="how much the second pass changes")
    return c


def _advanced(service: DemoService) -> dict:
    """The settings every tab shares, under Advanced, by name."""
    choices, pipe, c = service.choices, service.pipe, {}
    first = next(iter(choices.sizes))
    with gr.Accordion("Advanced", open=False) as c["advanced"]:
        with gr.Row():
            # precision=None: Gradio would round a fractional seed (1.5 -> 2) before our check sees it.
            c["seed"] = gr.Number(label="Seed", value=0, precision=None, minimum=0, maximum=choices.max_seed)
            c["randomize"] = gr.Checkbox(label="Randomize seed", value=True)
        c["guidance"] = gr.Slider(*choices.guidance_range, value=choices.guidance_scale, step=0.5,
                                  label="Guidance scale",
                                  info="1 or less: no guidance, one UNet pass per step (about twice as fast)")
        c["guidance_rescale"] = gr.Slider(0, 1, value=0, step=0.05, label="CFG rescale",
                                          info="Lin et al.'s rescale of the guided prediction, for v-prediction "
                                          "models with zero terminal SNR; 0.7 is usual, 0 turns it off")
        c["steps"] = gr.Slider(1, choices.max_steps, value=choices.steps, step=1, label="Steps")
        c["size"] = gr.Dropdown(list(choices.sizes), value=first, label="Size",
                                info="Image to image takes the size nearest its picture's")
        c["per_core"] = gr.Slider(1, max(2, service.max_images_per_core), value=1, step=1, label="Images per core",
                                  visible=service.max_images_per_core > 1)
        with gr.Row():
            c["sampler"] = gr.Dropdown(choices.samplers, value=choices.sampler, label="Sampler",
                                       info="the model's own by default; each compiles once, then stays cached")
            c["schedule_type"] = gr.Dropdown(choices.schedule_types, value="", label="Schedule type",
                                             info="an A1111 type (Karras, ...) samples as AUTOMATIC1111 and Forge "
                                             "do, from text")
        c["emphasis"] = gr.Dropdown(choices.emphasis, value=service.emphasis, label="Emphasis",
                                    info="how (word:1.2) weights apply, as in AUTOMATIC1111: Original keeps each "
                                    "chunk's mean, No norm does not, None reads brackets as text")
        with gr.Row():
            c["clip_skip"] = gr.Slider(*CLIP_SKIP_RANGE, value=1, step=1, label="Clip skip",
                                       info="as AUTOMATIC1111: SD 1.x reads its text encoder this many layers from "
                                       "the last; SD 2.x and SDXL ignore it")
            c["sdxl_clip_l_skip"] = gr.Checkbox(label="Clip skip SDXL", value=False, visible=pipe.spec.is_sdxl,
                                                info="as AUTOMATIC1111's setting: SDXL's CLIP-L encoder skips too")
        with gr.Row(visible=pipe.refiner is not None):
            c["refine"] = gr.Checkbox(label="Refine", value=False,
                                      info=f"finish with {pipe.refiner is not None and pipe.refiner.name}")
            c["refine_from"] = gr.Slider(0.5, 0.95, value=choices.refine_from, step=0.05, label="Refiner takes over at",
                                         info="the fraction of the noise the base model removes first")
        with gr.Row():
            c["noise_source"] = gr.Dropdown(choices.noise_sources, value="jax", label="Noise (RNG)",
                                            info="NV or CPU: the noise AUTOMATIC1111, Forge and ComfyUI draw for "
                                            "a seed")
            c["ensd"] = gr.Number(label="ENSD", value=0, precision=None, minimum=0, maximum=choices.max_seed,
                                  info="A1111's eta noise seed delta (NV or CPU), often 31337")
        with gr.Row():
            c["variation_seed"] = gr.Number(label="Variation seed", value=0, precision=None, minimum=0,
                                            maximum=choices.max_seed)
            c["variation_strength"] = gr.Slider(0, 1, value=0, step=0.01, label="Variation strength",
                                                info="mixes in the variation seed's noise, as A1111 (NV or CPU)")
        c["loras"] = [gr.Slider(*choices.lora_scale_range, value=scale, step=0.05, label=label,
                                info="0 turns it off; changing LoRAs never recompiles")
                      for label, scale in choices.loras]
        # None until a size is chosen: a request then takes its model's first size (the API's default too).
        c["width"], c["height"] = (gr.Number(value=None, precision=None, visible=False) for _ in "wh")
    return c


def _results(service: DemoService) -> dict:
    """The gallery, the status and what acts on a result (send, reuse, history), by name."""
    pixelated, c = _pixelated(service), {}
    c["gallery"] = gr.Gallery(label="Images", columns=min(4, service.max_images), format="png", elem_id="gallery",
                              interactive=False, height="auto", object_fit="contain", elem_classes=pixelated)
    c["status"] = gr.Markdown(elem_id="status")
    c["info"] = gr.Textbox(label="Generation info (the selected image's; copy it to share its settings)", lines=2,
                           max_lines=8, interactive=False, buttons=["copy"], elem_id="generation-info")
    with gr.Row():
        c["send"] = gr.Button("Send the selected image to image-to-image", size="sm", elem_id="send")
        c["send_control"] = gr.Button("Send it to ControlNet", size="sm", elem_id="send-control",
                                      visible=bool(service.pipe.controlnets))
        c["send_ip_adapter"] = gr.Button("Send it to image prompt", size="sm", elem_id="send-ip-adapter",
                                         visible=bool(service.pipe.ip_adapters))
        c["send_upscale"] = gr.Button("Send it to Upscale", size="sm", elem_id="send-upscale")
        c["reuse_run"] = gr.Button("Reuse its settings", size="sm", elem_id="reuse")
    c["grid_image"] = gr.Image(label="Grid", type="pil", format="png", visible=False, elem_id="grid-image")
    c["reuse_file"] = gr.File(label="Drop a PNG made here or by A1111 (or a text of its settings) to reuse them",
                              file_types=[".png", ".txt"], elem_id="reuse-png")
    c["reuse_report"] = gr.Markdown(elem_id="reuse-report", elem_classes="prompt-length")
    return c


def _pixelated(service: DemoService) -> str | None:
    """The galleries' class: pictures of a few dozen pixels are shown as pixels, not blurred."""
    return "pixelated" if max(service.sizes[0]) <= 256 else None


def _history(service: DemoService) -> dict:
    """This session's results, to reuse: below the settings, which a phone shows first."""
    c = {}
    with gr.Accordion("History (this session)", open=False, elem_id="history-section"):
        c["history"] = gr.Gallery(label="Earlier results: select one, then reuse its settings", columns=6, height=200,
                                  format="png", elem_id="history", interactive=False, object_fit="contain",
                                  elem_classes=_pixelated(service))
        c["history_reuse"] = gr.Button("Reuse the selected result's settings", size="sm")
    return c


def create_demo(handlers: Handlers) -> gr.Blocks:
    service = handlers.service
    # Generated images are served from Gradio's cache: clear what is older than an hour, every 10 minutes.
    with gr.Blocks(title="SDXL on JAX", delete_cache=CACHE_EXPIRY) as blocks:
        _header(service)
        page = {"model": _model_choice(service)}
        # The tabs and, under them, the panels on the left, the gallery on the right: on a laptop
        # screen the prompt, the button and the pictures are all in view. On a phone the columns stack
        # in this order, the gallery right under the tabs' buttons (style.css, #layout).
        with gr.Row(equal_height=False, elem_id="layout"):
            with gr.Column(scale=1, min_width=380, elem_id="tabs-column"):
                with gr.Tabs() as page["tabs"]:
                    for tab in (_generate_tab, _image_tab, _compare_tab, _grid_tab, _upscale_tab):
                        page |= tab(service)
            with gr.Column(scale=1, min_width=380, elem_id="results-column"):
                page |= _results(service)
            with gr.Column(scale=1, min_width=380, elem_id="panels-column"):
                page["control_panel"], controls = _control_panel(service) if service.pipe.controlnets else (None, [])
                page |= _image_prompt_panel(service) if service.pipe.ip_adapters else {}
                page |= _hires_panel(service)
                page |= _advanced(service)
                page |= _history(service)
        # The API's image inputs, filled from the editor for the page's own requests.
        page["image_in"], page["mask_in"] = (gr.Image(type="filepath", format="png", visible=False) for _ in "12")
        # The selected thumbnail's index, which a click's `SELECTED` reads from the page; the image it picked.
        page["selected_index"] = gr.Number(-1, visible=False)
        page["picked"], page["history_picked"] = gr.State(None), gr.State(None)
        page["past"] = gr.State([])  # this browser session's results, newest first
        forms = _forms(service, page, controls)
        for field in {id(field): field for form in forms.values() for field in form.values()}.values():
            _by_the_service(field)
        for field in (page["upscaler"], page["upscale_by"]):
            _by_the_service(field)
        _wire_submits(handlers, page, forms)
        _wire_live(handlers, page, controls)
        _wire_results(handlers, page, controls)
    blocks.queue(max_size=service.queue.max_queued, default_concurrency_limit=service.queue.max_queued)
    return blocks


# The settings under Advanced that draw A1111's pictures, by their names in every form (`Settings`'
# fields): after the other settings in every form, in the order they joined, so that the values before them
# keep their places in the API (the hires fix's and the IP-Adapters' come after: docs/api.md gives the order).
A1111_FIELDS = ("noise_source", "ensd", "variation_seed", "variation_strength", "schedule_type", "clip_skip",
                "sdxl_clip_l_skip")
# The hires fix's, after those, in the text-to-image tabs' forms.
HIRES_FIELDS = ("hires", "hires_upscaler", "hires_scale", "hires_steps", "hires_strength")


def _forms(service: DemoService, page: dict, controls: list[dict]) -> dict[str, dict]:
    """Each tab's form: its fields by the names its handler and its API endpoint take, in the API's order."""
    p = page
    loras = dict(zip(service.lora_parameters, p["loras"]))
    control = {name: fields[field] for names, fields in zip(service.control_parameters, controls)
               for field, name in names.items() if field in fields}
    common = {"seed": p["seed"], "guidance_scale": p["guidance"], "steps": p["steps"]}
    size = {"width": p["width"], "height": p["height"]}
    options = {"sampler": p["sampler"], "emphasis": p["emphasis"]}
    refining = {"refine": p["refine"], "refine_from": p["refine_from"]}
    prompts = {"negative_prompt": p["negative"], "style": p["style"]}
    a1111 = {name: p[name] for name in A1111_FIELDS}
    hires = {name: p[name] for name in HIRES_FIELDS}
    image_prompt = {name: p[name] for name in IP_ADAPTER_FIELDS if name in p}  # with IP-Adapters: after the others
    model = {"model": p["model"]}  # last but for what joined after it
    later = {"guidance_rescale": p["guidance_rescale"]}  # after the rest, so their places in the API stay
    return {
        "generate": {"prompt": p["prompt"], **prompts, **common, **size, "images_per_core": p["per_core"], **options,
                     **refining, **loras, **control, **a1111, **hires, **image_prompt, **model, **later},
        "image_to_image": {"prompt": p["image_prompt"], **prompts, **common, "image": p["image_in"],
                           "mask": p["mask_in"], "strength": p["strength"], "images_per_core": p["per_core"],
                           **options, **refining, **loras, **control, **a1111, **image_prompt, **model, **later},
        "compare": {"mode": p["mode"], "prompts": p["compare_prompts"], "negative_prompt": p["compare_negative"],
                    "style": p["compare_style"], "seed": p["seed"], "num_seeds": p["num_seeds"],
                    "guidance_scale": p["guidance"], "steps": p["steps"], **size, **options, **loras, **control,
                    **a1111, **hires, **image_prompt, **model, **later},
        "grid": {"prompt": p["grid_prompt"], **prompts, **common, **size, **options, "x_axis": p["x_axis"],
                 "x_values": p["x_values"], "y_axis": p["y_axis"], "y_values": p["y_values"], **loras, **control,
                 **a1111, **hires, **image_prompt, **model, **later},
    }


def _wire_submits(handlers: Handlers, p: dict, forms: dict[str, dict]) -> None:
    """Each tab's button: a fresh seed (unless fixed), the check, then the handler; then the history."""
    limit, max_seed = handlers.service.queue.max_queued, handlers.service.choices.max_seed

    def pick_seed(seed, randomize):
        return random.randint(0, max_seed) if randomize else seed

    def remember(results, past):
        """The session's history: the newest results first, at most 48; and the first result's generation info."""
        past = ([(path, None) for path, _ in results or []] + list(past))[:48]  # Gallery gives (path, caption)
        return past, past, handlers.parameters_of(results[0][0] if results else None)

    def seeded(trigger):
        return trigger(pick_seed, [p["seed"], p["randomize"]], p["seed"], api_name=False, queue=False)

    def checked_then_submitted(listen, tab: str, outputs: list, api_name):
        """`listen` (an event, or `.then` of one) runs the check, queued and with no outputs (Gradio shows a
        queued event's error as one message, and marks no output with an error badge), then the handler."""
        check = listen(handlers.check(tab), inputs_kwargs=forms[tab], outputs=None, api_name=False,
                       show_progress="hidden")
        return check.success(handlers.submit(tab, list(forms[tab])), inputs_kwargs=forms[tab], outputs=outputs,
                             api_name=api_name, concurrency_limit=limit)

    answer, history = [p["gallery"], p["status"]], dict(fn=remember, inputs=[p["gallery"], p["past"]],
                                                        outputs=[p["past"], p["history"], p["info"]], api_name=False,
                                                        queue=False)
    for trigger, api_name in ((p["run"].click, "generate"), (p["prompt"].submit, False)):
        checked_then_submitted(seeded(trigger).then, "generate", answer, api_name).success(**history)
    edited = seeded(p["image_run"].click).then(picture_and_mask, p["editor"], [p["image_in"], p["mask_in"]],
                                               api_name=False, queue=False)
    checked_then_submitted(edited.then, "image_to_image", answer, "image_to_image").success(**history)
    checked_then_submitted(seeded(p["compare_run"].click).then, "compare", answer, "compare").success(**history)
    checked_then_submitted(p["grid_run"].click, "grid", [p["grid_image"], *answer], "grid").success(
        lambda: gr.update(visible=True), None, p["grid_image"], api_name=False, queue=False).then(**history)
    for button in (p["run"], p["image_run"], p["compare_run"]):
        button.click(lambda: gr.update(visible=False), None, p["grid_image"], api_name=False, queue=False)
    for trigger in (p["run"].click, p["prompt"].submit, p["image_run"].click, p["compare_run"].click,
                    p["grid_run"].click):
        trigger(None, js=SHOW_RESULTS, api_name=False, queue=False)
    p["upscale_run"].click(handlers.upscale, [p["upscale_in"], p["upscaler"], p["upscale_by"]],
                           [p["upscaled"], p["upscale_status"]], api_name="upscale", concurrency_limit=1).success(
        None, js=SHOW_UPSCALED, api_name=False, queue=False)


def _wire_live(handlers: Handlers, p: dict, controls: list[dict]) -> None:
    """What follows the form as it is filled in: the size's numbers, each prompt's length, the control maps,
    Compare's text box and Seeds slider."""
    service = handlers.service
    sizes = {results.size_label(*size): size for model in service.models for size in model.sizes}  # every model's
    # In the page, so that a Generate clicked right after a size is chosen reads it: a request to the server
    # could reach a loaded one after the click's.
    p["size"].change(None, p["size"], [p["width"], p["height"]], js=f"(label) => ({json.dumps(sizes)})[label]",
                     api_name=False)
    # A model chosen by hand brings its own sizes and defaults (one chosen by reusing a picture's settings brings
    # the picture's).
    p["model"].input(handlers.model_defaults, p["model"], [p["size"], p["steps"], p["guidance"], p["sampler"]],
                     api_name=False, queue=False, show_progress="hidden")
    for box, line, negative in ((p["prompt"], p["prompt_length"], False), (p["negative"], p["negative_length"], True),
                                (p["image_prompt"], p["image_prompt_length"], False),
                                (p["grid_prompt"], p["grid_prompt_length"], False)):
        gr.on([box.change, p["emphasis"].change, p["model"].change],
              functools.partial(handlers.prompt_length, negative=negative), [box, p["emphasis"], p["model"]], line,
              api_name=False, queue=False, show_progress="hidden")

    def compare_mode(mode: str) -> list:
        return [gr.update(label=_prompts_label(mode)), gr.update(visible=_seeds_shown(service, mode))]

    p["mode"].change(compare_mode, p["mode"], [p["compare_prompts"], p["num_seeds"]], api_name=False, queue=False,
                     show_progress="hidden")
    for fields in controls:
        map_inputs = [fields[name] for name in ("picture", "preprocessor", "canny_low", "canny_high")]
        changes = [fields["picture"].change, fields["preprocessor"].change, fields["canny_low"].release,
                   fields["canny_high"].release, p["width"].change, p["height"].change]
        gr.on([*changes, p["model"].change], handlers.control_map, [*map_inputs, p["width"], p["height"], p["model"]],
              fields["map"], api_name=False, queue=False, show_progress="hidden")
        fields["preprocessor"].change(lambda name: [gr.update(visible=name == "canny")] * 2, fields["preprocessor"],
                                      [fields["canny_low"], fields["canny_high"]], api_name=False, queue=False,
                                      show_progress="hidden")


def _wire_results(handlers: Handlers, p: dict, controls: list[dict]) -> None:
    """Selecting an image, and what acts on it: send it to a tab, or reuse its settings (or a dropped PNG's)."""

    def selected_info(event: gr.SelectData) -> str:
        return handlers.parameters_of(event.value["image"]["path"] if event.value else None)

    def picked(images: list | None, index: float | None) -> str:
        """The path of the image at `index` (the page's selected thumbnail, -1 for none) among `images`."""
        if not images or index is None or not 0 <= index < len(images):
            raise gr.Error("select an image first (click one in the gallery, or in the history)",
                           title="Nothing selected", print_exception=False)
        return images[int(index)][0]

    def chosen(button, gallery, picked_path):
        """`button`'s click, refused with a message unless an image of `gallery` is selected, whose path it keeps
        in `picked_path`; returns the `success` chain. The selection is read in the page as the click is sent: a
        gallery's select, a request of its own, can reach a loaded server after the click sent right behind it."""
        return button.click(picked, [gallery, p["selected_index"]], picked_path, js=SELECTED % gallery.elem_id,
                            api_name=False, show_progress="hidden").success

    p["gallery"].select(selected_info, None, p["info"], api_name=False, queue=False)  # its generation info
    # The editor cleared in the page first (`CLEAR_EDITOR`), then the picture, the image prompt
    # (Generate's, unless it has its own) and the tab, in one update.
    chosen(p["send"], p["gallery"], p["picked"])(None, js=CLEAR_EDITOR, api_name=False, queue=False).then(
        lambda path, text, own: [path, own or text, gr.Tabs(selected="image-tab")],
        [p["picked"], p["prompt"], p["image_prompt"]], [p["editor"], p["image_prompt"], p["tabs"]], api_name=False,
        queue=False)
    chosen(p["send_upscale"], p["gallery"], p["picked"])(
        lambda path: [path, gr.Tabs(selected="upscale-tab")], p["picked"], [p["upscale_in"], p["tabs"]],
        api_name=False, queue=False)
    if controls:
        chosen(p["send_control"], p["gallery"], p["picked"])(
            lambda path: [path, gr.Accordion(open=True)], p["picked"], [controls[0]["picture"], p["control_panel"]],
            api_name=False, queue=False)
    if "ip_adapter_panel" in p:
        chosen(p["send_ip_adapter"], p["gallery"], p["picked"])(
            lambda path: [path, gr.Accordion(open=True)], p["picked"], [p["ip_adapter_image"], p["ip_adapter_panel"]],
            api_name=False, queue=False)
    # The image prompt's fields but its picture, which no PNG holds; with IP-Adapters only.
    fields = {"model": p["model"], "prompt": p["prompt"], "negative_prompt": p["negative"], "seed": p["seed"],
              "guidance_scale": p["guidance"], "steps": p["steps"], "sampler": p["sampler"],
              "emphasis": p["emphasis"], "size": p["size"], "guidance_rescale": p["guidance_rescale"],
              **{name: p[name] for name in (*A1111_FIELDS, *HIRES_FIELDS, *IP_ADAPTER_FIELDS[1:]) if name in p}}

    def reuse(found: dict, said: str) -> dict:
        """The fields a PNG or a text fills in, a fixed seed where it has one, Advanced opened to show them,
        and what was done, kept on the page."""
        fixed = {p["randomize"]: False} if "seed" in found else {}
        if "model" in found:  # the size among that model's
            labels = [results.size_label(*size) for size in handlers.service.model(found["model"]).sizes]
            found["size"] = gr.Dropdown(choices=labels, value=found.get("size", labels[0]))
        return {fields[name]: value for name, value in found.items()} | fixed | {p["reuse_report"]: said} | (
            {p["advanced"]: gr.Accordion(open=True)} if found else {}) | (
            {p["hires_panel"]: gr.Accordion(open=True)} if found.get("hires") else {}) | (
            {p["ip_adapter_panel"]: gr.Accordion(open=True)} if "ip_adapter" in found else {})

    outputs = [*fields.values(), p["randomize"], p["advanced"], p["hires_panel"], p["reuse_report"],
               *([p["ip_adapter_panel"]] if "ip_adapter_panel" in p else [])]
    from_file = lambda file: reuse(*handlers.reuse(file))  # noqa: E731
    chosen(p["reuse_run"], p["gallery"], p["picked"])(from_file, p["picked"], outputs, api_name=False)
    chosen(p["history_reuse"], p["history"], p["history_picked"])(from_file, p["history_picked"], outputs,
                                                                  api_name=False)
    p["reuse_file"].upload(from_file, p["reuse_file"], outputs, api_name=False)
    p["read_settings"].click(lambda text: reuse(*handlers.reuse_text(text)), p["prompt"], outputs, api_name=False)



# On a phone the results sit under the tabs (style.css, #layout): a click that fills them scrolls there,
# so that what it starts is seen.
SHOW_RESULTS = """() => {
  if (window.matchMedia('(max-width: 799px)').matches) {
    document.querySelector('#results-column')?.scrollIntoView({behavior: 'smooth', block: 'start'});
  }
}"""

# The Upscale tab's result sits under its picture and settings: brought into view once made.
SHOW_UPSCALED = """() => {
  document.querySelector('#upscaled')?.scrollIntoView({behavior: 'smooth', block: 'center'});
}"""

# The index of the thumbnail a gallery (by elem_id) shows selected, -1 for none, beside the gallery's images: what
# Send and Reuse act on (Gradio 6.31 marks it with the class `selected`, labelled "Thumbnail N of M").
SELECTED = """(images) => {
  const label = document.querySelector('#%s .thumbnail-item.selected')?.getAttribute('aria-label');
  return [images, label ? Number(label.match(/\\d+/)[0]) - 1 : -1];
}"""

# Gradio 6.31's image editor, once it holds an upload, never shows a picture a handler sets (it spins
# until reloaded); its own "Clear canvas" button first puts it back where a new picture shows.
CLEAR_EDITOR = """() => {
  document.querySelector('#image-editor button[aria-label="Clear canvas"]')?.click();
}"""


def _mcp_images() -> None:
    """Gradio 6.31 gives an MCP client a gallery, and a handler's several outputs, as one text (their
    Python repr): each image goes as image content with its URL instead, then the status text."""
    from gradio.mcp import GradioMCPServer

    postprocess = GradioMCPServer.postprocess_output_data

    def items(output):
        if isinstance(output, dict) and isinstance(output.get("image"), dict):  # a gallery's (image, caption)
            yield output["image"]
        elif isinstance(output, list | tuple):
            for item in output:
                yield from items(item)
        else:
            yield output

    GradioMCPServer.postprocess_output_data = lambda self, data, root_url: postprocess(self, [*items(data)], root_url)


def main() -> None:
    parser = demo_parser(__doc__.splitlines()[0])
    options = parser.parse_args()
    try:
        service = launch.demo_service(options)
    except CheckpointError as e:  # missing, corrupt or not downloadable: the reason in a line, as the CLI says it
        parser.exit(2, f"error: {e}\n")
    if service is None:  # another host's process (--process-id 1 or more): it followed process 0 until that ended
        return
    blocks = create_demo(Handlers(service))
    if options.mcp:
        _mcp_images()
    endpoints = {name.lstrip("/"): [parameter["parameter_name"] for parameter in endpoint["parameters"]]
                 for name, endpoint in blocks.get_api_info()["named_endpoints"].items()}
    api_names = {index: fn.api_name for index, fn in blocks.fns.items() if fn.api_name in endpoints}
    errors = Middleware(HttpErrors, endpoints=endpoints, api_names=api_names, statuses=ERROR_STATUS)
    blocks.launch(
        server_name=options.host, server_port=options.port, share=options.share, max_file_size=MAX_UPLOAD,
        head="".join(f"<script>\n{(PAGE / name).read_text()}</script>" for name in ("keyboard.js", "inputs.js")),
        css=(PAGE / "style.css").read_text(),
        app_kwargs={"middleware": [errors]}, mcp_server=options.mcp,
    )


if __name__ == "__main__":
    main()
