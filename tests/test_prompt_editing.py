"""sdxl.prompts.editing: prompt editing and alternation against webui's own parser (tests/a1111_reference.py,
its lark grammar as it is)."""

import random
from pathlib import Path

import numpy as np
import pytest

from a1111_reference import prompt_schedule as webui_schedule
from a1111_reference import scheduled_entry
from sdxl.prompts import editing
from sdxl.prompts.tokens import Tokens

# webui's doctests (modules/prompt_parser.py), a few of each kind, and what it reads as plain text.
PROMPTS = [
    "test",
    "",
    "a [b:3]",
    "a [b: 3]",
    "a [[[b]]:2]",
    "[(a:2):3]",
    "a [b : c : 1] d",
    "a[b:[c:d:2]:1]e",
    "a [unbalanced",
    "a [b:.5] c",
    "a [{b|d{:.5] c",  # a "|" outside an alternation: the whole prompt is text
    "((a][:b:c [d:3]",
    "[a|(b:1.1)]",
    "[fe|]male",
    "[fe|||]male",
    "[cat:dog:0.5]",
    "[red|blue] [cat:dog:4] ([big:small:.3]:1.2)",
    "[a:[b|c]:0.5]",
    "[[a|b]:c:2]",
    "[a:b:1.5]",
    "[a:b:12]",
    "[a:b:0]",
    "[a:b:-1]",
    "[a:b:1e1]",
    "[a:b:1.5e-1]",
    "[a:b: 2 ]",
    "[a:b:+.5]",
    r"\[a:b:2\] [c:d:2]",
    "a | b",
    "trailing \\",
    "[a:b]",
    "[a:b:c:2]",
    "(a:[b:c:2])",
    "[a::3]",
    "[:a:3]",
    "x: [a:b:2] ]",
]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize(("steps", "hires_steps"), [(10, None), (7, None), (10, 4), (10, 10)])
def test_schedules_are_webuis(prompt, steps, hires_steps):
    expected = [tuple(entry) for entry in webui_schedule(prompt, steps, hires_steps)]
    assert editing.prompt_schedule(prompt, steps, hires_steps) == expected


def test_webuis_documented_schedules():
    assert editing.prompt_schedule("a[b:[c:d:2]:1]e", 10) == [(1, "abe"), (2, "ace"), (10, "ade")]
    assert editing.prompt_schedule("a [b:1.5] c", 10, 10) == [(5, "a  c"), (10, "a b c")]
    assert editing.prompt_schedule("a [b:.5] c", 10, 10) == [(10, "a b c")]
    assert editing.prompt_schedule("a [b:12] c", 10, 4) == [(2, "a  c"), (4, "a b c")]
    deep = "[" * 3000 + "a"  # brackets left open past Python's stack: text, as webui reads them
    assert editing.prompt_schedule(deep, 10) == [(10, deep)]


def test_random_prompts_read_as_webui_reads_them():
    """Random strings of the grammar's characters. Where webui's parser could read a prompt two ways, an
    edit or plain brackets, and takes the plain one (around brackets left open after an edit), we read
    the edit: the one kind of difference allowed."""
    rng = random.Random(0)
    alphabet = ["a", "b", " ", "[", "]", "(", ")", ":", "|", "1", ".5", "\\", "2"]
    for _ in range(2000):
        prompt = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        ours = editing.prompt_schedule(prompt, 6)
        webuis = [tuple(entry) for entry in webui_schedule(prompt, 6)]
        if ours != webuis:
            assert webuis == [(6, prompt)], prompt
            assert len(ours) > 1 and ours[-1][1] != prompt, prompt
            assert prompt.rfind("[") > prompt.find("]") or prompt.rfind("(") > prompt.find("]"), prompt


@pytest.mark.parametrize("prompt", ["[cat:dog:0.5]", "[red|blue]", "[a:[b|c|d]:3]"])
def test_conditioning_index_is_webuis_entry(prompt):
    schedule = editing.prompt_schedule(prompt, 6)
    for step in range(8):  # model evaluations counted from 0, past the steps too (a second-order sampler's)
        assert schedule[editing.conditioning_index(schedule, step)] == tuple(scheduled_entry(schedule, step))


def test_alternation_starts_with_its_first_text_twice():
    """webui's denoiser counts calls from 0 and entry 1 is the first text, so [red|blue] reads red, red, blue."""
    schedule = editing.prompt_schedule("[red|blue]", 4)
    assert [schedule[editing.conditioning_index(schedule, s)][1] for s in range(4)] == ["red", "red", "blue", "red"]


def test_tokens_pick_each_iterations_conditioning_as_webui():
    """`Tokens.conditioning_steps` against webui's entry for each call, for an image-to-image run whose first
    iteration is 2 (calls counted from there), and past the schedule's end (webui's first entry)."""
    schedules = [editing.prompt_schedule("[red|blue]", 4), editing.prompt_schedule("[cat:dog:0.5]", 4)]
    variants = [list(dict.fromkeys(text for _, text in schedule)) for schedule in schedules]
    readings = np.array([[[v.index(schedule[editing.conditioning_index(schedule, s)][1]) for s in range(5)]
                          for schedule, v in zip(schedules, variants)]], np.int32)
    shape = (1, 2, 2, 1, 77)
    tokens = Tokens(np.zeros(shape, np.int32), np.ones(shape, np.float32), np.ones((1, 2, 2), np.int32),
                    np.ones(1, bool), readings)
    picked = tokens.conditioning_steps(evaluations=9, first=2)
    for j, (schedule, v) in enumerate(zip(schedules, variants)):
        for i in range(2, 9):
            assert v[picked[0, j, i]] == scheduled_entry(schedule, i - 2)[1], (j, i)
    merged = Tokens.merged([tokens, tokens.padded(2, 8, 7)])
    assert merged.ids.shape == (2, 2, 8, 1, 2 * 77)
    np.testing.assert_array_equal(merged.conditioning_steps(9, 2), np.concatenate([picked, picked]))


def test_a_schedule_is_encoded_as_its_distinct_texts():
    """[red|blue] over 40 steps is 40 entries but two texts, read alternately."""
    from transformers import CLIPTokenizer

    from sdxl.prompts.tokens import Prompts

    configs = Path(__file__).parents[1] / "sdxl" / "configs" / "sdxl-base-1.0"
    tokenizers = [CLIPTokenizer.from_pretrained(configs / name) for name in ("tokenizer", "tokenizer_2")]
    prompts = Prompts(None, tokenizers)
    tokens = prompts.tokens(["a [red|blue] cube"], ["[blurry::3]"], steps=40)
    assert tokens.num_conditionings == 2
    np.testing.assert_array_equal(tokens.readings[0, 1], [0, 0] + [1, 0] * 19 + [1])
    np.testing.assert_array_equal(tokens.readings[0, 0], [0] * 4 + [1] * 37)
    np.testing.assert_array_equal(tokens.ids[0, 1, 0], prompts.read("a red cube")[0])
    np.testing.assert_array_equal(tokens.ids[0, 1, 1], prompts.read("a blue cube")[0])
    np.testing.assert_array_equal(tokens.ids[0, 0, 1], prompts.read("", negative=True)[0])
    assert prompts.length_text("[a:a b c d e:0.5]") == "5 tokens, 1 chunk"
