"""What the demo's page says while a submission renders and when it is done: the progress line, each
image with its PNG parameters and caption, the status line, and a grid's labelled sheet. No Gradio
here: `app.py` shows what these return.
"""

import dataclasses
import time
from collections.abc import Iterator

from PIL import Image

from ..engine.images import image_count
from ..engine.pipeline import Generation, NonFiniteImageError
from ..engine.prepared import PreparedRequest
from . import grid
from .grid import GridPlan
from .queue import Ticket, Update

# Axis names in a grid cell's caption; a prompt, a style or a sampler says itself.
AXIS_SHORT = {"guidance_scale": "cfg", "negative_prompt": "neg", "prompt": "", "style": "", "sampler": "",
              "control_scale": "control", "control_end": "control end", "ip_adapter_scale": "image prompt"}
NOT_FINITE = ("The model produced NaN/inf values instead of an image (numerical overflow). Try another seed or "
              "fewer steps; the server is fine.")


@dataclasses.dataclass(frozen=True)
class Shown:
    """What the page shows next of a rendering submission: its progress (`progress`), with previews
    of its images when there are new ones; or, at last, its answer (`answer`, `grid_answer`)."""

    progress: tuple | None = None
    previews: tuple | None = None
    answer: tuple | None = None


def rendered(service, submission, owner: str | None) -> Iterator[Shown]:
    """Queues a submission's calls (one at a time: those queued before a refusal are given up), then
    follows them (`DeviceQueue.follow`: closing this gives them up), yielding what the page shows.

    Raises:
      ValueError, QueueFullError: a call was refused.
      NonFiniteImageError: the model produced NaN/inf.
    """
    start, queue, tickets = time.perf_counter(), service.queue, []
    try:
        for call in submission.calls:
            tickets.append(queue.submit(call, owner))
    except Exception:
        for ticket in tickets:
            queue.cancel(ticket)
        raise
    grid = submission.grid is not None
    for update in queue.follow(tickets):
        new = update.previews is not None and not grid
        yield Shown(progress(update, len(tickets)), previews(update) if new else None)
    generations = [ticket.future.result() for ticket in tickets]
    seconds = time.perf_counter() - start
    if grid:
        answered = grid_answer(service, submission, tickets, generations, seconds)
        yield Shown(answer=answered if submission.sheet else answered[1:])
    else:
        yield Shown(answer=answer(service, submission, tickets[0], generations[0], seconds))


def size_label(width, height) -> str:
    return f"{width}×{height}"


def progress(update: Update, calls: int) -> tuple:
    """(done, description, unit) for a progress bar: a grid's device calls; or one call's denoising
    steps, its compile, or its place in the queue. `done` is a (done, total) pair or 0."""
    ticket = update.ticket
    if calls > 1:
        return (update.index, calls), "Rendering the grid", "device calls"
    if ticket.step:
        return (ticket.step, ticket.steps), "Denoising", "steps"
    if ticket.compiling:
        request = ticket.prepared.request
        return 0, (f"Compiling for {size_label(request.width, request.height)}, {prompt_shape(ticket.prepared)} "
                   "(first use of this size, batch, sampler or kind of prompt; cached after)"), None
    return 0, f"Waiting in queue: {update.ahead} request(s) ahead" if update.ahead else "Starting", None


def previews(update: Update) -> tuple[list, str]:
    """The gallery and status while a request renders: its images' previews."""
    step = update.ticket.step
    return ([(Image.fromarray(p), f"preview · step {step}") for p in update.previews],
            f"step {step} of {update.ticket.steps}: previews (their colours are approximate)")


def pictures(service, prepared: PreparedRequest, result: Generation, left_out: str | None = None) -> list[Image.Image]:
    """The images, each with its parameters in its PNG text (with what was `left_out`).

    Raises:
      NonFiniteImageError: the model produced NaN/inf.
    """
    if not result.finite.all():
        raise NonFiniteImageError(NOT_FINITE)
    found = []
    for i, image in enumerate(result.images):
        picture = Image.fromarray(image)
        picture.info["parameters"] = service.png_parameters(prepared, i, left_out)
        found.append(picture)
    return found


def caption(prepared: PreparedRequest, i: int, device: str, model: str | None = None) -> str:
    """Image i's caption: its model (where several are served), what tells it from the others (its prompt
    where prompts differ, as when comparing prompts), its seed, its image index where those differ, and
    the core it ran on."""
    request = prepared.request
    prompt = request.prompts[i]
    parts = [
        model,
        (prompt if len(prompt) <= 40 else prompt[:39] + "…") if len(set(request.prompts)) > 1 else None,
        f"seed {request.seeds[i]}",
        f"image {request.image_index[i]}" if len(set(request.image_index)) > 1 else None,
        device,
    ]
    return " · ".join(part for part in parts if part)


def prompt_shape(prepared: PreparedRequest) -> str:
    """What of a request's prompts its program is compiled for: "prompts of one chunk", "prompts of up to 4
    chunks, 2 texts each (prompt editing), with embeddings"."""
    tokens, chunks = prepared.tokens, prepared.tokens.num_chunks
    shape = "prompts of one chunk" if chunks == 1 else f"prompts of up to {chunks} chunks"
    if tokens.num_conditionings > 1:
        shape += f", {tokens.num_conditionings} texts each (prompt editing)"
    if prepared.program.embedding_rows:
        shape += ", with embeddings"
    return shape


def answer(service, submission, ticket: Ticket, result: Generation, seconds: float) -> tuple:
    """(gallery, status) of a finished request: its images captioned, and what it took from the click (`seconds`):
    its compile's share, and what was left out."""
    prepared = submission.calls[0]
    model = service.label_of(prepared) if len(service.models) > 1 else None
    gallery = [(picture, caption(prepared, i, result.devices[i], model))
               for i, picture in enumerate(pictures(service, prepared, result, submission.left_out))]
    notes = [note for note in (submission.note, submission.left_out) if note]
    if ticket.batch_images > len(prepared):
        notes.append(f"batched with other requests: {ticket.batch_images} images")
    status = f"{image_count(len(prepared))} in {seconds:.1f} s on {service.pipe.device_description}"
    return gallery, status + _compiled([ticket]) + _moved([result]) + (f" ({'; '.join(notes)})" if notes else "")


def _compiled(tickets: list[Ticket]) -> str:
    """What of a result's time went to compiling, as the status says it; "" for nothing."""
    if not any(ticket.compiling for ticket in tickets):
        return ""
    # Each compile it waited for, whole (one under way when it came counts in full).
    compiles = {id(f): f for ticket in tickets for f in ticket.compiles}.values()
    seconds = sum(f.result() for f in compiles if f.done() and not f.cancelled() and f.exception() is None)
    return f", {seconds:.1f} s of it compiling for this size, batch, sampler and kind of prompt, cached for next time"


def _moved(results: list[Generation]) -> str:
    """What of a result's time went to moving a model from host memory onto the devices; "" for nothing."""
    moved = [result.moving_seconds for result in results if result.moving_seconds]
    what = "the model" if len(moved) == 1 else "models"
    return f", {sum(moved):.1f} s of it moving {what} onto the devices from host memory" if moved else ""


def grid_answer(service, submission, tickets: list[Ticket], results: list[Generation], seconds: float) -> tuple:
    """(sheet, gallery, status) of a finished grid: the labelled grid, its cells captioned with their
    axes' values, and the device calls it took."""
    plan = submission.grid
    made = [pictures(service, call, result, submission.left_out) for call, result in zip(plan.requests, results)]
    cells = [made[call][index] for call, index in plan.where]
    sheet = grid.labelled(cells, plan.x, plan.y, [cell.info["parameters"] for cell in cells])
    calls = len(plan.requests)
    status = (f"{image_count(len(cells))} in {seconds:.1f} s, {calls} device call{'' if calls == 1 else 's'} on "
              f"{service.pipe.device_description}")
    status += _compiled(tickets) + _moved(results) + (f" ({submission.left_out})" if submission.left_out else "")
    return sheet, [(cell, cell_caption(plan, i)) for i, cell in enumerate(cells)], status


def cell_caption(plan: GridPlan, i: int) -> str:
    """A grid cell's caption, short enough for its thumbnail: each axis's value, with a short name
    where the value alone would not say which setting it is ("cfg 3 · seed 1")."""
    columns = 1 if plan.x is None else len(plan.x.labels)
    values = [] if plan.y is None else [(plan.y, plan.y.labels[i // columns])]
    values += [] if plan.x is None else [(plan.x, plan.x.labels[i % columns])]
    return " · ".join(f"{AXIS_SHORT.get(axis.name, axis.name.removeprefix(grid.LORA_AXIS))} {label}".strip()
                      for axis, label in values)
