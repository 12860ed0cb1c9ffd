"""The demo's requests, built from a visitor's settings without a server (`sdxl.serving.demo`)."""

import numpy as np
import pytest
import safetensors.numpy
from PIL import Image

from sdxl.serving.models import Model
from sdxl.checkpoints import lora
from sdxl.engine.hires import Hires
from sdxl.engine.pipeline import Pipeline
from sdxl.engine.request import MAX_SEED
from sdxl.prompts.styles import STYLES
from sdxl.serving import results
from sdxl.serving.demo import DemoService
from sdxl.serving.forms import COMPARE_SEEDS, Settings, fit_to_sizes, lora_parameters


@pytest.fixture(scope="module")
def pipe():
    return Pipeline.from_pretrained("tiny", dtype="float32")


@pytest.fixture(scope="module")
def service(pipe, tmp_path_factory):
    folder = tmp_path_factory.mktemp("loras")
    loras = {str(lora.write_random(folder / name, pipe.spec, seed=i)): scale
             for i, (name, scale) in enumerate((("ink.safetensors", 0.8), ("glow.safetensors", 1.0)))}
    return DemoService([Model("tiny", pipe, loras=loras)], max_images_per_core=2)


def test_form_fields_arrive_by_name_and_lora_scales_by_their_parameters(service):
    assert service.lora_parameters == ["lora_ink", "lora_glow"]
    settings = service.settings({"prompt": "a fox", "seed": "7", "lora_glow": 0.5, "lora_ink": 0.25, "steps": 3})
    assert (settings.prompt, settings.seed, settings.steps) == ("a fox", "7", 3)
    assert settings.lora_scales == (0.25, 0.5), "in launch order, whatever the form's order"
    assert service.settings({"prompt": "a fox"}).lora_scales is None
    assert lora_parameters(["a/x.safetensors", "b/x.safetensors", "c/y-z.safetensors"]) == ["lora_x_0", "lora_x_1",
                                                                                          "lora_y_z"]


def test_images_are_one_per_core_with_the_style_loras_and_first_size(service, pipe):
    request = service.images(Settings(prompt="a fox", negative_prompt="blur", style="Cinematic", seed=5,
                                      images_per_core=2, lora_scales=(0.25, 0.0))).request
    assert len(request) == 2 * pipe.num_devices
    assert request.seeds == (5,) * 8 and request.image_index == tuple(range(8))
    assert request.prompts[0] == STYLES["Cinematic"].apply("a fox", "blur")[0]
    assert request.negative_prompts[0].endswith("blur")
    assert (request.width, request.height) == service.sizes[0]
    ink = next(source for source in service.loras if source.endswith("ink.safetensors"))
    assert request.loras == ((ink, 0.25),), "a scale of 0 leaves its LoRA out"
    assert service.images(Settings(prompt="a fox")).request.loras == tuple(sorted(service.loras.items()))


@pytest.mark.parametrize("settings, message", [
    (Settings(prompt="  "), "please enter a prompt"),
    (Settings(prompt="a fox", style="Baroque"), "unknown style 'Baroque'"),
    (Settings(prompt="a fox", images_per_core=3), "images per core must be an integer from 1 to 2"),
    (Settings(prompt="a fox", width=100, height=100), "height must be a multiple of 16"),
    (Settings(prompt="a fox", width=96, height=64), "size 96x64 is not one of this model's sizes"),
    (Settings(prompt="a fox", lora_scales=(1.0,)), "give one LoRA scale per LoRA"),
    (Settings(prompt="a fox", lora_scales=(9, 1)), "must be a number from -4 to 4, got 9"),
    (Settings(prompt="a fox", refine=True), "no refiner is loaded"),
    (Settings(prompt=["a", "list"]), "prompt must be text, got list"),
])
def test_bad_settings_are_refused_with_a_sentence_naming_them(service, settings, message):
    with pytest.raises(ValueError, match=message):
        service.images(settings)


def test_an_image_edit_is_fitted_to_the_nearest_size_with_its_mask(service):
    picture = Image.new("RGB", (300, 200), "red")
    painted = Image.new("L", (300, 200), 0)
    painted.paste(255, (0, 0, 150, 200))
    prepared, note = service.image_edit(Settings(prompt="a fox"), picture, painted, 0.6)
    request = prepared.request
    width, height = fit_to_sizes(picture, service.sizes)[1]
    assert (request.width, request.height) == (width, height) and request.images.shape[1:3] == (height, width)
    assert note.startswith("the image was 300x200; cropped and resized")
    assert request.strength == 0.6 and request.masks.shape == (len(request), height, width)
    assert request.masks[:, :, : width // 3].all() and not request.masks[:, :, -width // 3:].any()
    with pytest.raises(ValueError, match="the mask is 10x10, the image 300x200"):
        service.image_edit(Settings(prompt="a fox"), picture, Image.new("L", (10, 10)), 0.6)
    with pytest.raises(ValueError, match="strength must be a number from 0 to 1"):
        service.image_edit(Settings(prompt="a fox"), picture, None, 2)
    with pytest.raises(ValueError, match="upload an image"):
        service.image_edit(Settings(prompt="a fox"), None, None, 0.5)


def test_comparisons_share_the_starting_noise_or_step_through_seeds(service):
    prompts = service.prompt_comparison(Settings(seed=3, style="Anime"), ["a fox", "", "a cat"]).request
    assert prompts.prompts == tuple(STYLES["Anime"].apply(p, "")[0] for p in ("a fox", "a cat"))
    assert prompts.seeds == (3, 3) and prompts.image_index == (0, 0)
    with pytest.raises(ValueError, match="enter from 1 to 8 prompts"):
        service.prompt_comparison(Settings(), ["x"] * 9)
    seeds = service.seed_comparison(Settings(prompt="a fox", seed=10), 3).request
    assert seeds.seeds == (10, 11, 12) and seeds.image_index == (0, 0, 0)
    with pytest.raises(ValueError, match=f"go past {MAX_SEED}"):
        service.seed_comparison(Settings(prompt="a fox", seed=MAX_SEED), 2)


def test_a_grid_plans_its_cells_into_as_few_device_calls_as_fit(service):
    settings = Settings(prompt="a red fox", seed=1, steps=2)
    plan = service.grid(settings, "seed", "1-3", "prompt", "red, blue")
    assert len(plan.where) == 6 and len(plan.requests) == 1, "prompts and seeds are per-image: one call"
    cells = [plan.requests[call].request.prompts[index] for call, index in plan.where]
    assert cells == ["a red fox"] * 3 + ["a blue fox"] * 3
    assert [plan.requests[0].request.seeds[index] for _, index in plan.where] == [1, 2, 3] * 2

    by_scale = service.grid(settings, "lora:ink", "0, 0.5", "steps", "2, 3")
    assert len(by_scale.requests) == 4, "steps and LoRA scales change the call"
    loras = {call.request.loras for call in by_scale.requests}
    assert len(loras) == 2 and any(all("ink" not in source for source, _ in set_) for set_ in loras)
    by_schedule = service.grid(settings, "sampler", "Euler a, DPM++ 2M SDE", "schedule_type", "Karras, Exponential")
    assert len(by_schedule.requests) == 4 and by_schedule.y.labels == ("Karras", "Exponential")
    assert {(call.request.sampler, call.request.schedule_type) for call in by_schedule.requests} == {
        ("euler_ancestral", "Karras"), ("euler_ancestral", "Exponential"), ("dpmpp_2m_sde", "Karras"),
        ("dpmpp_2m_sde", "Exponential")}
    by_sampler = service.grid(settings, "sampler", "Euler, DPM++ 2M SDE", None, "")
    assert [call.request.schedule_type for call in by_sampler.requests] == ["diffusers", "Automatic"], (
        "with the default schedule type each sampler gets its own")
    with pytest.raises(ValueError, match="DDIM runs on diffusers' schedule only, not on the Karras schedule type"):
        service.grid(settings, "sampler", "Euler, DDIM", "schedule_type", "Karras")
    with pytest.raises(ValueError, match="both seed"):
        service.grid(settings, "seed", "1, 2", "seed", "3")
    with pytest.raises(ValueError, match="unknown axis 'lora:nope'"):
        service.grid(settings, "lora:nope", "1", None, "")


def test_emphasis_reaches_the_request_and_prompt_boxes_count_their_chunks(service):
    assert service.images(Settings(prompt="a (fox:1.2)", emphasis="no-norm")).request.emphasis == "no-norm"
    with pytest.raises(ValueError, match="emphasis"):
        service.images(Settings(prompt="a fox", emphasis="strong"))
    assert service.prompt_length("a fox <lora:ink:0.5>") == service.prompt_length("a fox"), "a tag is not text"
    assert service.prompt_length("a fox BREAK snow").endswith("tokens, 2 chunks")
    assert service.prompt_length("ab " * 450) == "900 tokens, 12 chunks (at most 8)"
    assert service.prompt_length("a fox", "strong") == "", "not a mode: nothing to show"


def test_prompt_search_and_replace_keeps_weights_and_prompts_of_other_lengths_share_a_call(service, pipe):
    settings = Settings(prompt="a (red:1.2) fox, [snow]", seed=1, steps=2, emphasis="no-norm")
    plan = service.grid(settings, "prompt", "red\nblue", "seed", "1, 2")
    assert [plan.requests[call].request.prompts[index] for call, index in plan.where][:2] == [
        "a (red:1.2) fox, [snow]", "a (blue:1.2) fox, [snow]"]
    plan = service.grid(settings, "prompt", "snow\nsnow] BREAK [dawn", None, "")
    cells = [plan.requests[call].request.prompts[index] for call, index in plan.where]
    assert cells == ["a (red:1.2) fox, [snow]", "a (red:1.2) fox, [snow] BREAK [dawn]"]
    (call,) = plan.requests
    assert call.request.emphasis == "no-norm" and call.tokens.chunks[:, 1, 0].tolist() == [1, 2]


def test_a_click_builds_its_submission_once_for_the_check_and_the_handler(service, monkeypatch):
    built, submission = [], service.submission
    monkeypatch.setattr(service, "submission", lambda tab, form: built.append(tab) or submission(tab, form))
    form = {"prompt": "a fox", "steps": 2, "seed": 1}
    service.check("generate", "me", form)
    kept = service.checked("generate", "me", form)
    assert built == ["generate"] and kept.calls[0].request.seeds[0] == 1, "the check's build, rendered as it is"
    assert service.checked("generate", "me", form) is not kept and len(built) == 2, "taken once; a raw call builds"
    service.check("generate", "me", form)
    other = service.checked("generate", "me", form | {"seed": 2})  # another click's form came between
    assert other.calls[0].request.seeds[0] == 2 and len(built) == 4
    with pytest.raises(ValueError, match="please enter a prompt"):
        service.check("generate", "me", {"prompt": ""})
    compared = service.submission("compare", {"mode": COMPARE_SEEDS, "prompts": "a fox", "seed": 5, "num_seeds": 2})
    assert compared.calls[0].request.seeds == (5, 6) and compared.grid is None
    with pytest.raises(ValueError, match="no tab 'paint'"):
        service.submission("paint", {})


def test_an_a1111_text_fills_in_the_noise_and_says_what_it_leaves_out(service):
    """Reuse of A1111's parameters: its sampler and schedule type, RNG, ENSD, variation seed and hires
    fix reach the form (and so the request), the model is named as not used, and what the text leaves
    out is reset."""
    text = ("a fox\nNegative prompt: blur\nSteps: 20, Sampler: DPM++ 2M SDE, Schedule type: Karras, CFG scale: 7, "
            "Seed: 42, Size: 128x128, Model: juggernautXL, Variation seed: 9, Variation seed strength: 0.5, "
            "ENSD: 31337, RNG: CPU, Hires upscale: 2")
    fields, said = service.reused(text)
    assert {k: fields[k] for k in ("seed", "sampler", "schedule_type", "noise_source", "ensd", "variation_seed",
                                   "variation_strength")} == dict(
        seed=42, sampler="dpmpp_2m_sde", schedule_type="Karras", noise_source="cpu", ensd=31337, variation_seed=9,
        variation_strength=0.5)
    assert "sampler DPM++ 2M SDE, schedule type Karras," in said
    assert said.endswith("noise CPU (A1111's CPU, ComfyUI, diffusers), ENSD 31337, variation seed 9, variation "
                         "strength 0.5, the hires fix (Latent, 2x). Not used: Model juggernautXL (loaded: tiny)"), said
    request = service.images(service.settings(fields)).request
    assert (request.sampler, request.schedule_type, request.noise_source, request.ensd, request.variation_seed,
            request.variation_strength) == ("dpmpp_2m_sde", "Karras", "cpu", 31337, 9, 0.5)
    assert request.hires == Hires(scale=2.0, sampler="dpmpp_2m_sde", schedule_type="Karras"), "webui's defaults"
    plain, _ = service.reused("a fox\nSteps: 20, Seed: 3")
    assert (plain["noise_source"], plain["ensd"], plain["variation_strength"], plain["hires"]) == (
        "nv", 0, 0.0, False), "no RNG: A1111's GPU source; no ENSD: none; no hires fix: off"


# A typical text pasted from Civitai: a LoRA and an embedding this demo has not loaded, a hires fix by an
# upscaler it has not loaded, and a size that is not the model's.
CIVITAI = ("masterpiece, a fox in the snow <lora:detail_tweaker:0.5>\nNegative prompt: easynegative, blurry\n"
           "Steps: 30, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 6, Seed: 1234, Size: 832x1216, "
           "Model hash: 31e35c80fc, Model: juggernautXL_v9, Denoising strength: 0.4, Hires upscale: 1.5, "
           "Hires steps: 10, Hires upscaler: 4x-UltraSharp, Lora hashes: \"detail_tweaker: 3b4e5f6a7b8c\", "
           "TI hashes: \"easynegative: c74b4e810b03\", Version: v1.9.4")


def test_a_pasted_civitai_text_fills_in_what_can_be_drawn_and_says_what_it_replaces(service):
    fields, said = service.reused(CIVITAI)
    assert (fields["seed"], fields["steps"], fields["sampler"], fields["schedule_type"]) == (
        1234, 30, "dpmpp_2m", "Karras")
    assert (fields["hires"], fields["hires_upscaler"], fields["hires_scale"], fields["hires_steps"]) == (
        True, "Lanczos", 1.5, 10), "the hires fix, with the nearest upscaler loaded"
    assert fields["size"] == "112×144", "the model's size of the nearest aspect ratio"
    for sentence in ("the hires upscaler 4x-UltraSharp is not loaded: Lanczos in its place",
                     "size 832x1216 is not this model's: its nearest, 112x144, in its place",
                     "the LoRA detail_tweaker is not loaded: the picture is drawn without it",
                     "Not used: Model juggernautXL_v9 (loaded: tiny)", "easynegative"):
        assert sentence in said, said
    submission = service.submission("generate", fields)
    assert submission.left_out == "Failed to find networks: detail_tweaker"
    prepared = submission.calls[0]
    assert prepared.request.prompts[0] == "masterpiece, a fox in the snow ", "drawn without the LoRA's tag"
    assert 'Left out: "Failed to find networks: detail_tweaker"' in service.png_parameters(prepared, 0,
                                                                                         submission.left_out)


def test_a_prompt_box_holding_a_parameters_text_offers_to_read_it(service):
    assert service.prompt_length(CIVITAI).startswith("This holds a picture's settings")
    assert service.prompt_length("a fox").endswith("1 chunk")
    assert service.prompt_length(CIVITAI, negative=True) != service.prompt_length(CIVITAI)


def test_clip_skip_reaches_the_request_and_reuse_fills_it_in(service):
    """The form's clip skip and SDXL setting reach the request; Reuse fills them from a text, and a
    text without "Clip skip" (webui writes none for its default) sets it back to 1."""
    request = service.images(Settings(prompt="a fox", clip_skip=2, sdxl_clip_l_skip=True)).request
    assert (request.clip_skip, request.sdxl_clip_l_skip) == (2, True)
    with pytest.raises(ValueError, match="clip skip must be an integer from 1 to 12, got 13"):
        service.images(Settings(prompt="a fox", clip_skip=13))
    fields, said = service.reused("a fox\nSteps: 20, Seed: 3, Clip skip: 2, Clip skip SDXL: True")
    assert (fields["clip_skip"], fields["sdxl_clip_l_skip"]) == (2, True)
    assert said.endswith("clip skip 2, SDXL's CLIP-L clip skip on"), said
    plain, _ = service.reused("a fox\nSteps: 20, Seed: 3")
    assert (plain["clip_skip"], plain["sdxl_clip_l_skip"]) == (1, False)


def test_a_hires_fix_reaches_the_request_and_its_grid_axes_turn_it_on(service):
    settings = Settings(prompt="a fox", steps=4, hires=True, hires_upscaler="Lanczos", hires_scale=2, hires_steps=2,
                        hires_strength=0.5)
    prepared = service.images(settings)
    assert prepared.request.hires == Hires(scale=2.0, upscaler="Lanczos", steps=2, strength=0.5, sampler="euler",
                                           schedule_type="diffusers")
    assert (prepared.hires.request.width, prepared.hires.request.height) == (256, 256)
    assert prepared.steps_run == 4 + 2, "progress counts both passes"
    plan = service.grid(Settings(prompt="a fox", steps=4), "hires_strength", "0.3, 0.6", "hires_upscaler",
                        "Latent, Latent (bicubic)")
    assert len(plan.requests) == 4, "each hires setting is a call of its own"
    assert {(c.request.hires.strength, c.request.hires.upscaler) for c in plan.requests} == {
        (0.3, "Latent"), (0.6, "Latent"), (0.3, "Latent (bicubic)"), (0.6, "Latent (bicubic)")}
    with pytest.raises(ValueError, match="hires upscaler must be one of"):
        service.grid(Settings(prompt="a fox", steps=4), "hires_upscaler", "Latent, SwinIR", None, "")


def test_the_compile_message_names_the_kind_of_prompt_a_program_is_for(tmp_path):
    """Prompt edits and embeddings compile programs of their own: the progress message says so."""
    pipe = Pipeline.from_pretrained("tiny", dtype="float32")
    width = pipe.spec.text_encoders[0].hidden_size
    vectors = {key: np.full((2, width), 0.01, np.float32) for key in ("clip_l", "clip_g")}
    safetensors.numpy.save_file(vectors, str(tmp_path / "softblue.safetensors"))
    pipe.load_textual_inversion(tmp_path / "softblue.safetensors")
    service = DemoService([Model("tiny", pipe)], max_images_per_core=1)
    assert results.prompt_shape(service.images(Settings(prompt="a fox"))) == "prompts of one chunk"
    edited = service.images(Settings(prompt="a [fox|cat] BREAK softblue"))
    assert results.prompt_shape(edited) == "prompts of up to 2 chunks, 2 texts each (prompt editing), with embeddings"
