"""Gradio demo: Stable Diffusion XL in JAX, one image per accelerator core.

python app.py [--model M] [--lora FILE[:SCALE] ...] [--refiner R] [--host H] [--port P] [--cache-dir D] [--share]

Every option also reads an environment variable (SDXL_MODEL, SDXL_HOST, ...), for Spaces.
"""

import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import logging
import random
import re
import time

import gradio as gr
import numpy as np
from PIL import Image
from starlette.middleware import Middleware

from sdxl import CheckpointError
from sdxl.checkpoints import lora
from sdxl.engine import control_maps, images
from sdxl.engine.images import image_count
from sdxl.engine.request import (
    DEFAULT_REFINE_FROM, GUIDANCE_SCALE_RANGE, LORA_SCALE_RANGE, MAX_SEED, Request, default_control_scale,
    default_strength,
)
from sdxl.models.controlnet_union import CONTROL_MODES, describe_mode
from sdxl.prompts.styles import NO_STYLE, STYLES
from sdxl.prompts.syntax import A1111_EMPHASIS_NAMES, EMPHASIS_MODES
from sdxl.sampling.samplers import SAMPLER_NAMES
from sdxl.serving import grid, launch
from sdxl.serving.demo import Control, DemoService
from sdxl.serving.grid import GridPlan
from sdxl.serving.http_errors import HttpErrors
from sdxl.serving.queue import QueueFullError

# Uploads decode to at most this many pixels: PIL refuses twice as many, and warns above it.
Image.MAX_IMAGE_PIXELS = images.MAX_IMAGE_PIXELS

EXAMPLES = [
    ["a lighthouse on a cliff at dusk, waves crashing, warm light in the windows", "Cinematic"],
    ["a red fox sleeping in fresh snow, morning light", "Photographic"],
    ["a tiny robot watering a bonsai tree", "3D model"],
    ["a castle floating above the clouds", "Fantasy art"],
]

log = logging.getLogger("sdxl.serving.demo")

# Gradio notices that a client has gone only when a handler yields: handlers that wait yield "no
# change" this often.
KEEPALIVE_SECONDS = 1.0
# The titles of errors for the user, and the HTTP status each gives an answer on /run/.
INVALID_REQUEST, QUEUE_FULL, NO_IMAGE = "Invalid request", "Queue full", "No image"
ERROR_STATUS = {INVALID_REQUEST: 422, QUEUE_FULL: 503, NO_IMAGE: 500}
CACHE_EXPIRY = (600, 3600)  # Gradio's delete_cache: (every, older than), seconds
# Gradio's upload endpoint takes any file; bound what it accepts: a phone's photo is 2-5 MB.
MAX_UPLOAD = "8mb"
COMPARE_PROMPTS = "One prompt per line, same seed"
COMPARE_SEEDS = "One prompt, consecutive seeds"
AXIS_VALUES_HINT = "comma-separated or one per line; ranges like 1-4; a prompt value found in the prompt replaces it"


class Handlers:
    """The events' handlers: the form's fields arrive by name (`**form`, made `Settings` by the
    service); each submits its requests to the device queue, shows progress and previews, and
    answers with the gallery."""

    def __init__(self, service: DemoService):
        self.service = service

    def generate(self, request: gr.Request, progress=gr.Progress(), **form):
        yield from self._answer(request, progress, self.images, form)

    def image_to_image(self, request: gr.Request, progress=gr.Progress(), **form):
        yield from self._answer(request, progress, self.image_edit, form)

    def compare(self, request: gr.Request, progress=gr.Progress(), **form):
        yield from self._answer(request, progress, self.comparison, form)

    def grid(self, request: gr.Request, progress=gr.Progress(), **form):
        """A comparison grid: its labelled image, the cells in the gallery, and a status with the
        number of device calls it took."""
        plan = self._built(self.grid_plan, form)
        yield from _routed(request, self._grid(plan, _owner(request), progress))

    def check(self, build, **form) -> None:
        """What a tab's button submits, built and dropped: the page runs this first, with no outputs,
        so that a bad value is one message and the gallery and status keep what they show."""
        self._built(build, form)

    # What each tab submits, from the form's fields by name; each raises ValueError.

    def images(self, form) -> tuple[Request, None]:
        return self.service.images(self._settings(form)), None

    def image_edit(self, form) -> tuple[Request, str | None]:
        picture, painted = (None if form.get(f) is None else images.read_image(_path_of(form[f])) for f in
                            ("image", "mask"))
        return self.service.image_edit(self._settings(form), picture, painted, form.get("strength"))

    def comparison(self, form) -> tuple[Request, None]:
        mode, prompts = form.get("mode"), form.get("prompts")
        if not isinstance(prompts, (str, type(None))):
            raise ValueError(f"prompts must be text (one per line), got {type(prompts).__name__} {prompts!r:.80}")
        if mode not in (COMPARE_PROMPTS, COMPARE_SEEDS):
            raise ValueError(f"compare mode must be {COMPARE_PROMPTS!r} or {COMPARE_SEEDS!r}, got {mode!r}")
        settings = self._settings(form)
        if mode == COMPARE_PROMPTS:
            return self.service.prompt_comparison(settings, (prompts or "").splitlines()), None
        settings = dataclasses.replace(settings, prompt=(prompts or "").strip())
        return self.service.seed_comparison(settings, form.get("num_seeds")), None

    def grid_plan(self, form) -> GridPlan:
        return self.service.grid(self._settings(form), form.get("x_axis") or None, form.get("x_values"),
                                 form.get("y_axis") or None, form.get("y_values"))

    def reuse(self, png):
        """The settings a PNG made by this demo (or A1111) records, for the form's fields, and Advanced
        opened to show them; fields it does not name are left as they are. A message says what was
        filled in."""
        keep = gr.update()
        try:
            with Image.open(_path_of(png)) as picture:
                found = images.read_parameters(picture.info.get("parameters", ""))
        except (OSError, ValueError) as e:  # a warning, not an error: the fields keep what they hold
            gr.Warning(f"cannot reuse that image's settings: {e}")
            return [keep] * 10
        size = (found.get("width"), found.get("height"))
        size = size if size in self.service.sizes else None
        filled = {"seed": found.get("seed"), "guidance": found.get("guidance_scale"), "steps": found.get("steps"),
                  "sampler": SAMPLER_NAMES.get(found.get("sampler")), "emphasis": found.get("emphasis"),
                  "size": size and _size_label(*size)}
        gr.Info("Filled in: the prompts" + "".join(f", {name} {value}" for name, value in filled.items()
                                                   if value is not None), title="Settings reused")
        return [
            found["prompt"], found["negative_prompt"],
            found.get("seed", keep), False if "seed" in found else keep,
            found.get("guidance_scale", keep), found.get("steps", keep), found.get("sampler", keep),
            found.get("emphasis", keep), _size_label(*size) if size else keep, gr.Accordion(open=True),
        ]

    def prompt_length(self, text, emphasis, negative: bool = False) -> str:
        return self.service.prompt_length(text, emphasis, negative=negative)

    def control_map(self, picture, preprocessor, canny_low, canny_high, width, height):
        """The map a ControlNet panel's picture gives at the chosen size, as the request will make it."""
        if picture is None:
            return None
        try:
            control = Control(_control_picture(picture), preprocessor, canny_low, canny_high)
            return Image.fromarray(control.control_map(int(width), int(height)))
        except (TypeError, ValueError) as e:
            raise _user_error(str(e)) from e

    def _settings(self, form):
        """The form's settings (`DemoService.settings`), its control images read from their uploads."""
        pictures = {names["picture"] for names in self.service.control_parameters}
        form = {k: _control_picture(v) if k in pictures and v is not None else v for k, v in form.items()}
        return self.service.settings(form)

    def _answer(self, request: gr.Request, progress, build, form):
        """Renders the request `build(form)` makes, with a note for the status (or None)."""
        built, note = self._built(build, form)
        yield from _routed(request, self._render(built, _owner(request), progress, note))

    @staticmethod
    def _built(build, form):
        try:
            return build(form)
        except ValueError as e:
            raise _user_error(str(e)) from e

    def _submit(self, request: Request, owner: str | None):
        try:
            return self.service.queue.submit(request, owner)
        except QueueFullError as e:
            raise _user_error(str(e), title=QUEUE_FULL) from e
        except ValueError as e:  # a prompt that cannot be read: too long, or a weight out of range
            raise _user_error(str(e)) from e

    def _render(self, request: Request, owner: str | None, progress: gr.Progress, note: str | None):
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
                    progress(0, desc=f"Compiling for {size}, {_chunks_label(ticket.request)} (first use of this size, "
                             "batch, sampler or prompt length; cached after)")
                else:
                    ahead = self.service.queue.position(ticket)
                    progress(0, desc=f"Waiting in queue: {ahead} request(s) ahead" if ahead else "Starting")
                if ticket.previews is not None and ticket.previews is not shown:
                    shown = ticket.previews
                    previews = [(Image.fromarray(p), f"preview · step {ticket.step}") for p in shown]
                    yield previews, f"step {ticket.step} of {ticket.steps}: previews (their colours are approximate)"
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > KEEPALIVE_SECONDS:
                    yield gr.skip()
                    quiet_since = time.monotonic()
        yield self._finished(request, ticket, ticket.future.result(), note)

    def _grid(self, plan: GridPlan, owner: str | None, progress: gr.Progress):
        """Yields "no change" while the grid's calls render, as `_render` does; then (the labelled
        grid, its cells, status)."""
        start = time.perf_counter()
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
        gallery = [(picture, _caption(request, i, result.devices[i]))
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
        """The images, each with its parameters in its PNG text."""
        pictures = []
        for i, image in enumerate(result.images):
            picture = Image.fromarray(image)
            picture.info["parameters"] = self.service.png_parameters(request, i)
            pictures.append(picture)
        return pictures


def _routed(request: gr.Request | None, updates):
    """A handler's updates as its route takes them: /run/ answers with the first value yielded, so
    there only the last is yielded."""
    if _route(request) == "run":
        *_, last = updates
        yield last
    else:
        yield from updates


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


def _path_of(file) -> str:
    """The server-side path of an uploaded file as a handler receives it (Gradio's FileData, or a dict
    from an API client, or a path)."""
    return file if isinstance(file, str) else (file["path"] if isinstance(file, dict) else file.path)


def _control_picture(upload) -> Image.Image:
    """A control image's upload, read. Raises ValueError naming it."""
    try:
        return images.read_image(_path_of(upload))
    except (TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"the control image must be an uploaded image file, got {upload!r:.80}") from e
    except ValueError as e:
        raise ValueError(f"the control image: {e}") from e


def _caption(request: Request, i: int, device: str) -> str:
    """Image i's caption: what tells it from the others (its prompt where prompts differ, as when
    comparing prompts), its seed, its image index where those differ, and the core it ran on."""
    prompt = request.prompts[i]
    parts = [
        (prompt if len(prompt) <= 40 else prompt[:39] + "…") if len(set(request.prompts)) > 1 else None,
        f"seed {request.seeds[i]}",
        f"image {request.image_index[i]}" if len(set(request.image_index)) > 1 else None,
        device,
    ]
    return " · ".join(part for part in parts if part)


def _size_label(width: int, height: int) -> str:
    return f"{width}×{height}"


def _chunks_label(request: Request) -> str:
    count = request.tokens.num_chunks
    return "prompts of one chunk" if count == 1 else f"prompts of up to {count} chunks"


def _length_line(elem_id: str) -> gr.Markdown:
    """The line under a prompt box that says how long the prompt is."""
    return gr.Markdown("", elem_id=elem_id, elem_classes="prompt-length")


def _cell_caption(plan: GridPlan, i: int) -> str:
    """A grid cell's caption, short enough for its thumbnail: each axis's value, with a short name
    where the value alone would not say which setting it is ("cfg 3 · seed 1")."""
    columns = 1 if plan.x is None else len(plan.x.labels)
    values = [] if plan.y is None else [(plan.y, plan.y.labels[i // columns])]
    values += [] if plan.x is None else [(plan.x, plan.x.labels[i % columns])]
    return " · ".join(f"{_AXIS_SHORT.get(axis.name, axis.name.removeprefix(grid.LORA_AXIS))} {label}".strip()
                      for axis, label in values)


# Axis names in a cell's caption; a prompt, a style or a sampler says itself.
_AXIS_SHORT = {"guidance_scale": "cfg", "negative_prompt": "neg", "prompt": "", "style": "", "sampler": "",
               "control_scale": "control", "control_end": "control end"}


def _checked_by_the_service(field):
    """Gradio checks a number's bounds and a choice's options before the handler runs, with messages
    that do not name the field ("Value 0 is less than minimum value 1."), and text sent for a number
    makes its check raise a TypeError that reaches the client as a generic error; a list sent for a
    prompt would be rendered as its Python text. The values go unchanged to the service's
    validation instead (`sdxl.engine.request`), whose one-sentence message names the field and what it
    allows. (Replaced on the instance, not subclassed: Gradio writes a .pyi stub beside any module
    that subclasses a component.)"""
    field.preprocess = lambda payload: payload


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

# Gradio 6.31's image editor, once it holds an upload, never shows a picture a handler sets (it spins
# until reloaded); its own "Clear canvas" button first puts it back where a new picture shows.
CLEAR_EDITOR = """() => {
  document.querySelector('#image-editor button[aria-label="Clear canvas"]')?.click();
}"""

# The token count under each prompt box: a quiet caption, close to the box it counts.
CSS = """
.prompt-length, .prompt-length * {
    font-size: var(--text-sm) !important; color: var(--body-text-color-subdued) !important;
}
.prompt-length p { margin: 0 0 0 var(--spacing-md); }
.pixelated img { image-rendering: pixelated; }
/* The gallery as tall as its thumbnails (Gradio keeps 450 px, mostly empty under a row of four); a
   selected image's preview, drawn over them, keeps the full height. */
#gallery .gallery-container:not(:has(.preview)) .grid-wrap.fixed-height { min-height: 0; height: auto; }
/* The PNG drop zone as tall as what it says (Gradio's is 240 px, or clips its text when made lower). */
#reuse-png .upload-container, #reuse-png .upload-container .wrap { min-height: 0; height: auto; }
#reuse-png .upload-container .wrap { padding: 30px 0 var(--spacing-md); }
"""


def _mask_of(editor) -> tuple[Image.Image | None, Image.Image | None]:
    """The picture an image editor holds and, where a layer is painted, a mask (white where painted)."""
    if not editor or editor.get("background") is None:
        return None, None
    background = editor["background"]
    painted = [np.asarray(layer.convert("RGBA"))[..., 3] > 0 for layer in editor.get("layers") or []]
    if not painted or not np.any(painted):
        return background, None
    return background, Image.fromarray(np.any(painted, axis=0).astype(np.uint8) * 255)


def _optional(handler, names: list[str]):
    """`handler` (a generator) with keyword parameters `names` that default to None: Gradio's API
    makes a parameter optional only where the handler's signature gives it a default, and a control
    image, which has no initial value, must be optional (a request without one is not steered)."""
    @functools.wraps(handler)
    def with_defaults(*args, **kwargs):
        yield from handler(*args, **kwargs)

    signature = inspect.signature(handler)
    *named, form = signature.parameters.values()
    optional = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in names]
    with_defaults.__signature__ = signature.replace(parameters=[*named, *optional, form])
    return with_defaults


def _control_panel(service: DemoService) -> tuple[gr.Accordion, list[dict]]:
    """The ControlNet panel: for each launched ControlNet, its picture, preprocessor and the map they
    make, a Union's control mode, and its scale, start and end. Returns the panel, and each one's
    components by `Control` field (and "map")."""
    pipe = service.pipe
    panels = []
    with gr.Accordion("ControlNet", open=False, elem_id="controlnet") as accordion:
        gr.Markdown("Steer every tab's images with edges, a depth map or a pose: upload a picture or send one "
                    "from the gallery. Canny draws its edges; a depth map or an OpenPose skeleton is given as it "
                    "is. It steers from Start to End, fractions of the steps, with Scale's strength. Clear the "
                    "picture to generate without it.", elem_classes="prompt-length")
        for k, controlnet in enumerate(pipe.controlnets):
            name = images.controlnet_label(controlnet.name)
            suffix = f"-{k}" if k else ""
            with gr.Group():
                with gr.Row():
                    picture = gr.Image(label=f"Control image · {name}", type="filepath", format="png", height=220,
                                       sources=["upload", "clipboard"], elem_id=f"control-image{suffix}")
                    shown = gr.Image(label="Control map", format="png", height=220,
                                     interactive=False, elem_id=f"control-map{suffix}")
                canny = control_maps.default_preprocessor(name) == "canny"
                preprocessor = gr.Radio([("Canny edges", "canny"), ("None: the picture is the map", "none")],
                                        value="canny" if canny else "none", label="Preprocessor")
                with gr.Row():
                    low, high = (gr.Slider(1, 255, value=value, step=1, label=f"Canny {which} threshold",
                                           visible=canny)
                                 for value, which in zip(control_maps.DEFAULT_CANNY_THRESHOLDS, ("low", "high")))
                fields = {}
                modes = getattr(controlnet.config, "num_control_type", 0)  # a ControlNet Union's
                if modes:
                    fields["mode"] = gr.Dropdown(
                        [(describe_mode(m), CONTROL_MODES[m][0]) for m in range(modes)], value="canny" if canny
                        else "depth", label="Control mode", info="what the control map is (a ControlNet Union)")
                with gr.Row():
                    scale = gr.Slider(0, 2, value=default_control_scale(pipe.spec, image=False, inpainting=False),
                                      step=0.05, label="Scale")
                    start = gr.Slider(0, 1, value=0, step=0.05, label="Start")
                    end = gr.Slider(0, 1, value=1, step=0.05, label="End")
            panels.append({"picture": picture, "map": shown, "preprocessor": preprocessor, "canny_low": low,
                           "canny_high": high, "scale": scale, "start": start, "end": end, **fields})
    return accordion, panels


def _require_picked(path: str | None) -> None:
    """Raises a message unless an image is selected, for the buttons that use it."""
    if path is None:
        raise gr.Error("select an image first (click one in the gallery, or in the history)",
                       title="Nothing selected", print_exception=False)


def create_demo(handlers: Handlers) -> gr.Blocks:
    service = handlers.service
    pipe = service.pipe
    settings = service.recommended
    native = service.sizes[0]
    # Generated images are served from Gradio's cache: clear what is older than an hour, every 10 minutes.
    with gr.Blocks(title="SDXL on JAX", delete_cache=CACHE_EXPIRY) as blocks:
        gr.Markdown(f"# SDXL on JAX\n`{service.model_label}` on {pipe.device_description}: one image per core.")
        defaults = (f"{settings.note}: the defaults below are {settings.steps} step(s) at guidance "
                    f"{settings.guidance_scale:g}." if settings.note else "")
        if service.notice:  # one line above the controls; the reason and the way to real models behind it
            gr.Markdown(f"**Showing the built-in {service.model_label} model instead** of the one asked for: "
                        "it draws coloured shapes from a few English words (try the examples).",
                        elem_id="model-notice")
            with gr.Accordion("Why, and how to get SDXL", open=False, elem_id="model-notice-details"):
                gr.Markdown(f"{service.notice}\n\n{defaults}")
        elif defaults:
            gr.Markdown(defaults, elem_id="model-settings")
        # Controls on the left, the gallery on the right: on a laptop screen the prompt, the button and
        # the pictures are all in view; on a phone the columns stack.
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=380):
                with gr.Tabs() as tabs:
                    with gr.Tab("Generate", id="generate-tab"):
                        prompt = gr.Textbox("", label="Prompt", placeholder=settings.placeholder, lines=2,
                                            elem_id="prompt", info="Ctrl+Enter generates; (word:1.2) weighs a word, "
                                            "BREAK starts a new chunk")
                        prompt_length = _length_line("prompt-length")
                        negative = gr.Textbox("", label="Negative prompt", placeholder="What to avoid (optional)")
                        negative_length = _length_line("negative-length")
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
                        image_prompt_length = _length_line("image-prompt-length")
                        strength = gr.Slider(0.05, 1, value=default_strength(pipe.spec, inpainting=False),
                                             step=0.05, label="Strength",
                                             info="how much changes: low keeps the picture, 1 redraws it "
                                             "(inpainting: only where painted)")
                        image_run = gr.Button("Generate from image", variant="primary", elem_id="image-generate")
                    with gr.Tab("Compare"):
                        mode = gr.Radio([COMPARE_PROMPTS, COMPARE_SEEDS], value=COMPARE_PROMPTS, label="Compare")
                        compare_prompts = gr.Textbox("", label="Prompts (one per line) or one prompt", lines=4)
                        compare_negative = gr.Textbox("", label="Negative prompt")
                        compare_style = gr.Dropdown(list(STYLES), value=NO_STYLE, label="Style")
                        # A slider's range needs two ends: one image a call leaves nothing to choose.
                        num_seeds = gr.Slider(1, max(2, service.max_images), value=pipe.num_devices, step=1,
                                              label="Seeds", visible=service.max_images > 1)
                        compare_run = gr.Button("Compare", variant="primary")
                    with gr.Tab("Grid"):
                        grid_prompt = gr.Textbox("", label="Prompt", lines=2, elem_id="grid-prompt")
                        grid_prompt_length = _length_line("grid-prompt-length")
                        lora_axes = [grid.LORA_AXIS + lora.display_name(source) for source in service.loras]
                        control_axes = [(name.replace("control", "ControlNet").replace("_", " "), name)
                                        for name in grid.CONTROL_AXES] if pipe.controlnets else []
                        axes = [("none", ""), *((name.replace("_", " "), name) for name in grid.AXES),
                                *((f"LoRA {name[len(grid.LORA_AXIS):]} scale", name) for name in lora_axes),
                                *control_axes]
                        with gr.Row():
                            x_axis = gr.Dropdown(axes, value="seed", label="X axis")
                            x_values = gr.Textbox("1-4", label="X values", info=AXIS_VALUES_HINT)
                        with gr.Row():
                            y_axis = gr.Dropdown(axes, value="guidance_scale", label="Y axis")
                            y_values = gr.Textbox("3, 7", label="Y values", info=AXIS_VALUES_HINT)
                        grid_run = gr.Button("Make grid", variant="primary", elem_id="grid-run")
                control_accordion, controls = _control_panel(service) if pipe.controlnets else (None, [])
                with gr.Accordion("Advanced", open=False) as advanced:
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
                                       label="Size", info="Image to image takes the size nearest its picture's")
                    per_core = gr.Slider(1, max(2, service.max_images_per_core), value=1, step=1,
                                         label="Images per core", visible=service.max_images_per_core > 1)
                    sampler = gr.Dropdown(
                        [(label, name) for name, label in SAMPLER_NAMES.items()], value=pipe.spec.default_sampler,
                        label="Sampler", info="the model's own by default; each compiles once, then stays cached",
                    )
                    emphasis = gr.Dropdown(
                        [(A1111_EMPHASIS_NAMES[mode], mode) for mode in EMPHASIS_MODES], value=service.emphasis,
                        label="Emphasis", info="how (word:1.2) weights apply, as in AUTOMATIC1111: Original keeps "
                        "each chunk's mean, No norm does not, None reads brackets as text",
                    )
                    has_refiner = pipe.refiner is not None
                    with gr.Row(visible=has_refiner):
                        refine = gr.Checkbox(label="Refine", value=False,
                                             info=f"finish with {has_refiner and pipe.refiner.name}")
                        refine_from = gr.Slider(0.5, 0.95, value=DEFAULT_REFINE_FROM, step=0.05,
                                                label="Refiner takes over at", info="the fraction of the noise "
                                                "the base model removes first")
                    lora_sliders = [gr.Slider(*LORA_SCALE_RANGE, value=scale, step=0.05,
                                       label=f"LoRA {lora.display_name(source)}",
                                       info="0 turns it off; changing LoRAs never recompiles")
                             for source, scale in service.loras.items()]
                    width = gr.Number(value=native[0], precision=None, visible=False)
                    height = gr.Number(value=native[1], precision=None, visible=False)
            with gr.Column(scale=1, min_width=380):
                # Pictures of a few dozen pixels (the shapes model's) are shown as pixels, not blurred.
                small = max(native) <= 256
                gallery = gr.Gallery(label="Images", columns=min(4, service.max_images), format="png",
                                     elem_id="gallery", interactive=False, height="auto", object_fit="contain",
                                     elem_classes="pixelated" if small else None)
                status = gr.Markdown(elem_id="status")
                with gr.Row():
                    send = gr.Button("Send the selected image to image-to-image", size="sm", elem_id="send")
                    send_control = gr.Button("Send it to ControlNet", size="sm", elem_id="send-control",
                                             visible=bool(controls))
                    reuse_run = gr.Button("Reuse its settings", size="sm", elem_id="reuse")
                grid_image = gr.Image(label="Grid", type="pil", format="png", visible=False, elem_id="grid-image")
                reuse_file = gr.File(label="Drop a PNG made here (or by A1111) to reuse its settings",
                                     file_types=[".png"], elem_id="reuse-png")
                with gr.Accordion("History (this session)", open=False):
                    history = gr.Gallery(label="Earlier results: select one, then reuse its settings",
                                         columns=6, height=200, format="png", elem_id="history",
                                         interactive=False, object_fit="contain",
                                         elem_classes="pixelated" if small else None)
                    history_reuse = gr.Button("Reuse the selected result's settings", size="sm")
        # The API's image inputs, filled from the editor for the page's own requests.
        image_in = gr.Image(type="filepath", format="png", visible=False)
        mask_in = gr.Image(type="filepath", format="png", visible=False)
        selected = gr.State(None)  # the gallery image last selected, for "send" and "reuse"
        history_selected = gr.State(None)
        past = gr.State([])  # this browser session's results, newest first
        control_form = {name: fields[field] for names, fields in zip(service.control_parameters, controls)
                        for field, name in names.items() if field in fields}
        for field in (prompt, negative, compare_prompts, compare_negative, num_seeds, seed, guidance, steps, per_core,
                      width, height, *lora_sliders, style, compare_style, mode, sampler, emphasis, image_prompt,
                      strength, refine, refine_from, image_in, mask_in, grid_prompt, x_axis, x_values, y_axis,
                      y_values, *control_form.values()):
            _checked_by_the_service(field)
        for fields in controls:
            map_inputs = [fields[name] for name in ("picture", "preprocessor", "canny_low", "canny_high")]
            gr.on([fields["picture"].change, fields["preprocessor"].change, fields["canny_low"].release,
                   fields["canny_high"].release, width.change, height.change],
                  handlers.control_map, [*map_inputs, width, height], fields["map"], api_name=False, queue=False,
                  show_progress="hidden")
            fields["preprocessor"].change(lambda name: [gr.update(visible=name == "canny")] * 2,
                                          fields["preprocessor"], [fields["canny_low"], fields["canny_high"]],
                                          api_name=False, queue=False, show_progress="hidden")

        size.change(lambda label: [int(v) for v in label.split("×")], size, [width, height], api_name=False)
        for box, line, negative_prompt in ((prompt, prompt_length, False), (negative, negative_length, True),
                                           (image_prompt, image_prompt_length, False),
                                           (grid_prompt, grid_prompt_length, False)):
            count = functools.partial(handlers.prompt_length, negative=negative_prompt)
            gr.on([box.change, emphasis.change], count, [box, emphasis], line, api_name=False, queue=False,
                  show_progress="hidden")

        def pick_seed(seed, randomize):
            return random.randint(0, MAX_SEED) if randomize else seed

        def remember(results, past):
            """The session's history: the newest results first, at most 48."""
            past = ([(path, None) for path, _ in results or []] + list(past))[:48]  # Gallery gives (path, caption)
            return past, past

        limit = service.queue.max_queued
        pictures = [names["picture"] for names in service.control_parameters]
        generate, compare, make_grid = (_optional(handler, pictures)
                                        for handler in (handlers.generate, handlers.compare, handlers.grid))
        image_to_image = _optional(handlers.image_to_image, ["mask", *pictures])

        # Checks run in the queue, with no outputs: Gradio shows a queued event's error as one message
        # (an unqueued one's not at all), and marks no output with an error badge.
        def checked(listen, build, form):
            """`listen` (an event, or `.then` of one) runs what a button submits built and dropped
            (`Handlers.check`): a bad value is one message, and the gallery and status keep what they
            show. Returns the `success` chain, for the handler that submits it."""
            return listen(functools.partial(handlers.check, build), inputs_kwargs=form, outputs=None,
                          api_name=False, show_progress="hidden").success
        loras = dict(zip(service.lora_parameters, lora_sliders))
        refining = {"refine": refine, "refine_from": refine_from}
        common = {"seed": seed, "guidance_scale": guidance, "steps": steps}
        dimensions = {"width": width, "height": height}
        generate_form = {"prompt": prompt, "negative_prompt": negative, "style": style, **common, **dimensions,
                         "images_per_core": per_core, "sampler": sampler, "emphasis": emphasis, **refining, **loras,
                         **control_form}
        for trigger, api_name in ((run.click, "generate"), (prompt.submit, False)):
            picked = trigger(pick_seed, [seed, randomize], seed, api_name=False, queue=False)
            checked(picked.then, handlers.images, generate_form)(
                generate, inputs_kwargs=generate_form, outputs=[gallery, status], api_name=api_name,
                concurrency_limit=limit,
            ).success(remember, [gallery, past], [past, history], api_name=False, queue=False)
        image_form = {"prompt": image_prompt, "negative_prompt": negative, "style": style, **common,
                      "image": image_in, "mask": mask_in, "strength": strength, "images_per_core": per_core,
                      "sampler": sampler, "emphasis": emphasis, **refining, **loras, **control_form}
        picked = image_run.click(pick_seed, [seed, randomize], seed, api_name=False, queue=False).then(
            _mask_of, editor, [image_in, mask_in], api_name=False, queue=False)
        checked(picked.then, handlers.image_edit, image_form)(
            image_to_image, inputs_kwargs=image_form, outputs=[gallery, status], api_name="image_to_image",
            concurrency_limit=limit,
        ).success(remember, [gallery, past], [past, history], api_name=False, queue=False)
        compare_form = {"mode": mode, "prompts": compare_prompts, "negative_prompt": compare_negative,
                        "style": compare_style, "seed": seed, "num_seeds": num_seeds, "guidance_scale": guidance,
                        "steps": steps, **dimensions, "sampler": sampler, "emphasis": emphasis, **loras,
                        **control_form}
        picked = compare_run.click(pick_seed, [seed, randomize], seed, api_name=False, queue=False)
        checked(picked.then, handlers.comparison, compare_form)(
            compare, inputs_kwargs=compare_form, outputs=[gallery, status], api_name="compare",
            concurrency_limit=limit,
        ).success(remember, [gallery, past], [past, history], api_name=False, queue=False)
        grid_form = {"prompt": grid_prompt, "negative_prompt": negative, "style": style, **common, **dimensions,
                     "sampler": sampler, "emphasis": emphasis, "x_axis": x_axis, "x_values": x_values,
                     "y_axis": y_axis, "y_values": y_values, **loras, **control_form}
        checked(grid_run.click, handlers.grid_plan, grid_form)(
            make_grid, inputs_kwargs=grid_form, outputs=[grid_image, gallery, status], api_name="grid",
            concurrency_limit=limit,
        ).success(lambda: gr.update(visible=True), None, grid_image, api_name=False, queue=False).then(
            remember, [gallery, past], [past, history], api_name=False, queue=False)
        for button in (run, image_run, compare_run):
            button.click(lambda: gr.update(visible=False), None, grid_image, api_name=False, queue=False)

        def select(event: gr.SelectData):
            return event.value["image"]["path"] if event.value else None

        gallery.select(select, None, selected, api_name=False, queue=False)
        history.select(select, None, history_selected, api_name=False, queue=False)
        def chosen(button, picked):
            """`button`'s click, refused with a message unless an image is picked; returns the `success` chain."""
            return button.click(_require_picked, picked, None, api_name=False, show_progress="hidden").success

        # The editor cleared in the page first (`CLEAR_EDITOR`), then the picture, the image prompt
        # (Generate's, unless it has its own) and the tab, in one update.
        chosen(send, selected)(None, js=CLEAR_EDITOR, api_name=False, queue=False).then(
            lambda path, text, own: [path, own or text, gr.Tabs(selected="image-tab")],
            [selected, prompt, image_prompt], [editor, image_prompt, tabs], api_name=False, queue=False)
        if controls:
            chosen(send_control, selected)(lambda path: [path, gr.Accordion(open=True)], selected,
                                           [controls[0]["picture"], control_accordion], api_name=False, queue=False)
        reused = [prompt, negative, seed, randomize, guidance, steps, sampler, emphasis, size, advanced]
        chosen(reuse_run, selected)(handlers.reuse, selected, reused, api_name=False)  # queued: its messages show
        chosen(history_reuse, history_selected)(handlers.reuse, history_selected, reused, api_name=False)
        reuse_file.upload(handlers.reuse, reuse_file, reused, api_name=False)
    blocks.queue(max_size=limit, default_concurrency_limit=limit)
    return blocks


def main() -> None:
    parser = launch.demo_parser(__doc__.splitlines()[0])
    options = parser.parse_args()
    try:
        service = launch.demo_service(options)
    except CheckpointError as e:  # missing, corrupt or not downloadable: the reason in a line, as the CLI says it
        parser.exit(2, f"error: {e}\n")
    if service is None:  # another host's process (--process-id 1 or more): it followed process 0 until that ended
        return
    blocks = create_demo(Handlers(service))
    endpoints = {name.lstrip("/"): [parameter["parameter_name"] for parameter in endpoint["parameters"]]
                 for name, endpoint in blocks.get_api_info()["named_endpoints"].items()}
    api_names = {index: fn.api_name for index, fn in blocks.fns.items() if fn.api_name in endpoints}
    errors = Middleware(HttpErrors, endpoints=endpoints, api_names=api_names, statuses=ERROR_STATUS)
    blocks.launch(
        server_name=options.host, server_port=options.port, share=options.share, max_file_size=MAX_UPLOAD,
        head=KEYBOARD_SCRIPT, css=CSS, app_kwargs={"middleware": [errors]},
    )


if __name__ == "__main__":
    main()
