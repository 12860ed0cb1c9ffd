"""The device queue's batching: requests merge only into compiled batch sizes; given-up work is dropped."""

import concurrent.futures
import dataclasses
import threading
import time

import numpy as np
import pytest

from sdxl.checkpoints import lora
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.request import Request
from sdxl.serving.queue import DeviceQueue, Runner

HEIGHT, WIDTH, STEPS = 64, 64, 2


@pytest.fixture(scope="module")
def pipe():
    pipe = Pipeline.from_pretrained("tiny", dtype="float32", max_steps=4)
    pipe.warmup(HEIGHT, WIDTH, progress=True)  # one image per device, as the app compiles at launch
    return pipe


def _request(seed: int) -> Request:
    return Request(("a cat",) * 4, ("",) * 4, (seed,) * 4, tuple(range(4)), (5.0,) * 4, STEPS, HEIGHT, WIDTH)


def _staged(pipe: Pipeline, request: Request) -> np.ndarray:
    """`request`'s images drawn alone, with progress reports as the device queue draws: by the staged programs
    that the queue's renders compiled (a render without reports compiles its whole-run program besides;
    test_pipeline checks that the two draw alike)."""
    return pipe.render(request, on_step=lambda done: True).images


def _render_at_once(queue: DeviceQueue, seeds) -> list:
    """The tickets of requests submitted together, once they are done."""
    tickets = [queue.submit(queue.pipe.prepare(_request(seed))) for seed in seeds]
    for ticket in tickets:
        queue.wait(ticket)
    return tickets


@pytest.mark.compiles
def test_requests_merge_only_into_compiled_batch_sizes(pipe):
    # At most 8: three requests waiting at once then never have a batch of 12 compiled in the background.
    queue = DeviceQueue(pipe, max_batch_images=8, max_queued=8)
    merged = pipe.programs_for(_request(0), 8)
    assert pipe.num_devices == 4 and not pipe.is_compiled(merged, progress=True)

    tickets = _render_at_once(queue, range(3))
    # Batch 8 was not compiled, so the requests ran one by one, and it compiled in the background.
    assert [t.batch_images for t in tickets] == [4, 4, 4]
    assert not any(t.compiling for t in tickets)
    queue.compile_in_background(merged).result(timeout=300)
    assert pipe.is_compiled(merged, progress=True)

    # While the first of three renders, the other two wait, and now they share a compiled call.
    tickets = _render_at_once(queue, range(3, 6))
    assert 8 in [t.batch_images for t in tickets]
    assert not any(t.compiling for t in tickets)
    assert DeviceQueue(pipe, max_batch_images=8, max_queued=8).compile_in_background(merged) is None


@pytest.mark.compiles
def test_a_batch_being_compiled_in_the_background_waits_for_it(pipe):
    queue = DeviceQueue(pipe, max_batch_images=16, max_queued=8)
    # 16: a batch size that no other test compiles on the same pipeline.
    request = Request(("a dog",) * 16, ("",) * 16, (7,) * 16, tuple(range(16)), (5.0,) * 16, STEPS, HEIGHT, WIDTH)
    compiling = queue.compile_in_background(pipe.programs_for(request))
    assert compiling is not None
    updates = []
    ticket = queue.submit(pipe.prepare(request))
    result = queue.wait(ticket, on_update=lambda ticket: updates.append(ticket.compiling))
    assert compiling.done() and ticket.batch_images == 16 and ticket.compiling
    assert updates and all(updates), "while it waits for the compile, the request must say it is compiling"
    assert len(result.images) == 16


@pytest.mark.compiles
def test_compiles_a_waiting_request_needs_go_before_those_ahead_of_need(pipe):
    started, release = [], threading.Event()

    class Recording(Runner):
        def compile(self, programs):
            started.append(programs)
            release.wait(60)
            return 0.0

    queue = DeviceQueue(pipe, max_batch_images=16, max_queued=8, runner=Recording(pipe))
    first, second, third, new_size = (tuple(pipe.programs_for(dataclasses.replace(_request(0), height=h, width=h)))
                                      for h in (32, 48, 80, 96))
    compiles = [queue.compile_in_background(first)]
    while not started:  # the first is under way: nothing overtakes it
        threading.Event().wait(0.01)
    compiles += [queue.compile_in_background(programs) for programs in (second, third)]
    assert queue.compile_in_background(third, needed=True) is compiles[2], "moved up, compiled once"
    compiles.append(queue.compile_in_background(new_size, needed=True))
    release.set()
    for compiling in compiles:
        compiling.result(timeout=60)
    assert started == [first, third, new_size, second]


@pytest.mark.compiles
def test_requests_with_other_loras_never_share_a_batch(pipe, tmp_path):
    
    style = str(lora.write_random(tmp_path / "style.safetensors", pipe.spec))
    queue = DeviceQueue(pipe, max_batch_images=16, max_queued=8)
    plain, styled, half = (dataclasses.replace(_request(0), loras=loras)
                           for loras in ((), ((style, 1.0),), ((style, 0.5),)))
    expected = {}
    for request in (plain, styled, half):
        expected[request.loras] = _staged(pipe, request)
    tickets = [queue.submit(pipe.prepare(request)) for request in (plain, styled, half, plain)]
    results = [queue.wait(ticket) for ticket in tickets]
    # Only the two plain requests may merge (when a batch of 8 is compiled); no batch mixes LoRAs.
    assert [t.batch_images for t in tickets][1:3] == [4, 4]
    for ticket, result in zip(tickets, results):
        # Within 1 where a merged batch of 8 took other XLA:CPU GEMM blockings than a batch of 4.
        difference = np.abs(result.images.astype(int) - expected[ticket.prepared.request.loras])
        assert difference.max() <= 1 and difference.mean() < 1e-3
    assert np.abs(expected[()].astype(int) - expected[((style, 1.0),)]).mean() > 1


@pytest.mark.compiles
def test_prompts_are_read_when_a_request_is_prepared_never_in_the_device_worker(pipe, monkeypatch):
    """Issue 21, hole 1: the one device worker never spends its time on text; a prepared request keeps
    its tokens, and a prompt over the chunk limit is refused when it is prepared."""
    threads = []
    read = pipe.prompts.read
    monkeypatch.setattr(pipe.prompts, "read", lambda *args, **kwargs: threads.append(threading.current_thread().name)
                        or read(*args, **kwargs))
    queue = DeviceQueue(pipe, max_batch_images=16, max_queued=8)
    long = "word " * 100
    tickets = [queue.submit(pipe.prepare(dataclasses.replace(_request(seed), prompts=(prompt,) * 4)))
               for seed, prompt in ((1, "a cat"), (2, long))]
    results = [queue.wait(ticket) for ticket in tickets]
    assert threads and "device-queue" not in threads
    alone = _staged(pipe, dataclasses.replace(_request(2), prompts=(long,) * 4))
    np.testing.assert_array_equal(results[1].images, alone)
    with pytest.raises(ValueError, match="over the limit of 8 chunks"):
        pipe.prepare(dataclasses.replace(_request(3), prompts=("w " * 700,) * 4))


def _held(monkeypatch, pipe, gate: threading.Event, on_render=None):
    """Makes the device worker wait for `gate` before each render; `on_render(prepared, on_step)`
    returns the on_step the render reports to (default: the worker's own)."""
    render = pipe.render

    def held(request, *, on_step=None, **kwargs):
        gate.wait(timeout=60)
        return render(request, on_step=on_render(request, on_step) if on_render else on_step, **kwargs)

    monkeypatch.setattr(pipe, "render", held)


def _running(ticket) -> None:
    while not ticket.batch_images:  # set once the worker has taken it into a batch
        threading.Event().wait(0.01)


def test_a_cancelled_waiting_request_leaves_the_queue_unrendered(pipe, monkeypatch):
    """Issue 21, hole 2: a request whose client has gone is dropped before it reaches the devices."""
    gate = threading.Event()
    _held(monkeypatch, pipe, gate)
    queue = DeviceQueue(pipe, max_batch_images=4, max_queued=8)  # batches of one request: nothing merges
    running = queue.submit(pipe.prepare(_request(1)))
    _running(running)
    gone, kept = queue.submit(pipe.prepare(_request(2))), queue.submit(pipe.prepare(_request(3)))
    assert queue.position(kept) == 2, "the request before it and the batch on the devices"
    queue.cancel(gone)
    assert gone.future.cancelled() and queue.position(kept) == 1
    gate.set()
    assert len(queue.wait(running).images) == len(queue.wait(kept).images) == 4
    assert gone.batch_images == 0, "a cancelled request never reaches the devices"


@pytest.mark.compiles
def test_a_batch_everyone_gave_up_stops_between_progress_reports(pipe, monkeypatch):
    """Only once every request of the batch is given up; the worker then goes on with the next."""
    queue = DeviceQueue(pipe, max_batch_images=8, max_queued=8)
    if (compiling := queue.compile_in_background(pipe.programs_for(_request(0), 8))) is not None:
        compiling.result(timeout=300)  # so that two requests share a batch
    gate, reports = threading.Event(), []

    def giving_up(prepared, on_step):
        def step(done):
            reports.append(done)
            if done == 1:
                for ticket in tickets:
                    queue.cancel(ticket)
            return on_step(done)
        return step if prepared.request.seeds[0] == 4 else on_step

    _held(monkeypatch, pipe, gate, giving_up)

    def submitted_together(seeds, going):
        """Tickets queued while another request holds the worker, so that they share the next batch;
        those at the `going` indices are given up at the batch's first report."""
        gate.clear()
        blocker = queue.submit(pipe.prepare(_request(0)))
        _running(blocker)
        together = [queue.submit(pipe.prepare(_request(seed))) for seed in seeds]
        tickets[:] = [together[i] for i in going]
        gate.set()
        queue.wait(blocker)
        return together

    tickets = []
    together = submitted_together([4, 5], going=[0, 1])
    for ticket in together:
        with pytest.raises(concurrent.futures.CancelledError):
            ticket.future.result(timeout=120)
    assert together[0].batch_images == 8 and reports == [1], "stopped at the first report, before step 2"
    assert len(queue.wait(queue.submit(pipe.prepare(_request(6)))).images) == 4  # the worker carries on

    reports.clear()
    together = submitted_together([4, 5], going=[0])  # the other client's images are rendered all the same
    result = queue.wait(together[1])
    assert reports == [1, STEPS] and len(result.images) == 4 and together[1].batch_images == 8


def test_following_a_request_reports_its_moves_and_closing_early_gives_it_up(pipe, monkeypatch):
    """`DeviceQueue.follow`, every tab's one progress loop: an update whenever the request moves (its
    place, its step, new previews), and a given-up request when the follower stops following."""
    gate = threading.Event()

    def lingering(prepared, on_step):  # each step outlasts many polls, however fast the machine
        def step(done: int) -> bool:
            going = on_step(done)
            time.sleep(0.2)
            return going
        return step

    _held(monkeypatch, pipe, gate, lingering)
    queue = DeviceQueue(pipe, max_batch_images=4, max_queued=8)
    blocker = queue.submit(pipe.prepare(_request(1)))
    _running(blocker)
    followed = queue.submit(pipe.prepare(_request(2)))
    following = queue.follow([followed], poll_seconds=0.01, quiet_seconds=60)
    first = next(following)
    assert (first.ticket, first.index, first.ahead, first.previews) == (followed, 0, 1, None)
    gate.set()
    updates, steps = [first], [first.ticket.step]
    for update in following:  # the ticket is the one followed: read its step as each update comes
        updates.append(update)
        steps.append(update.ticket.step)
    assert followed.future.done() and updates[-1].ahead == 0
    assert set(range(1, STEPS + 1)) <= set(steps), f"each step it reaches is reported: {steps}"
    assert any(u.previews is not None for u in updates), "the runner's previews reach the follower"

    gate.clear()
    blocker, gone = queue.submit(pipe.prepare(_request(3))), queue.submit(pipe.prepare(_request(4)))
    _running(blocker)
    following = queue.follow([gone], poll_seconds=0.01)
    next(following)
    following.close()  # the client went away
    assert gone.abandoned and gone.future.cancelled()
    gate.set()
    queue.wait(blocker)
