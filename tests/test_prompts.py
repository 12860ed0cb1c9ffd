"""Prompts as webui reads them, in images: ours against diffusers given the conditioning of the webui
oracle (tests/a1111_reference.py), for SDXL and SD 1.x; weights that never recompile; LoRA tags."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import a1111_reference as webui
from reference import diffusers_images, random_latents, sd_pipeline, sdxl_pipeline
from sdxl.checkpoints import lora
from sdxl.engine.compilation import CompileCounter
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.text_encoding import emphasized
from sdxl.engine.request import Request
from sdxl.prompts import syntax as prompt_syntax

HEIGHT, WIDTH, STEPS = 64, 96, 3
EMPHASIS_NAMES = {"original": "Original", "no-norm": "No norm", "none": "None"}
# The tiny models' tokenizer gives a token per character, "ab" two: 75 of them fill a chunk.
# 98 tokens, where the comma backtrack moves "dawn light" to the second chunk.
LONG = ", ".join(["a red fox"] * 10) + ", (snowy forest:1.2), dawn light"
MANY = " ".join(["(the quick:1.1) brown [fox]"] * 12)  # 4 chunks


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdxl-prompts")
    return sdxl_pipeline(folder), Pipeline.from_pretrained(folder, dtype="float32", max_steps=8)


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    """SD 1.x, its final layer norm's bias shifted: the random one averages about 0, and so would the
    states that "Original" emphasis divides by, amplifying float32 rounding a thousandfold (CLIP-L's
    real states average well away from 0)."""
    folder = tmp_path_factory.mktemp("sd1-prompts")
    ref = sd_pipeline(folder)
    with torch.no_grad():
        ref.text_encoder.final_layer_norm.bias += 0.5
    ref.text_encoder.save_pretrained(folder / "text_encoder", safe_serialization=True)
    return ref, Pipeline.from_pretrained(folder, dtype="float32", max_steps=8)


def _webui_images(ref, prompts, negatives, latents, emphasis) -> np.ndarray:
    """diffusers' images given webui's conditioning, image by image. A prompt and a negative prompt of k
    and j chunks are each repeated to lcm(k, j) chunks: attention over keys and values repeated alike is
    attention over them once, so this is what their separate passes give."""
    name = EMPHASIS_NAMES[emphasis]
    images = []
    for i, (prompt, negative) in enumerate(zip(prompts, negatives)):
        embeds = {}
        if hasattr(ref, "text_encoder_2"):
            encoders = (ref.tokenizer, ref.tokenizer_2), (ref.text_encoder, ref.text_encoder_2)
            (z, pooled), (neg, neg_pooled) = (webui.sdxl_conditioning(text, *encoders, name, negative=is_negative)
                                              for text, is_negative in ((prompt, False), (negative, True)))
            embeds = dict(pooled_prompt_embeds=pooled, negative_pooled_prompt_embeds=neg_pooled)
        else:
            z, neg = (webui.sd1_conditioning(text, ref.tokenizer, ref.text_encoder, name)
                      for text in (prompt, negative))
        common = math.lcm(z.shape[1], neg.shape[1])
        images.append(diffusers_images(
            ref, prompt_embeds=z.repeat(1, common // z.shape[1], 1), height=HEIGHT, width=WIDTH,
            negative_prompt_embeds=neg.repeat(1, common // neg.shape[1], 1), num_inference_steps=STEPS,
            guidance_scale=5.0, latents=torch.from_numpy(latents[i:i + 1]), **embeds,
        )[0])
    return np.stack(images)


def test_emphasis_keeps_each_chunks_mean_or_not():
    hidden = np.random.default_rng(0).normal(size=(3, 77, 16)).astype(np.float32) + 0.3
    weights = np.ones((3, 77), np.float32)
    weights[:2, 3:6] = [1.5, 0.5, 1.21]
    got = np.asarray(emphasized(jnp.asarray(hidden), jnp.asarray(weights), jnp.array([True, False, True])))
    original, no_norm, unweighted = got
    weighted = hidden[0] * weights[0, :, None]
    np.testing.assert_allclose(original.mean(), hidden[0].mean(), rtol=1e-5)
    np.testing.assert_allclose(original, weighted * (hidden[0].mean() / weighted.mean()), rtol=1e-5)
    assert not np.allclose(original, weighted) and not np.allclose(original, hidden[0])
    np.testing.assert_array_equal(no_norm, hidden[1] * weights[1, :, None])
    np.testing.assert_array_equal(unweighted, hidden[2]), "weights of 1 (emphasis 'none') change nothing"


def _chunk_sizes(pipe, text, backtrack) -> list[int]:
    """How many tokens each chunk of a prompt holds, with or without the comma backtrack."""
    tokenizer = pipe.prompts.tokenizers[0]

    def tokenize(texts):
        return tokenizer(texts, add_special_tokens=False).input_ids

    chunks = prompt_syntax.chunks(prompt_syntax.parse_weights(text), tokenize, backtrack=backtrack,
                                  comma_id=tokenizer.convert_tokens_to_ids(",</w>"), eos=tokenizer.eos_token_id)
    return [chunk.used for chunk in chunks]


def _chunks(pipe, text) -> int:
    ids, _ = pipe.prompts.read(text)
    return ids.shape[-1] // 77


# Each batch mixes prompts of different chunk counts, and prompts whose negative has another count.
BATCHES = {
    "weights, nesting, escapes": (
        ["a (red:1.3) ((fox)), [blurry] \\(not weighted\\), (sharp focus:0.8)", "a plain cat BREAK on a mat"],
        ["low quality, (watermark:1.2)", ""],
    ),
    "BREAK and a long prompt": (["a red fox BREAK in the (snow:1.4)", LONG], ["blurry", "[lowres] BREAK text"]),
    "four chunks against one": ([MANY, "a (cat:0.7)"], ["ugly BREAK dull BREAK flat", "(blurry:1.5)"]),
}


@pytest.mark.compiles
@pytest.mark.parametrize("emphasis", ["original", "no-norm", "none"])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_sdxl_reads_prompts_as_webui(sdxl, batch, emphasis):
    ref, pipe = sdxl
    prompts, negatives = BATCHES[batch]
    if batch == "BREAK and a long prompt":
        assert _chunk_sizes(pipe, LONG, backtrack=20) != _chunk_sizes(pipe, LONG, backtrack=0), "backtrack matters"
    latents = random_latents(len(prompts), HEIGHT, WIDTH, seed=3)
    expected = _webui_images(ref, prompts, negatives, latents, emphasis)
    got = pipe.generate(prompts, negatives, steps=STEPS, guidance_scale=5.0, height=HEIGHT, width=WIDTH,
                        latents=latents, emphasis=emphasis, output_type="np")
    difference = np.abs(got - expected).max()
    print(f"{batch}, {emphasis}: max abs difference {difference:.2e}")
    assert expected.std() > 0.05 and difference <= 1e-4
    assert {_chunks(pipe, p) for p in prompts + negatives} != {1}, "the batch must mix chunk counts"


@pytest.mark.compiles
def test_sd1_reads_prompts_as_webui(sd1):
    ref, pipe = sd1
    prompts = ["a (red:1.3) fox BREAK [snow]", LONG]
    negatives = ["(blurry:1.2)", "lowres BREAK watermark BREAK text"]
    latents = random_latents(2, HEIGHT, WIDTH, seed=4)
    expected = _webui_images(ref, prompts, negatives, latents, "original")
    got = pipe.generate(prompts, negatives, steps=STEPS, guidance_scale=5.0, height=HEIGHT, width=WIDTH,
                        latents=latents, output_type="np")
    assert expected.std() > 0.05 and np.abs(got - expected).max() <= 1e-4


@pytest.mark.compiles
def test_a_prompt_gives_its_images_whatever_its_batch(sdxl):
    """A short prompt merged with a long one is padded and masked, not changed (webui would pad it with
    empty chunks, which changes it). Two chunks and three (compiled as four), two images each, with given noise:
    the programs of the webui comparisons above, so that this test compiles none of its own."""
    _, pipe = sdxl
    noise = random_latents(4, HEIGHT, WIDTH, seed=5).transpose(0, 2, 3, 1)
    short = Request.from_prompt("a (red:1.2) fox BREAK snow", "blur", num_images=2, guidance_scale=5.0,
                                steps=STEPS, height=HEIGHT, width=WIDTH, noise=noise[:2])
    long = dataclasses.replace(short, prompts=(MANY,) * 2, noise=noise[2:])
    assert [_chunks(pipe, p) for p in (short.prompts[0], MANY)] == [2, 3]
    merged = pipe.render(Request.merged([short, long]), output_type="np").images
    np.testing.assert_allclose(merged[:2], pipe.render(short, output_type="np").images, atol=1e-5)
    np.testing.assert_allclose(merged[2:], pipe.render(long, output_type="np").images, atol=1e-5)


@pytest.mark.compiles
def test_changing_weights_never_recompiles(sdxl):
    _, pipe = sdxl
    settings = dict(steps=2, height=HEIGHT, width=WIDTH, num_images=4)
    first = pipe.generate("a (red:1.2) fox, snow", **settings, output_type="np")
    with CompileCounter() as compiles:
        again = pipe.generate("a (red:0.6) fox, [snow]", "(blurry:1.4)", **settings, output_type="np")
        pipe.generate("a red fox, snow", **settings, emphasis="no-norm", output_type="np")
    assert compiles.count == 0 and np.abs(first - again).max() > 1e-3


def test_prompts_over_the_limit_or_with_wild_weights_are_refused(sdxl):
    _, pipe = sdxl
    with pytest.raises(ValueError, match="the prompt is 900 tokens in 12 chunks of 75, over the limit of 8 chunks"):
        pipe.generate("ab " * 450, steps=1, height=HEIGHT, width=WIDTH)
    with pytest.raises(ValueError, match="the weight 12 on 'fox' in the negative prompt is outside -10 to 10"):
        pipe.generate("a fox", "(fox:12)", steps=1, height=HEIGHT, width=WIDTH)
    assert pipe.prompts.length_text("ab " * 450) == "900 tokens, 12 chunks (at most 8)"


def test_lora_tags_apply_their_lora_for_that_request_only(sdxl, tmp_path):
    _, pipe = sdxl
    style = lora.write_random(tmp_path / "style.safetensors", pipe.spec)
    pipe.set_loras({str(style): 1.0})
    try:
        request = Request.from_prompt("a red fox", num_images=4, seed=2, steps=2, height=HEIGHT, width=WIDTH)
        tagged = pipe.prepare(dataclasses.replace(request, prompts=("a red fox<lora:style:0.5>",) * 4),
                              output_type="np")
        assert tagged.request.loras == ((str(style), 0.5),), "the tag's scale replaces the one set"
        expected = pipe.render(dataclasses.replace(request, loras=((str(style), 0.5),)), output_type="np").images
        np.testing.assert_allclose(pipe.render(tagged).images, expected, atol=1e-5)
        assert pipe.loras == {str(style): 1.0}, "rendering never changes the active LoRAs"
        untagged = pipe.render(request, output_type="np").images
        assert np.abs(untagged - expected).mean() > 1e-3, "the next request has the active ones"
        twice = pipe.prepare(dataclasses.replace(request, prompts=("<lora:style> <lora:style:0.5> a fox",) * 4))
        assert twice.request.loras == ((str(style), 1.5),), "a LoRA tagged twice applies twice, as in webui"
        with pytest.raises(ValueError, match="the prompt names the LoRA 'ink', which is not loaded; the loaded "
                                             "ones: style"):
            pipe.prepare(dataclasses.replace(request, prompts=("a fox <lora:ink:1>",) * 4))
        with pytest.raises(ValueError, match="name different LoRA tags"):
            pipe.prepare(dataclasses.replace(request, prompts=("a <lora:style:1>", "a", "a", "a")))
    finally:
        pipe.set_loras({})
