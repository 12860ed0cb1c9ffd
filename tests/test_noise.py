"""Noise sources and batch conventions against A1111's numbers, torch's CPU generator, and a small
re-implementation of A1111's ImageRNG over torch."""

import math

import numpy as np
import pytest
import torch

from kdiffusion_reference import ImageRNG, PhiloxGenerator
from sdxl.sampling import noise
from sdxl.sampling.noise import BatchNoise, ImageNoise, a1111_seeds, generator, philox4x32

# modules/rng_philox.py's docstring: Generator(seed=0).randn(shape=(3, 4)).
A1111_DOCUMENTED = [
    [-0.92466259, -0.42534415, -2.6438457, 0.14518388],
    [-0.12086647, -0.57972564, -0.62285122, -0.32838709],
    [-1.07454231, -0.36314407, -1.67105067, 2.26550497],
]
# What that code prints for it (numpy 1.26 and 2.4 alike): its float64 Box-Muller, in float32.
A1111_COMPUTED = [
    [-0.9246624, -0.42534396, -2.6438458, 0.14518388],
    [-0.12086651, -0.5797257, -0.6228513, -0.32838714],
    [-1.074542, -0.3631441, -1.6710504, 2.265505],
]


def assert_same_as_torch(ours: np.ndarray, theirs: torch.Tensor):
    theirs = theirs.numpy()
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        np.testing.assert_array_equal(ours, theirs)
    else:  # torch's other kernels call the C library's log, sin and cos (see sdxl.sampling.noise)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=4e-6)


def torch_randn(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# --- "nv" -------------------------------------------------------------------------------------------


def test_philox_known_answers():
    # Random123's known-answer vectors for Philox-4x32-10: (counter, key) -> output.
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, key, expected in cases:
        assert tuple(int(word[0]) for word in philox4x32(counter, key)) == expected


def test_nv_gives_a1111s_numbers():
    ours = generator("nv", 0).randn((3, 4))
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, np.float32(A1111_COMPUTED))
    np.testing.assert_array_equal(PhiloxGenerator(0).randn((3, 4)), np.float32(A1111_COMPUTED))  # the oracle
    # The docstring's numbers are not quite what its code computes (CUDA's, within 3e-7, say the notes).
    np.testing.assert_allclose(ours, A1111_DOCUMENTED, rtol=0, atol=3e-7)


def scalar_nv_normal(seed: int, draw: int, index: int) -> np.float32:
    """Element `index` of a Philox generator's draw number `draw`, word by word in Python integers."""
    mask = 0xFFFFFFFF
    c0, c1, c2, c3 = draw, 0, index, 0
    k0, k1 = seed & mask, seed >> 32
    for _ in range(10):
        p0, p2 = c0 * 0xD2511F53, c2 * 0xCD9E8D57
        c0, c1, c2, c3 = (p2 >> 32) ^ c1 ^ k0, p2 & mask, (p0 >> 32) ^ c3 ^ k1, p0 & mask
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    step, angle_step = float(np.float32(2.3283064e-10)), float(np.float32(2.3283064e-10 * 6.2831855))
    u, v = c0 * step + step / 2, c1 * angle_step + angle_step / 2
    return np.float32(math.sqrt(-2.0 * math.log(u)) * math.sin(v))


@pytest.mark.parametrize("seed", [0, 12345, 2**40 + 3, 2**64 - 1])
def test_nv_elements_and_later_draws(seed):
    g = generator("nv", seed)
    draws = [g.randn((4, 32, 32)).ravel() for _ in range(3)]
    for draw in (0, 2):
        for index in (0, 1, 17, 1000, 4095):
            assert draws[draw][index] == scalar_nv_normal(seed, draw, index), (draw, index)
    assert not np.array_equal(draws[0], draws[1])


def test_fused_multiply_add_rounds_once():
    # a * b + c = 1 + 3 * 2^-24 - 2^-60: float64 rounds it to the float32 midpoint 1 + 3 * 2^-24, which a
    # second rounding takes up to the even 1 + 2^-22; one rounding gives 1 + 2^-23.
    a, b, c = np.float32([2**-12 * (1 + 2**-18)]), np.float32(2**-12 * (1 - 2**-18)), np.float32(1 + 2**-23)
    assert np.float32(np.float64(a[0]) * np.float64(b) + np.float64(c)) == np.float32(1 + 2**-22)
    np.testing.assert_array_equal(noise.fused_multiply_add(a, b, c), np.float32([1 + 2**-23]))


# --- "cpu" ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 128, 128), (4, 13, 17), (2, 4, 64, 64), (16,), (17,), (3, 5), (1,)])
@pytest.mark.parametrize("seed", [0, 31337, 2**32 - 1])
def test_cpu_is_torch_randn(seed, shape):
    assert_same_as_torch(generator("cpu", seed).randn(shape), torch_randn(seed, shape))


def test_cpu_draws_continue_the_generator():
    # Small draws (torch's scalar path) keep a spare normal across the block draws between them.
    shapes = [(3, 5), (4, 13, 17), (7,), (3, 5), (4, 16, 16), (1,), (2, 2)]
    ours, theirs = generator("cpu", 7), torch.Generator().manual_seed(7)
    for shape in shapes:
        assert_same_as_torch(ours.randn(shape), torch.randn(shape, generator=theirs))


def test_seed_range():
    # torch's mt19937 keeps the seed's low 32 bits.
    for seed in (2**32 + 5, 2**64 - 1):
        assert_same_as_torch(generator("cpu", seed).randn((4, 8, 8)), torch_randn(seed, (4, 8, 8)))
    np.testing.assert_array_equal(generator("cpu", 2**32 + 5).randn((20,)), generator("cpu", 5).randn((20,)))
    assert not np.array_equal(generator("nv", 2**32 + 5).randn((20,)), generator("nv", 5).randn((20,)))
    for source in ("nv", "cpu"):
        for seed in (-1, 2**64):
            with pytest.raises(ValueError, match="seed"):
                generator(source, seed)
    with pytest.raises(ValueError, match="jax"):
        generator("jax", 0)


# --- A1111's per-image generators -------------------------------------------------------------------


SHAPE = (4, 24, 40)
IMAGE_CASES = {
    "plain": {},
    "ensd": {"ensd": 31337},
    "odd size": {"shape": (4, 13, 17), "ensd": 1},
    "variation": {"subseeds": (7, 8, 9), "subseed_strength": 0.3},
    "variation at 1": {"subseeds": (7, 8, 9), "subseed_strength": 1.0},
    "variation at 0": {"subseeds": (7, 8, 9), "subseed_strength": 0.0},
    "variation seed = seed": {"subseeds": (100, 101, 102), "subseed_strength": 0.6},
    "short subseeds": {"subseeds": (7,), "subseed_strength": 0.5, "ensd": 5},
    "resized from smaller": {"seed_resize_from": (160, 256), "subseeds": (7, 8, 9), "subseed_strength": 0.4},
    "resized from larger": {"seed_resize_from": (232, 360)},
}


@pytest.mark.parametrize("case", IMAGE_CASES)
def test_image_noise_is_a1111s(case):
    options = dict(IMAGE_CASES[case])
    shape = options.pop("shape", SHAPE)
    seeds = (100, 101, 102)
    ours = ImageNoise("cpu", shape, seeds, **options)
    oracle = ImageRNG(shape, seeds, **options)
    draws = [ours.first(), ours.next(), ours.next()]
    expected = [oracle.next() for _ in draws]
    assert draws[0].shape == (3, *shape)
    if options.get("subseed_strength"):  # slerp: ours in float64, theirs in float32
        assert draws[0].dtype == np.float32
        # 4.8e-7 apart, an ulp of values near 4, where torch's normals are ours to the bit; elsewhere those
        # differ by up to 4e-6 (`assert_same_as_torch`) and the slerp's weights, at most sqrt(2) together,
        # carry that through (1.8e-6 measured with ATEN_CPU_CAPABILITY=default).
        exact = torch.backends.cpu.get_cpu_capability() == "AVX2"
        atol = 2e-6 if exact else 2e-6 + math.sqrt(2) * 4e-6
        np.testing.assert_allclose(draws[0], expected[0].numpy(), rtol=0, atol=atol)
    else:
        assert_same_as_torch(draws[0], expected[0])
    for ours_later, theirs_later in zip(draws[1:], expected[1:]):
        assert_same_as_torch(ours_later, theirs_later)


@pytest.mark.parametrize("case", ["ensd", "odd size", "variation", "resized from smaller"])
def test_nv_image_noise_is_a1111s(case):
    options = dict(IMAGE_CASES[case])
    shape = options.pop("shape", SHAPE)
    ours = ImageNoise("nv", shape, (100, 101, 102), **options)
    oracle = ImageRNG(shape, (100, 101, 102), source="NV", **options)
    for draw in range(3):
        atol = 2e-6 if draw == 0 and options.get("subseed_strength") else 0  # slerp: ours in float64
        np.testing.assert_allclose(ours.next(), oracle.next().numpy(), rtol=0, atol=atol)


def test_variation_strength_ends():
    seeds, subseeds = (3, 4), (50, 60)
    plain = ImageNoise("cpu", SHAPE, seeds).first()
    for strength, expected in ((0.0, plain), (1.0, np.stack([generator("cpu", s).randn(SHAPE) for s in subseeds]))):
        mixed = ImageNoise("cpu", SHAPE, seeds, subseeds, subseed_strength=strength).first()
        np.testing.assert_allclose(mixed, expected, rtol=0, atol=1e-6)
    halfway = ImageNoise("cpu", SHAPE, seeds, subseeds, subseed_strength=0.5).first()
    assert np.abs(halfway - plain).max() > 0.1


@pytest.mark.parametrize("ensd", [0, 31337])
def test_nv_image_noise_draws_each_images_generator(ensd):
    seeds = (5, 6, 2**33)
    image_noise = ImageNoise("nv", SHAPE, seeds, ensd=ensd)
    first, later = image_noise.first(), [image_noise.next() for _ in range(2)]
    for i, seed in enumerate(seeds):
        np.testing.assert_array_equal(first[i], generator("nv", seed).randn(SHAPE))
        continued = generator("nv", seed + ensd)
        if not ensd:
            continued.randn(SHAPE)
        for draw in later:
            np.testing.assert_array_equal(draw[i], continued.randn(SHAPE))


def test_first_is_drawn_once():
    for noise_of_batch, fresh in (
        (ImageNoise("cpu", SHAPE, (1, 2)), ImageNoise("cpu", SHAPE, (1, 2))),
        (BatchNoise("cpu", (2, *SHAPE), 1), BatchNoise("cpu", (2, *SHAPE), 1)),
    ):
        starting = noise_of_batch.next()  # the first next() is the starting noise, as A1111's
        np.testing.assert_array_equal(starting, fresh.first())
        with pytest.raises(RuntimeError, match="already"):
            noise_of_batch.first()
        assert not np.array_equal(noise_of_batch.next(), starting)


# --- A1111's seeds for a job's images ---------------------------------------------------------------


def test_a1111_seeds():
    # processing.py, process_images_inner: p.all_seeds = [int(seed) + (x if p.subseed_strength == 0 else 0)
    # for x in range(len(p.all_prompts))], p.all_subseeds = [int(subseed) + x for x in ...], and batch n takes
    # p.seeds = p.all_seeds[n * p.batch_size:(n + 1) * p.batch_size] (and the same slice of subseeds).
    batch_size = 2
    second_batch = range(batch_size, 2 * batch_size)
    assert a1111_seeds(100, range(4)) == ((100, 101, 102, 103), (0, 1, 2, 3))
    assert a1111_seeds(100, second_batch, subseed=7) == ((102, 103), (9, 10))
    # With a variation strength the seeds stay and only the variation seeds advance.
    assert a1111_seeds(100, second_batch, subseed=7, subseed_strength=0.25) == ((100, 100), (9, 10))
    assert a1111_seeds(100, range(3), subseed=7, subseed_strength=1.0) == ((100, 100, 100), (7, 8, 9))


def test_batch_split_does_not_change_the_noise():
    seeds, subseeds = a1111_seeds(40, range(4), subseed=9, subseed_strength=0.3)
    whole = ImageNoise("cpu", SHAPE, seeds, subseeds, subseed_strength=0.3, ensd=3)
    halves = [ImageNoise("cpu", SHAPE, seeds[i:i + 2], subseeds[i:i + 2], subseed_strength=0.3, ensd=3) for i in (0, 2)]
    for _ in range(2):
        np.testing.assert_array_equal(whole.next(), np.concatenate([half.next() for half in halves]))


# --- diffusers' and ComfyUI's one generator per batch -----------------------------------------------


def test_batch_noise_is_one_generator_over_the_batch():
    shape, seed = (2, 4, 24, 40), 1234
    batch_noise, theirs = BatchNoise("cpu", shape, seed), torch.Generator().manual_seed(seed)
    for _ in range(3):
        assert_same_as_torch(batch_noise.next(), torch.randn(shape, generator=theirs))
    per_image = ImageNoise("cpu", shape[1:], (seed, seed + 1)).first()
    assert not np.array_equal(BatchNoise("cpu", shape, seed).first()[1], per_image[1])


def test_batch_noise_is_diffusers_latents():
    from diffusers.utils.torch_utils import randn_tensor  # what diffusers' pipelines draw their latents with

    shape, seed = (2, 4, 32, 32), 77
    expected = randn_tensor(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    assert_same_as_torch(BatchNoise("cpu", shape, seed).first(), expected)


def test_noise_sources_named():
    assert noise.NOISE_SOURCES == ("jax", "nv", "cpu")
