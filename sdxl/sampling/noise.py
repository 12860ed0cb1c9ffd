"""Noise as AUTOMATIC1111's webui, Forge, diffusers and ComfyUI draw it, made on the host with numpy.

The same seed gives the same picture only if it gives the same noise. Three sources:

- "jax": this project's own noise, JAX's PRNG at (seed, image index); it is made in the compiled
  program, not here.
- "nv": A1111's "NV" source (`modules/rng_philox.py`), its imitation of `torch.randn` on an NVIDIA
  GPU, which is what A1111's default "GPU" source draws there. Philox-4x32-10 keyed by the seed; the
  n-th draw of a generator takes element i from the counter (n, 0, i, 0) and keeps one Box-Muller
  normal of the first two output words. The arithmetic is A1111's numpy arithmetic, float64 included
  (its uint32 words times float32 constants promote to float64), so the numbers are those its code
  computes, to the last bit. Its docstring's example for seed 0 differs from them by up to 2.6e-7.
- "cpu": `torch.randn` on a `torch.Generator("cpu")`: A1111's "CPU" source, ComfyUI's starting noise,
  and diffusers called with a CPU generator. mt19937 seeded with the seed's low 32 bits (as torch's
  `manual_seed` does), one 32-bit draw per float32 uniform of 24 bits, and torch's Box-Muller layout:
  tensors of 16 elements or more are transformed in blocks of 16 (the first 8 uniforms give the
  radii, the next 8 the angles) and, when 16 does not divide the size, the last 16 elements are drawn
  again from 16 fresh uniforms; smaller tensors take torch's scalar path in float64, with the spare
  normal of each pair kept in the generator for its next small draw.
  torch's block transform depends on the CPU: on x86-64 CPUs where torch runs its AVX2 kernels (see
  `torch.backends.cpu.get_cpu_capability()`), it evaluates log, sin and cos with
  the Cephes polynomials of avx_mathfun.h, which the compiler fused into FMAs. That is what is
  reproduced here, bit for bit. Where torch runs its AVX-512 or non-x86 (ARM, Apple) kernels, it
  calls the C library's float log, sin and cos instead: measured against torch run with
  ATEN_CPU_CAPABILITY=default, about 38% of the elements then differ, by at most 2.1e-6.

Two conventions turn sources into a batch's noise:

- `ImageNoise`, A1111's and Forge's (`modules/rng.py` `ImageRNG`): one generator per image, seeded
  with that image's seed (see `a1111_seeds`); later draws (ancestral and SDE noise) continue each
  image's generator, or come from generators seeded seed + ENSD when an eta noise seed delta is set. A
  variation seed mixes the image's starting noise with that of the variation seed by `slerp`.
- `BatchNoise`, diffusers' and ComfyUI's: one generator for the whole batch, drawn over the batch's
  shape, so `BatchNoise("cpu", (B, C, H, W), seed).first()` is
  `torch.randn((B, C, H, W), generator=torch.Generator().manual_seed(seed))`.

Everything returns float32 numpy arrays.
"""

import math
import operator
from collections.abc import Sequence
from typing import Protocol

import numpy as np

NOISE_SOURCES = ("jax", "nv", "cpu")
_MAX_SEED = 2**64 - 1  # both torch and A1111's Philox take the seed as an unsigned 64-bit integer
_LATENT_FACTOR = 8  # A1111's opt_f: "Seed resize from" is in pixels, the noise in latents

_f32 = np.float32


def _check_seed(seed: int) -> int:
    seed = operator.index(seed)
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed {seed} is outside [0, 2**64): torch and A1111 take seeds as unsigned 64-bit integers")
    return seed


class Generator(Protocol):
    """A seeded stream of standard normal noise, as a torch.Generator is for torch.randn."""

    def randn(self, shape: tuple[int, ...]) -> np.ndarray:
        """The next draw: float32 standard normal noise of `shape`."""
        ...


# ---------------------------------------------------------------------------------------------------
# "nv": A1111's Philox imitation of torch.randn on CUDA.

_PHILOX_MULTIPLIERS = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
_PHILOX_ROUNDS = 10
# A1111's constants, rounded to float32 as its numpy arrays hold them: 2^-32, and 2^-32 * 2 pi.
_TWO_POW32_INV = np.float64(_f32(2.3283064e-10))
_TWO_POW32_INV_2PI = np.float64(_f32(2.3283064e-10 * 6.2831855))


def philox4x32(counter: Sequence[np.ndarray], key: tuple[int, int] | Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Philox-4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3").

    Args:
      counter: four uint32 arrays (or scalars) that broadcast together: the counter's words.
      key: two uint32 arrays (or ints) that broadcast with them: the key's words.

    Returns:
      The four uint32 output words, broadcast to one shape.
    """
    c0, c1, c2, c3 = (np.array(c, np.uint32, ndmin=1) for c in counter)
    k0, k1 = (np.array(k, np.uint32, ndmin=1) for k in key)
    for _ in range(_PHILOX_ROUNDS):
        product0 = c0.astype(np.uint64) * _PHILOX_MULTIPLIERS[0]
        product2 = c2.astype(np.uint64) * _PHILOX_MULTIPLIERS[1]
        c0, c1, c2, c3 = (
            (product2 >> np.uint64(32)).astype(np.uint32) ^ c1 ^ k0,
            product2.astype(np.uint32),
            (product0 >> np.uint64(32)).astype(np.uint32) ^ c3 ^ k1,
            product0.astype(np.uint32),
        )
        k0 = k0 + np.uint32(_PHILOX_KEY_STEPS[0])  # wraps modulo 2^32, as Philox's key schedule does
        k1 = k1 + np.uint32(_PHILOX_KEY_STEPS[1])
    return np.broadcast_arrays(c0, c1, c2, c3)


class PhiloxGenerator:
    """A1111's "NV" generator: torch.randn on CUDA, imitated on the CPU (`modules/rng_philox.py`)."""

    def __init__(self, seed: int):
        self.seed = _check_seed(seed)
        self.offset = 0  # how many draws came before: the counter's first word

    def randn(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.randn_each([self], shape)[0]

    @staticmethod
    def randn_each(generators: Sequence["PhiloxGenerator"], shape: tuple[int, ...]) -> np.ndarray:
        """[B, *shape]: the next draw of each generator, computed in one vectorised pass."""
        size = math.prod(shape)
        if size > 2**32:
            raise ValueError(f"a draw of {size} elements does not fit Philox's 32-bit element counter")
        seeds = np.array([g.seed for g in generators], np.uint64)[:, None]
        offsets = np.array([g.offset for g in generators], np.uint32)[:, None]
        key = (seeds.astype(np.uint32), (seeds >> np.uint64(32)).astype(np.uint32))  # the seed's low and high words
        index = np.arange(size, dtype=np.uint32)[None, :]
        words = philox4x32((offsets, 0, index, 0), key)
        for g in generators:
            g.offset += 1
        return _philox_box_muller(words[0], words[1]).reshape(len(generators), *shape)


def _philox_box_muller(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The first normal of Box-Muller on two uint32 words, in A1111's precision.

    A1111 multiplies uint32 arrays by float32 arrays, which numpy promotes to float64, so everything
    up to the final cast is float64.
    """
    u = x * _TWO_POW32_INV + _TWO_POW32_INV / 2  # in (0, 1): never 0, so the log is finite
    v = y * _TWO_POW32_INV_2PI + _TWO_POW32_INV_2PI / 2
    return (np.sqrt(-2.0 * np.log(u)) * np.sin(v)).astype(_f32)


# ---------------------------------------------------------------------------------------------------
# "cpu": torch.randn on a CPU generator.


def _mt19937(seed: int) -> np.random.MT19937:
    """numpy's mt19937 in the state torch's `manual_seed(seed)` leaves its own in (init_genrand)."""
    key = np.empty(624, np.uint32)
    word = seed & 0xFFFFFFFF  # torch keeps only the seed's low 32 bits
    for i in range(624):
        key[i] = word
        word = (1812433253 * (word ^ (word >> 30)) + i + 1) & 0xFFFFFFFF
    bits = np.random.MT19937()
    bits.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 624}}  # 624: twist before the first draw
    return bits


class TorchCPUGenerator:
    """torch.Generator("cpu").manual_seed(seed), for torch.randn in float32."""

    def __init__(self, seed: int):
        self.seed = _check_seed(seed)
        self._bits = _mt19937(self.seed)
        self._spare_normal: float | None = None  # the scalar path's second normal, kept for its next call

    def randn(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.randn_each([self], shape)[0]

    @staticmethod
    def randn_each(generators: Sequence["TorchCPUGenerator"], shape: tuple[int, ...]) -> np.ndarray:
        """[B, *shape]: the next draw of each generator, transformed in one vectorised pass."""
        size = math.prod(shape)
        if size < 16:
            return np.stack([g._randn_scalar(size) for g in generators]).reshape(len(generators), *shape)
        draws = size + (16 if size % 16 else 0)  # the tail block takes 16 more uniforms
        words = np.stack([g._bits.random_raw(draws) for g in generators])
        return _torch_normal_fill(words, size).reshape(len(generators), *shape)

    def _randn_scalar(self, size: int) -> np.ndarray:
        """torch's path for tensors under 16 elements: at::normal_distribution<double>, cast to float32."""
        normals = []
        for _ in range(size):
            if self._spare_normal is not None:
                normals.append(self._spare_normal)
                self._spare_normal = None
                continue
            words = [int(w) for w in self._bits.random_raw(4)]
            u1, u2 = (((high << 32) | low) % 2**53 * 2.0**-53 for high, low in (words[:2], words[2:]))
            radius = math.sqrt(-2.0 * math.log1p(-u2))
            theta = 2.0 * math.pi * u1
            self._spare_normal = radius * math.sin(theta)
            normals.append(radius * math.cos(theta))
        return np.array(normals, _f32)


def _torch_normal_fill(words: np.ndarray, size: int) -> np.ndarray:
    """torch's `normal_fill` for float32: [B, size] normals from [B, size (+ 16)] mt19937 words.

    The 16 extra words, when 16 does not divide `size`, redraw the last 16 elements.
    """
    uniforms = (words & 0xFFFFFF).astype(_f32) * _f32(2.0**-24)  # uniform_real_distribution<float>: low 24 bits
    whole = size - size % 16
    if size % 16:
        uniforms = np.concatenate([uniforms[:, :whole], uniforms[:, size:]], axis=1)
    blocks = uniforms.reshape(len(uniforms), -1, 2, 8)  # [B, blocks, radius or angle, 8]
    radius = np.sqrt(_f32(-2.0) * _log_avx2(_f32(1.0) - blocks[:, :, 0]))  # 1 - u is in (0, 1]
    sin, cos = _sincos_avx2(_f32(2.0 * math.pi) * blocks[:, :, 1])
    # torch's closing fmadd(n, std=1, mean=0) is exact, but for turning -0 into +0.
    normals = np.stack([radius * cos, radius * sin], axis=2).reshape(len(uniforms), -1) + _f32(0.0)
    if size % 16:
        normals = np.concatenate([normals[:, : size - 16], normals[:, -16:]], axis=1)
    return normals


def fused_multiply_add(a: np.ndarray, b, c) -> np.ndarray:
    """float32 a * b + c rounded once, as the FMA instructions the compiler made of torch's mul + add.

    The float64 product of two float32 is exact, and so the float64 sum is the exact sum rounded once.
    Rounding that to float32 errs only when it lands exactly halfway between two float32 while the
    exact sum does not; those few are moved one float64 step toward the exact sum first.
    """
    shape = np.broadcast_shapes(np.shape(a), np.shape(b), np.shape(c))  # scalars too: amended as 1-d arrays
    product = np.atleast_1d(np.multiply(a, b, dtype=np.float64))
    total = product + c
    halfway = np.nonzero((total.view(np.uint64) & 0x1FFFFFFF) == 0x10000000)  # the low 29 bits: 1 then 28 zeros
    if halfway[0].size:
        p, s, c = product[halfway], total[halfway], np.broadcast_to(c, total.shape)[halfway]
        error = (p - (s - c)) + (c - (s - (s - c)))  # two-sum: the exact sum is s + error
        total[halfway] = np.where(error == 0, s, np.nextafter(s, np.copysign(np.inf, error)))
    return total.astype(_f32).reshape(shape)


# Cephes' float32 log and sin/cos coefficients, as avx_mathfun.h holds them.
_LOG_COEFFICIENTS = tuple(_f32(p) for p in (
    7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
    -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1,
))
_LOG_Q1, _LOG_Q2 = _f32(-2.12194440e-4), _f32(0.693359375)  # ln 2 = Q2 - Q1, split for exact e * Q2
_SQRT_HALF = _f32(0.707106781186547524)
_FOUR_OVER_PI = _f32(1.27323954473516)
_PI_OVER_4_PARTS = (_f32(-0.78515625), _f32(-2.4187564849853515625e-4), _f32(-3.77489497744594108e-8))
_COS_COEFFICIENTS = (_f32(2.443315711809948e-5), _f32(-1.388731625493765e-3), _f32(4.166664568298827e-2))
_SIN_COEFFICIENTS = (_f32(-1.9515295891e-4), _f32(8.3321608736e-3), _f32(-1.6666654611e-1))


def _log_avx2(x: np.ndarray) -> np.ndarray:
    """avx_mathfun.h's `log256_ps` for x in (0, 1], with GCC's FMA contractions."""
    bits = x.view(np.int32)
    exponent = ((bits >> 23) - 0x7F).astype(_f32) + _f32(1.0)
    mantissa = ((bits & ~0x7F800000) | 0x3F000000).view(_f32)  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    below = mantissa < _SQRT_HALF  # then use 2 * mantissa, so the series runs on [sqrt(1/2) - 1, sqrt(2) - 1]
    exponent = exponent - np.where(below, _f32(1.0), _f32(0.0))
    m = (mantissa - _f32(1.0)) + np.where(below, mantissa, _f32(0.0))
    m2 = m * m
    y = np.full_like(m, _LOG_COEFFICIENTS[0])
    for coefficient in _LOG_COEFFICIENTS[1:]:
        y = fused_multiply_add(y, m, coefficient)
    y = fused_multiply_add(y * m, m2, exponent * _LOG_Q1)
    y = y - m2 * _f32(0.5)
    return (m + y) + exponent * _LOG_Q2  # exponent * Q2 is exact, so fused or not makes no difference


def _sincos_avx2(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """avx_mathfun.h's `sincos256_ps` for x >= 0, with GCC's FMA contractions: (sin x, cos x)."""
    octant = ((x * _FOUR_OVER_PI).astype(np.int32) + 1) & ~1  # truncation, then round up to even
    n = octant.astype(_f32)
    for part in _PI_OVER_4_PARTS:  # x - n * pi / 4 in three parts, for extra precision
        x = fused_multiply_add(n, part, x)
    x2 = x * x
    cos = fused_multiply_add(np.full_like(x2, _COS_COEFFICIENTS[0]), x2, _COS_COEFFICIENTS[1])
    cos = fused_multiply_add(cos, x2, _COS_COEFFICIENTS[2])
    cos = fused_multiply_add(cos * x2, x2, -(x2 * _f32(0.5))) + _f32(1.0)
    sin = fused_multiply_add(np.full_like(x2, _SIN_COEFFICIENTS[0]), x2, _SIN_COEFFICIENTS[1])
    sin = fused_multiply_add(sin, x2, _SIN_COEFFICIENTS[2])
    sin = fused_multiply_add(sin * x2, x, x)
    swap = (octant & 2) != 0  # near pi/2 and 3 pi/2 (n = 2, 6) sine and cosine trade series
    sin, cos = np.where(swap, cos, sin), np.where(swap, sin, cos)
    sin = np.where((octant & 4) != 0, -sin, sin)
    cos = np.where(((octant - 2) & 4) == 0, -cos, cos)
    return sin, cos


# ---------------------------------------------------------------------------------------------------
# Sources, and the conventions that turn them into a batch's noise.

_GENERATORS = {"nv": PhiloxGenerator, "cpu": TorchCPUGenerator}


def generator(source: str, seed: int) -> Generator:
    """A fresh generator of `source` ("nv" or "cpu") at `seed`."""
    if source not in _GENERATORS:
        raise ValueError(f"noise source {source!r} is not made on the host: choose one of {sorted(_GENERATORS)}")
    return _GENERATORS[source](seed)


def _randn_each(generators: Sequence[Generator], shape: tuple[int, ...]) -> np.ndarray:
    """[B, *shape]: the next draw of each generator (all of one source)."""
    return type(generators[0]).randn_each(generators, shape)


def slerp(strength: float, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """A1111's `rng.slerp`: spherical interpolation from `low` (strength 0) to `high` (strength 1).

    As A1111 calls it on one image's [C, H, W] noise, the vectors are the columns along H: one angle
    per (channel, column). When the mean cosine exceeds 0.9995 it falls back to the linear
    `low * strength + high * (1 - strength)`, whose weights run the other way round; A1111 only meets
    it when both noises are the same (seed equal to the variation seed), where the order is moot.

    Args:
      strength: the variation seed strength.
      low, high: [B, C, H, W] the seeds' and the variation seeds' noise.

    Returns:
      [B, C, H, W] float32.
    """
    low, high = low.astype(np.float64), high.astype(np.float64)
    cosine = np.sum(
        low / np.linalg.norm(low, axis=2, keepdims=True) * (high / np.linalg.norm(high, axis=2, keepdims=True)),
        axis=2, keepdims=True,
    )  # [B, C, 1, W]
    with np.errstate(invalid="ignore", divide="ignore"):  # cosines of 1 and more go the linear way
        angle = np.arccos(cosine)
        spherical = (np.sin((1.0 - strength) * angle) * low + np.sin(strength * angle) * high) / np.sin(angle)
    linear = np.mean(cosine, axis=(1, 2, 3)) > 0.9995
    mixed = np.where(linear[:, None, None, None], low * strength + high * (1.0 - strength), spherical)
    return mixed.astype(_f32)


class Noise(Protocol):
    """A batch's noise: its starting noise, then the noise of each later draw (ancestral, SDE)."""

    def first(self) -> np.ndarray:
        """[B, C, H, W] float32: the starting noise, drawn once, before any `next()`."""
        ...

    def next(self) -> np.ndarray:
        """[B, C, H, W] float32: the starting noise on the first call (as A1111's ImageRNG), later draws after."""
        ...


class ImageNoise:
    """A1111's and Forge's noise for one batch (`modules/rng.py` `ImageRNG`): a generator per image.

    Args:
      source: "nv" or "cpu".
      shape: (C, H, W) of one image's latents.
      seeds: each image's seed (see `a1111_seeds`).
      subseeds: each image's variation seed; images past its end take 0, as A1111's do. Unused at
        strength 0.
      subseed_strength: the variation seed strength: 0 keeps the seed's noise, 1 is the variation
        seed's.
      ensd: the eta noise seed delta; when nonzero, the draws after the first come from generators
        at seed + ensd.
      seed_resize_from: "Seed resize from" as (height, width) in pixels: the seed's noise is drawn at
        that size and pasted, centred, into the image's. None, or a size <= 0, for none.
    """

    def __init__(
        self,
        source: str,
        shape: tuple[int, int, int],
        seeds: Sequence[int],
        subseeds: Sequence[int] | None = None,
        subseed_strength: float = 0.0,
        ensd: int = 0,
        seed_resize_from: tuple[int, int] | None = None,
    ):
        self.source = source
        self.shape = tuple(shape)
        self.seeds = tuple(_check_seed(s) for s in seeds)
        self.subseeds = None if subseeds is None else tuple(subseeds)
        self.subseed_strength = subseed_strength
        self.ensd = ensd
        height, width = seed_resize_from or (0, 0)
        resized = height > 0 and width > 0
        self.noise_shape = (shape[0], height // _LATENT_FACTOR, width // _LATENT_FACTOR) if resized else self.shape
        self.generators = [generator(source, s) for s in self.seeds]
        self._drawn_first = False

    def first(self) -> np.ndarray:
        if self._drawn_first:
            raise RuntimeError("the starting noise was drawn already; call next() for the later draws")
        self._drawn_first = True
        resized = self.noise_shape != self.shape
        if resized:  # A1111 draws the seed's noise at the other size from a fresh generator
            noise = _randn_each([generator(self.source, s) for s in self.seeds], self.noise_shape)
        else:
            noise = _randn_each(self.generators, self.shape)
        if self.subseeds is not None and self.subseed_strength != 0:
            subseeds = [self.subseeds[i] if i < len(self.subseeds) else 0 for i in range(len(self.seeds))]
            # Each variation seed's noise is the first draw of a fresh generator.
            subnoise = _randn_each([generator(self.source, s) for s in subseeds], self.noise_shape)
            noise = slerp(self.subseed_strength, noise, subnoise)
        if resized:
            noise = _paste_centred(noise, _randn_each(self.generators, self.shape))
        if self.ensd:
            self.generators = [generator(self.source, s + self.ensd) for s in self.seeds]
        return noise

    def next(self) -> np.ndarray:
        if not self._drawn_first:
            return self.first()
        return _randn_each(self.generators, self.shape)


def _paste_centred(noise: np.ndarray, canvas: np.ndarray) -> np.ndarray:
    """`canvas` [B, C, H, W] with `noise` [B, C, h, w] pasted centred and cropped, as A1111 places resized seeds."""
    (h, w), (height, width) = noise.shape[2:], canvas.shape[2:]
    dy, dx = (height - h) // 2, (width - w) // 2
    rows = h if dy >= 0 else h + 2 * dy  # an odd difference leaves A1111's last row or column unpasted
    cols = w if dx >= 0 else w + 2 * dx
    top, left = max(dy, 0), max(dx, 0)
    from_top, from_left = max(-dy, 0), max(-dx, 0)
    canvas = canvas.copy()
    canvas[:, :, top:top + rows, left:left + cols] = noise[:, :, from_top:from_top + rows, from_left:from_left + cols]
    return canvas


class BatchNoise:
    """diffusers' and ComfyUI's noise: one generator for the whole batch, drawn over the batch's shape.

    With the "cpu" source, `first()` is what diffusers' pipelines draw for their latents when called
    with `generator=torch.Generator().manual_seed(seed)` (and ComfyUI's starting noise), and `next()` is
    what diffusers' ancestral schedulers draw on at each step from that same generator.

    Args:
      source: "nv" or "cpu".
      shape: (B, C, H, W) of the batch's latents.
      seed: the batch's one seed.
    """

    def __init__(self, source: str, shape: tuple[int, int, int, int], seed: int):
        self.shape = tuple(shape)
        self.generator = generator(source, seed)
        self._drawn_first = False

    def first(self) -> np.ndarray:
        if self._drawn_first:
            raise RuntimeError("the starting noise was drawn already; call next() for the later draws")
        self._drawn_first = True
        return self.generator.randn(self.shape)

    def next(self) -> np.ndarray:
        if not self._drawn_first:
            return self.first()
        return self.generator.randn(self.shape)


def a1111_seeds(
    seed: int, image_indices: Sequence[int], subseed: int = 0, subseed_strength: float = 0.0
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The seeds and variation seeds of images of one A1111 job (`processing.py` `process_images_inner`).

    Image i of a job (counted across its batches: batch n of size b holds images n * b ... n * b + b - 1)
    has seed `seed + i`, or `seed` itself when the variation strength is nonzero, and variation seed
    `subseed + i` either way. As each image has its own generator, the split into batches changes no
    image's noise.

    Returns:
      (seeds, subseeds), one of each per index.
    """
    seeds = tuple(seed + (i if subseed_strength == 0 else 0) for i in image_indices)
    return seeds, tuple(subseed + i for i in image_indices)


def drawn(
    source: str,
    shape: tuple[int, int, int],
    seeds: Sequence[int],
    image_index: Sequence[int],
    *,
    later_draws: int = 0,
    batch_noise: bool = False,
    variation_seed: int = 0,
    variation_strength: float = 0.0,
    ensd: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Each image's starting noise and its later draws, image i being image `image_index[i]` of a job
    of seed `seeds[i]`, as the tool whose convention is asked draws them.

    A1111's and Forge's (`ImageNoise`): image i has its own generator, at seed + index (`a1111_seeds`;
    the seed alone, and variation seed + index, at a nonzero variation strength). diffusers' and
    ComfyUI's (`batch_noise`): the images of one seed are the rows of one generator's draws over
    (rows, C, H, W), rows being the highest index + 1: a call of that many images.

    Args:
      source: "nv" or "cpu".
      shape: (C, H, W) of one image's latents.
      later_draws: the draws after the starting noise (one per step of a stochastic sampler).

    Returns:
      ([N, C, H, W], [N, later_draws, C, H, W]) float32.
    """
    if batch_noise:
        first, later = np.empty((len(seeds), *shape), _f32), np.empty((len(seeds), later_draws, *shape), _f32)
        for seed in set(seeds):
            images = [i for i, s in enumerate(seeds) if s == seed]
            rows = [image_index[i] for i in images]
            batch = BatchNoise(source, (max(rows) + 1, *shape), seed)
            first[images] = batch.first()[rows]
            for draw in range(later_draws):
                later[images, draw] = batch.next()[rows]
        return first, later
    job = [a1111_seeds(seed, [index], variation_seed, variation_strength) for seed, index in zip(seeds, image_index)]
    images = ImageNoise(source, shape, [s[0] for s, _ in job], [s[0] for _, s in job], variation_strength, ensd)
    first = images.first()
    later = np.stack([images.next() for _ in range(later_draws)], axis=1) if later_draws else (
        np.empty((len(seeds), 0, *shape), _f32))
    return first, later
