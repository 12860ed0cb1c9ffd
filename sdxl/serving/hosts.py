"""One demo over many hosts: process 0 serves, the others follow its device queue.

Every host runs the same command (`python app.py --coordinator HOST:PORT --num-processes N
--process-id I`). `join` starts JAX's multi-controller runtime (`jax.distributed.initialize`, gloo
collectives on CPU), which joins every host's devices into one mesh: a batch's images spread over
all of them, and `sdxl.engine.mesh.fetch` gathers them to every process.

Process 0 takes every decision (`sdxl.serving.queue.DeviceQueue`); its `HostsRunner` sends each one to the
followers over the runtime's own coordination service (its key-value store: no home-made RPC), and
each follower (`Hosts.follow`) makes the same pipeline calls in the same order:
- the render stream: a batch's prepared request (checked and tokenized once, on process 0: the
  follower builds the same arrays from it, and renders with its own loaded model, the same as process
  0's by name), then at each progress report the decision to go on or
  give up, so every process runs the same device calls and joins the same collectives;
- the compile stream: the programs compiled in the background, in process 0's order, on a thread of
  their own as on process 0, so a long compile never holds up rendering there either. Each follower
  says when it has compiled them, and process 0 counts programs as compiled (its queue renders them)
  only once every host has: a batch then starts on every host together. (A host still compiling
  while the others wait in the batch's first collective would fail it: gloo waits 30 s.)

Faults end the demo with a sentence rather than hang it: a collective that fails on process 0 (a
follower died: gloo notices the closed connection at once) names the hosts and exits with status 3;
the coordination service notices a host that stops sending heartbeats (`HEARTBEAT_SECONDS`) and ends
the others; a follower whose options, model or code differ from process 0's is refused at start
(`Hosts.agree`), with the difference, and exit status 2.

What the broadcasts cost is counted as they go: process 0's `HostsRunner.sent` holds, per kind of
message, how many it sent, their bytes and the seconds it spent sending them; a follower's
`Hosts.lag_seconds` adds up how long after process 0 sent each step's decision the follower had it
(a step message carries the time it was sent; across hosts the offset of their clocks adds in), and
`Hosts.wait_seconds` how long it waited for them, having finished the step first.
With `SDXL_HOSTS_STATS=FILE`, each process rewrites FILE with its counters (JSON) after each batch
(and process 0 after each compile it sends): `python -m sdxl bench --soak-hosts` reads them.
"""

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 60  # a host silent this long is dead: the coordination service ends the others
JOIN_SECONDS = 300  # how long the processes wait for one another at start, by default
AGREE_SECONDS = 1800  # how long process 0 waits for every host to load the model and report it
REFUSED_WAIT_SECONDS = 30  # how long process 0 waits for a refused follower to say so before it exits
REFUSED_GRACE_SECONDS = 1  # and then for the follower's exit, which takes microseconds
POLL_MS = 10_000  # a follower waits for the next message this long at a time
LIVE_NODES_SECONDS = 5  # how long a lost process asks the coordination service which processes live
COMPILE_SECONDS = 3600  # how long process 0 waits for every follower to have compiled what it compiled
CHUNK = 1 << 22  # the largest value written to the key-value store at once (bytes)
PREFIX = "sdxl"
STATS_VARIABLE = "SDXL_HOSTS_STATS"  # names a file each process rewrites with its counters (JSON)

LOST_STATUS = 3  # the exit status when a host is lost
REFUSED_STATUS = 2  # the exit status when the hosts disagree at start


@dataclasses.dataclass(frozen=True)
class Where:
    """Which processes to join: all None for one process; `coordinator == "auto"`: let
    `jax.distributed.initialize()` detect them (a TPU pod slice, SLURM, ...)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def distributed(self) -> bool:
        return self.coordinator is not None

    def problem(self) -> str | None:
        """What is wrong with the three options together, or None."""
        given = [self.coordinator is not None, self.num_processes is not None, self.process_id is not None]
        if self.coordinator == "auto":
            return None if given == [True, False, False] else (
                "--coordinator auto detects the processes: give no --num-processes or --process-id")
        if any(given) and not all(given):
            return "--coordinator, --num-processes and --process-id go together: give all three or none"
        if all(given) and not 0 <= self.process_id < self.num_processes:
            return f"--process-id must be from 0 to {self.num_processes - 1}, got {self.process_id}"
        return None


def detected() -> Where:
    """Where no process options are given: on a Cloud TPU VM of a slice of several hosts, `Where("auto")`,
    so that plain `python app.py` on every host joins them as JAX detects them; else one process.
    Other clusters (SLURM, Kubernetes) take `--coordinator auto`: detecting those queries them."""
    import jax  # noqa: F401  (importing it finds out whether this is a Cloud TPU VM)
    from jax._src import cloud_tpu_init
    from jax._src.clusters import cloud_tpu_cluster

    if cloud_tpu_init.running_in_cloud_tpu_vm:
        for cluster in (cloud_tpu_cluster.GkeTpuCluster, cloud_tpu_cluster.GceTpuCluster):
            if cluster.is_env_present():
                return Where("auto") if cluster.get_process_count() > 1 else Where()
    return Where()


def fail(sentence: str, status: int, *, then: Callable[[], None] | None = None) -> None:
    """Ends this process with `sentence` on stderr, after `then()` if given. `os._exit`: the runtime's
    exit barrier would wait for (or abort on) the hosts that are gone."""
    print(f"error: {sentence}", file=sys.stderr, flush=True)
    logging.shutdown()
    if then is not None:
        then()
    os._exit(status)


def source_hash() -> str:
    """A hash of this package's source: every host must run the same code."""
    digest = hashlib.sha256()
    root = Path(__file__).parents[1]
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


class Channel:
    """Messages from process 0 to every other process, in order, through the coordination service's
    key-value store. A message is pickled (every host runs the same code: `Hosts.agree` checks) and
    written in chunks; the last follower to read it deletes it."""

    def __init__(self, client, name: str, readers: int):
        self.client, self.name, self.readers = client, name, readers
        self.count = 0

    def _key(self) -> str:
        key = f"{PREFIX}/{self.name}/{self.count}"
        self.count += 1
        return key

    def send(self, message) -> int:
        """Writes `message` for the followers; returns the bytes written."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
        key = self._key()
        for i, chunk in enumerate(chunks[1:], 1):
            self.client.key_value_set_bytes(f"{key}/{i}", chunk)
        self.client.key_value_set_bytes(key, len(chunks).to_bytes(4, "little") + chunks[0])  # last: it is complete
        return 4 + len(data)

    def receive(self):
        """The next message; waits as long as it takes (the demo may be idle for hours)."""
        import jax

        key = self._key()
        while True:
            try:
                head = self.client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except jax.errors.JaxRuntimeError as e:
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        count = int.from_bytes(head[:4], "little")
        data = head[4:] + b"".join(self.client.blocking_key_value_get_bytes(f"{key}/{i}", POLL_MS)
                                   for i in range(1, count))
        if self.client.key_value_increment(f"{key}/read", 1) == self.readers:
            self.client.key_value_delete(key)  # with its chunks and counter
        return pickle.loads(data)


@dataclasses.dataclass
class Tally:
    """Messages of one kind that process 0 sent: how many, their bytes (pickled, as written to the
    key-value store, which every follower reads), and the seconds spent pickling and writing them."""

    messages: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, size: int, seconds: float) -> None:
        self.messages += 1
        self.bytes += size
        self.seconds += seconds


class Hosts:
    """This process's place among the processes of one demo, and the runtime's client."""

    def __init__(self, process_id: int, count: int, client, stats: Path | None = None):
        self.process_id, self.count, self.client = process_id, count, client
        self.names: dict[int, str] = {process_id: socket.gethostname()}  # filled in by `agree`
        self.renders = Channel(client, "render", count - 1)
        self.compiles = Channel(client, "compile", count - 1)
        self.stats = stats  # where `report` writes this process's counters, if anywhere
        self._reporting = threading.Lock()
        # A follower's count of the batches it followed and of their step messages, with the seconds
        # from each one's sending on process 0 to its reading here (the lag), and those spent waiting
        # for it here (when this process had finished the step first).
        self.batches, self.steps, self.lag_seconds, self.wait_seconds = 0, 0, 0.0, 0.0

    @property
    def leader(self) -> bool:
        return self.process_id == 0

    def describe(self, process_id: int) -> str:
        name = self.names.get(process_id)
        return f"process {process_id}" + (f" on host {name}" if name else "")

    def agree(self, what: str, facts: Mapping[str, object]) -> None:
        """Exchanges `facts` (JSON values) with every process and ends this one with the difference,
        status 2, unless all processes' facts are process 0's."""
        import jax

        mine = json.dumps({"host": socket.gethostname(), "facts": dict(facts)}, sort_keys=True, default=str)
        self.client.key_value_set(f"{PREFIX}/agree/{what}/{self.process_id}", mine)
        others = range(self.count) if self.leader else [0]
        theirs = {}
        for other in others:
            try:
                theirs[other] = json.loads(
                    self.client.blocking_key_value_get(f"{PREFIX}/agree/{what}/{other}", AGREE_SECONDS * 1000))
            except jax.errors.JaxRuntimeError as e:
                fail(f"{self.describe(other)} did not report its {what} within {AGREE_SECONDS} s "
                     f"({str(e).splitlines()[0]})", REFUSED_STATUS)
            self.names[other] = theirs[other]["host"]
        expected = json.loads(mine)["facts"] if self.leader else theirs[0]["facts"]
        got = {other: t["facts"] for other, t in theirs.items()} | {self.process_id: json.loads(mine)["facts"]}
        refusals = {}
        for other, facts_of_other in sorted(got.items()):
            differences = [f"{key} {facts_of_other.get(key)!r} where process 0 has {expected.get(key)!r}"
                           for key in sorted(set(expected) | set(facts_of_other))
                           if facts_of_other.get(key) != expected.get(key)]
            if differences:
                refusals[other] = (f"{self.describe(other)} was started differently from process 0 ({what}: "
                                   f"{'; '.join(differences)}); start every host with the same options, model "
                                   "files and code")
        if not refusals:
            return
        # Each refused follower says so itself, then exits; process 0 waits for that before it exits,
        # since its going (with the coordination service it runs) aborts the followers still running.
        refused = f"{PREFIX}/agree/{what}/refused"
        if self.leader:
            for other in refusals:
                with contextlib.suppress(jax.errors.JaxRuntimeError):
                    self.client.blocking_key_value_get(f"{refused}/{other}", REFUSED_WAIT_SECONDS * 1000)
            time.sleep(REFUSED_GRACE_SECONDS)  # for the followers' own exits, which follow at once
            fail(next(iter(refusals.values())), REFUSED_STATUS)

        def said_so():
            with contextlib.suppress(jax.errors.JaxRuntimeError):  # process 0 may be going already
                self.client.key_value_set(f"{refused}/{self.process_id}", "1")

        fail(refusals[self.process_id], REFUSED_STATUS, then=said_so)

    def lost(self, error: BaseException) -> None:
        """Ends this process after a collective failed: another process is gone, and the hosts can no
        longer render together."""
        others = [p for p in range(self.count) if p != self.process_id]
        # The service answers only once every live process asks, and one may be waiting in a
        # collective: asked aside, for a few seconds, or every other process is named.
        asking = concurrent.futures.ThreadPoolExecutor(1).submit(self.client.get_live_nodes, list(range(self.count)))
        try:
            live = set(asking.result(timeout=LIVE_NODES_SECONDS))
            dead = [p for p in others if p not in live] or others
        except concurrent.futures.TimeoutError:
            dead = others
        except Exception:  # the coordination service itself is gone (process 0 ended)
            dead = [0] if not self.leader else others
        names = ", ".join(self.describe(p) for p in dead)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        fail(f"lost {names} ({reason}); the demo stops: start every host again", LOST_STATUS)

    def report(self, counters: Mapping[str, object]) -> None:
        """Rewrites the `stats` file (if any) with `counters`, whole: a reader never sees half of it.
        A file that cannot be written is logged, not raised: the demo serves on without it."""
        if self.stats is None:
            return
        with self._reporting:
            partial = self.stats.with_name(self.stats.name + ".partial")
            try:
                partial.write_text(json.dumps({"process": self.process_id, "processes": self.count, **counters}))
                os.replace(partial, self.stats)
            except OSError as e:
                log.warning("could not write %s=%s: %s", STATS_VARIABLE, self.stats, e)

    # Process 0

    def runner(self, pipe):
        return HostsRunner(pipe, self)

    # The others

    def follow(self, pipes) -> None:
        """Makes process 0's pipeline calls here, in its order, until it ends (which ends this one), with
        `pipes` (the models served, in process 0's order; they share their compiled programs)."""
        log.info("%s follows process 0's requests", self.describe(self.process_id))
        threading.Thread(target=self._follow_compiles, args=(pipes[0],), name="follow-compiles", daemon=True).start()
        while True:
            try:
                message = self.renders.receive()
            except Exception as e:  # the coordination service is gone: process 0 ended
                self.lost(e)
            kind = message[0]
            if kind == "render":
                self._render(pipes, *message[1:])
            else:
                fail(f"{self.describe(self.process_id)} expected a render, got {kind!r}", LOST_STATUS)

    def _follow_compiles(self, pipe) -> None:
        while True:
            number = self.compiles.count
            try:
                kind, programs = self.compiles.receive()
            except Exception as e:
                self.lost(e)
            try:
                pipe.compile(programs, progress=True)
            except Exception:  # process 0 failed the same way; the requests that need it fail there
                log.exception("a background compile failed")
            self.client.key_value_set(self.compiled_key(number, self.process_id), "1")

    def compiled_key(self, number: int, process_id: int) -> str:
        """Where a process says it has done compile message `number` (`HostsRunner.compile` waits for it)."""
        return f"{PREFIX}/compiled/{number}/{process_id}"

    def _render(self, pipes, prepared, model_key: tuple, previews: bool) -> None:
        import jax

        pipe = next((pipe for pipe in pipes if pipe.model.key == model_key), None)
        if pipe is None:
            fail(f"{self.describe(self.process_id)} has loaded {[pipe.model.key for pipe in pipes]}, process 0 "
                 f"renders with {model_key}", LOST_STATUS)
        model = pipe.model
        model = model.reading(source for source, _ in prepared.request.loras)
        prepared = prepared.with_model(model, model.refiner)

        def on_step(done: int) -> bool:
            start = time.time()
            message = self.renders.receive()
            if message[:2] != ("step", done):
                fail(f"{self.describe(self.process_id)} is out of step with process 0: expected step {done}, got "
                     f"{message[0]} {message[1]}", LOST_STATUS)
            _, _, go_on, sent = message
            now = time.time()
            self.steps, self.lag_seconds, self.wait_seconds = (
                self.steps + 1, self.lag_seconds + now - sent, self.wait_seconds + now - start)
            return go_on

        try:
            pipe.render(prepared, on_step=on_step, on_preview=(lambda done, images: None) if previews else None)
        except jax.errors.JaxRuntimeError as e:
            self.lost(e)
        except Exception:  # process 0 failed the same way, before any collective, and told its users
            log.exception("a render failed")
        self.batches += 1
        self.report({"batches": self.batches, "steps": self.steps, "step_lag_seconds": self.lag_seconds,
                     "step_wait_seconds": self.wait_seconds})


class HostsRunner:
    """`sdxl.serving.queue.Runner` for several processes: each call is sent to the followers, then made here.

    `sent` counts what went to the followers, by kind: "render" (a batch's request), "step" (its
    go-on-or-give-up at each progress report) and "compile"."""

    def __init__(self, pipe, hosts: Hosts):
        self.pipe, self.hosts = pipe, hosts
        self._sending = threading.Lock()  # the compile thread and the device worker both call
        self._counting = threading.Lock()  # and both count, and report the counts
        self.sent = {kind: Tally() for kind in ("render", "step", "compile")}
        self._everywhere: set = set()  # the programs every host has compiled

    def _send(self, channel: Channel, message: tuple) -> None:
        start = time.perf_counter()
        size = channel.send(message)
        with self._counting:
            self.sent[message[0]].add(size, time.perf_counter() - start)

    def _report(self) -> None:
        with self._counting:
            sent = {kind: dataclasses.asdict(tally) for kind, tally in self.sent.items()}
        self.hosts.report({"sent": sent})

    def compile(self, programs) -> float:
        """Compiles here and on every follower, and returns (the seconds here) once every follower has
        too: a batch of these programs then starts on every host together. (One host compiling while
        the others wait in the batch's first collective would fail it: gloo gives a late process 30 s.)"""
        with self._sending:
            number = self.hosts.compiles.count
            self._send(self.hosts.compiles, ("compile", list(programs)))
        self._report()
        seconds = self.pipe.compile(programs, progress=True)
        for follower in range(1, self.hosts.count):
            key = self.hosts.compiled_key(number, follower)
            try:
                self.hosts.client.blocking_key_value_get(key, COMPILE_SECONDS * 1000)
            except Exception as e:
                self.hosts.lost(e)
            self.hosts.client.key_value_delete(key)
        with self._counting:
            self._everywhere.update(programs)
        return seconds

    def is_compiled(self, programs) -> bool:
        """Whether every host has compiled the programs (`compile`)."""
        with self._counting:
            return all(program in self._everywhere for program in programs)

    def render(self, prepared, on_step: Callable[[int], bool], on_preview):
        import jax

        # Without its loaded model (arrays on the devices): each follower renders with its own, loaded alike.
        self._send(self.hosts.renders, ("render", prepared.with_model(None), prepared.model.key,
                                        on_preview is not None))

        def step(done: int) -> bool:
            go_on = on_step(done) is not False
            self._send(self.hosts.renders, ("step", done, go_on, time.time()))  # its time: the followers' lag
            return go_on

        try:
            return self.pipe.render(prepared, on_step=step, on_preview=on_preview)
        except jax.errors.JaxRuntimeError as e:
            self.hosts.lost(e)
        finally:
            self._report()


def join(where: Where, *, join_seconds: int = JOIN_SECONDS) -> Hosts | None:
    """Joins the processes `where` names (None for one process), or ends this one with a sentence
    (status 3) when they have not all joined within `join_seconds`. Call before anything touches
    JAX's devices."""
    if not where.distributed:
        return None
    import jax
    from jax._src import distributed

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives between processes
    # Its SIGTERM handler holds a process for a training job's checkpoint; a demo asked to stop stops.
    jax.config.update("jax_enable_preemption_service", False)
    # JAX's own time limit aborts the process with its words: ours ends it first, with a sentence.
    kwargs = dict(heartbeat_timeout_seconds=HEARTBEAT_SECONDS, initialization_timeout=join_seconds + 60)
    if where.coordinator == "auto":
        late = f"this host did not join the slice's other hosts within {join_seconds} s"
    elif where.process_id == 0:
        late = (f"not all {where.num_processes} processes joined process 0 at {where.coordinator} within "
                f"{join_seconds} s")
    else:
        late = f"process {where.process_id} could not join process 0 at {where.coordinator} within {join_seconds} s"
    watchdog = threading.Timer(join_seconds, fail, (f"{late}; the demo stops: start every host (--join-timeout "
                                                    "gives them longer)", LOST_STATUS))
    watchdog.daemon = True
    watchdog.start()
    if where.coordinator == "auto":
        jax.distributed.initialize(**kwargs)
    else:
        jax.distributed.initialize(where.coordinator, num_processes=where.num_processes,
                                   process_id=where.process_id, **kwargs)
    watchdog.cancel()
    stats = os.environ.get(STATS_VARIABLE)
    return Hosts(jax.process_index(), jax.process_count(), distributed.global_state.client,
                 Path(stats) if stats else None)


def option_facts(options) -> dict:
    """What every process must be started with alike, from `sdxl.serving.launch`'s options."""
    import jax

    names = ("model", "config", "unet", "lora", "controlnet", "ip_adapter", "refiner", "dtype", "emphasis",
             "max_images_per_core")
    return {name: getattr(options, name, None) for name in names} | {
        "sdxl source": source_hash(), "jax": jax.__version__, "python": sys.version.split()[0],
    }


def model_facts(model) -> dict:
    """What every process must have loaded alike: the model (each host may fall back to `shapes`
    on its own when offline), its configs, sizes and settings."""
    pipe = model.pipe
    return {
        "model": model.label, "configs": hashlib.sha256(repr(pipe.spec).encode()).hexdigest()[:16],
        "dtype": pipe.dtype.name, "sizes": model.settings.sizes, "steps": model.settings.steps,
        "guidance": model.settings.guidance_scale, "loras": sorted(model.loras),
        "refiner": pipe.refiner.name if pipe.refiner is not None else None,
        "controlnets": [c.name for c in pipe.controlnets], "ip_adapters": [a.name for a in pipe.ip_adapters],
    }
