"""The noise AUTOMATIC1111's webui (1.10) gives its SDE samplers, made on the host with numpy.

DPM++ SDE, DPM++ 2M SDE and DPM++ 3M SDE draw their noise from k-diffusion's (0.1.1)
`BrownianTreeNoiseSampler`, which A1111 builds in `sd_samplers_common.Sampler.create_noise_sampler`
over the batch's schedule, between its smallest positive sigma and its largest, with one tree per image
seeded by the image's seed. A draw `noise_sampler(sigma, sigma_next)` is the increment of the image's
Brownian motion W over the step's interval divided by the square root of its length: a standard normal, and
draws over overlapping intervals are correlated as the increments are.

Each tree is torchsde's (0.2.6) `BrownianTree`: a `BrownianInterval` with `halfway_tree=True`,
`tol=1e-6` and `pool_size=24`, without Levy area. Its times are Python floats (the float32 sigmas,
widened) rounded to 6 decimals. The tree's root [t0, t1] holds W(t1) - W(t0), a normal scaled by
sqrt(t1 - t0) of the unrounded times; every interval splits at its rounded midpoint, the left half's
increment drawn from the Brownian bridge on the whole's, the right half's the whole's minus the left's.
A query is answered by the dyadic intervals that tile it, the increments summed from left to right, each
interval's computed down from the root (torchsde's caches only spare the recomputation). Every normal is
the first draw of a fresh generator seeded from `np.random.SeedSequence(image seed, pool_size=24)`: the
root's from its first state word, an interval's split from the first word of the sequence spawned at
(key, depth), the key being the interval's path from the root as binary digits. The generators' seeds
are words of `generate_state`: uint32, below 2**32 whatever the image's seed.

A1111 replaces torchsde's generator (`brownian_interval._randn`) with its `randn_local(seed, shape)`:
the first draw of a generator seeded with `seed` of its noise source, its "NV" Philox or torch's CPU
generator (`sdxl.sampling.noise.generator`). torch does the tree's arithmetic in float32, Python
floats rounded to float32 where they scale a tensor; so does this module, in the same order, and the
square root of the query's length is float32's correctly rounded one, as CUDA computes it. So the
draws are A1111's on a GPU to the last bit. (torch's float32 sqrt on the CPU is one ulp off for about
a fifth of values: A1111 run on a CPU draws values up to 2.4e-7 from these, relative.)

The cost is in the normals: a query's intervals hang off the paths from the root down to its two
ends, some 20 levels deep (from 14.6 down to steps of 1e-6), and each split is one normal of the
latents' shape per image. `BrownianNoise` keeps the splits of its last query, one of whose ends the
sampler's next query shares, so a query splits about 20 intervals. The draws depend only on the
seeds and the schedule, not on the latents, so they can be made ahead of the denoiser.
"""

import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .noise import generator

_DECIMALS = 6  # torchsde rounds times with round(t, -int(log10(tol))), BrownianTree's tol being 1e-6
_POOL_SIZE = 24  # BrownianTree's pool_size: the SeedSequence's entropy pool, in words

_f32 = np.float32


class _Interval(NamedTuple):
    """A node of the tree: [start, end], and where it lies, which seeds its split."""

    start: float
    end: float
    depth: int
    key: int  # the path from the root: 0 for a left half, 1 for a right half, the first step the highest digit

    def halves(self) -> tuple["_Interval", "_Interval"]:
        midway = round(0.5 * (self.end + self.start), _DECIMALS)
        return (
            _Interval(self.start, midway, self.depth + 1, 2 * self.key),
            _Interval(midway, self.end, self.depth + 1, 2 * self.key + 1),
        )


class BrownianNoise:
    """k-diffusion's BrownianTreeNoiseSampler as A1111 builds it: one Brownian tree per image.

    Args:
      source: A1111's noise source for `randn_local`, "nv" or "cpu".
      shape: one image's latent shape in torch's layout, (C, H, W).
      seeds: each image's seed, as A1111's batch holds them (`p.all_seeds` of the batch).
      sigma_min, sigma_max: the schedule's smallest positive sigma and its largest.
    """

    def __init__(self, source: str, shape: tuple[int, ...], seeds: Sequence[int], sigma_min: float, sigma_max: float):
        self.source = source
        self.shape = tuple(shape)
        self.seeds = tuple(operator.index(seed) for seed in seeds)
        low, high = _f32(sigma_min), _f32(sigma_max)  # k-diffusion's torch.as_tensor: float32
        self._sign = 1 if low < high else -1  # BatchedBrownianTree orders the ends, and flips draws if it swapped them
        t0, t1 = sorted((float(low), float(high)))
        self._root = _Interval(round(t0, _DECIMALS), round(t1, _DECIMALS), 0, 0)
        root_seeds = [np.random.SeedSequence(seed, pool_size=_POOL_SIZE).generate_state(3)[0] for seed in self.seeds]
        self._root_increment = self._randn(root_seeds) * _f32(math.sqrt(t1 - t0))
        self._left_halves: dict[_Interval, np.ndarray] = {}  # the last query's splits: each left half's increment

    def __call__(self, sigma: float, sigma_next: float) -> np.ndarray:
        """[B, *shape] float32: (W(sigma_next) - W(sigma)) / sqrt(|sigma_next - sigma|) per image, as the sampler
        draws it."""
        a, b = _f32(sigma), _f32(sigma_next)
        sign = 1 if a < b else -1
        increment = self._increment(*sorted((float(a), float(b))))
        return (self._sign * sign) * increment / np.sqrt(np.abs(b - a))

    def _increment(self, ta: float, tb: float) -> np.ndarray:
        """[B, *shape] float32: W(tb) - W(ta), for ta <= tb, as torchsde's BrownianInterval sums it."""
        root = self._root
        # torchsde clamps to the rounded ends (with a warning: the float32 sigmas often lie just outside them).
        ta, tb = (round(min(max(t, root.start), root.end), _DECIMALS) for t in (ta, tb))
        if ta == tb:
            # torchsde returns zeros; for distinct times that round to the same one, its search instead
            # splits without end (RecursionError) in some cases.
            return np.zeros((len(self.seeds), *self.shape), _f32)
        splits: dict[_Interval, np.ndarray] = {}
        parts = self._tile(root, self._root_increment, ta, tb, splits)
        self._left_halves = splits
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def _tile(
        self, interval: _Interval, increment: np.ndarray, ta: float, tb: float, splits: dict[_Interval, np.ndarray]
    ) -> list[np.ndarray]:
        """The increments over the tree's intervals that tile [ta, tb] within `interval`, left to right."""
        if (ta, tb) == (interval.start, interval.end):
            return [increment]
        left, right = interval.halves()
        left_increment = self._left_halves.get(interval)
        if left_increment is None:
            left_increment = self._bridge(interval, left.end, increment)
        splits[interval] = left_increment
        if tb <= left.end:
            return self._tile(left, left_increment, ta, tb, splits)
        right_increment = increment - left_increment
        if ta >= right.start:
            return self._tile(right, right_increment, ta, tb, splits)
        return self._tile(left, left_increment, ta, left.end, splits) + self._tile(
            right, right_increment, right.start, tb, splits
        )

    def _bridge(self, interval: _Interval, midway: float, increment: np.ndarray) -> np.ndarray:
        """W(midway) - W(start) given W(end) - W(start) = `increment`: a draw from the Brownian bridge.

        torchsde's names and order of operations, each Python float rounded to float32 where it meets an array.
        """
        h_reciprocal = 1 / (interval.end - interval.start)
        left_diff, right_diff = midway - interval.start, interval.end - midway
        seeds = [
            np.random.SeedSequence(seed, spawn_key=(interval.key, interval.depth), pool_size=_POOL_SIZE)
            .generate_state(4)[0]
            for seed in self.seeds
        ]
        mean = _f32(left_diff) * increment * _f32(h_reciprocal)
        return mean + _f32(math.sqrt(left_diff * right_diff * h_reciprocal)) * self._randn(seeds)

    def _randn(self, seeds: Sequence[int]) -> np.ndarray:
        """[B, *shape]: A1111's randn_local(seed, shape) for each seed, one per image."""
        return np.stack([generator(self.source, seed).randn(self.shape) for seed in seeds])
