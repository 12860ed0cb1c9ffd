import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    LCMScheduler,
    TCDScheduler,
)
from diffusers.schedulers import scheduling_euler_ancestral_discrete, scheduling_lcm, scheduling_tcd
from jax._src.cudnn import fused_attention_stablehlo

import two_hosts
from reference import diffusers_images, random_latents, sdxl_pipeline
from sdxl.checkpoints import BUILTIN_CONFIGS, ModelSpec, random_models
from sdxl.engine import inputs
from sdxl.engine.compilation import CompileCounter
from sdxl.engine.compiled import Executables
from sdxl.engine.mesh import batch_mesh
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.program import GenerateProgram, per_image_keys
from sdxl.engine.request import Request
from sdxl.models import unet
from sdxl.models.layers import STEP_INVARIANTS
from sdxl.sampling.samplers import step_noise
from sdxl.sampling.schedulers import TCD_GAMMA

HEIGHT, WIDTH = 64, 96  # non-square, and a multiple of the tiny model's latent factor (16)
PROMPTS = ["a red cube on a table", "a blue sphere floating over grass"]
NEGATIVES = ["blurry", "low quality, watermark"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdxl-reference")
    return folder, sdxl_pipeline(folder)


@pytest.fixture(scope="module")
def pipe(reference):
    return Pipeline.from_pretrained(reference[0], dtype="float32", max_steps=8)


@pytest.fixture(scope="module")
def winograd(reference):
    """A pipeline whose programs compile with Winograd convolutions: tests that use it set SDXL_CONV=winograd
    (read as a program is traced) before it compiles anything. One for the module, so that they share programs."""
    return Pipeline.from_pretrained(reference[0], dtype="float32", max_steps=8)


def _latents(n, seed=0):
    return random_latents(n, HEIGHT, WIDTH, seed)


def _diffusers_images(ref, prompts, negatives, latents, steps, guidance, scheduler=None, **call_kwargs):
    return diffusers_images(
        ref,
        scheduler,
        prompt=prompts,
        negative_prompt=negatives,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=steps,
        guidance_scale=guidance,
        latents=torch.from_numpy(latents),
        **call_kwargs,
    )


@pytest.mark.oracle
def test_images_match_diffusers(reference, pipe):
    _, ref = reference
    latents = _latents(2)
    expected = _diffusers_images(ref, PROMPTS, NEGATIVES, latents, steps=4, guidance=5.0)
    got = pipe.generate(
        PROMPTS, NEGATIVES, steps=4, guidance_scale=5.0, height=HEIGHT, width=WIDTH, latents=latents, output_type="np"
    )
    diff = np.abs(got - expected).max()
    print(f"end-to-end max abs diff vs diffusers: {diff:.2e}")
    assert got.shape == (2, HEIGHT, WIDTH, 3)
    assert expected.std() > 0.05 and np.abs(expected[0] - expected[1]).mean() > 1e-3
    assert diff <= 1e-4


@pytest.mark.oracle
def test_a_vae_with_latents_mean_and_std_decodes_like_diffusers(tmp_path):
    """Playground v2.5's VAE config: SDXL's pipeline unscales its latents per channel."""
    vae = {
        **random_models.SDXL_CONFIGS["vae/config.json"],
        "latents_mean": [0.1, -0.3, 0.2, 0.05], "latents_std": [0.9, 1.2, 0.7, 1.1], "scaling_factor": 0.5,
    }
    ref = sdxl_pipeline(tmp_path, {**random_models.SDXL_CONFIGS, "vae/config.json": vae})
    pipe = Pipeline.from_pretrained(tmp_path, dtype="float32", max_steps=8)
    assert pipe.spec.vae.latents_mean == (0.1, -0.3, 0.2, 0.05)
    latents = _latents(2, seed=5)
    expected = _diffusers_images(ref, PROMPTS, NEGATIVES, latents, steps=2, guidance=5.0)
    got = pipe.generate(
        PROMPTS, NEGATIVES, steps=2, guidance_scale=5.0, height=HEIGHT, width=WIDTH, latents=latents, output_type="np"
    )
    assert np.abs(got - expected).max() <= 1e-4


@pytest.mark.oracle
@pytest.mark.parametrize(
    "sampler, scheduler_cls, options",
    [
        ("dpmpp_2m", DPMSolverMultistepScheduler, {}),
        ("dpmpp_2m_karras", DPMSolverMultistepScheduler, {"use_karras_sigmas": True}),
        ("ddim", DDIMScheduler, {}),  # eta = 0, the pipeline's default
    ],
)
def test_deterministic_samplers_match_diffusers(reference, pipe, sampler, scheduler_cls, options):
    _, ref = reference
    latents = _latents(2, seed=4)
    scheduler = scheduler_cls.from_config(ref.scheduler.config, **options)
    # 4 steps: DPM++ 2M takes first, second, second and (lower_order_final) first order steps.
    expected = _diffusers_images(ref, PROMPTS, NEGATIVES, latents, steps=4, guidance=5.0, scheduler=scheduler)
    got = pipe.generate(
        PROMPTS, NEGATIVES, steps=4, guidance_scale=5.0, height=HEIGHT, width=WIDTH, latents=latents,
        sampler=sampler, output_type="np",
    )
    diff = np.abs(got - expected).max()
    print(f"{sampler} max abs diff vs diffusers {type(scheduler).__name__}: {diff:.2e}")
    assert expected.std() > 0.05
    euler = _diffusers_images(ref, PROMPTS, NEGATIVES, latents, steps=4, guidance=5.0)
    # DDIM is Euler's method in other variables, so it differs only by its last step and starting noise.
    assert np.abs(euler - expected).max() > 1e-3, "the sampler must make a difference for the test to mean something"
    assert diff <= 1e-4


def _diffusers_draws_our_step_noise(monkeypatch, module, seed: int, n: int) -> list:
    """Makes diffusers' scheduler `module` draw, at each step, the noise our stochastic samplers draw
    for images 0..n-1 of `seed`; returns the list of steps drawn (to count them)."""
    _, keys = per_image_keys(np.full(n, seed, np.uint32), np.arange(n, dtype=np.uint32))
    drawn = []

    def same_noise(shape, **kwargs):  # diffusers' draw for one step, [B, C, h, w]
        noise = step_noise(keys, len(drawn), (shape[2], shape[3], shape[1]))  # [B, h, w, C]
        drawn.append(len(drawn))
        return torch.from_numpy(np.asarray(noise).transpose(0, 3, 1, 2).copy())

    monkeypatch.setattr(module, "randn_tensor", same_noise)
    return drawn


@pytest.mark.oracle
@pytest.mark.parametrize(
    "sampler, scheduler_cls, module, options, draws",
    [
        ("euler_ancestral", EulerAncestralDiscreteScheduler, scheduling_euler_ancestral_discrete, {}, 3),
        ("euler_ancestral", EulerAncestralDiscreteScheduler, scheduling_euler_ancestral_discrete,
         {"timestep_spacing": "trailing"}, 3),  # SDXL-Turbo's
        ("lcm", LCMScheduler, scheduling_lcm, {}, 2),  # no noise after the last step
        ("tcd", TCDScheduler, scheduling_tcd, {}, 2),  # gamma ("eta") 0.3, as TCD's card runs it
    ],
)
def test_stochastic_samplers_match_diffusers_given_the_same_noise(
    reference, pipe, monkeypatch, sampler, scheduler_cls, module, options, draws
):
    folder, ref = reference
    if options:  # the checkpoint's scheduler config with these fields replaced, in both
        pipe = Pipeline.from_pretrained(folder, dtype="float32", max_steps=8, scheduler=options)
    seed, steps, latents = 5, 3, _latents(2, seed=5)
    drawn = _diffusers_draws_our_step_noise(monkeypatch, module, seed, 2)
    scheduler = scheduler_cls.from_config(ref.scheduler.config, **options)
    expected = _diffusers_images(ref, PROMPTS, NEGATIVES, latents, steps=steps, guidance=5.0, scheduler=scheduler,
                                 eta=TCD_GAMMA)  # only TCD's step takes an eta
    assert len(drawn) == draws
    kwargs = dict(steps=steps, guidance_scale=5.0, height=HEIGHT, width=WIDTH, latents=latents, output_type="np")
    got = pipe.generate(PROMPTS, NEGATIVES, seed=seed, sampler=sampler, **kwargs)
    diff = np.abs(got - expected).max()
    print(f"{sampler} {options} max abs diff vs diffusers, same noise: {diff:.2e}")
    assert diff <= 1e-4
    other_seed = pipe.generate(PROMPTS, NEGATIVES, seed=seed + 1, sampler=sampler, **kwargs)
    assert np.abs(other_seed - got).max() > 1e-2, "the step noise must come from the seed"


@pytest.mark.oracle
@pytest.mark.parametrize("sampler, scheduler_cls", [("euler", EulerDiscreteScheduler),
                                                    ("euler_ancestral", EulerAncestralDiscreteScheduler)])
@pytest.mark.parametrize("batch_noise", [True, False], ids=["one generator", "one per image"])
def test_cpu_noise_gives_diffusers_picture_for_its_torch_generators(reference, pipe, sampler, scheduler_cls,
                                                                    batch_noise):
    """noise_source="cpu" draws what diffusers draws from CPU generators: with `batch_noise`, one
    generator for the call (`generator=torch.Generator().manual_seed(seed)`); without, one per image
    at seed + i (A1111's convention, which diffusers takes as a list of generators). The starting
    latents, and an ancestral sampler's noise at every step, continue each generator."""
    folder, ref = reference
    seed, steps = 11, 3
    generators = torch.Generator().manual_seed(seed) if batch_noise else [
        torch.Generator().manual_seed(seed + i) for i in range(len(PROMPTS))]
    expected = diffusers_images(
        ref, scheduler_cls.from_config(ref.scheduler.config), prompt=PROMPTS, negative_prompt=NEGATIVES,
        height=HEIGHT, width=WIDTH, num_inference_steps=steps, guidance_scale=5.0, generator=generators,
    )
    kwargs = dict(seed=seed, sampler=sampler, steps=steps, guidance_scale=5.0, height=HEIGHT, width=WIDTH,
                  output_type="np")
    got = pipe.generate(PROMPTS, NEGATIVES, noise_source="cpu", batch_noise=batch_noise, **kwargs)
    diff = np.abs(got - expected).max()
    print(f"{sampler}, batch noise {batch_noise}: max abs diff vs diffusers with torch generators {diff:.2e}")
    assert diff <= 1e-4
    assert np.abs(pipe.generate(PROMPTS, NEGATIVES, **kwargs) - got).max() > 1e-2, "JAX's noise is other noise"


@pytest.mark.compiles
def test_a_refiner_continues_the_drawn_noise_where_the_base_stopped():
    """The refiner's part of a handoff reads the draws of the steps it runs: with a "refiner" that is the
    model itself, refining from halfway is the whole run, ancestral noise, ENSD and all."""
    pipe = Pipeline.from_pretrained("tiny", max_steps=8, devices=jax.devices()[:1])
    pipe.set_refiner(Pipeline.from_pretrained("tiny", max_steps=8, devices=jax.devices()[:1]))
    kwargs = dict(seed=3, steps=4, num_images=2, sampler="euler_ancestral", output_type="np", noise_source="nv",
                  ensd=31337)
    whole = pipe.generate("a fox", **kwargs)
    np.testing.assert_array_equal(pipe.generate("a fox", refine_from=0.5, **kwargs), whole)
    assert np.abs(pipe.generate("a fox", **(kwargs | dict(ensd=0))) - whole).max() > 1e-2, "ENSD re-seeds the steps"


@pytest.mark.oracle
def test_an_lcm_unet_takes_the_guidance_as_an_embedding_like_diffusers(tmp_path, monkeypatch):
    """An LCM UNet (time_cond_proj_dim, as SimianLuo/LCM_Dreamshaper_v7): guidance is the embedding
    of scale - 1 added to the time embedding, and there is no unconditional pass."""
    configs = {
        **random_models.SDXL_CONFIGS,
        "unet/config.json": {**random_models.SDXL_CONFIGS["unet/config.json"], "time_cond_proj_dim": 16},
        "scheduler/scheduler_config.json": {
            **random_models.SDXL_CONFIGS["scheduler/scheduler_config.json"], "_class_name": "LCMScheduler"},
    }
    ref = sdxl_pipeline(tmp_path, configs)
    pipe = Pipeline.from_pretrained(tmp_path, dtype="float32", max_steps=8)
    assert pipe.spec.default_sampler == "lcm"
    seed, steps, latents = 3, 3, _latents(2, seed=7)
    _diffusers_draws_our_step_noise(monkeypatch, scheduling_lcm, seed, 2)
    expected = _diffusers_images(ref, PROMPTS, NEGATIVES, latents, steps=steps, guidance=6.0)
    kwargs = dict(seed=seed, steps=steps, height=HEIGHT, width=WIDTH, latents=latents, output_type="np")
    got = pipe.generate(PROMPTS, NEGATIVES, guidance_scale=6.0, **kwargs)
    with CompileCounter() as compiles:  # the scale is a traced input of the one (unguided) program
        other_guidance = pipe.generate(PROMPTS, NEGATIVES, guidance_scale=2.0, **kwargs)
    diff = np.abs(got - expected).max()
    print(f"LCM UNet max abs diff vs diffusers, same noise: {diff:.2e}")
    assert diff <= 1e-4
    assert np.abs(other_guidance - got).max() > 1e-2, "the guidance embedding must matter"
    assert compiles.count == 0


@pytest.mark.oracle
@pytest.mark.parametrize(
    "sampler, scheduler_cls, options",
    [
        ("euler", EulerDiscreteScheduler, {"timestep_spacing": "trailing"}),  # SDXL-Lightning's
        ("ddim", DDIMScheduler, {"timestep_spacing": "trailing"}),  # Hyper-SD's
        # SDXL-Lightning's 1-step UNet predicts the clean latents.
        ("euler", EulerDiscreteScheduler, {"timestep_spacing": "trailing", "prediction_type": "sample"}),
    ],
)
def test_few_step_settings_match_diffusers_without_guidance(reference, sampler, scheduler_cls, options):
    """As few-step models run: 2 steps, guidance 0, with the scheduler fields they ask for."""
    folder, ref = reference
    pipe = Pipeline.from_pretrained(folder, dtype="float32", max_steps=8, scheduler=options)
    latents = _latents(2, seed=6)
    scheduler = scheduler_cls.from_config(ref.scheduler.config, **options)
    expected = _diffusers_images(ref, PROMPTS, NEGATIVES, latents, steps=2, guidance=0.0, scheduler=scheduler)
    got = pipe.generate(PROMPTS, NEGATIVES, steps=2, guidance_scale=0.0, height=HEIGHT, width=WIDTH, latents=latents,
                        sampler=sampler, output_type="np")
    diff = np.abs(got - expected).max()
    print(f"{sampler} {options} max abs diff vs diffusers: {diff:.2e}")
    leading = _diffusers_images(ref, PROMPTS, NEGATIVES, latents, steps=2, guidance=0.0,
                                scheduler=scheduler_cls.from_config(ref.scheduler.config))
    assert np.abs(leading - expected).max() > 1e-3, "the options must make a difference for the test to mean something"
    assert diff <= 1e-4


@pytest.mark.oracle
def test_empty_negative_prompt_is_zero_conditioning_like_diffusers(reference, pipe):
    _, ref = reference
    latents = _latents(2, seed=1)
    expected = _diffusers_images(ref, PROMPTS, None, latents, steps=3, guidance=7.0)
    got = pipe.generate(
        PROMPTS, "", steps=3, guidance_scale=7.0, height=HEIGHT, width=WIDTH, latents=latents, output_type="np"
    )
    assert np.abs(got - expected).max() <= 1e-4
    with_text = _diffusers_images(ref, PROMPTS, [" "] * 2, latents, steps=3, guidance=7.0)
    assert np.abs(with_text - expected).max() > 1e-3  # zeroing is not the same as encoding ""


@pytest.mark.oracle
def test_guidance_at_most_one_uses_the_conditional_branch_like_diffusers(reference, pipe):
    _, ref = reference
    latents = _latents(2, seed=2)
    expected = _diffusers_images(ref, PROMPTS, NEGATIVES, latents, steps=2, guidance=1.0)
    got = pipe.generate(
        PROMPTS, NEGATIVES, steps=2, guidance_scale=1.0, height=HEIGHT, width=WIDTH, latents=latents, output_type="np"
    )
    assert np.abs(got - expected).max() <= 1e-4


@pytest.mark.compiles
def test_without_guidance_the_unet_sees_the_prompts_alone(reference, pipe):
    """Guidance at most 1 everywhere: the variant with half the UNet work, the same images (within
    float noise) as the guided program's conditional branch, and one compile for all such scales."""
    latents = _latents(4, seed=6)
    request = Request(tuple(PROMPTS * 2), tuple(NEGATIVES * 2), (1,) * 4, (0, 1, 2, 3), (1.0, 0.0, 0.5, 1.0), 2,
                      HEIGHT, WIDTH, noise=latents.transpose(0, 2, 3, 1))
    assert not request.guided
    unguided = pipe.render(request, output_type="np").images
    prepared = pipe.prepare(request, output_type="np")
    program = prepared.program
    forced = dataclasses.replace(program, guided=True)
    arrays = inputs.placed(inputs.host_inputs(dataclasses.replace(prepared, program=forced)), pipe.mesh)
    guided = pipe.executables.compiled(forced, "whole")(pipe.params, arrays)
    np.testing.assert_allclose(unguided, np.asarray(guided[0]), atol=1e-5)
    # A denoising step (the loop's body, which the cost analysis counts once) costs about half. Of the
    # plain text-to-image program, whose guided stages the progress tests compile too.
    text = _text_to_image(pipe)
    flops = [pipe.executables.compiled(p, "denoise").cost_analysis()["flops"]
             for p in (text, dataclasses.replace(text, guided=False))]
    assert 0.4 < flops[1] / flops[0] < 0.6
    pipe.generate("a cat", steps=2, guidance_scale=0.0, height=HEIGHT, width=WIDTH, num_images=4)
    with CompileCounter() as compiles:
        pipe.generate("a dog", "rain", steps=3, guidance_scale=1.0, height=HEIGHT, width=WIDTH, num_images=4)
    assert compiles.count == 0


@pytest.mark.compiles
def test_same_seed_same_images_on_one_and_four_devices(reference, pipe):
    assert pipe.num_devices == 4
    one = Pipeline.from_pretrained(reference[0], dtype="float32", max_steps=8, devices=jax.devices()[:1])
    kwargs = dict(seed=7, steps=3, height=HEIGHT, width=WIDTH, output_type="np")
    four_images = pipe.generate("a cat", **kwargs)
    one_images = one.generate("a cat", num_images=4, **kwargs)
    assert four_images.shape == (4, HEIGHT, WIDTH, 3)
    for i in range(4):
        for j in range(i):
            assert np.abs(four_images[i] - four_images[j]).mean() > 1e-3, "images of one request must differ"
    np.testing.assert_allclose(four_images, one_images, atol=1e-5)
    # A batch that does not fill the devices is padded; the images it keeps are unchanged.
    three = pipe.generate("a cat", num_images=3, **kwargs)
    np.testing.assert_allclose(three, four_images[:3], atol=1e-5)
    pil = pipe.generate("a cat", seed=7, steps=3, height=HEIGHT, width=WIDTH)
    assert [im.size for im in pil] == [(WIDTH, HEIGHT)] * 4
    np.testing.assert_array_equal(np.asarray(pil[2]), np.round(four_images[2] * 255).astype(np.uint8))


@pytest.mark.compiles
def test_what_a_larger_batch_guarantees(pipe):
    """The README's promise: a request rendered alone (4 images) and merged into a batch of 16 gives
    floats within 1e-4 and uint8 pixels within 1, in at most 0.1% of the values; again alone, the same."""
    alone = Request.from_prompt("a cat", num_images=4, seed=11, steps=3, height=HEIGHT, width=WIDTH)
    others = Request.from_prompt("a dog", num_images=12, seed=12, steps=3, height=HEIGHT, width=WIDTH)
    merged = Request.merged([alone, others])
    for output_type in ("np", "pil"):
        first = pipe.render(alone, output_type=output_type).images
        in_batch = pipe.render(merged, output_type=output_type).images[:4]
        np.testing.assert_array_equal(pipe.render(alone, output_type=output_type).images, first)
        difference = np.abs(first.astype(np.float64) - in_batch)
        if output_type == "pil":
            assert difference.max() <= 1 and np.mean(difference > 0) <= 1e-3, np.mean(difference > 0)
        else:
            assert difference.max() <= 1e-4


@pytest.mark.hosts
def test_two_processes_render_the_images_of_one(reference, pipe, tmp_path):
    """Several hosts, as on a TPU pod slice: 2 processes of 2 CPU devices make one 4-device mesh,
    and each gets every image of the batch, the same as one process with 4 devices."""
    request = dict(prompt="a cat", seed=7, steps=3, guidance_scale=5.0, height=HEIGHT, width=WIDTH)
    expected = two_hosts.render(pipe, request)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    worker = Path(two_hosts.__file__)
    env = {**os.environ, "PYTHONPATH": str(worker.parent.parent)}
    outs = [tmp_path / f"process-{i}.npz" for i in range(2)]
    processes = [
        subprocess.Popen(
            [sys.executable, str(worker), str(i), "2", str(port), str(reference[0]), str(out), json.dumps(request)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for i, out in enumerate(outs)
    ]
    try:
        logs = [p.communicate(timeout=600)[0] for p in processes]
    finally:
        for p in processes:  # one that died leaves the other waiting in a collective
            p.kill()
    for p, log in zip(processes, logs):
        assert p.returncode == 0, log[-3000:]
    for out in outs:
        got = np.load(out)
        np.testing.assert_allclose(got["generate"], expected["generate"], atol=1e-5)
        # Agreeing to 1e-5 in float32 (above), a pixel may still round to the next uint8 level.
        np.testing.assert_allclose(got["run"], expected["run"], atol=1)
        assert list(got["reported"]) == list(expected["reported"]) == [1, 2, 3]


@pytest.mark.compiles
def test_prompt_seed_guidance_steps_and_clip_skip_do_not_recompile(pipe):
    kwargs = dict(height=HEIGHT, width=WIDTH)
    pipe.generate("first", seed=0, steps=2, guidance_scale=5.0, **kwargs)
    with CompileCounter() as compiles:
        a = pipe.generate("second prompt", "a negative", seed=1, steps=2, guidance_scale=5.0, **kwargs)
        b = pipe.generate("second prompt", "a negative", seed=2, steps=2, guidance_scale=5.0, **kwargs)
        c = pipe.generate("second prompt", "a negative", seed=1, steps=2, guidance_scale=9.0, **kwargs)
        d = pipe.generate("second prompt", "a negative", seed=1, steps=5, guidance_scale=5.0, **kwargs)
        e = pipe.generate("second prompt", "a negative", seed=1, steps=2, guidance_scale=5.0, clip_skip=1,
                          sdxl_clip_l_skip=True, **kwargs)  # CLIP-L's last layer in place of its penultimate
    assert compiles.count == 0
    for other in (b, c, d, e):
        assert not np.array_equal(np.asarray(a[0]), np.asarray(other[0]))
    with CompileCounter() as compiles:
        pipe.generate("first", seed=0, steps=2, height=HEIGHT, width=HEIGHT)
    assert compiles.count >= 1, "the counter must see a new image size compile"


def test_prompt_edits_do_not_recompile_and_plain_prompts_keep_their_program(pipe):
    """A prompt's edits are a traced choice among its texts: other texts, switch steps and alternatives
    run the same program (for as many texts); a prompt without them runs the program it ran before."""
    kwargs = dict(height=HEIGHT, width=WIDTH, seed=1, steps=4)
    assert _text_to_image(pipe).conditionings == 1
    edited = Request.from_prompt("[a cat:a dog:0.5]", num_images=4, steps=4, height=HEIGHT, width=WIDTH)
    assert pipe.prepare(edited).program == dataclasses.replace(_text_to_image(pipe), conditionings=2)
    first = pipe.generate("[a cat:a dog:0.5]", "blurry", **kwargs)
    with CompileCounter() as compiles:
        others = [
            pipe.generate("[a red cube:a dog:0.25]", "blurry", **kwargs),
            pipe.generate("[a cat|a dog]", "blurry", **kwargs),
            pipe.generate("a cat", "[blurry:noisy:2]", **kwargs),
            pipe.generate("[a cat:a dog:3]", "blurry", **{**kwargs, "steps": 6}),
        ]
    assert compiles.count == 0
    for other in others:
        assert not np.array_equal(np.asarray(first[0]), np.asarray(other[0]))


def _assert_no_cross_device_communication(hlo: str) -> None:
    for collective in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"):
        assert collective not in hlo


@pytest.mark.compiles
def test_compiled_program_has_no_cross_device_communication(pipe):
    """With XLA's attention, the CPU's default (splash attention's program: the test below)."""
    _assert_no_cross_device_communication(pipe.executables.compiled(_text_to_image(pipe), "whole").as_text())


@pytest.mark.compiles
def test_splash_attention_renders_the_same_images_on_four_devices_without_communicating(reference, pipe, monkeypatch):
    kwargs = dict(seed=3, steps=2, height=HEIGHT, width=WIDTH, output_type="np")
    expected = pipe.generate("a cat", **kwargs)
    monkeypatch.setenv("SDXL_ATTENTION", "splash")
    splash = Pipeline.from_pretrained(reference[0], dtype="float32", max_steps=8)
    np.testing.assert_allclose(splash.generate("a cat", **kwargs), expected, atol=1e-5)
    # The program that rendered them: one compile checked for both.
    program = splash.prepare(Request.from_prompt("a cat", num_images=4, steps=2, height=HEIGHT, width=WIDTH),
                             output_type="np").program
    assert splash.executables.has(program)
    _assert_no_cross_device_communication(splash.executables.compiled(program, "whole").as_text())


def _lowered_sdxl(platforms: tuple[str, ...]):
    """SDXL base's program at 1024x1024, batch 4 on this host's 4 devices, in bfloat16, lowered for an
    accelerator from this CPU host: a program compiles from its fields alone, with no weights."""
    spec = ModelSpec.from_folder(BUILTIN_CONFIGS / "sdxl-base-1.0")
    program = GenerateProgram(spec, "euler", 1024, 1024, 4, jnp.dtype("bfloat16"), 100)
    return Executables(batch_mesh(jax.devices())).lowered(program, "whole", platforms)


@pytest.mark.compiles
def test_sdxl_program_lowers_for_a_tpu_with_a_splash_kernel_per_device(monkeypatch):
    """The TPU target at full size: 1024x1024, batch 4 on 4 devices. Pallas' Mosaic lowering checks
    each kernel's block shapes and dtypes, which its interpreter (the other splash tests) does not."""
    monkeypatch.setenv("SDXL_ATTENTION", "splash")
    text = _lowered_sdxl(("tpu",)).as_text()
    # One kernel per distinct attention shape. Operand types: two masks, then query, key, value, ...
    operand_types = [types.split(", ") for types in re.findall(r"@tpu_custom_call\(.*? : \(([^)]*)\)", text)]
    assert operand_types, "no splash kernel went through Mosaic (was it interpreted?)"
    shapes = {(_tensor_shape(types[2]), _tensor_shape(types[3])) for types in operand_types}
    unet = {(q, k) for q, k in shapes if len(q) == 4}
    # Per device: 2 of the 8 latents (4 images, with and without the prompt); CLIP's 77 tokens pad to 128.
    assert unet == {
        ((2, 10, 4096, 64), (2, 10, 4096, 64)),
        ((2, 10, 4096, 64), (2, 10, 128, 64)),
        ((2, 20, 1024, 64), (2, 20, 1024, 64)),
        ((2, 20, 1024, 64), (2, 20, 128, 64)),
    }
    # The VAE's mid-block: one 512-wide head over 128x128 pixels, one image per device.
    assert shapes - unet == {((1, 16384, 512), (1, 16384, 512))}


@pytest.mark.compiles
def test_sdxl_program_lowers_for_a_gpu_with_a_cudnn_call_per_device(monkeypatch):
    """The GPU program at full size: 1024x1024, batch 4 on 4 devices. JAX lowers cuDNN's flash
    attention only where it finds cuDNN, so the test stands in a cuDNN 9.10 for it; what cuDNN itself
    checks (the GPU, its plan for each shape) comes only on a GPU."""
    monkeypatch.setattr(fused_attention_stablehlo, "cuda_versions", SimpleNamespace(cudnn_get_version=lambda: 91000))
    monkeypatch.setenv("SDXL_ATTENTION", "cudnn")
    text = _lowered_sdxl(("cuda",)).as_text()
    # Each device calls the kernel on its own latents: nothing is left for XLA's partitioner to decide.
    assert "CustomSPMDPartitioning" not in text
    calls = re.findall(r"@__cudnn\$fmhaSoftmax\(.*? : \(([^)]*)\)", text)
    # SDXL's 70 transformer blocks, each with a self- and a cross-attention; the UNet traced once.
    assert len(calls) == 140
    assert text.count('\\22is_flash_attention\\22: true') == 140
    # Per device: 2 of the 8 latents, [batch, tokens, heads, head width]; CLIP's 77 tokens as they are.
    shapes = {tuple(_tensor_shape(t) for t in types.split(", ")[:2]) for types in calls}
    assert shapes == {
        ((2, 4096, 10, 64), (2, 4096, 10, 64)),
        ((2, 4096, 10, 64), (2, 77, 10, 64)),
        ((2, 1024, 20, 64), (2, 1024, 20, 64)),
        ((2, 1024, 20, 64), (2, 77, 20, 64)),
    }


def _tensor_shape(mlir_type: str) -> tuple[int, ...]:  # "tensor<2x10x128x64xbf16>" -> (2, 10, 128, 64)
    return tuple(int(d) for d in mlir_type.removeprefix("tensor<").split("x")[:-1])


@pytest.mark.compiles
@pytest.mark.parametrize("convolution", ["default", "winograd"])
# Prompt edits: `prepare` then leaves the text's keys and values to each step, which reads its own text.
@pytest.mark.parametrize(("prompt", "negative"), [("a cat", "dog"), ("[a cat|a dog]", "[dog:fog:0.4]")])
def test_progress_reports_every_step_and_changes_no_pixel(pipe, winograd, monkeypatch, convolution, prompt, negative):
    if convolution != "default":  # the per-step programs then reuse the kernels that `prepare` transformed
        monkeypatch.setenv("SDXL_CONV", convolution)
        pipe = winograd
    kwargs = dict(steps=5, height=HEIGHT, width=WIDTH)
    request = Request((prompt,) * 4, (negative,) * 4, (3,) * 4, tuple(range(4)), (6.0,) * 4, **kwargs)
    whole = pipe.render(request)
    reported = []
    staged = pipe.render(request, on_step=reported.append)
    assert reported == [1, 2, 3, 4, 5]
    np.testing.assert_array_equal(staged.images, whole.images)
    every_two = []
    pipe.render(request, on_step=every_two.append, steps_per_report=2)
    assert every_two == [2, 4, 5]


def _text_to_image(pipe, num_images=4, **settings) -> GenerateProgram:
    """The program of a plain text-to-image request at the test size."""
    request = Request.from_prompt("a cat", num_images=num_images, steps=1, height=HEIGHT, width=WIDTH, **settings)
    return pipe.prepare(request).program  # the steps are an input: any count names the same program


@pytest.mark.compiles
def test_is_compiled_tells_what_warmup_compiled(reference):
    pipe = Pipeline.from_pretrained(reference[0], dtype="float32", max_steps=8)
    programs = [_text_to_image(pipe)]
    assert not pipe.is_compiled(programs) and not pipe.is_compiled(programs, progress=True)
    pipe.warmup(HEIGHT, WIDTH, 4)
    assert pipe.is_compiled(programs) and not pipe.is_compiled(programs, progress=True)
    pipe.warmup(HEIGHT, WIDTH, 4, progress=True)
    assert pipe.is_compiled(programs, progress=True)
    assert not pipe.is_compiled([_text_to_image(pipe, 8)])
    assert not pipe.is_compiled([_text_to_image(pipe, sampler="ddim")])


@pytest.mark.compiles
def test_denoising_loops_leave_the_step_invariants_outside(winograd, monkeypatch):
    """The text's keys and values and the Winograd kernels are alike in every step: the per-step
    program takes them from `prepare`, and XLA hoists them out of the single program's loop."""
    monkeypatch.setenv("SDXL_CONV", "winograd")

    def products(stage):  # the program's matmuls and convolutions that compute step invariants
        return _products_named(winograd.executables.compiled(_text_to_image(winograd), stage).as_text(),
                               STEP_INVARIANTS)

    _, prepared = products("prepare")
    for invariant in ("attn2/step_invariants/to_k", "attn2/step_invariants/to_v", "conv1/step_invariants"):
        assert any(f"/{invariant}/" in op for op in prepared), invariant
    assert products("denoise") == ([], [])
    in_loops, in_all = products("whole")
    assert in_all and not in_loops


def _products_named(hlo: str, name: str) -> tuple[list[str], list[str]]:
    """The op names of a compiled HLO module's dots and convolutions in the op-name scope `name`:
    (in while loops, in all). Reshapes and transposes of such values may stay in loops; they are cheap."""
    computations, lines = {}, None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            lines = computations[header.group(1)] = []
        elif line.startswith(" ") and lines is not None:
            lines.append(line)

    def called(computation):
        return re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", "\n".join(computations[computation]))

    pending = [body for c in computations for body in re.findall(r"body=%?([\w.\-]+)", "\n".join(computations[c]))]
    in_loops = set()
    while pending:
        computation = pending.pop()
        if computation not in in_loops:
            in_loops.add(computation)
            pending += called(computation)

    def products(names):
        pattern = re.compile(f'= \\S+ (?:dot|convolution)\\(.*op_name="([^"]*/{name}/[^"]*)"')
        return [m.group(1) for c in names for line in computations[c] if (m := pattern.search(line))]

    return products(in_loops), products(computations)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(steps=0), "steps"),
        (dict(steps=9), "steps"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**32), "seed"),
        (dict(guidance_scale=float("nan")), "guidance"),
        (dict(height=65), "height"),
        (dict(width=0), "width"),
        (dict(output_type="jpeg"), "output_type"),
    ],
)
def test_bad_arguments_raise_clear_errors(pipe, kwargs, message):
    args = dict(height=HEIGHT, width=WIDTH, steps=2) | kwargs
    with pytest.raises(ValueError, match=message):
        pipe.generate("a cat", **args)


@pytest.mark.compiles
def test_bfloat16_is_finite_and_close_to_float32(reference, pipe):
    bf16 = Pipeline.from_pretrained(reference[0], dtype="bfloat16", max_steps=8)
    latents = _latents(2, seed=3)
    kwargs = dict(steps=3, guidance_scale=5.0, height=HEIGHT, width=WIDTH, latents=latents, output_type="np")
    low = bf16.generate(PROMPTS, NEGATIVES, **kwargs)
    full = pipe.generate(PROMPTS, NEGATIVES, **kwargs)
    error = np.abs(low - full).mean()
    print(f"bf16 vs fp32 mean abs diff: {error:.3e}")
    assert np.isfinite(low).all()
    assert error < 0.02


def test_parameter_shapes_are_cached_per_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = ModelSpec.from_folder(random_models.ensure_checkpoint("tiny"))
    traced = spec.abstract_params()
    assert len(list((tmp_path / "sdxl-jax" / "shapes").glob("*.json"))) == 4  # one per component

    def no_tracing(config):
        raise AssertionError("traced again")

    monkeypatch.setattr(unet, "abstract_params", no_tracing)
    cached = spec.abstract_params()
    assert jax.tree.map(lambda leaf: leaf.shape, cached) == jax.tree.map(lambda leaf: leaf.shape, traced)
    wider = dataclasses.replace(spec, unet=dataclasses.replace(spec.unet, cross_attention_dim=48))
    with pytest.raises(AssertionError, match="traced again"):  # another config is another entry
        wider.abstract_params()


@pytest.mark.compiles
def test_a_refiner_shares_the_weights_it_has_of_the_base(tmp_path):
    """The published SDXL refiner's VAE and second text encoder are the base's: the devices hold them
    once. A refiner with weights of its own keeps them, and sharing changes no image."""
    devices = jax.devices()[:1]
    base = Pipeline.from_pretrained("tiny", devices=devices)
    own = Pipeline.from_pretrained("tiny-refiner", devices=devices)
    base.set_refiner(own)
    assert own.params["vae"] is not base.params["vae"] and own.params["unet"] is not base.params["unet"]

    folder = tmp_path / "refiner"  # saved as diffusers saves a refiner built with the base's vae and text_encoder_2
    shutil.copytree(random_models.ensure_checkpoint("tiny-refiner"), folder)
    for component in ("vae", "text_encoder_2"):
        shutil.rmtree(folder / component)
        shutil.copytree(random_models.ensure_checkpoint("tiny") / component, folder / component)
    refiner = Pipeline.from_pretrained(str(folder), devices=devices)
    picture = np.asarray(jax.random.uniform(jax.random.key(0), (32, 32, 3)) * 255, np.uint8)
    before = refiner.generate("a cat", steps=3, image=picture, strength=0.6, output_type="np")
    executables = refiner.executables
    base.set_refiner(refiner)
    assert refiner.executables is executables, "each keeps its own compiled programs: a program names its model"
    assert refiner.params["vae"] is base.params["vae"]
    assert refiner.params["text_encoder_2"] is base.params["text_encoder_2"]
    assert refiner.params["unet"] is not base.params["unet"] and refiner.params_with(()) is refiner.params
    np.testing.assert_array_equal(refiner.generate("a cat", steps=3, image=picture, strength=0.6, output_type="np"),
                                  before)
