"""The benchmark's workload: its prompts, one batch of them, a long prompt, the sweep of what users
change between calls; and timing one call."""

import dataclasses
import itertools
import time
from collections.abc import Callable

from ..engine.compilation import CompileCounter
from ..engine.request import DEFAULT_GUIDANCE_SCALE, Request
from ..prompts.tokens import TOKENS_PER_CHUNK

PROMPT = "a photograph of an astronaut riding a horse on the moon, detailed, sharp focus"
# Weighted, as prompts pasted from model pages are; repeated to fill a given number of chunks.
WEIGHTED_PHRASE = "(an astronaut:1.2) riding a horse on the moon, [blurry], ((sharp focus)), "
LONG_PROMPT_CHUNKS = 3  # compiled as 4, one masked: the cost of a long prompt as users write them
NEGATIVE_PROMPT = "blurry, low quality"
GUIDANCE_SCALE = DEFAULT_GUIDANCE_SCALE
SAMPLER = "euler"  # diffusers' EulerDiscreteScheduler is the reference's counterpart


def batch_request(
    batch: int,
    height: int,
    width: int,
    steps: int,
    *,
    prompt=PROMPT,
    negative_prompt=NEGATIVE_PROMPT,
    seed=0,
    guidance_scale=GUIDANCE_SCALE,
) -> Request:
    """One batch of images (seed, 0), (seed, 1), ... of one prompt."""
    return Request.from_prompt(
        prompt, negative_prompt, num_images=batch, seed=seed, guidance_scale=guidance_scale, steps=steps,
        height=height, width=width, sampler=SAMPLER,
    )


def prompt_of_chunks(prompts, chunks: int) -> str:
    """`WEIGHTED_PHRASE` repeated until the model's tokenizers read it as `chunks` chunks."""
    for repeats in itertools.count(1):
        text = WEIGHTED_PHRASE * repeats
        ids, _ = prompts.read(text)
        if ids.shape[-1] // TOKENS_PER_CHUNK >= chunks:
            return text


def sweep_requests(batch: int, height: int, width: int, steps: int, long_prompt: str) -> list[Request]:
    """Requests that change everything a user changes between calls except what selects another
    program (the image size, the batch, the sampler, guidance or none, the chunk count): prompts
    (including an empty negative prompt), their weights and emphasis, seed, guidance scale and step
    count. `long_prompt` is one of a chunk count already compiled, whose weights the sweep changes."""
    reweighted = long_prompt.replace(":1.2)", ":0.7)").replace("((", "(((")
    return [
        batch_request(batch, height, width, 1, prompt="a red cube", negative_prompt=""),
        batch_request(batch, height, width, 2, seed=123, prompt="a (red:1.4) [cube]", negative_prompt="(blurry:1.3)"),
        dataclasses.replace(batch_request(batch, height, width, 1, prompt=reweighted), emphasis="no-norm"),
        batch_request(batch, height, width, 1, guidance_scale=1.5),
        batch_request(batch, height, width, steps + 1, guidance_scale=9.0, seed=7),
    ]


def count_compilations(pipe, requests: list[Request]) -> int:
    """How many XLA compilations `pipe.render` needs over `requests`."""
    with CompileCounter() as compiles:
        for request in requests:
            pipe.render(request)
    return compiles.count


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu
