"""PNG parameters as webui writes and reads them (`sdxl.engine.images`)."""

import pytest

from sdxl.engine import images


@pytest.mark.parametrize("sampler, schedule, ours", [
    ("DPM++ 2M", "Karras", "dpmpp_2m_karras"),  # webui 1.9 and later, and Forge
    ("DPM++ 2M", "Automatic", "dpmpp_2m_karras"),  # webui's automatic schedule for DPM++ 2M is Karras
    ("DPM++ 2M Karras", None, "dpmpp_2m_karras"),  # before 1.9: one field
    ("DPM++ 2M", None, "dpmpp_2m"),
    ("DPM++ 2M", "Exponential", "dpmpp_2m"),  # a schedule we lack: the nearest sampler we have
    ("Euler a", "Automatic", "euler_ancestral"),
    ("Euler", "Karras", "euler"),
    ("DDIM", None, "ddim"),
])
def test_webui_samplers_and_schedule_types_read_as_ours(sampler, schedule, ours):
    fields = f"Steps: 20, Sampler: {sampler}, " + (f"Schedule type: {schedule}, " if schedule else "") + "CFG scale: 7"
    assert images.read_parameters(f"a fox\n{fields}")["sampler"] == ours


def test_a_sampler_we_lack_is_left_as_it_is():
    assert "sampler" not in images.read_parameters("a fox\nSteps: 20, Sampler: Heun, CFG scale: 7")


def test_written_parameters_read_back_with_quoted_values_and_emphasis():
    text = images.parameters_text("a (red:1.2) fox, <lora:ink:0.5>", "blur, (watermark)", {
        "Steps": 30, "Sampler": "DPM++ 2M", "Schedule type": "Karras", "CFG scale": 6.5, "Seed": 7,
        "Size": "1152x896", "Model": None, "Emphasis": "No norm", "Lora hashes": "ink: 0123456789ab, glow: ba98",
    })
    assert text.splitlines()[-1] == ('Steps: 30, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 6.5, Seed: 7, '
                                     'Size: 1152x896, Emphasis: No norm, Lora hashes: "ink: 0123456789ab, glow: ba98"')
    found = images.read_parameters(text)
    assert found == dict(prompt="a (red:1.2) fox, <lora:ink:0.5>", negative_prompt="blur, (watermark)", steps=30,
                         guidance_scale=6.5, seed=7, width=1152, height=896, sampler="dpmpp_2m_karras",
                         emphasis="no-norm")
    assert images.read_parameters("a fox\nSteps: 20")["emphasis"] == "original"


def test_lora_hashes_text_and_its_infotext_quoting():
    value = images.lora_hashes_text(
        [("foxy:v2, final", "0123456789ab"), ("owl", "ba9876543210"), ("foxyv2 final", "c" * 12)])
    assert value == "foxyv2 final: cccccccccccc, owl: ba9876543210"
    assert images.infotext_quote(value) == '"foxyv2 final: cccccccccccc, owl: ba9876543210"'
    assert images.infotext_quote("No norm") == "No norm"


def test_emphasis_infotext():
    assert images.emphasis_infotext("original", ["(a:1.2)"]) is None
    assert images.emphasis_infotext("no-norm", ["(a:1.2)", ""]) == "No norm"
    assert images.emphasis_infotext("no-norm", ["a", "b"]) is None
    assert images.emphasis_infotext("none", ["a", "[b]"]) == "None"
