"""The webui oracle (tests/a1111_reference.py) checked on its own, then held against sdxl.prompts.syntax, and
against the program's text encoding under clip skip (on tiny random SD 1.x and SDXL pipelines).

Tiny random CLIP encoders stand in for the real ones; the tokenizers are the real SDXL ones.
"""

import copy
import dataclasses
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

import a1111_reference as ref
from reference import sd_pipeline, sdxl_pipeline
from sdxl import Pipeline
from sdxl.engine.inputs import clip_layers
from sdxl.engine.text_encoding import emphasized, encode_text
from sdxl.engine.request import Request
from sdxl.models import clip
from sdxl.prompts import syntax as ps

CONFIGS = Path(__file__).parents[1] / "sdxl" / "configs" / "sdxl-base-1.0"
WEBUI_EMPHASIS = ps.A1111_EMPHASIS_NAMES  # ours -> webui's


def tiny_config(hidden_size: int) -> CLIPTextConfig:
    return CLIPTextConfig(vocab_size=49408, hidden_size=hidden_size, intermediate_size=37, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=77, projection_dim=24)


@pytest.fixture(scope="module")
def sdxl():
    """(tokenizers, models) like SDXL's: CLIP-L-like and OpenCLIP-G-like, with different widths."""
    tokenizers = (CLIPTokenizer.from_pretrained(str(CONFIGS / "tokenizer")),
                  CLIPTokenizer.from_pretrained(str(CONFIGS / "tokenizer_2")))
    torch.manual_seed(0)
    models = (CLIPTextModel(tiny_config(32)).eval(), CLIPTextModelWithProjection(tiny_config(40)).eval())
    return tokenizers, models


def plain_encoding(prompt, tokenizers, models):
    """The diffusers-style reading: one 77-token window per encoder, penultimate layer, pooled from the second."""
    zs, pooled = [], None
    with torch.no_grad():
        for tokenizer, model in zip(tokenizers, models):
            ids = tokenizer(prompt, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
            out = model(input_ids=ids, output_hidden_states=True)
            zs.append(out.hidden_states[-2])
            pooled = getattr(out, "text_embeds", pooled)
    return torch.cat(zs, dim=-1), pooled


# --- the oracle on its own ---

def test_oracle_parse_matches_webui_documented_examples():
    assert ref.parse_prompt_attention("an (important) word") == [["an ", 1.0], ["important", 1.1], [" word", 1.0]]
    assert ref.parse_prompt_attention(r"\(literal\]") == [["(literal]", 1.0]]
    assert ref.parse_prompt_attention("(unnecessary)(parens)") == [["unnecessaryparens", 1.1]]
    assert ref.parse_prompt_attention("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).") == [
        ["a ", 1.0], ["house", 1.5730000000000004], [" ", 1.1], ["on", 1.0], [" a ", 1.1], ["hill", 0.55],
        [", sun, ", 1.1], ["sky", 1.4641000000000006], [".", 1.1]]


def test_oracle_plain_prompt_is_the_plain_77_token_encoding(sdxl):
    tokenizers, models = sdxl
    prompt = "a photo of a red fox, jumping over a lazy dog"
    z, pooled = ref.sdxl_conditioning(prompt, tokenizers, models)
    plain_z, plain_pooled = plain_encoding(prompt, tokenizers, models)
    assert z.shape == (1, 77, 32 + 40) and pooled.shape == (1, 24)
    torch.testing.assert_close(z, plain_z, rtol=0, atol=1e-6)
    torch.testing.assert_close(pooled, plain_pooled, rtol=0, atol=0)


def test_oracle_sd1_uses_the_last_hidden_state(sdxl):
    (tokenizer, _), (model, _) = sdxl
    # Its final layer norm's bias shifted, as `tiny_pipelines`' SD 1.x: the random one centres every token's
    # states, and "Original" emphasis divides their mean by itself, 0 / 0 where torch's default CPU kernels
    # (ATEN_CPU_CAPABILITY=default) sum them to 0.
    model = copy.deepcopy(model)
    with torch.no_grad():
        getattr(model, "text_model", model).final_layer_norm.bias += 0.5
    z = ref.sd1_conditioning("a red fox", tokenizer, model)
    with torch.no_grad():
        ids = tokenizer("a red fox", padding="max_length", max_length=77, return_tensors="pt").input_ids
        expected = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(z, expected, rtol=0, atol=1e-6)


def test_oracle_weight_one_is_no_weight(sdxl):
    tokenizers, models = sdxl
    z, pooled = ref.sdxl_conditioning("a (fox:1.0) in snow", tokenizers, models)
    plain_z, plain_pooled = ref.sdxl_conditioning("a fox in snow", tokenizers, models)
    torch.testing.assert_close(z, plain_z, rtol=0, atol=0)
    torch.testing.assert_close(pooled, plain_pooled, rtol=0, atol=0)


def test_oracle_original_emphasis_keeps_the_chunk_mean(sdxl):
    tokenizers, models = sdxl
    unweighted, _ = ref.sdxl_conditioning("a red fox in snow", tokenizers, models)
    weights = torch.ones(77)
    weights[2] = 1.4  # "red"
    for model, tokenizer, features in zip(models, tokenizers, (slice(0, 32), slice(32, 72))):
        base = ref.encode("a red fox in snow", tokenizer, model, "penultimate")[0]
        torch.testing.assert_close(base, unweighted[..., features])
        original = ref.encode("a (red:1.4) fox in snow", tokenizer, model, "penultimate", "Original")[0]
        no_norm = ref.encode("a (red:1.4) fox in snow", tokenizer, model, "penultimate", "No norm")[0]
        torch.testing.assert_close(original.mean(), base.mean(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(no_norm, base * weights[None, :, None])
        torch.testing.assert_close(original, no_norm * (base.mean() / no_norm.mean()))
        assert not torch.allclose(no_norm.mean(), base.mean(), rtol=1e-4)


def test_oracle_pooled_is_unweighted_from_the_first_chunk(sdxl):
    tokenizers, models = sdxl
    _, pooled = ref.sdxl_conditioning("a (red:1.5) fox BREAK (snow:0.5)", tokenizers, models)
    _, plain_pooled = plain_encoding("a red fox", tokenizers, models)
    torch.testing.assert_close(pooled, plain_pooled, rtol=0, atol=0)


def test_oracle_long_prompt_is_chunks_side_by_side(sdxl):
    tokenizers, models = sdxl
    first = ", ".join(["a red fox"] * 18)  # 71 tokens
    second = "snowy forest at dawn"
    z, _ = ref.sdxl_conditioning(f"{first} BREAK {second}", tokenizers, models)
    assert z.shape == (1, 154, 72)
    torch.testing.assert_close(z[:, :77], plain_encoding(first, tokenizers, models)[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(z[:, 77:], plain_encoding(second, tokenizers, models)[0], rtol=0, atol=1e-6)


def test_oracle_empty_negative_prompt_is_zeros(sdxl):
    tokenizers, models = sdxl
    z, pooled = ref.sdxl_conditioning("", tokenizers, models, negative=True)
    assert z.shape == (1, 77, 72) and not z.any() and pooled.shape == (1, 24) and not pooled.any()
    z, pooled = ref.sdxl_conditioning("", tokenizers, models)  # an empty positive prompt is encoded
    assert z.any() and pooled.any()


def test_oracle_none_emphasis_reads_the_prompt_literally(sdxl):
    tokenizers, models = sdxl
    prompt = "a (red:1.5) fox BREAK [snow]"
    z, _ = ref.sdxl_conditioning(prompt, tokenizers, models, emphasis="None")
    torch.testing.assert_close(z, plain_encoding(prompt, tokenizers, models)[0], rtol=0, atol=1e-6)


# --- sdxl.prompts.syntax against the oracle ---

def ours(prompt, tokenizers, models, emphasis="original", negative=False):
    """The conditioning built from sdxl.prompts.syntax's chunks and the program's `emphasized`, with the torch
    encoders."""
    tokenizer = tokenizers[0]
    tokenize = lambda texts: tokenizer(texts, truncation=False, add_special_tokens=False)["input_ids"]  # noqa: E731
    chunk_list = ps.prompt_chunks(prompt, tokenize, comma_id=tokenizer.get_vocab()[",</w>"],
                                  eos=tokenizer.eos_token_id, emphasis=emphasis)
    per_encoder, pooled = [], None
    for tokenizer, model in zip(tokenizers, models):
        outputs = []
        for i, chunk in enumerate(chunk_list):
            ids, weights = ps.encoder_ids(chunk, bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id,
                                          pad=tokenizer.pad_token_id)
            with torch.no_grad():
                out = model(input_ids=torch.from_numpy(ids)[None].long(), output_hidden_states=True)
            hidden = jnp.asarray(out.hidden_states[-2].numpy())
            rescale = jnp.array([emphasis == "original"])
            outputs.append(np.asarray(emphasized(hidden, jnp.asarray(weights[None]), rescale))[0])
            if i == 0 and hasattr(out, "text_embeds"):
                pooled = out.text_embeds.numpy()
        per_encoder.append(np.concatenate(outputs, axis=0))
    z = np.concatenate(per_encoder, axis=-1)[None]
    if negative and prompt == "":
        return np.zeros_like(z), np.zeros_like(pooled)
    return z, pooled


PARITY_PROMPTS = [
    "",
    "a photo of a red fox",
    "a (red:1.3) fox, ((snow)), [blur], (dramatic lighting:0.8)",
    r"\(literal\) (fox:abc) stray ) and ] (unbalanced",
    "BREAK leading break",
    "two BREAK BREAK breaks BREAK",
    "(inside BREAK brackets)",
    "(un)believable [mix(ed]) (a [b) c]",
    ", ".join(["masterpiece", "best quality", "(a fox in a snowy forest:1.2)", "dramatic lighting",
               "highly detailed fur", "[cinematic composition]", "soft focus background", "volumetric fog"] * 3),
    " ".join(f"word{i}" for i in range(160)) + ", end (of:1.1) it",
]


@pytest.mark.parametrize("emphasis", ps.EMPHASIS_MODES)
@pytest.mark.parametrize("prompt", PARITY_PROMPTS)
def test_prompt_syntax_matches_the_oracle(sdxl, prompt, emphasis):
    tokenizers, models = sdxl
    expected_z, expected_pooled = ref.sdxl_conditioning(prompt, tokenizers, models, emphasis=WEBUI_EMPHASIS[emphasis])
    z, pooled = ours(prompt, tokenizers, models, emphasis)
    assert z.shape == tuple(expected_z.shape)
    np.testing.assert_allclose(z, expected_z.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(pooled, expected_pooled.numpy())


def test_prompt_syntax_matches_the_oracle_on_an_empty_negative_prompt(sdxl):
    tokenizers, models = sdxl
    expected_z, expected_pooled = ref.sdxl_conditioning("", tokenizers, models, negative=True)
    z, pooled = ours("", tokenizers, models, negative=True)
    np.testing.assert_array_equal(z, expected_z.numpy())
    np.testing.assert_array_equal(pooled, expected_pooled.numpy())


FRAGMENTS = ["fox", "red", "snow", "un", "believable", ",", ", ", " ", "(", ")", "[", "]", ":1.3)", ": 0.5 )", ":",
             ":abc", "\\(", "\\)", "\\[", "\\]", "\\\\", "\\", " BREAK ", "BREAK", "break", "a", "of", "the"]


def random_prompt(rng: random.Random) -> str:
    length = rng.choice([rng.randint(0, 12), rng.randint(20, 90), rng.randint(150, 260)])
    return "".join(rng.choice(FRAGMENTS) if rng.random() < 0.6 else f" w{rng.randint(0, 99)}" for _ in range(length))


def test_parsing_and_chunking_match_the_oracle_on_random_prompts(sdxl):
    (tokenizer, tokenizer_2), _ = sdxl
    rng = random.Random(0)
    for _ in range(300):
        prompt = random_prompt(rng)
        assert ps.parse_weights(prompt) == [tuple(piece) for piece in ref.parse_prompt_attention(prompt)], prompt
        for emphasis in ("original", "none"):
            for tok in (tokenizer, tokenizer_2):
                expected, expected_count = ref.tokenize_line(prompt, tok, WEBUI_EMPHASIS[emphasis])
                chunk_list = ps.chunks(
                    ps.prompt_pieces(prompt, emphasis),
                    lambda texts, tok=tok: tok(texts, truncation=False, add_special_tokens=False)["input_ids"],
                    comma_id=267, eos=tok.eos_token_id)
                framed = [ps.encoder_ids(chunk, bos=tok.bos_token_id, eos=tok.eos_token_id, pad=tok.eos_token_id)
                          for chunk in chunk_list]
                assert [ids.tolist() for ids, _ in framed] == [tokens for tokens, *_ in expected], prompt
                expected_weights = [np.asarray(m, np.float32).tolist() for _, m, _ in expected]
                assert [w.tolist() for _, w in framed] == expected_weights, prompt
                assert ps.token_count(chunk_list) == expected_count, prompt


# --- clip skip: the program's text encoding (`encode_text` on `clip_layers`) against the oracle ---

CLIP_SKIP_PROMPT = "a (red:1.3) fox in the snow BREAK [blurry] background"


@pytest.fixture(scope="module")
def tiny_pipelines(tmp_path_factory):
    """{"sd1": ..., "sdxl": ...}: (our pipeline, the diffusers pipeline it was saved from), tiny and random.

    SD 1.x's final layer norm has its bias shifted, as tests/test_prompts.py's: the random one centres every
    token's states, so a chunk's mean, which "Original" emphasis divides by, is up to 490 times smaller than
    its states and carries the float32 rounding of its sum as many times over: its rescale of a chunk moved
    by 1.5e-5 between summation orders (vector widths), 2.6e-5 with XLA built for AVX without FMA. CLIP-L's
    real states average well away from 0."""
    made = {}
    for family, write in (("sd1", sd_pipeline), ("sdxl", sdxl_pipeline)):
        folder = tmp_path_factory.mktemp(family)
        theirs = write(folder)
        if family == "sd1":
            with torch.no_grad():
                theirs.text_encoder.final_layer_norm.bias += 0.5
            theirs.text_encoder.save_pretrained(folder / "text_encoder", safe_serialization=True)
        made[family] = Pipeline.from_pretrained(folder, dtype="float32", max_steps=4), theirs
    return made


def program_context(pipe, prompt: str, **settings) -> np.ndarray:
    """[1, 77k, D] the program's conditioning of `prompt` under a request's clip skip settings, compiled."""
    request = dataclasses.replace(Request.from_prompt(prompt, num_images=1, height=64, width=64), **settings)
    tokens = pipe.prompts.tokens([prompt], [""])
    layers = clip_layers(pipe.spec, request)
    layer = np.array([[skip for skip, _ in layers]], np.int32)
    norm = np.array([[normed for _, normed in layers]])
    encode = jax.jit(encode_text, static_argnums=(0, 7))
    context, _ = encode(pipe.spec, pipe.params, tokens.ids[:, 1, 0], tokens.weights[:, 1, 0], tokens.rescale, layer,
                        norm, jnp.float32)  # the prompt's one conditioning
    return np.asarray(context)


@pytest.mark.parametrize("clip_skip", [1, 2, 3])  # 3: the tiny encoder's 2 layers back to its embeddings
def test_sd1_clip_skip_matches_the_oracle(tiny_pipelines, clip_skip):
    pipe, theirs = tiny_pipelines["sd1"]
    expected = ref.sd1_conditioning(CLIP_SKIP_PROMPT, theirs.tokenizer, theirs.text_encoder, clip_skip=clip_skip)
    # The oracle's float32 states are within 1.3e-6 of its float64 ones (states up to 4.7, chunk means near 0.5),
    # ours within 1.7e-6 of its, however XLA (AVX-512, AVX without FMA, SSE4.2) and torch (AVX-512, AVX2,
    # default kernels) are built: an 8-fold margin. A wrong layer or weight is 1e-2 and more away.
    np.testing.assert_allclose(program_context(pipe, CLIP_SKIP_PROMPT, clip_skip=clip_skip), expected.numpy(),
                               rtol=1e-5, atol=1e-5)
    if clip_skip > 1:  # and the skip changed something
        default = ref.sd1_conditioning(CLIP_SKIP_PROMPT, theirs.tokenizer, theirs.text_encoder)
        assert np.abs(expected.numpy() - default.numpy()).max() > 0.1


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_the_default_reads_the_familys_state_to_the_bit(tiny_pipelines, family):
    """Clip skip 1 is SD 1.x's last hidden state and SDXL's penultimate ones, weighted, computed as before it."""
    pipe, _ = tiny_pipelines[family]
    tokens = pipe.prompts.tokens([CLIP_SKIP_PROMPT], [""])
    ids, weights, rescale = tokens.ids[:, 1, 0], tokens.weights[:, 1, 0], tokens.rescale
    chunks = ids.shape[-1] // 77

    def family_state(params):
        states = []
        for e, (name, config) in enumerate(zip(pipe.spec.text_encoder_names, pipe.spec.text_encoders)):
            out = clip.CLIPTextModel(config).apply({"params": params[name]}, ids[:, e].reshape(chunks, 77))
            state = out.hidden_states[-2] if family == "sdxl" else out.last_hidden_state
            states.append(emphasized(state, weights[:, e].reshape(chunks, 77), np.repeat(rescale, chunks)))
        return jnp.concatenate(states, axis=-1).reshape(1, chunks * 77, -1)

    np.testing.assert_array_equal(program_context(pipe, CLIP_SKIP_PROMPT), jax.jit(family_state)(pipe.params))


@pytest.mark.parametrize("clip_skip", [1, 2, 3])
@pytest.mark.parametrize("sdxl_clip_l_skip", [False, True])
def test_sdxl_clip_skip_applies_to_clip_l_only_with_its_setting(tiny_pipelines, clip_skip, sdxl_clip_l_skip):
    pipe, theirs = tiny_pipelines["sdxl"]
    encoders = (theirs.tokenizer, theirs.tokenizer_2), (theirs.text_encoder, theirs.text_encoder_2)
    expected, _ = ref.sdxl_conditioning(CLIP_SKIP_PROMPT, *encoders, clip_skip=clip_skip,
                                        sdxl_clip_l_skip=sdxl_clip_l_skip)
    ours = program_context(pipe, CLIP_SKIP_PROMPT, clip_skip=clip_skip, sdxl_clip_l_skip=sdxl_clip_l_skip)
    np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-5, atol=1e-5)
    default, _ = ref.sdxl_conditioning(CLIP_SKIP_PROMPT, *encoders)
    width = theirs.text_encoder.config.hidden_size
    changed = np.abs(expected.numpy() - default.numpy()).max(axis=(0, 1)) > 1e-3  # per feature
    # Without the setting, or at skip 2 (SDXL's own penultimate layer), nothing changes; else CLIP-L's
    # features alone, and OpenCLIP-G's never.
    assert changed[:width].any() == (sdxl_clip_l_skip and clip_skip != 2)
    assert not changed[width:].any()


def test_sd2_ignores_clip_skip_as_webui(tiny_pipelines):
    pipe, _ = tiny_pipelines["sd1"]
    openclip = dataclasses.replace(pipe.spec.text_encoders[0], hidden_act="gelu")  # SD 2.x's OpenCLIP ViT-H
    sd2 = dataclasses.replace(pipe.spec, text_encoders=(openclip,))
    request = dataclasses.replace(Request.from_prompt("a fox", num_images=1, height=64, width=64), clip_skip=2)
    assert clip_layers(sd2, request) == ((1, True),)
    assert clip_layers(pipe.spec, request) == ((2, True),)
