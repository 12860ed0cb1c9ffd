"""Serving a pipeline to many users: one device queue that batches concurrent requests.

The devices run one compiled call at a time. Requests that arrive while they are busy wait in a
bounded queue; when the devices free up, the oldest request is taken together with every other
waiting request of the same settings that still fits, and they are rendered in one call. So N users
who click at once wait about as long as one, not N times as long.

The devices run only compiled programs: compiling one takes far longer than rendering (minutes for
SDXL on a TPU). A request whose programs are new (another size, sampler or prompt length) waits aside
while they compile in the background, and the devices serve the others meanwhile; requests merge only
into batch sizes already compiled, and a declined merge compiles that batch size for the next time.

One user cannot take the queue: each owner (a browser session, an API client) may have at most
`max_per_owner` requests waiting, and the next batch starts with the oldest request of the owner
served longest ago, so a user with many requests waits behind one with a single request only once.

Work nobody waits for is given up (`DeviceQueue.cancel`, when a client has gone): a waiting request
leaves the queue, and a rendering batch stops at its next progress report once every request in it
has been given up; a batch that still holds someone else's images renders on.

Every decision is the queue's, taken on this process; the devices hear of them through a `Runner`,
so that a runner for several processes can send each one to all of them.

The queue takes prepared requests (`Pipeline.prepare`: checked, tokenized, their programs named)
and renders them as they are; requests it merges are merged prepared ones.

A failure is confined to the requests it concerns: input is checked before it is queued, a NaN
image fails only the request it belongs to, and the worker thread survives any exception.
"""

import concurrent.futures
import dataclasses
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ..engine.pipeline import Generation, Pipeline
from ..engine.prepared import PreparedRequest
from ..engine.program import GenerateProgram

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The queue holds its maximum number of requests."""


class Runner:
    """What the device queue has the devices do: here, on this process's pipeline. A runner for
    several processes makes each call on every process, in the same order."""

    def __init__(self, pipe: Pipeline):
        self.pipe = pipe

    def compile(self, programs: Sequence[GenerateProgram]) -> float:
        """Compiles the staged programs a batch runs (the queue reports progress); returns the seconds."""
        return self.pipe.compile(programs, progress=True)

    def is_compiled(self, programs: Sequence[GenerateProgram]) -> bool:
        """Whether the staged programs a batch runs are compiled wherever it renders."""
        return self.pipe.is_compiled(programs, progress=True)

    def render(self, prepared: PreparedRequest, on_step: Callable[[int], bool], on_preview) -> Generation | None:
        """The batch's images, or None if `on_step` gave it up."""
        return self.pipe.render(prepared, on_step=on_step, on_preview=on_preview)


@dataclasses.dataclass(eq=False)
class Ticket:
    """A queued request: its future result and where it stands."""

    prepared: PreparedRequest
    owner: str | None = None  # who asked (a browser session); None: nobody in particular
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    step: int = 0  # denoising steps done, while running
    steps: int = 0  # the steps it runs (fewer than the request's for image-to-image), once running
    previews: "np.ndarray | None" = None  # [N, h, w, 3] uint8 previews of its images, while running
    compiling: bool = False  # whether it waits for its programs to compile (a new size, sampler or prompt length)
    compiles: set = dataclasses.field(default_factory=set)  # the futures of the compiles it waited for
    batch_images: int = 0  # images in the batch it runs in (its own and other requests')
    abandoned: bool = False  # given up (`DeviceQueue.cancel`): nobody waits for its result


@dataclasses.dataclass(frozen=True)
class Update:
    """Where a followed request stands (`DeviceQueue.follow`)."""

    ticket: Ticket  # the request followed now
    index: int  # its place among those followed
    ahead: int  # requests ahead of it: those waiting before it, and the batch on the devices (0: next, or its own)
    previews: "np.ndarray | None"  # new previews of its images since the last update, else None


class DeviceQueue:
    """Owns the devices: a worker thread renders queued requests, batching those that fit together."""

    def __init__(self, pipe: Pipeline, *, max_batch_images: int, max_queued: int, max_per_owner: int | None = None,
                 runner: Runner | None = None):
        self.pipe = pipe
        self.runner = runner or Runner(pipe)
        self.max_batch_images = max_batch_images
        self.max_queued = max_queued
        self.max_per_owner = max_per_owner or max_queued
        self._waiting: list[Ticket] = []
        self._rendering = False  # a batch is on the devices
        self._batches_started = 0
        self._last_started: dict[str | None, int] = {}  # owner -> the batch number it last led
        self._changed = threading.Condition()
        # One compile at a time, so that background compiles never starve the host of CPU.
        self._compiles: dict[tuple[GenerateProgram, ...], concurrent.futures.Future] = {}
        self._to_compile: list[tuple[int, int, tuple[GenerateProgram, ...]]] = []  # heap: (urgency, order, programs)
        self._queued_urgency: dict[tuple[GenerateProgram, ...], int] = {}  # programs in the heap, not yet started
        self._order = itertools.count()
        threading.Thread(target=self._serve, name="device-queue", daemon=True).start()
        threading.Thread(target=self._compile_forever, name="compile", daemon=True).start()

    def compile_in_background(
        self, programs: Sequence[GenerateProgram], *, needed: bool = False
    ) -> concurrent.futures.Future | None:
        """Compiles the programs of a batch (`Pipeline.programs_for`) without holding up the devices,
        once each, one at a time. Those a waiting request `needed` go first: a visitor who picks a new
        size waits for at most the one compile under way, not for every batch size compiled ahead.

        Returns a future of the seconds it took (the same one while it runs), or None if compiled."""
        key, urgency = tuple(programs), 0 if needed else 1
        with self._changed:
            compiling = self._compiles.get(key)
            if compiling is None:
                if self.runner.is_compiled(key):
                    return None
                compiling = self._compiles[key] = concurrent.futures.Future()
                compiling.add_done_callback(self._notify)  # requests waiting for it may be ready
            elif key not in self._queued_urgency or self._queued_urgency[key] <= urgency:
                return compiling  # under way, done, or queued at least this urgently
            self._queued_urgency[key] = urgency  # an entry queued less urgently is skipped when it comes up
            heapq.heappush(self._to_compile, (urgency, next(self._order), key))
            self._changed.notify_all()
            return compiling

    def _compile_forever(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._to_compile)
                urgency, _, key = heapq.heappop(self._to_compile)
                if self._queued_urgency.get(key) != urgency:
                    continue  # moved up: its more urgent entry came first
                del self._queued_urgency[key]
            compiling = self._compiles[key]
            try:
                compiling.set_result(self.runner.compile(key))
            except Exception as e:  # the requests waiting for it fail with the reason (`_ready`)
                compiling.set_exception(e)

    def _notify(self, _) -> None:
        with self._changed:
            self._changed.notify_all()

    def submit(self, prepared: PreparedRequest, owner: str | None = None) -> Ticket:
        """Queues `owner`'s prepared request (`Pipeline.prepare`, in the submitting thread: the device
        worker never spends its time on text).

        Raises:
          ValueError: more images than a batch holds.
          QueueFullError: the queue is at capacity, or the owner has `max_per_owner` waiting.
        """
        if len(prepared) > self.max_batch_images:
            raise ValueError(f"at most {self.max_batch_images} images per request, got {len(prepared)}")
        ticket = Ticket(prepared, owner)
        # Said from the start, not once the worker next looks: the first update a client gets is true.
        ticket.compiling = not self.runner.is_compiled(prepared.programs)
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
                log.info("gave up a waiting request of %d images: nobody waits for it", len(ticket.prepared))

    def position(self, ticket: Ticket) -> int:
        """How many requests are ahead of this one: those waiting before it, and the batch on the
        devices (0: next, or its own batch runs)."""
        with self._changed:
            return self._waiting.index(ticket) + self._rendering if ticket in self._waiting else 0

    def wait(self, ticket: Ticket, on_update=None, poll_seconds: float = 0.1) -> Generation:
        """Blocks until the ticket's result is ready, calling `on_update(ticket)` while it waits."""
        while True:
            try:
                return ticket.future.result(timeout=poll_seconds)
            except concurrent.futures.TimeoutError:
                if on_update is not None:
                    on_update(ticket)

    def follow(self, tickets: Sequence[Ticket], *, poll_seconds: float = 0.1,
               quiet_seconds: float = 1.0) -> Iterator[Update]:
        """Follows tickets in turn until each is done, yielding an `Update` whenever the one followed
        moves (its place in the queue, its compile, its step, new previews), and at least every
        `quiet_seconds` (a web server notices a client that has gone only when its handler yields).
        Closing the generator early (an error, a client gone) gives up every ticket not done
        (`cancel`), so that nobody waits behind work whose result nobody will see."""
        try:
            for index, ticket in enumerate(tickets):
                seen, shown, quiet_since = None, None, time.monotonic()
                while not _done_within(ticket, poll_seconds):
                    now = (self.position(ticket), ticket.compiling, ticket.step)
                    previews = ticket.previews if ticket.previews is not shown else None
                    if now != seen or previews is not None or time.monotonic() - quiet_since > quiet_seconds:
                        seen, shown, quiet_since = now, ticket.previews, time.monotonic()
                        yield Update(ticket, index, now[0], previews)
        finally:
            for ticket in tickets:
                if not ticket.future.done():
                    self.cancel(ticket)

    def _ready(self) -> list[Ticket]:
        """The waiting requests whose programs are compiled. The others' programs compile in the
        background meanwhile; a request whose compile failed fails."""
        ready = []
        for ticket in list(self._waiting):
            programs = ticket.prepared.programs
            if self.runner.is_compiled(programs):
                ready.append(ticket)
                continue
            ticket.compiling = True
            compiling = self.compile_in_background(programs, needed=True)
            if compiling is not None:
                ticket.compiles.add(compiling)
            if compiling.done() and compiling.exception() is not None:
                self._waiting.remove(ticket)
                ticket.future.set_exception(compiling.exception())
        return ready

    def _take_batch(self, ready: list[Ticket]) -> list[Ticket]:
        """Of the `ready` requests, the oldest of the owner who led a batch longest ago (or never), plus
        other waiting requests with its batch key, oldest first, up to the image budget, as long as the
        merged batch's programs are compiled."""
        first = min(ready, key=lambda t: self._last_started.get(t.owner, -1))  # min keeps the oldest
        self._waiting.remove(first)
        # Only owners with requests waiting need remembering: a session does not grow the server forever.
        waiting_owners = {t.owner for t in self._waiting}
        self._last_started = {o: n for o, n in self._last_started.items() if o in waiting_owners}
        self._last_started[first.owner] = self._batches_started
        self._batches_started += 1
        lead = first.prepared
        batch, size = [first], len(lead)
        for ticket in list(self._waiting):
            merged = size + len(ticket.prepared)
            if ticket.prepared.batch_key != lead.batch_key or merged > self.max_batch_images:
                continue
            grows = self.pipe.padded_batch(merged) > self.pipe.padded_batch(size)
            programs = lead.programs_at(self.pipe.padded_batch(merged))
            if grows and not self.runner.is_compiled(programs):
                self.compile_in_background(programs)
                continue
            batch.append(ticket)
            size = merged
            self._waiting.remove(ticket)
        return batch

    def _serve(self) -> None:
        while True:
            with self._changed:
                batch = self._take_batch(self._changed.wait_for(self._ready))
                self._rendering = True
            try:
                self._render(batch)
            except Exception as e:  # never let one bad batch stop the queue
                log.exception("batch failed")
                for ticket in batch:
                    if not ticket.future.done():
                        ticket.future.set_exception(e)
            finally:
                with self._changed:
                    self._rendering = False

    def _render(self, batch: list[Ticket]) -> None:
        parts = [t.prepared for t in batch]
        total = sum(len(part) for part in parts)
        prepared = parts[0] if len(parts) == 1 else PreparedRequest.merged(parts, self.pipe.padded_batch(total))
        for ticket in batch:
            ticket.batch_images, ticket.steps = total, prepared.steps_run
        starts = np.cumsum([0, *(len(part) for part in parts)])

        def on_step(done: int) -> bool:
            """Whether anyone still waits for the batch."""
            if all(ticket.abandoned for ticket in batch):
                log.info("gave up a batch of %d images at step %d of %d: nobody waits for them", total, done,
                         prepared.steps_run)
                return False
            for ticket in batch:
                ticket.step = done
            return True

        def on_preview(done: int, previews: np.ndarray) -> None:
            for ticket, begin, end in zip(batch, starts, starts[1:]):
                ticket.previews = previews[begin:end]

        result = self.runner.render(prepared, on_step, on_preview)
        if result is None:
            for ticket in batch:
                ticket.future.cancel()
            return
        for ticket, begin, end in zip(batch, starts, starts[1:]):
            ticket.future.set_result(result.part(begin, end))


def _done_within(ticket: Ticket, seconds: float) -> bool:
    done, _ = concurrent.futures.wait([ticket.future], timeout=seconds)
    return bool(done)
