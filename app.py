"""Gradio demo: Stable Diffusion XL in JAX, one image per accelerator core.

python app.py [--model M] [--lora FILE[:SCALE] ...] [--refiner R] [--host H] [--port P] [--cache-dir D] [--share]

Every option also reads an environment variable (SDXL_MODEL, SDXL_HOST, ...), for Spaces.
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import random
import re
import time

import gradio as gr
import numpy as np
from PIL import Image
from starlette.middleware import Middleware

from sdxl import CheckpointError, enable_compilation_cache, grid, images, lora
from sdxl.checkpoints.known import recommended
from sdxl.http_errors import HttpErrors
from sdxl.images import image_count, model_label, parameters_text
from sdxl.lora import parse_option as parse_lora_option
from sdxl.pipeline import Pipeline
from sdxl.request import (
    DEFAULT_MODEL, DEFAULT_REFINE_FROM, GUIDANCE_SCALE_RANGE, LORA_SCALE_RANGE, MAX_SEED, Request, default_strength,
)
from sdxl.sampling import SAMPLER_NAMES
from sdxl.serving import FALLBACK_MODEL, QueueFullError, TextToImage, load_pipeline
from sdxl.styles import NO_STYLE, STYLES

# Uploads decode to at most this many pixels: PIL refuses twice as many, and warns above it.
Image.MAX_IMAGE_PIXELS = images.MAX_IMAGE_PIXELS

EXAMPLES = [
    ["a lighthouse on a cliff at dusk, waves crashing, warm light in the windows", "Cinematic"],
    ["a red fox sleeping in fresh snow, morning light", "Photographic"],
    ["a tiny robot watering a bonsai tree", "3D model"],
    ["a castle floating above the clouds", "Fantasy art"],
]


def _checked_by_the_service(field):
    """Gradio checks a number's bounds and a choice's options before the handler runs, with messages
    that do not name the field ("Value 0 is less than minimum value 1."), and text sent for a number
    makes its check raise a TypeError that reaches the client as a generic error; a list sent for a
    prompt would be rendered as its Python text. The values go
    unchanged to the service's validation instead (`sdxl.request`), whose one-sentence message names
    the field and what it allows. (Replaced on the instance, not subclassed: Gradio writes a .pyi
    stub beside any module that subclasses a component.)"""
    field.preprocess = lambda payload: payload


def _report_background_compile(what: int | str, guided: bool, compiling) -> None:
    """`what`: a batch size, or the program compiled ("inpainting")."""
    error = compiling.exception()
    outcome = f"failed: {error}" if error else f"{compiling.result():.1f} s"
    label = f"batch {what}" if isinstance(what, int) else what
    print(f"background compile of {label}{'' if guided else ' without guidance'}: {outcome}", flush=True)


log = logging.getLogger("sdxl.demo")

# Gradio notices that a client has gone only when a handler yields: handlers that wait yield "no
# change" this often.
KEEPALIVE_SECONDS = 1.0
# The titles of errors for the user, and the HTTP status each gives an answer on /run/.
INVALID_REQUEST, QUEUE_FULL, NO_IMAGE = "Invalid request", "Queue full", "No image"
ERROR_STATUS = {INVALID_REQUEST: 422, QUEUE_FULL: 503, NO_IMAGE: 500}


def _size_label(width: int, height: int) -> str:
    return f"{width}×{height}"



class Demo:
    """The event handlers: submit a request to the device queue, show progress and previews, return the gallery."""

    def __init__(self, service: TextToImage, model_name: str):
        self.service = service
        self.model_name = model_name

    def _submit(self, request: Request, owner: str | None):
        try:
            return self.service.queue.submit(request, owner)
        except QueueFullError as e:
            raise _user_error(str(e), title=QUEUE_FULL) from e

    def _render(self, request: Request, owner: str | None, progress: gr.Progress, note: str | None = None):
        """Yields (previews, status) while the request renders, then (its images, status).

        In between, it yields "no change" every second or so: Gradio stops a generator whose client
        has gone when it next yields, and closing this one gives the request up (`DeviceQueue.cancel`),
        so that nobody waits behind work whose result nobody will see."""
        ticket = self._submit(request, owner)
        with self._given_up_unless_done([ticket]):
            shown, quiet_since = None, time.monotonic()
            while not _done_within(ticket, 0.1):
                if ticket.step:
                    progress((ticket.step, ticket.steps), desc="Denoising", unit="steps")
                elif ticket.compiling:
                    size = _size_label(request.width, request.height)
                    progress(0, desc=f"Compiling for {size} (first use of this size, batch or sampler; cached after)")
                else:
                    ahead = self.service.queue.position(ticket)
                    progress(0, desc=f"Waiting in queue: {ahead} request(s) ahead" if ahead else "Starting")
                if ticket.previews is not None and ticket.previews is not shown:
                    shown = ticket.previews
                    previews = [(Image.fromarray(p), f"preview · step {ticket.step}") for p in shown]
                    yield previews, f"step {ticket.step} of {ticket.steps}: previews"
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > KEEPALIVE_SECONDS:
                    yield gr.skip()
                    quiet_since = time.monotonic()
        yield self._finished(request, ticket, ticket.future.result(), note)

    @contextlib.contextmanager
    def _given_up_unless_done(self, tickets):
        """Gives up the tickets not done when the block is left early: by an error, or by Gradio
        closing the handler's generator after its client went away."""
        try:
            yield
        finally:
            for ticket in tickets:
                if not ticket.future.done():
                    self.service.queue.cancel(ticket)

    def _finished(self, request: Request, ticket, result, note: str | None) -> tuple[list, str]:
        _raise_if_not_finite(result)
        for prompt in result.truncated_prompts:
            gr.Warning(f"Prompt truncated to {self.service.pipe.spec.max_tokens} tokens: {prompt[:80]!r}…")
        gallery = [(picture, f"seed {request.seeds[i]} · image {request.image_index[i]} · {result.devices[i]}")
                   for i, picture in enumerate(self._pictures(request, result))]
        notes = [note] if note else []
        if ticket.batch_images > len(request):
            notes.append(f"batched with other requests: {ticket.batch_images} images")
        if ticket.compiling:
            notes.append("includes compiling for this size, batch and sampler; next time it is cached")
        status = f"{image_count(len(request))} in {result.seconds:.1f} s on {self.service.pipe.device_description}"
        if notes:
            status += f" ({'; '.join(notes)})"
        return gallery, status

    def _pictures(self, request: Request, result) -> list[Image.Image]:
        """The images, each with its parameters in its PNG text: the prompts as the model read them."""
        pictures = []
        refiner = self.service.refiner_name
        for i, image in enumerate(result.images):
            picture = Image.fromarray(image)
            picture.info["parameters"] = parameters_text(
                prompt=self.service.pipe.read_prompt(request.prompts[i]),
                negative_prompt=self.service.pipe.read_prompt(request.negative_prompts[i]), steps=request.steps,
                sampler=SAMPLER_NAMES[request.sampler], guidance_scale=request.guidance_scales[i],
                seed=request.seeds[i], index=request.image_index[i], width=request.width, height=request.height,
                model=self.model_name, loras=request.loras or (),
                strength=None if request.images is None else request.strength,
                refiner=None if request.refine_from is None else (refiner, request.refine_from),
            )
            pictures.append(picture)
        return pictures

    def _handle(self, make_request, owner, progress):
        try:
            request, note = make_request()
        except ValueError as e:
            raise _user_error(str(e)) from e
        yield from self._render(request, owner, progress, note)

    # `lora_scales`: one per launched LoRA (`TextToImage.loras`), the last inputs of each endpoint.

    def generate(self, prompt, negative_prompt, style, seed, guidance_scale, steps, width, height, images_per_core,
                 sampler, refine, refine_from, *lora_scales, owner=None, progress=gr.Progress()):
        yield from self._handle(lambda: (self.service.request_images(
            prompt, negative_prompt, style, seed, guidance_scale, steps, width, height, images_per_core, sampler,
            lora_scales, _refining(refine, refine_from)), None), owner, progress)

    def image_to_image(self, prompt, negative_prompt, style, seed, guidance_scale, steps, image, mask, strength,
                       images_per_core, sampler, refine, refine_from, *lora_scales, owner=None,
                       progress=gr.Progress()):
        def make():
            picture, painted = (None if f is None else images.read_image(_path_of(f)) for f in (image, mask))
            return self.service.request_image_edit(
                prompt, negative_prompt, style, seed, guidance_scale, steps, picture, painted, strength,
                images_per_core, sampler, lora_scales, _refining(refine, refine_from),
            )

        yield from self._handle(make, owner, progress)

    def compare(self, mode, prompts, negative_prompt, style, seed, num_seeds, guidance_scale, steps, width, height,
                sampler, *lora_scales, owner=None, progress=gr.Progress()):
        if not isinstance(prompts, (str, type(None))):
            raise _user_error(f"prompts must be text (one per line), got {type(prompts).__name__} {prompts!r:.80}")
        if mode not in (COMPARE_PROMPTS, COMPARE_SEEDS):
            raise _user_error(f"compare mode must be {COMPARE_PROMPTS!r} or {COMPARE_SEEDS!r}, got {mode!r}")
        if mode == COMPARE_PROMPTS:
            make = lambda: (self.service.request_prompt_comparison(  # noqa: E731
                (prompts or "").splitlines(), negative_prompt, style, seed, guidance_scale, steps, width, height,
                sampler, lora_scales), None)
        else:
            make = lambda: (self.service.request_seed_comparison(  # noqa: E731
                (prompts or "").strip(), negative_prompt, style, seed, num_seeds, guidance_scale, steps, width, height,
                sampler, lora_scales), None)
        yield from self._handle(make, owner, progress)

    def grid(self, prompt, negative_prompt, style, seed, guidance_scale, steps, width, height, sampler,
             x_axis, x_values, y_axis, y_values, *lora_scales, owner=None, progress=gr.Progress()):
        """A comparison grid: its labelled image, the cells in the gallery, and a status with the
        number of device calls it took. Yields "no change" while it waits, as `_render` does."""
        start = time.perf_counter()
        try:
            plan = self.service.request_grid(
                prompt, negative_prompt, style, seed, guidance_scale, steps, width, height, sampler,
                x_axis or None, x_values, y_axis or None, y_values, lora_scales,
            )
        except ValueError as e:
            raise _user_error(str(e)) from e
        tickets = []
        with self._given_up_unless_done(tickets):
            for request in plan.requests:  # one at a time: those queued before a refusal are given up too
                tickets.append(self._submit(request, owner))
            pictures, compiled = [], False
            for done, (request, ticket) in enumerate(zip(plan.requests, tickets)):
                progress((done, len(tickets)), desc="Rendering the grid", unit="device calls")
                while not _done_within(ticket, KEEPALIVE_SECONDS):
                    yield gr.skip()
                result = ticket.future.result()
                _raise_if_not_finite(result)
                pictures.append(self._pictures(request, result))
                compiled |= ticket.compiling
        cells = [pictures[call][index] for call, index in plan.where]
        sheet = grid.labelled(cells, plan.x, plan.y, [cell.info["parameters"] for cell in cells])
        calls = len(plan.requests)
        status = (f"{image_count(len(cells))} in {time.perf_counter() - start:.1f} s, "
                  f"{calls} device call{'' if calls == 1 else 's'} on {self.service.pipe.device_description}")
        if compiled:
            status += " (includes compiling for this size, batch or sampler; next time it is cached)"
        yield sheet, [(cell, _cell_caption(plan, i)) for i, cell in enumerate(cells)], status

    def reuse(self, png):
        """The settings a PNG made by this demo (or A1111) records, for the form's fields; fields it
        does not name are left as they are."""
        keep = gr.update()
        if png is None:
            return [keep] * 8
        try:
            with Image.open(_path_of(png)) as picture:
                found = images.read_parameters(picture.info.get("parameters", ""))
        except (OSError, ValueError) as e:
            raise _user_error(f"cannot reuse that image's settings: {e}") from e
        samplers = {label: name for name, label in SAMPLER_NAMES.items()}
        size = (found.get("width"), found.get("height"))
        return [
            found["prompt"], found["negative_prompt"],
            found.get("seed", keep), False if "seed" in found else keep,
            found.get("guidance_scale", keep), found.get("steps", keep),
            samplers.get(found.get("sampler"), keep),
            _size_label(*size) if size in self.service.sizes else keep,
        ]


def _user_error(message: str, title: str = INVALID_REQUEST) -> gr.Error:
    """An error for the user: its sentence in the page or the API's answer, under a title that
    `HttpErrors` turns into the HTTP status of /run/'s answer; one line in the log, as a traceback
    would say nothing more."""
    log.info("%s: %s", title, message)
    return gr.Error(message, title=title, print_exception=False)


def _done_within(ticket, seconds: float) -> bool:
    done, _ = concurrent.futures.wait([ticket.future], timeout=seconds)
    return bool(done)


def _raise_if_not_finite(result) -> None:
    if not result.finite.all():
        raise _user_error("The model produced NaN/inf values instead of an image (numerical overflow). "
                          "Try another seed or fewer steps; the server is fine.", title=NO_IMAGE)


def _refining(refine, refine_from) -> float | None:
    return float(refine_from) if refine else None


def _path_of(file) -> str:
    """The server-side path of an uploaded file as a handler receives it (Gradio's FileData, or a dict
    from an API client, or a path)."""
    return file if isinstance(file, str) else (file["path"] if isinstance(file, dict) else file.path)


def _cell_caption(plan, i: int) -> str:
    labels = []
    columns = 1 if plan.x is None else len(plan.x.labels)
    if plan.y is not None:
        labels.append(f"{plan.y.name}: {plan.y.labels[i // columns]}")
    if plan.x is not None:
        labels.append(f"{plan.x.name}: {plan.x.labels[i % columns]}")
    return " · ".join(labels)


def _route(request: gr.Request | None) -> str | None:
    """How a call came in: "queue" (/gradio_api/queue/join: the page and gradio_client, in their
    session), "call" (raw HTTP through the queue), "run" (raw HTTP outside it), or None."""
    path = getattr(getattr(request, "url", None), "path", "")
    found = re.search(r"/gradio_api/(queue|call|run|api)/", path)
    return None if found is None else {"api": "run"}.get(found[1], found[1])


def _owner(request: gr.Request | None) -> str | None:
    """Whose request it is: the browser session or gradio_client. Gradio gives each raw HTTP call a
    session of its own, so those are the address they came from: they count against the per-user
    bound together."""
    if _route(request) in (None, "queue"):
        return getattr(request, "session_hash", None)
    forwarded = (request.headers.get("x-forwarded-for") or "").split(",")[0].strip()  # behind a proxy (Spaces)
    return f"address {forwarded or getattr(request.client, 'host', None)}"


def _gradio_handler(handler, sources):
    """`handler(*inputs, *lora_scales, owner=, progress=)` as Gradio calls it: with one named
    parameter per LoRA in its signature (so that the API calls them `lora_<file stem>`, not
    `param_10`), and the browser session (Gradio's `gr.Request`) as the requests' owner."""
    signature = inspect.signature(handler)
    fixed = [p for p in signature.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    names = ["lora_" + re.sub(r"\W", "_", lora.display_name(source)) for source in sources]
    names = [name if names.count(name) == 1 else f"{name}_{i}" for i, name in enumerate(names)]
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    scales = [inspect.Parameter(name, positional) for name in names]
    specials = [inspect.Parameter("request", positional, annotation=gr.Request),
                inspect.Parameter("progress", positional, default=gr.Progress())]

    def call(args):
        *inputs, request, progress = args  # Gradio passes its special arguments where the signature has them
        return handler(*inputs, owner=_owner(request), progress=progress)

    if inspect.isgeneratorfunction(handler):  # Gradio streams a generator function's outputs

        @functools.wraps(handler)
        def gradio_handler(*args):
            if _route(args[-2]) == "run":  # answered with the first value yielded: yield only the last
                *_, last = call(args)
                yield last
            else:
                yield from call(args)
    else:

        @functools.wraps(handler)
        def gradio_handler(*args):
            return call(args)

    gradio_handler.__signature__ = signature.replace(parameters=[*fixed, *scales, *specials])
    gradio_handler.__annotations__ = {"request": gr.Request}  # Gradio finds gr.Request by its type hint
    return gradio_handler


CACHE_EXPIRY = (600, 3600)  # Gradio's delete_cache: (every, older than), seconds
# Gradio's upload endpoint takes any file; bound what it accepts: a phone's photo is 2-5 MB.
MAX_UPLOAD = "8mb"

COMPARE_PROMPTS = "One prompt per line, same seed"
COMPARE_SEEDS = "One prompt, consecutive seeds"


# Ctrl+Enter (Cmd+Enter on a Mac) in a prompt box clicks its tab's button.
KEYBOARD_SCRIPT = """<script>
document.addEventListener("keydown", (event) => {
  if (event.key !== "Enter" || !(event.ctrlKey || event.metaKey)) return;
  const box = event.target.closest("[data-run]");
  const button = box && document.getElementById(box.dataset.run);
  if (button) { event.preventDefault(); button.click(); }
});
const label = () => {
  for (const [box, run] of [["prompt", "generate"], ["image-prompt", "image-generate"], ["grid-prompt", "grid-run"]]) {
    const element = document.getElementById(box);
    if (element) element.dataset.run = run;
  }
};
new MutationObserver(label).observe(document.documentElement, {childList: true, subtree: true});
</script>"""


def _mask_of(editor) -> tuple[Image.Image | None, Image.Image | None]:
    """The picture an image editor holds and, where a layer is painted, a mask (white where painted)."""
    if not editor or editor.get("background") is None:
        return None, None
    background = editor["background"]
    painted = [np.asarray(layer.convert("RGBA"))[..., 3] > 0 for layer in editor.get("layers") or []]
    if not painted or not np.any(painted):
        return background, None
    return background, Image.fromarray(np.any(painted, axis=0).astype(np.uint8) * 255)


def create_demo(demo: Demo) -> gr.Blocks:
    service = demo.service
    pipe = service.pipe
    settings = service.recommended
    native = service.sizes[0]
    # Generated images are served from Gradio's cache: clear what is older than an hour, every 10 minutes.
    with gr.Blocks(title="SDXL on JAX", delete_cache=CACHE_EXPIRY) as blocks:
        gr.Markdown(f"# SDXL on JAX\n`{demo.model_name}` on {pipe.device_description}: one image per core.")
        if service.notice:
            gr.Markdown(f"**Note:** {service.notice}", elem_id="model-notice")
        if settings.note:
            gr.Markdown(f"{settings.note}: the defaults below are {settings.steps} step(s) at guidance "
                        f"{settings.guidance_scale:g}.", elem_id="model-settings")
        # Controls on the left, the gallery on the right: on a laptop screen the prompt, the button and
        # the pictures are all in view; on a phone the columns stack.
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=380):
                with gr.Tabs() as tabs:
                    with gr.Tab("Generate", id="generate-tab"):
                        prompt = gr.Textbox("", label="Prompt", placeholder=settings.placeholder, lines=2,
                                            elem_id="prompt", info="Ctrl+Enter generates")
                        negative = gr.Textbox("", label="Negative prompt", placeholder="What to avoid (optional)")
                        style = gr.Dropdown(list(STYLES), value=NO_STYLE, label="Style")
                        run = gr.Button("Generate", variant="primary", elem_id="generate")
                        examples = [[text, NO_STYLE] for text in settings.examples] or EXAMPLES
                        gr.Examples(examples, inputs=[prompt, style])
                    with gr.Tab("Image to image", id="image-tab"):
                        editor = gr.ImageEditor(
                            label="Image: upload one, or send one from the gallery; paint over what to repaint",
                            type="pil", sources=["upload", "clipboard"], layers=False, elem_id="image-editor",
                            brush=gr.Brush(colors=["#ffffff"], color_mode="fixed"), height=320,
                        )
                        image_prompt = gr.Textbox("", label="Prompt", lines=2, elem_id="image-prompt")
                        strength = gr.Slider(0.05, 1, value=default_strength(pipe.spec, inpainting=False),
                                             step=0.05, label="Strength",
                                             info="how much changes: 0.3 keeps the picture, 1 redraws it "
                                             "(inpainting: only where painted)")
                        image_run = gr.Button("Generate from image", variant="primary", elem_id="image-generate")
                    with gr.Tab("Compare"):
                        mode = gr.Radio([COMPARE_PROMPTS, COMPARE_SEEDS], value=COMPARE_PROMPTS, label="Compare")
                        compare_prompts = gr.Textbox("", label="Prompts (one per line) or one prompt", lines=4)
                        compare_negative = gr.Textbox("", label="Negative prompt")
                        compare_style = gr.Dropdown(list(STYLES), value=NO_STYLE, label="Style")
                        num_seeds = gr.Slider(1, service.max_images, value=pipe.num_devices, step=1, label="Seeds")
                        compare_run = gr.Button("Compare", variant="primary")
                    with gr.Tab("Grid"):
                        grid_prompt = gr.Textbox("", label="Prompt", lines=2, elem_id="grid-prompt")
                        lora_axes = [grid.LORA_AXIS + lora.display_name(source) for source in service.loras]
                        axes = [("none", ""), *((name.replace("_", " "), name) for name in grid.AXES),
                                *((f"LoRA {name[len(grid.LORA_AXIS):]} scale", name) for name in lora_axes)]
                        with gr.Row():
                            x_axis = gr.Dropdown(axes, value="seed", label="X axis")
                            x_values = gr.Textbox("1-4", label="X values", info="comma-separated or one per "
                                                  "line; ranges like 1-4 for seeds and steps")
                        with gr.Row():
                            y_axis = gr.Dropdown(axes, value="guidance_scale", label="Y axis")
                            y_values = gr.Textbox("3, 7", label="Y values", info="a prompt axis whose first "
                                                  "value is in the prompt replaces it (Prompt S/R)")
                        grid_run = gr.Button("Make grid", variant="primary", elem_id="grid-run")
                with gr.Accordion("Advanced", open=False):
                    with gr.Row():
                        # precision=None: Gradio would round a fractional seed (1.5 -> 2) before our check sees it.
                        seed = gr.Number(label="Seed", value=0, precision=None, minimum=0, maximum=MAX_SEED)
                        randomize = gr.Checkbox(label="Randomize seed", value=True)
                    guidance = gr.Slider(
                        *GUIDANCE_SCALE_RANGE, value=settings.guidance_scale, step=0.5, label="Guidance scale",
                        info="1 or less: no guidance, one UNet pass per step (about twice as fast)",
                    )
                    steps = gr.Slider(1, pipe.max_steps, value=settings.steps, step=1, label="Steps")
                    size = gr.Dropdown([_size_label(w, h) for w, h in service.sizes], value=_size_label(*native),
                                       label="Size")
                    per_core = gr.Slider(1, service.max_images_per_core, value=1, step=1, label="Images per core")
                    sampler = gr.Dropdown(
                        [(label, name) for name, label in SAMPLER_NAMES.items()], value=pipe.spec.default_sampler,
                        label="Sampler", info="the model's own by default; each compiles once, then stays cached",
                    )
                    has_refiner = pipe.refiner is not None
                    with gr.Row(visible=has_refiner):
                        refine = gr.Checkbox(label="Refine", value=False, info=f"finish with {service.refiner_name}")
                        refine_from = gr.Slider(0.5, 0.95, value=DEFAULT_REFINE_FROM, step=0.05,
                                                label="Refiner takes over at", info="the fraction of the noise "
                                                "the base model removes first")
                    loras = [gr.Slider(*LORA_SCALE_RANGE, value=scale, step=0.05,
                                       label=f"LoRA {lora.display_name(source)}",
                                       info="0 turns it off; changing LoRAs never recompiles")
                             for source, scale in service.loras.items()]
                    width = gr.Number(value=native[0], precision=None, visible=False)
                    height = gr.Number(value=native[1], precision=None, visible=False)
            with gr.Column(scale=1, min_width=380):
                gallery = gr.Gallery(label="Images", columns=min(4, service.max_images), format="png",
                                     elem_id="gallery", interactive=False)
                status = gr.Markdown(elem_id="status")
                with gr.Row():
                    send = gr.Button("Send the selected image to image-to-image", size="sm", elem_id="send")
                    reuse_run = gr.Button("Reuse its settings", size="sm", elem_id="reuse")
                grid_image = gr.Image(label="Grid", type="pil", format="png", visible=False, elem_id="grid-image")
                reuse_file = gr.File(label="Drop a PNG made here (or by A1111) to reuse its settings",
                                     file_types=[".png"], elem_id="reuse-png", height=90)
                with gr.Accordion("History (this session)", open=False):
                    history = gr.Gallery(label="Earlier results: select one, then reuse its settings",
                                         columns=6, height=200, format="png", elem_id="history",
                                         interactive=False)
                    history_reuse = gr.Button("Reuse the selected result's settings", size="sm")
        # The API's image inputs, filled from the editor for the page's own requests.
        image_in = gr.Image(type="filepath", format="png", visible=False)
        mask_in = gr.Image(type="filepath", format="png", visible=False)
        selected = gr.State(None)  # the gallery image last selected, for "send" and "reuse"
        history_selected = gr.State(None)
        past = gr.State([])  # this browser session's results, newest first
        for field in (prompt, negative, compare_prompts, compare_negative, num_seeds, seed, guidance, steps, per_core,
                      width, height, *loras, style, compare_style, mode, sampler, image_prompt, strength, refine,
                      refine_from, image_in, mask_in, grid_prompt, x_axis, x_values, y_axis, y_values):
            _checked_by_the_service(field)

        size.change(lambda label: [int(v) for v in label.split("×")], size, [width, height], api_name=False)

        def pick_seed(seed, randomize):
            return random.randint(0, MAX_SEED) if randomize else seed

        def remember(results, past):
            """The session's history: the newest results first, at most 48."""
            past = ([(path, None) for path, _ in results or []] + list(past))[:48]  # Gallery gives (path, caption)
            return past, past

        limit = service.queue.max_queued
        refining = [refine, refine_from]
        generate_inputs = [prompt, negative, style, seed, guidance, steps, width, height, per_core, sampler,
                           *refining, *loras]
        for trigger, api_name in ((run.click, "generate"), (prompt.submit, False)):
            trigger(pick_seed, [seed, randomize], seed, api_name=False, queue=False).then(
                _gradio_handler(demo.generate, service.loras), generate_inputs, [gallery, status],
                api_name=api_name, concurrency_limit=limit,
            ).success(remember, [gallery, past], [past, history], api_name=False, queue=False)
        image_inputs = [image_prompt, negative, style, seed, guidance, steps, image_in, mask_in, strength, per_core,
                        sampler, *refining, *loras]
        image_run.click(pick_seed, [seed, randomize], seed, api_name=False, queue=False).then(
            _mask_of, editor, [image_in, mask_in], api_name=False, queue=False,
        ).then(
            _gradio_handler(demo.image_to_image, service.loras), image_inputs, [gallery, status],
            api_name="image_to_image", concurrency_limit=limit,
        ).success(remember, [gallery, past], [past, history], api_name=False, queue=False)
        compare_inputs = [mode, compare_prompts, compare_negative, compare_style, seed, num_seeds, guidance, steps,
                          width, height, sampler, *loras]
        compare_run.click(pick_seed, [seed, randomize], seed, api_name=False, queue=False).then(
            _gradio_handler(demo.compare, service.loras), compare_inputs, [gallery, status], api_name="compare",
            concurrency_limit=limit,
        ).success(remember, [gallery, past], [past, history], api_name=False, queue=False)
        grid_inputs = [grid_prompt, negative, style, seed, guidance, steps, width, height, sampler,
                       x_axis, x_values, y_axis, y_values, *loras]
        grid_run.click(
            _gradio_handler(demo.grid, service.loras), grid_inputs, [grid_image, gallery, status], api_name="grid",
            concurrency_limit=limit,
        ).success(lambda: gr.update(visible=True), None, grid_image, api_name=False, queue=False)
        for button in (run, image_run, compare_run):
            button.click(lambda: gr.update(visible=False), None, grid_image, api_name=False, queue=False)

        def select(event: gr.SelectData):
            return event.value["image"]["path"] if event.value else None

        gallery.select(select, None, selected, api_name=False, queue=False)
        history.select(select, None, history_selected, api_name=False, queue=False)
        send.click(lambda path: path, selected, editor, api_name=False, queue=False).then(
            lambda: gr.Tabs(selected="image-tab"), None, tabs, api_name=False, queue=False)
        reused = [prompt, negative, seed, randomize, guidance, steps, sampler, size]
        reuse_run.click(demo.reuse, selected, reused, api_name=False, queue=False)
        history_reuse.click(demo.reuse, history_selected, reused, api_name=False, queue=False)
        reuse_file.upload(demo.reuse, reuse_file, reused, api_name=False, queue=False)
    blocks.queue(max_size=limit, default_concurrency_limit=limit)
    return blocks


def _integer_from(low: int, high: int | None = None):
    """An argparse type: an integer of at least `low` (and at most `high`)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f"of at least {low}"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {text!r}")
        return value

    return parse


def main() -> None:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=env("SDXL_MODEL", DEFAULT_MODEL),
        help="Hub repo id, diffusers folder, single .safetensors file (local, or owner/name/file on the Hub), "
        "'tiny' or 'tiny-sd1'",
    )
    parser.add_argument(
        "--config", default=env("SDXL_CONFIG"),
        help="for a single file: sdxl-base-1.0, sd-1.5, sd-2.1, sd-2.1-base or a diffusers folder "
        "(default: the published one of the family its keys show)",
    )
    parser.add_argument("--host", default=env("SDXL_HOST"), help="default: 127.0.0.1 (Gradio's own default)")
    parser.add_argument("--port", type=_integer_from(1, 65535), default=env("SDXL_PORT", "7860"))
    parser.add_argument("--cache-dir", default=env("SDXL_CACHE_DIR"), help="persistent compilation cache")
    parser.add_argument("--share", action="store_true", default=env("SDXL_SHARE") == "1")
    parser.add_argument("--dtype", default=env("SDXL_DTYPE"), choices=[None, "float32", "bfloat16"])
    # String defaults go through `type` too, so a bad environment variable gets argparse's message.
    parser.add_argument("--max-images-per-core", type=_integer_from(1), default=env("SDXL_MAX_IMAGES_PER_CORE", "4"))
    parser.add_argument("--max-queue", type=_integer_from(1), default=env("SDXL_MAX_QUEUE", "32"))
    parser.add_argument("--max-per-user", type=_integer_from(1), default=env("SDXL_MAX_PER_USER", "4"),
                        help="requests one browser session or API client may have waiting (default: %(default)s)")
    parser.add_argument(
        "--unet", default=env("SDXL_UNET"), help="a UNet weights file (diffusers keys) replacing the model's, e.g. "
        "ByteDance/SDXL-Lightning/sdxl_lightning_4step_unet.safetensors (local, or owner/name/file on the Hub)",
    )
    parser.add_argument("--lora", action="append", type=parse_lora_option, default=[], metavar="FILE[:SCALE]",
                        help="a LoRA users may apply, with its default scale (1); repeatable. A .safetensors file "
                        "(kohya/A1111 or diffusers/PEFT) or a Hub repo id")
    parser.add_argument(
        "--refiner", default=env("SDXL_REFINER"), help="an SDXL refiner (e.g. stabilityai/stable-diffusion-xl-"
        "refiner-1.0) that users may switch on to finish images; it is held on every device beside the model",
    )
    args = parser.parse_args()

    # The package's own log lines (refused requests, given-up work) go to the console, one line each.
    console = logging.StreamHandler()
    console.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("sdxl").addHandler(console)
    logging.getLogger("sdxl").setLevel(logging.INFO)
    cache = enable_compilation_cache(args.cache_dir)
    start = time.perf_counter()
    loras = dict(args.lora)
    try:
        scheduler = recommended(args.model, args.unet, loras=tuple(loras)).scheduler
        pipe, notice = load_pipeline(args.model, config=args.config, dtype=args.dtype, scheduler=scheduler,
                                     unet=args.unet)
        pipe.set_loras(loras)  # each file read and checked now, not at a user's first request
        if args.refiner:
            refiner = Pipeline.from_pretrained(args.refiner, dtype=args.dtype, max_steps=pipe.max_steps,
                                               devices=list(pipe.mesh.devices.flat))
            pipe.set_refiner(refiner)
    except CheckpointError as e:  # missing, corrupt or not downloadable: the reason in a line, as the CLI says it
        parser.exit(2, f"error: {e}\n")
    loaded = time.perf_counter()
    model_name = FALLBACK_MODEL if notice else model_label(args.model, args.unet)
    settings = recommended(FALLBACK_MODEL if notice else args.model, args.unet, pipe.spec.default_sampler,
                           tuple(loras))
    service = TextToImage(pipe, max_images_per_core=args.max_images_per_core, max_queued=args.max_queue,
                          max_per_owner=args.max_per_user, notice=notice, loras=loras, recommended=settings,
                          refiner_name=args.refiner)
    width, height = service.sizes[0]
    default_guided = settings.guidance_scale > 1  # the program the default settings run compiles first
    compile_seconds = pipe.warmup(height, width, progress=True, guided=default_guided)
    warm_start = time.perf_counter()
    warm_up = service.request_images("warm-up", "", NO_STYLE, 0, settings.guidance_scale, 2, width, height)
    service.queue.wait(service.queue.submit(warm_up))
    ready = time.perf_counter()
    print(f"model {model_name} ({pipe.dtype.name}) on {pipe.device_description}; compilation cache {cache}")
    print(f"startup: load {loaded - start:.1f} s, compile {compile_seconds:.1f} s, "
          f"warm-up {ready - warm_start:.1f} s, total {ready - start:.1f} s", flush=True)
    # The batch sizes that "images per core" and merged requests use compile while the demo serves.
    # So does the other guidance variant (with, or without: a guidance scale of 1 or less), for one
    # image per core.
    # Then image-to-image and inpainting (and the refiner's handoff) at the native size, one image per core.
    batches = [(n * pipe.num_devices, default_guided) for n in range(2, args.max_images_per_core + 1)]
    for batch, guided in [*batches, (pipe.num_devices, not default_guided)]:
        like = dataclasses.replace(warm_up, guidance_scales=(5.0 if guided else 1.0,) * len(warm_up))
        compiling = service.queue.compile_in_background(like, batch)
        if compiling is not None:
            compiling.add_done_callback(functools.partial(_report_background_compile, batch, guided))
    pixels = np.zeros((len(warm_up), height, width, 3), np.uint8)
    edits = {"image-to-image": dict(images=pixels), "inpainting": dict(images=pixels, masks=pixels[..., 0] == 0)}
    if pipe.refiner is not None:
        edits["refining"] = dict(refine_from=DEFAULT_REFINE_FROM)
    for label, edit in edits.items():
        compiling = service.queue.compile_in_background(dataclasses.replace(warm_up, **edit), len(warm_up))
        if compiling is not None:
            compiling.add_done_callback(functools.partial(_report_background_compile, label, default_guided))
    blocks = create_demo(Demo(service, model_name))
    endpoints = {name.lstrip("/"): [parameter["parameter_name"] for parameter in endpoint["parameters"]]
                 for name, endpoint in blocks.get_api_info()["named_endpoints"].items()}
    api_names = {index: fn.api_name for index, fn in blocks.fns.items() if fn.api_name in endpoints}
    errors = Middleware(HttpErrors, endpoints=endpoints, api_names=api_names, statuses=ERROR_STATUS)
    blocks.launch(
        server_name=args.host, server_port=args.port, share=args.share, max_file_size=MAX_UPLOAD,
        head=KEYBOARD_SCRIPT, app_kwargs={"middleware": [errors]},
    )


if __name__ == "__main__":
    main()
