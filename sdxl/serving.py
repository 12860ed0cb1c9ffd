"""Serving a pipeline to many users: one device queue that batches concurrent requests.

The devices run one compiled call at a time. Requests that arrive while they are busy wait in a
bounded queue; when the devices free up, the oldest request is taken together with every other
waiting request of the same image size and step count that still fits, and they are rendered in
one call. So N users who click at once wait about as long as one, not N times as long.

Requests merge only into batch sizes that are already compiled: compiling a new one takes far
longer than rendering the requests one after another (minutes for SDXL on a TPU). A declined merge
compiles that batch size in the background instead, for the next time.

One user cannot take the queue: each owner (a browser session, an API client) may have at most
`max_per_owner` requests waiting, and the next batch starts with the oldest request of the owner
served longest ago, so a user with many requests waits behind one with a single request only once.

Work nobody waits for is given up (`DeviceQueue.cancel`, when a client has gone): a waiting request
leaves the queue, and a rendering batch stops at its next progress report once every request in it
has been given up; a batch that still holds someone else's images renders on.

A failure is confined to the requests it concerns: input is validated before it is queued, a
NaN image fails only the request it belongs to, and the worker thread survives any exception.
"""

import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from PIL import Image

from . import grid, images, lora
from .checkpoints import HubUnavailableError
from .checkpoints.known import Recommended
from .pipeline import Generation, Pipeline
from .request import MAX_SEED, Request, integer, number
from .styles import STYLES

log = logging.getLogger(__name__)

# SDXL's training buckets (width, height); other models get them scaled to their native size.
SDXL_SIZES = ((1024, 1024), (1152, 896), (896, 1152), (1216, 832), (832, 1216), (1344, 768), (768, 1344))


class QueueFullError(RuntimeError):
    """The queue holds its maximum number of requests."""


class BatchAbandoned(Exception):
    """Every request of the rendering batch was given up: the devices stop between progress reports."""


def size_presets(pipe: Pipeline) -> list[tuple[int, int]]:
    """The model's native aspect-ratio presets as (width, height), native square first."""
    scale = pipe.spec.native_size / 1024
    f = pipe.spec.latent_factor
    presets = [(max(f, round(w * scale / f) * f), max(f, round(h * scale / f) * f)) for w, h in SDXL_SIZES]
    return list(dict.fromkeys(presets))


@dataclasses.dataclass(eq=False)
class Ticket:
    """A queued request: its future result and where it stands."""

    request: Request
    owner: str | None = None  # who asked (a browser session); None: nobody in particular
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    step: int = 0  # denoising steps done, while running
    steps: int = 0  # the steps it runs (fewer than the request's for image-to-image), once running
    previews: "np.ndarray | None" = None  # [N, h, w, 3] uint8 previews of its images, while running
    compiling: bool = False  # whether its batch compiles first (a new size, batch size or sampler)
    batch_images: int = 0  # images in the batch it runs in (its own and other requests')
    abandoned: bool = False  # given up (`DeviceQueue.cancel`): nobody waits for its result


class DeviceQueue:
    """Owns the devices: a worker thread renders queued requests, batching those that fit together."""

    def __init__(self, pipe: Pipeline, *, max_batch_images: int, max_queued: int, max_per_owner: int | None = None):
        self.pipe = pipe
        self.max_batch_images = max_batch_images
        self.max_queued = max_queued
        self.max_per_owner = max_per_owner or max_queued
        self._waiting: list[Ticket] = []
        self._batches_started = 0
        self._last_started: dict[str | None, int] = {}  # owner -> the batch number it last led
        self._changed = threading.Condition()
        # One compile at a time, so that background compiles never starve the host of CPU.
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile")
        self._compiles: dict[tuple, concurrent.futures.Future] = {}
        threading.Thread(target=self._serve, name="device-queue", daemon=True).start()

    def compile_in_background(self, request: Request, num_images: int) -> concurrent.futures.Future | None:
        """Compiles the programs `request` runs (`Pipeline.programs_of`) at a batch size, without
        holding up the devices, once each.

        Returns a future of the seconds it took (the same one while it runs), or None if compiled.
        """
        key = _compile_key(self.pipe, request, num_images)
        with self._changed:
            if key in self._compiles:
                return self._compiles[key]
            if self.pipe.is_compiled_for(request, num_images, progress=True):
                return None
            self._compiles[key] = self._compiler.submit(self.pipe.warmup_request, request, num_images, progress=True)
            return self._compiles[key]

    def submit(self, request: Request, owner: str | None = None) -> Ticket:
        """Queues `owner`'s request, checked first (`Pipeline.validated`: a ValueError names a bad value).
        Raises QueueFullError when the queue is at capacity, or the owner has `max_per_owner` waiting."""
        request = self.pipe.validated(request)
        if len(request) > self.max_batch_images:
            raise ValueError(f"at most {self.max_batch_images} images per request, got {len(request)}")
        request = self.pipe.tokenized(request)  # here, in the submitting thread, not in the device worker
        ticket = Ticket(request, owner)
        with self._changed:
            if len(self._waiting) >= self.max_queued:
                raise QueueFullError(f"the queue is full ({self.max_queued} requests waiting); try again shortly")
            if owner is not None and sum(t.owner == owner for t in self._waiting) >= self.max_per_owner:
                raise QueueFullError(
                    f"you already have {self.max_per_owner} requests waiting; one must finish before you add another"
                )
            self._waiting.append(ticket)
            self._changed.notify_all()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Gives up a request whose client has gone. A waiting one leaves the queue (its future is
        cancelled). A running one is dropped with its batch at the batch's next progress report, once
        every request in the batch has been given up; until then it renders with the others."""
        with self._changed:
            ticket.abandoned = True
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                ticket.future.cancel()
                log.info("gave up a waiting request of %d images: nobody waits for it", len(ticket.request))

    def position(self, ticket: Ticket) -> int:
        """How many queued requests are ahead of this one (0: next, or running)."""
        with self._changed:
            return self._waiting.index(ticket) if ticket in self._waiting else 0

    def _take_batch(self) -> list[Ticket]:
        """The oldest waiting request of the owner who led a batch longest ago (or never), plus other
        waiting requests with its batch key, oldest first, up to the image budget, as long as the
        merged batch size is compiled."""
        first = min(self._waiting, key=lambda t: self._last_started.get(t.owner, -1))  # min keeps the oldest
        self._waiting.remove(first)
        # Only owners with requests waiting need remembering: a session does not grow the server forever.
        waiting_owners = {t.owner for t in self._waiting}
        self._last_started = {o: n for o, n in self._last_started.items() if o in waiting_owners}
        self._last_started[first.owner] = self._batches_started
        self._batches_started += 1
        lead = first.request
        batch, size = [first], len(lead)
        for ticket in list(self._waiting):
            merged = size + len(ticket.request)
            if ticket.request.batch_key != first.request.batch_key or merged > self.max_batch_images:
                continue
            grows = self.pipe.padded_batch(merged) > self.pipe.padded_batch(size)
            if grows and not self.pipe.is_compiled_for(lead, merged, progress=True):
                self.compile_in_background(lead, merged)
                continue
            batch.append(ticket)
            size = merged
            self._waiting.remove(ticket)
        return batch

    def _serve(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._waiting)
                batch = self._take_batch()
            try:
                self._render(batch)
            except BatchAbandoned as e:
                log.info("%s", e)
                for ticket in batch:
                    ticket.future.cancel()
            except Exception as e:  # never let one bad batch stop the queue
                log.exception("batch failed")
                for ticket in batch:
                    if not ticket.future.done():
                        ticket.future.set_exception(e)

    def _render(self, batch: list[Ticket]) -> None:
        request = Request.merged([t.request for t in batch])
        compiling = not self.pipe.is_compiled_for(request, progress=True)
        first, stop = self.pipe.steps_run(request)
        for ticket in batch:
            ticket.compiling, ticket.batch_images, ticket.steps = compiling, len(request), stop - first
        background = self._compiles.get(_compile_key(self.pipe, request, len(request)))
        if background is not None:
            background.exception()  # the programs being compiled are this batch's: wait rather than compile twice
        starts = np.cumsum([0, *(len(t.request) for t in batch)])

        def on_step(done: int) -> None:
            if all(ticket.abandoned for ticket in batch):
                raise BatchAbandoned(f"gave up a batch of {len(request)} images at step {done} of {stop - first}: "
                                     "nobody waits for them")
            for ticket in batch:
                ticket.step = done

        def on_preview(done: int, previews: np.ndarray) -> None:
            for ticket, begin, end in zip(batch, starts, starts[1:]):
                ticket.previews = previews[begin:end]

        result: Generation = self.pipe.render(request, on_step=on_step, on_preview=on_preview)
        start = 0
        for ticket in batch:
            end = start + len(ticket.request)
            ticket.future.set_result(result.part(start, end, ticket.request))
            start = end

    def wait(self, ticket: Ticket, on_update=None, poll_seconds: float = 0.1) -> Generation:
        """Blocks until the ticket's result is ready, calling `on_update(ticket)` while it waits."""
        while True:
            try:
                return ticket.future.result(timeout=poll_seconds)
            except concurrent.futures.TimeoutError:
                if on_update is not None:
                    on_update(ticket)


def _compile_key(pipe: Pipeline, request: Request, num_images: int) -> tuple:
    """What identifies a background compile: the programs and their batch size."""
    programs = tuple((id(p), tuple(sorted(kwargs.items()))) for p, kwargs in pipe.programs_of(request, num_images))
    return programs, pipe.padded_batch(num_images)


FALLBACK_MODEL = "shapes"  # trained here, shipped in assets/: it draws what it is told, offline


def fit_to_sizes(picture: Image.Image, sizes: Sequence[tuple[int, int]]) -> tuple[Image.Image, tuple[int, int]]:
    """`picture` at the size of `sizes` (width, height) whose aspect ratio is nearest its own:
    centre-cropped to that ratio, then resized (Lanczos). Returns it and the size chosen."""
    width, height = picture.size
    target = min(sizes, key=lambda size: abs(np.log(size[0] / size[1]) - np.log(width / height)))
    if (width, height) == target:
        return picture, target
    scale = min(width / target[0], height / target[1])
    crop_w, crop_h = target[0] * scale, target[1] * scale
    box = ((width - crop_w) / 2, (height - crop_h) / 2, (width + crop_w) / 2, (height + crop_h) / 2)
    return picture.resize(target, Image.Resampling.LANCZOS, box=box), target


@dataclasses.dataclass
class Grid:
    """A comparison grid's plan: its axes and the requests (device calls) that render its cells; cell i
    is image `where[i]` = (request, index) of those."""

    x: grid.Axis | None
    y: grid.Axis | None
    requests: list[Request]
    where: list[tuple[int, int]]


def load_pipeline(model: str, config: str | None = None, **kwargs) -> tuple[Pipeline, str | None]:
    """Loads `model` (with a single file's `config`); a Hub model that can't be fetched falls back
    to the built-in `shapes` model.

    Returns the pipeline and, after a fallback, a notice saying why and how to get real weights.
    """
    try:
        return Pipeline.from_pretrained(model, config=config, **kwargs), None
    except HubUnavailableError as e:
        notice = (
            f"{e}. Showing the built-in {FALLBACK_MODEL} model instead: it draws coloured circles, squares and "
            f"triangles on coloured backgrounds (try the examples). "
            f"For real images, start once where the Hub is reachable and without HF_HUB_OFFLINE=1: the "
            f"files the pipeline loads (configs, tokenizers, safetensors weights) are then downloaded into "
            f"your Hugging Face cache, and later starts read them from there, offline too."
        )
        log.warning(notice)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("scheduler", "unet")}  # the model's, not the fallback's
        return Pipeline.from_pretrained(FALLBACK_MODEL, **kwargs), notice


class TextToImage:
    """The demo's requests: turns what a user typed into validated device-queue requests."""

    def __init__(
        self, pipe: Pipeline, *, max_images_per_core: int = 4, max_queued: int = 32, max_per_owner: int = 4,
        notice: str | None = None, loras: Mapping[str, float] | None = None, recommended: Recommended = Recommended(),
        refiner_name: str | None = None,
    ):
        """`loras`: the LoRAs a request may use, {source: default scale}, in the order the UI lists them.
        `recommended`: the model's default steps and guidance (`checkpoints.known`). `refiner_name`:
        how results name the pipeline's refiner (`Pipeline.set_refiner`), if it has one."""
        self.pipe = pipe
        self.refiner_name = refiner_name
        self.notice = notice
        self.recommended = recommended
        self.loras = dict(loras or {})
        self.max_images_per_core = max_images_per_core
        self.sizes = list(recommended.sizes) if recommended.sizes else size_presets(pipe)
        self.queue = DeviceQueue(pipe, max_batch_images=pipe.num_devices * max_images_per_core, max_queued=max_queued,
                                 max_per_owner=max_per_owner)

    @property
    def max_images(self) -> int:
        return self.pipe.num_devices * self.max_images_per_core

    def _checked(self, request: Request, style: str, lora_scales: Sequence | None) -> Request:
        """The request validated by the pipeline, at one of the demo's sizes, with the launched LoRAs at
        `lora_scales` (one per LoRA, in order; None: their launch scales; 0 leaves one out)."""
        scales = list(self.loras.values()) if lora_scales is None else list(lora_scales)
        if len(scales) != len(self.loras):
            names = ", ".join(self.loras) or "none are loaded"
            raise ValueError(f"give one LoRA scale per LoRA ({names}), got {len(scales)}")
        request = self.pipe.validated(dataclasses.replace(request, loras=tuple(zip(self.loras, scales))))
        if (request.width, request.height) not in self.sizes:
            presets = ", ".join(f"{w}x{h}" for w, h in self.sizes)
            raise ValueError(f"size {request.width}x{request.height} is not one of this model's sizes: {presets}")
        return request

    @staticmethod
    def _styled(prompt, negative_prompt, style) -> tuple[str, str]:
        if style not in STYLES:
            raise ValueError(f"unknown style {style!r}; choose one of: {', '.join(STYLES)}")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be text, got {type(prompt).__name__} {prompt!r:.80}")
        if not prompt.strip():
            raise ValueError("please enter a prompt (an empty prompt would give unguided, random images)")
        if not isinstance(negative_prompt, (str, type(None))):
            raise ValueError(f"negative prompt must be text, got {negative_prompt!r:.80}")
        return STYLES[style].apply(prompt, negative_prompt or "")

    def request_images(
        self, prompt, negative_prompt, style, seed, guidance_scale, steps, width, height,
        images_per_core=1, sampler=None, lora_scales=None, refine_from=None,
    ) -> Request:
        """One prompt, `images_per_core` images on every core: images (seed, 0), (seed, 1), ...; with
        `refine_from`, finished by the refiner from that fraction of the noise."""
        n = self.pipe.num_devices * integer(images_per_core, "images per core", 1, self.max_images_per_core)
        text, negative = self._styled(prompt, negative_prompt, style)
        request = Request.from_prompt(
            text, negative, num_images=n, seed=seed, guidance_scale=guidance_scale, steps=steps, height=height,
            width=width, sampler=sampler,
        )
        return self._checked(dataclasses.replace(request, refine_from=refine_from), style, lora_scales)

    def request_prompt_comparison(
        self, prompts: list[str], negative_prompt, style, seed, guidance_scale, steps, width, height,
        sampler=None, lora_scales=None,
    ) -> Request:
        """Several prompts from the same starting noise (seed, image 0), side by side."""
        prompts = [p for p in prompts if p.strip()]
        if not 1 <= len(prompts) <= self.max_images:
            raise ValueError(f"enter from 1 to {self.max_images} prompts, one per line (got {len(prompts)})")
        styled = [self._styled(p, negative_prompt, style) for p in prompts]
        n = len(styled)
        request = Request(
            tuple(p for p, _ in styled), tuple(q for _, q in styled), (seed,) * n, (0,) * n, (guidance_scale,) * n,
            steps, height, width, sampler,
        )
        return self._checked(request, style, lora_scales)

    def request_seed_comparison(
        self, prompt, negative_prompt, style, seed, num_seeds, guidance_scale, steps, width, height,
        sampler=None, lora_scales=None,
    ) -> Request:
        """One prompt from `num_seeds` consecutive seeds, side by side."""
        first = integer(seed, "seed", 0, MAX_SEED)
        n = integer(num_seeds, "number of seeds", 1, self.max_images)
        if first + n - 1 > MAX_SEED:
            raise ValueError(f"seeds {first}..{first + n - 1} go past {MAX_SEED}")
        text, negative = self._styled(prompt, negative_prompt, style)
        request = Request(
            (text,) * n, (negative,) * n, tuple(range(first, first + n)), (0,) * n, (guidance_scale,) * n,
            steps, height, width, sampler,
        )
        return self._checked(request, style, lora_scales)

    def request_image_edit(
        self, prompt, negative_prompt, style, seed, guidance_scale, steps, image, mask, strength,
        images_per_core=1, sampler=None, lora_scales=None, refine_from=None,
    ) -> tuple[Request, str | None]:
        """Image-to-image of `image` (a PIL image), inpainting where `mask` (a PIL image, None for none)
        is white: both fitted to the demo's size of the nearest aspect ratio (`fit_to_sizes`).
        Returns the request and a note when the image was resized."""
        if image is None:
            raise ValueError("upload an image to start from")
        original = image.size
        picture, (width, height) = fit_to_sizes(image, self.sizes)
        pixels = images.pixels(picture)
        masks = None
        if mask is not None:
            if mask.size != original:
                raise ValueError(f"the mask is {mask.size[0]}x{mask.size[1]}, the image {original[0]}x{original[1]}")
            masks = images.mask(fit_to_sizes(mask.convert("L"), [(width, height)])[0])[None]
        request = self.request_images(
            prompt, negative_prompt, style, seed, guidance_scale, steps, width, height, images_per_core, sampler,
            lora_scales,
        )
        n = len(request)
        request = dataclasses.replace(
            request, images=np.repeat(pixels[None], n, axis=0), masks=None if masks is None else masks.repeat(n, 0),
            strength=number(strength, "strength", 0.0, 1.0), refine_from=refine_from,
        )
        note = None if original == (width, height) else (
            f"the image was {original[0]}x{original[1]}; cropped and resized to {width}x{height}, this model's "
            "nearest size"
        )
        return self._checked(request, style, lora_scales), note

    def request_grid(
        self, prompt, negative_prompt, style, seed, guidance_scale, steps, width, height, sampler,
        x_axis, x_values, y_axis, y_values, lora_scales=None,
    ) -> Grid:
        """A prompt x seed x ... grid (`sdxl.grid`): each cell image 0 of its own settings, the cells
        that can share a device call in as few calls as fit."""
        settings = dict(prompt=prompt, negative_prompt=negative_prompt, style=style, seed=seed,
                        guidance_scale=guidance_scale, steps=steps, sampler=sampler)
        scales = list(self.loras.values()) if lora_scales is None else list(lora_scales)
        settings |= {grid.LORA_AXIS + lora.display_name(source): scale for source, scale in zip(self.loras, scales)}
        names = [lora.display_name(source) for source in self.loras]
        axes = [
            None if not name else grid.parse_axis(
                name, values, prompt=prompt if isinstance(prompt, str) else "", max_steps=self.pipe.max_steps,
                loras=names,
            )
            for name, values in ((x_axis, x_values), (y_axis, y_values))
        ]
        x, y = axes
        if x is not None and y is not None and x.name == y.name:
            raise ValueError(f"the x and y axes are both {x.name}: choose two different settings")
        cells = grid.cell_settings(settings, x, y)
        singles = [self._cell_request(cell, width, height, names) for cell in cells]
        requests, where = [], [None] * len(cells)
        # Cells with guidance 1 or less share calls with guided ones: their images are the conditional
        # branch either way (within float rounding), and the grid takes fewer calls.
        for call in grid.calls([r.call_settings for r in singles], self.max_images):
            for index, cell in enumerate(call):
                where[cell] = (len(requests), index)
            requests.append(Request.merged([singles[i] for i in call]))
        return Grid(x, y, requests, where)

    def _cell_request(self, cell: dict, width, height, lora_names: list[str]) -> Request:
        text, negative = self._styled(cell["prompt"], cell["negative_prompt"], cell["style"])
        request = Request(
            (text,), (negative,), (cell["seed"],), (0,), (cell["guidance_scale"],), cell["steps"], height, width,
            cell["sampler"],
        )
        return self._checked(request, cell["style"], [cell[grid.LORA_AXIS + name] for name in lora_names])
