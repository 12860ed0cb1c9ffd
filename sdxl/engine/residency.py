"""Models that share devices without all fitting on them at once: the weights of those not in use wait in
host memory, and a model about to render moves onto the devices, the one used longest ago moving out
(as A1111's "Maximum number of checkpoints loaded at the same time").

A snapshot's value never changes (`sdxl.engine.model`), but where its arrays are may: moving a model out
places every snapshot of it still held (a waiting prepared request's among them) in host memory, so that
no waiting request keeps device memory in use, and moving it in places them back. A prepared request
renders the picture it was prepared for either way. Arrays a model on the devices holds too (components
held once: `Pipeline.hold_once`; a refiner's shared with its base) stay on the devices.
"""

import logging
import threading
import time
import weakref

import jax
import numpy as np

from . import mesh as meshes

log = logging.getLogger(__name__)

DEVICES, HOST = "devices", "host memory"


class Placement:
    """Where one model's weights are, and the snapshots of it that move with them."""

    def __init__(self, name: str, residency: "Residency"):
        self.name = name
        self.residency = residency
        self.where = HOST  # until it moves in (`Residency.add`)
        self._snapshots = weakref.WeakSet()

    def track(self, snapshot) -> None:
        """Makes `snapshot` (`LoadedModel`, of this model) move with the others."""
        self._snapshots.add(snapshot)

    def snapshots(self) -> list:
        """The snapshots held, with the refiners' they render with."""
        found = list(self._snapshots)
        return found + [s.refiner for s in found if s.refiner is not None]

    def use(self) -> float:
        """Moves the model onto the devices if it waits in host memory; returns the seconds it took."""
        return self.residency.use(self)


class Residency:
    """The models on one mesh that share its memory: at most `most_on_devices` of them hold their weights
    on the devices (None: every one), the others in host memory until a request needs them.

    residency = Residency(1)
    for pipe in pipes:
        residency.add(pipe)  # each as it loads: the others move out to make room
    """

    def __init__(self, most_on_devices: int | None = None):
        self.most_on_devices = most_on_devices
        self._on_devices: list[Placement] = []  # the least recently used first
        self._placements: list[Placement] = []
        self._lock = threading.RLock()
        # Each array moved, by id, with its copy on the other side while both are held: a model moving in
        # takes the device array another model on the devices holds for its host copy, and one moving out
        # the host copy it came from, so that arrays held once stay held once.
        self._copies: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    @property
    def on_devices(self) -> list[str]:
        """The names of the models on the devices, the one used longest ago first."""
        return [placement.name for placement in self._on_devices]

    def limit(self, most: int) -> None:
        """Makes `most` the most models on the devices at once, moving out those used longest ago beyond it."""
        with self._lock:
            self.most_on_devices = most
            while len(self._on_devices) > most:
                self._move_out(self._on_devices[0], None)

    def make_room(self, incoming: Placement | None = None) -> None:
        """Moves models out, those used longest ago first, until one more fits the limit, keeping on the
        devices what `incoming` (the model moving in) holds there too."""
        with self._lock:
            while self.most_on_devices is not None and len(self._on_devices) >= max(self.most_on_devices, 1):
                self._move_out(self._on_devices[0], incoming)

    def add(self, pipe, name: str | None = None) -> None:
        """Makes a newly loaded pipeline's model one of these (its snapshots from now on move with it), on
        the devices, the others moving out beyond the limit; `name` names it in the log (default its own)."""
        with self._lock:
            placement = Placement(name or pipe.name, self)
            pipe.move_with(placement)
            self._placements.append(placement)
            self.make_room(incoming=placement)  # what it shares with a model moving out stays
            self._move_in(placement)

    def use(self, placement: Placement) -> float:
        """Moves a model onto the devices, the others moving out beyond the limit; the seconds it took
        (0 when it was there)."""
        with self._lock:
            if placement.where == DEVICES:
                self._on_devices.remove(placement)
                self._on_devices.append(placement)
                return 0.0
            start, before = time.perf_counter(), self.on_devices
            self.make_room(incoming=placement)
            moved_out = [name for name in before if name not in self.on_devices]
            self._move_in(placement)
            seconds = time.perf_counter() - start
            log.info("moved %s onto the devices in %.2f s%s", placement.name, seconds,
                     f", {', '.join(moved_out)} to host memory" if moved_out else "")
            return seconds

    def _move_out(self, placement: Placement, incoming: Placement | None) -> None:
        self._on_devices.remove(placement)
        placement.where = HOST
        staying = [*self._on_devices, *([incoming] if incoming else [])]
        kept = {id(leaf) for each in staying for snapshot in each.snapshots()
                for leaf in jax.tree.leaves(snapshot.params)}
        for each in self._placements:  # and any other model in host memory lets go of what it shared with it
            if each.where == HOST and each is not incoming:
                self._move(each, lambda leaf: leaf if id(leaf) in kept else _on_host(leaf), jax.Array)

    def _move_in(self, placement: Placement) -> None:
        sharding = meshes.replicated(placement.snapshots()[0].mesh)
        self._move(placement, lambda leaf: meshes.place(leaf, sharding), np.ndarray)
        placement.where = DEVICES
        self._on_devices.append(placement)

    def _move(self, placement: Placement, copy, kind: type) -> None:
        """Replaces each of the model's arrays of `kind` by its copy on the other side: `copy(array)`, or the
        one it was copied from while that is still held."""
        copies = {}

        def moved(leaf):
            if not isinstance(leaf, kind):
                return leaf
            if id(leaf) not in copies:
                this, other = self._copies.get(id(leaf), (lambda: None, lambda: None))
                found = other() if this() is leaf else None
                copies[id(leaf)] = found if found is not None else copy(leaf)
                if copies[id(leaf)] is not leaf:
                    pair = weakref.ref(leaf), weakref.ref(copies[id(leaf)])
                    self._copies[id(leaf)], self._copies[id(copies[id(leaf)])] = pair, pair[::-1]
            return copies[id(leaf)]

        for snapshot in placement.snapshots():
            # A component none of whose arrays moved stays the same tree (held once: `Pipeline.hold_once`).
            trees = {name: (tree, jax.tree.map(moved, tree)) for name, tree in snapshot.params.items()}
            snapshot.placed({name: tree if all(a is b for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(new)))
                             else new for name, (tree, new) in trees.items()})
        self._copies = {key: pair for key, pair in self._copies.items() if pair[0]() is not None}


def _on_host(array: jax.Array) -> np.ndarray:
    """A replicated array's values, copied from this process's first copy (each host keeps its own; on a CPU,
    a view would keep the devices' buffer)."""
    return np.array(array.addressable_data(0))
