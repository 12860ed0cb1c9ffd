"""sdxl.sampling.brownian against the real thing: k-diffusion's BrownianTreeNoiseSampler over torchsde's
BrownianTree, with torchsde's generator replaced by A1111's `randn_local` as A1111 replaces it."""

import math
import warnings
from unittest import mock

import numpy as np
import pytest
import torch
from torchsde._brownian import brownian_interval

from kdiffusion_reference import PhiloxGenerator, kdiffusion
from sdxl.sampling.brownian import BrownianNoise

SHAPE = (4, 8, 12)
# A root one ulp off (at most 2**-23 of it) and the two quotients' roundings (2**-24 each) put the draws at
# most 2**-22 = 2.4e-7 apart, relative.
RTOL_CPU_SQRT = 2**-22
SEEDS = [(0,), (3_141_592_653,), (2**40 + 7,), (42, 43)]  # 2**40 + 7: SeedSequence takes any entropy


def randn_local(source: str):
    """A1111's replacement for torchsde's `_randn`: `randn_local(seed, size)`, a fresh generator's first draw."""
    if source == "nv":
        return lambda size, dtype, device, seed: torch.asarray(PhiloxGenerator(seed).randn(size)).to(device, dtype)
    return lambda size, dtype, device, seed: torch.randn(
        size, generator=torch.Generator("cpu").manual_seed(int(seed))
    ).to(device, dtype)


def a1111_draws(source, shape, seeds, sigmas: torch.Tensor, queries) -> tuple[np.ndarray, np.ndarray]:
    """[queries, B, *shape] twice: what A1111's noise sampler (`create_noise_sampler`) returns for each query,
    as A1111 computes it on a GPU, and as k-diffusion computes it here, on the CPU.

    The sampler divides the tree's increment by the root of the interval's length. CUDA's float32 sqrt
    is correctly rounded; torch's on the CPU is not (it is one ulp off for about a fifth of float32
    values), so the GPU's root is taken here in float64 and rounded.
    """
    sampling, _ = kdiffusion()
    x = torch.zeros(len(seeds), *shape)
    on_gpu, on_cpu = [], []
    with mock.patch.object(brownian_interval, "_randn", randn_local(source)), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchsde warns of float32 sigmas just outside its rounded ends
        sampler = sampling.BrownianTreeNoiseSampler(x, sigmas[sigmas > 0].min(), sigmas.max(), seed=list(seeds))
        for sigma, sigma_next in queries:
            on_cpu.append(sampler(sigma, sigma_next).numpy())
            root = (sigma_next - sigma).abs().double().sqrt().float()
            on_gpu.append((sampler.tree(sigma, sigma_next) / root).numpy())
    return np.stack(on_gpu), np.stack(on_cpu)


def assert_same_draws(source: str, ours: np.ndarray, theirs: np.ndarray):
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    if source == "cpu" and torch.backends.cpu.get_cpu_capability() != "AVX2":
        # torch's other kernels make their normals with the C library's log, sin and cos (see
        # sdxl.sampling.noise); the draws then differ by up to 1.4e-6 (measured with ATEN_CPU_CAPABILITY=default).
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=4e-6)
    else:
        np.testing.assert_array_equal(ours, theirs)


def our_draws(source, shape, seeds, sigmas: torch.Tensor, queries) -> np.ndarray:
    ours = BrownianNoise(source, shape, seeds, sigmas[sigmas > 0].min().item(), sigmas.max().item())
    return np.stack([ours(sigma.item(), sigma_next.item()) for sigma, sigma_next in queries])


def karras_sigmas(steps: int = 10) -> torch.Tensor:
    sampling, _ = kdiffusion()
    return sampling.get_sigmas_karras(steps, 0.0292, 14.6146)


def multistep_queries(sigmas: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """DPM++ 2M SDE's and 3M SDE's: (sigmas[i], sigmas[i + 1]) for each step that does not end at 0."""
    return [(sigmas[i], sigmas[i + 1]) for i in range(len(sigmas) - 1) if sigmas[i + 1] > 0]


def dpmpp_sde_queries(sigmas: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """DPM++ SDE's, in k-diffusion's float32 arithmetic: to the half step's sigma, then to the step's end."""
    sigma_fn, t_fn = (lambda t: t.neg().exp()), (lambda sigma: sigma.log().neg())
    queries = []
    for sigma, sigma_next in multistep_queries(sigmas):
        t, t_next = t_fn(sigma), t_fn(sigma_next)
        s = t + (t_next - t) * (1 / 2)
        queries += [(sigma_fn(t), sigma_fn(s)), (sigma_fn(t), sigma_fn(t_next))]
    return queries


@pytest.mark.parametrize("source", ["nv", "cpu"])
@pytest.mark.parametrize("seeds", SEEDS, ids=str)
@pytest.mark.parametrize("queries", [multistep_queries, dpmpp_sde_queries], ids=["multistep", "dpmpp_sde"])
def test_same_as_a1111(source, seeds, queries):
    sigmas = karras_sigmas()
    on_gpu, on_cpu = a1111_draws(source, SHAPE, seeds, sigmas, queries(sigmas))
    assert_same_draws(source, our_draws(source, SHAPE, seeds, sigmas, queries(sigmas)), on_gpu)
    np.testing.assert_allclose(on_cpu, on_gpu, rtol=RTOL_CPU_SQRT, atol=0)


@pytest.mark.parametrize("source", ["nv", "cpu"])
def test_same_as_a1111_on_any_interval(source):
    """Intervals in either order, overlapping, repeated, reaching past the tree's ends, on shapes that take
    torch's other paths for small tensors (under 16 elements) and sizes 16 does not divide."""
    sigmas = torch.tensor([14.6146, 0.0292])
    rng = np.random.default_rng(0)
    ends = torch.tensor(rng.uniform(0.0, 16.0, (12, 2)), dtype=torch.float32)
    queries = [(a, b) for a, b in ends] + [(sigmas[0], sigmas[1]), (ends[0, 1], ends[0, 0]), (ends[3, 0], ends[3, 1])]
    for shape in [(1, 2, 3), (4, 5, 7)]:
        on_gpu, _ = a1111_draws(source, shape, (7, 8), sigmas, queries)
        assert_same_draws(source, our_draws(source, shape, (7, 8), sigmas, queries), on_gpu)


def test_a_draw_does_not_depend_on_the_draws_before():
    """Keeping the last query's splits changes no value: each draw is that of a fresh sampler."""
    sigmas = karras_sigmas()
    queries = dpmpp_sde_queries(sigmas)
    in_turn = our_draws("nv", SHAPE, (5, 6), sigmas, queries)
    alone = [our_draws("nv", SHAPE, (5, 6), sigmas, [query])[0] for query in queries]
    np.testing.assert_array_equal(in_turn, np.stack(alone))


def test_draws_are_standard_normal_and_correlated_as_increments():
    """Each draw is N(0, 1); DPM++ SDE's two draws of a step overlap, with correlation sqrt(half / whole)."""
    sigmas = karras_sigmas()
    queries = dpmpp_sde_queries(sigmas)
    ours = our_draws("nv", (4, 64, 64), (11,), sigmas, queries)  # 16384 values a draw
    assert np.abs(ours.mean(axis=(1, 2, 3, 4))).max() < 0.03
    assert np.abs(ours.std(axis=(1, 2, 3, 4)) - 1).max() < 0.03
    for step in range(len(queries) // 2):
        (sigma, sigma_half), (_, sigma_next) = queries[2 * step], queries[2 * step + 1]
        expected = math.sqrt((sigma - sigma_half) / (sigma - sigma_next))
        measured = np.corrcoef(ours[2 * step].ravel(), ours[2 * step + 1].ravel())[0, 1]
        assert measured == pytest.approx(expected, abs=0.03)


def test_distinct_times_that_round_together_draw_zeros():
    """torchsde rounds times to 6 decimals: such an interval is empty. (For some such pairs, unlike this one,
    torchsde's search splits without end instead, and A1111's sampling fails with a RecursionError.)"""
    sigmas = torch.tensor([14.6146, 0.0292])
    queries = [(torch.tensor(1.1044066), torch.tensor(1.1044067))]
    on_gpu, _ = a1111_draws("nv", SHAPE, (1,), sigmas, queries)
    ours = our_draws("nv", SHAPE, (1,), sigmas, queries)
    assert not ours.any()
    assert_same_draws("nv", ours, on_gpu)
