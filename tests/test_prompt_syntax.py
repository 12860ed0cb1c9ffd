"""sdxl.prompts.syntax: prompts read as AUTOMATIC1111's webui reads them (parsing, chunking, LoRA tags)."""

import re
from pathlib import Path

import numpy as np
import pytest
from transformers import CLIPTokenizer

from sdxl.prompts import syntax as ps

CONFIGS = Path(__file__).parents[1] / "sdxl" / "configs" / "sdxl-base-1.0"

# A fake tokenizer: one token per word, "," its own token; "wN" is token 100 + N, other words get ids from 1000.
BOS, EOS, PAD, COMMA = 0, 2, 3, 1
_VOCAB: dict[str, int] = {}


def fake_tokenize(texts: list[str]) -> list[list[int]]:
    def token(word: str) -> int:
        if word == ",":
            return COMMA
        if re.fullmatch(r"w\d+", word):
            return 100 + int(word[1:])
        return _VOCAB.setdefault(word, 1000 + len(_VOCAB))

    return [[token(w) for w in re.findall(r",|[^\s,]+", text.lower())] for text in texts]


def words(start: int, count: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + count))


def fake_chunks(prompt: str, **kwargs) -> list[ps.Chunk]:
    return ps.chunks(ps.parse_weights(prompt), fake_tokenize, comma_id=COMMA, eos=EOS, **kwargs)


def prompt_ids(chunk: ps.Chunk) -> list[int]:
    return list(chunk.ids[: chunk.used])


# --- parse_weights: webui's documented examples (prompt_parser.parse_prompt_attention's docstring), exactly ---

@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("normal text", [("normal text", 1.0)]),
        ("an (important) word", [("an ", 1.0), ("important", 1.1), (" word", 1.0)]),
        ("(unbalanced", [("unbalanced", 1.1)]),
        (r"\(literal\]", [("(literal]", 1.0)]),
        ("(unnecessary)(parens)", [("unnecessaryparens", 1.1)]),
        (
            "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
            [
                ("a ", 1.0),
                ("house", 1.5730000000000004),
                (" ", 1.1),
                ("on", 1.0),
                (" a ", 1.1),
                ("hill", 0.55),
                (", sun, ", 1.1),
                ("sky", 1.4641000000000006),
                (".", 1.1),
            ],
        ),
    ],
)
def test_parse_weights_matches_webui_documented_examples(prompt, expected):
    assert ps.parse_weights(prompt) == expected


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("((text))", [("text", 1.1 * 1.1)]),
        ("[text]", [("text", 1 / 1.1)]),
        ("[[text]]", [("text", (1 / 1.1) * (1 / 1.1))]),
        ("(text:1.5)", [("text", 1.5)]),
        ("(text : 1.5 )", [("text ", 1.5)]),  # spaces around the weight
        ("((text:1.5))", [("text", 1.5 * 1.1)]),
        ("(text:-1)", [("text", -1.0)]),
        ("(text:.5)", [("text", 0.5)]),
        ("(fox:abc)", [("fox:abc", 1.1)]),  # no number: literal text, still inside round brackets
        ("fox:1.5)", [("fox:1.5)", 1.0)]),  # a weight that closes nothing is text
        ("a ) b ] c", [("a ) b ] c", 1.0)]),  # stray closing brackets are literal
        (r"\(a\) \[b\]", [("(a) [b]", 1.0)]),
        ("a \\\\ b", [("a \\ b", 1.0)]),  # \\ is one backslash
        ("a\\b", [("ab", 1.0)]),  # a lone backslash is dropped
        ("[a:b]", [("a:b", 1 / 1.1)]),
        ("(a [b) c]", [("a ", 1.1), ("b", 1.1 * (1 / 1.1)), (" c", 1 / 1.1)]),  # ")" closes "(" over the "["
        ("", [("", 1.0)]),
        ("()", [("", 1.0)]),
        ("(", [("", 1.0)]),
        (":", [(":", 1.0)]),
    ],
)
def test_parse_weights_syntax(prompt, expected):
    assert ps.parse_weights(prompt) == expected


def test_break_is_its_own_piece_only_as_an_uppercase_word_outside_brackets():
    assert ps.parse_weights("a BREAK b") == [("a", 1.0), ps.BREAK, ("b", 1.0)]
    assert ps.parse_weights("a,BREAK,b") == [("a,", 1.0), ps.BREAK, (",b", 1.0)]
    assert ps.parse_weights("BREAK a") == [("", 1.0), ps.BREAK, ("a", 1.0)]
    assert ps.parse_weights("a break b") == [("a break b", 1.0)]
    assert ps.parse_weights("aBREAK b") == [("aBREAK b", 1.0)]
    # Inside brackets its -1 is multiplied too, so it no longer marks a break: webui reads the word.
    inside = ps.parse_weights("(a BREAK b)")
    assert inside == [("a", 1.1), ("BREAK", -1 * 1.1), ("b", 1.1)]
    assert not any(ps.is_break(piece) for piece in inside)
    assert ps.parse_weights("x (a) BREAK y") == [("x ", 1.0), ("a", 1.1), ("", 1.0), ps.BREAK, ("y", 1.0)]


def test_a_weight_that_is_not_a_number_is_refused():
    with pytest.raises(ValueError, match="not a number"):
        ps.parse_weights("(fox:1.2.3)")


def test_prompt_pieces_none_reads_the_text_literally():
    assert ps.prompt_pieces("(a:1.5) BREAK b", "none") == [("(a:1.5) BREAK b", 1.0)]
    assert ps.prompt_pieces("(a:1.5)", "no-norm") == [("a", 1.5)]
    with pytest.raises(ValueError, match="emphasis"):
        ps.prompt_pieces("a", "Original")


# --- chunks, with the fake tokenizer ---

def test_empty_prompt_is_one_empty_chunk():
    [chunk] = fake_chunks("")
    assert chunk.ids == (EOS,) * 75 and chunk.weights == (1.0,) * 75
    assert chunk.used == 0 and chunk.final
    assert ps.token_count([chunk]) == 0
    assert ps.length_text([chunk]) == "0 tokens, 1 chunk"


def test_exactly_75_tokens_is_one_chunk_and_76_is_two():
    [chunk] = fake_chunks(words(0, 75))
    assert chunk.used == 75 and EOS not in chunk.ids
    first, second = fake_chunks(words(0, 76))
    assert first.used == 75 and prompt_ids(second) == [175]
    assert ps.length_text([first, second]) == "76 tokens, 2 chunks"


def test_comma_backtrack_moves_the_text_after_the_last_comma_to_the_next_chunk():
    prompt = f"{words(0, 70)}, {words(70, 10)}"  # the comma is token 70; 81 tokens
    first, second = fake_chunks(prompt)
    assert first.used == 71 and first.ids[70] == COMMA and first.ids[71:] == (EOS,) * 4
    assert prompt_ids(second) == [100 + i for i in range(70, 80)]
    assert not first.final and second.final
    assert ps.token_count([first, second]) == 75 + 10  # webui counts the early-closed chunk as 75
    # Without the backtrack the chunk is cut at 75 tokens.
    first, second = fake_chunks(prompt, backtrack=0)
    assert first.used == 75 and prompt_ids(second) == [100 + i for i in range(74, 80)]


@pytest.mark.parametrize(("comma_at", "moves"), [(55, True), (54, False)])
def test_comma_backtrack_reaches_20_tokens_back(comma_at, moves):
    first, _ = fake_chunks(f"{words(0, comma_at)}, {words(comma_at, 40)}")
    assert first.used == (comma_at + 1 if moves else 75)


def test_comma_backtrack_needs_a_token_after_the_full_chunk():
    # 75 tokens with a comma near the end and nothing after: one full chunk, nothing moved.
    [chunk] = fake_chunks(f"{words(0, 70)}, {words(70, 4)}")
    assert chunk.used == 75
    # A comma as the 76th token opens the next chunk; nothing moves.
    first, second = fake_chunks(f"{words(0, 75)}, {words(75, 3)}")
    assert first.used == 75 and prompt_ids(second) == [COMMA, 175, 176, 177]


def test_comma_backtrack_keeps_each_token_its_weight_and_spans_pieces():
    first, second = fake_chunks(f"{words(0, 60)}, ({words(60, 20)}:1.3)")
    assert first.used == 61 and first.weights[:61] == (1.0,) * 61
    assert prompt_ids(second) == [100 + i for i in range(60, 80)]
    assert second.weights[:20] == (1.3,) * 20 and second.weights[20:] == (1.0,) * 55


def test_break_closes_the_chunk():
    assert [prompt_ids(c) for c in fake_chunks("w1 BREAK w2")] == [[101], [102]]
    assert [prompt_ids(c) for c in fake_chunks("BREAK w1")] == [[], [101]]  # a leading BREAK: an empty chunk
    assert [prompt_ids(c) for c in fake_chunks("w1 BREAK")] == [[101]]  # a trailing BREAK adds nothing
    assert [prompt_ids(c) for c in fake_chunks("w1 BREAK BREAK w2")] == [[101], [], [102]]
    # A full chunk followed by BREAK: no empty chunk between.
    assert [c.used for c in fake_chunks(f"{words(0, 75)} BREAK w1")] == [75, 1]
    assert [c.used for c in fake_chunks(f"{words(0, 76)} BREAK w1")] == [75, 1, 1]
    # webui counts a chunk that BREAK closed as 75 tokens.
    assert ps.token_count(fake_chunks("w1 BREAK")) == 75
    assert ps.token_count(fake_chunks("w1 BREAK w2")) == 76


def test_break_forgets_the_last_comma():
    # Were the comma (token 70 of the first chunk) remembered, the full second chunk would be cut after 71.
    first, second, third = fake_chunks(f"{words(0, 70)}, BREAK {words(100, 80)}")
    assert first.used == 71 and first.ids[70] == COMMA
    assert second.used == 75 and prompt_ids(third) == [100 + i for i in range(175, 180)]


def test_break_inside_brackets_is_the_word_with_its_weight():
    [chunk] = fake_chunks("(w1 BREAK w2)")
    assert chunk.used == 3 and chunk.ids[1] == _VOCAB["break"]
    assert chunk.weights[:3] == (1.1, -1 * 1.1, 1.1)


def test_none_emphasis_keeps_break_and_brackets_as_text():
    pieces = ps.prompt_pieces("w1 BREAK (w2:1.5)", "none")
    [chunk] = ps.chunks(pieces, fake_tokenize, comma_id=COMMA, eos=EOS)
    assert chunk.weights == (1.0,) * 75 and chunk.used == 3


def test_weights_follow_their_tokens():
    [chunk] = fake_chunks("(w1) w2 [w3] (w4 w5:0.5)")
    assert prompt_ids(chunk) == [101, 102, 103, 104, 105]
    assert chunk.weights[:5] == (1.1, 1.0, 1 / 1.1, 0.5, 0.5)


# --- encoder_ids ---

def test_encoder_ids_frames_the_chunk_and_pads_after_the_first_eos():
    [chunk] = fake_chunks("(w1:1.5) w2")
    ids, weights = ps.encoder_ids(chunk, bos=BOS, eos=EOS, pad=PAD)
    assert ids.dtype == np.int32 and ids.shape == (77,) and weights.dtype == np.float32
    assert ids[:4].tolist() == [BOS, 101, 102, EOS] and set(ids[4:].tolist()) == {PAD}
    assert weights[:3].tolist() == [1.0, 1.5, 1.0] and set(weights[3:].tolist()) == {1.0}
    # With pad == EOS (SD 1.x, SDXL's first tokenizer) the padding stays EOS.
    ids, _ = ps.encoder_ids(chunk, bos=BOS, eos=EOS, pad=EOS)
    assert ids[:3].tolist() == [BOS, 101, 102] and set(ids[3:].tolist()) == {EOS}
    # A full chunk: the closing EOS at 76 and nothing after it.
    [full] = fake_chunks(words(0, 75))
    ids, _ = ps.encoder_ids(full, bos=BOS, eos=EOS, pad=PAD)
    assert ids[76] == EOS and PAD not in ids.tolist()


# --- checks ---

def test_check_refuses_long_prompts_with_one_sentence():
    prompt = words(0, 600)
    pieces = ps.parse_weights(prompt)
    ok = ps.chunks(pieces, fake_tokenize, comma_id=COMMA, eos=EOS)
    assert len(ok) == ps.MAX_CHUNKS
    ps.check(pieces, ok)
    pieces = ps.parse_weights(prompt + " w600")
    too_long = ps.chunks(pieces, fake_tokenize, comma_id=COMMA, eos=EOS)
    with pytest.raises(ValueError, match=r"^the negative prompt is 601 tokens in 9 chunks of 75, over the limit of 8 "
                                         r"chunks \(600 tokens\)$"):
        ps.check(pieces, too_long, what="negative prompt")


@pytest.mark.parametrize(("prompt", "refused"), [
    ("(a:10)", False), ("(a:-10)", False), ("(a:10.5)", True), ("(a:-11)", True), ("((a:9.5))", True),
    ("(:20)", False), ("(a:20) BREAK", True), ("(BREAK:-1)", False),
])
def test_check_refuses_weights_outside_the_range(prompt, refused):
    pieces = ps.parse_weights(prompt)
    chunk_list = ps.chunks(pieces, fake_tokenize, comma_id=COMMA, eos=EOS)
    if refused:
        with pytest.raises(ValueError, match=r"^the weight .* on 'a' in the prompt is outside -10 to 10$"):
            ps.check(pieces, chunk_list)
    else:
        ps.check(pieces, chunk_list)


def test_prompt_chunks_checks():
    with pytest.raises(ValueError, match="outside"):
        ps.prompt_chunks("(a:11)", fake_tokenize, comma_id=COMMA, eos=EOS)
    # "none" reads the weight as text, so there is nothing to refuse.
    [chunk] = ps.prompt_chunks("(a:11)", fake_tokenize, comma_id=COMMA, eos=EOS, emphasis="none")
    assert set(chunk.weights) == {1.0}


# --- the real CLIP tokenizers ---

@pytest.fixture(scope="module")
def tokenizers():
    return CLIPTokenizer.from_pretrained(str(CONFIGS / "tokenizer")), CLIPTokenizer.from_pretrained(
        str(CONFIGS / "tokenizer_2"))


def real_tokenize(tokenizer):
    return lambda texts: tokenizer(texts, truncation=False, add_special_tokens=False)["input_ids"]


def real_chunks(tokenizer, prompt, emphasis="original"):
    return ps.chunks(ps.prompt_pieces(prompt, emphasis), real_tokenize(tokenizer),
                     comma_id=tokenizer.get_vocab()[",</w>"], eos=tokenizer.eos_token_id)


def test_real_tokenizer_ids(tokenizers):
    tokenizer, tokenizer_2 = tokenizers
    assert tokenizer.get_vocab()[",</w>"] == tokenizer_2.get_vocab()[",</w>"] == 267
    assert real_tokenize(tokenizer)([","]) == [[267]]
    assert (tokenizer.pad_token_id, tokenizer_2.pad_token_id) == (tokenizer.eos_token_id, 0)


def test_real_tokenizer_pieces_are_tokenized_apart(tokenizers):
    tokenizer, _ = tokenizers
    tokenize = real_tokenize(tokenizer)
    [chunk] = real_chunks(tokenizer, "(un)believable")
    apart = tokenize(["un"])[0] + tokenize(["believable"])[0]
    assert prompt_ids(chunk) == apart and apart != tokenize(["unbelievable"])[0]
    assert chunk.weights[: chunk.used] == (1.1,) * len(tokenize(["un"])[0]) + (1.0,) * len(tokenize(["believable"])[0])


def test_real_tokenizer_short_prompt_matches_plain_tokenization(tokenizers):
    for tokenizer in tokenizers:
        prompt = "a photo of a red fox, jumping over a lazy dog, golden hour"
        [chunk] = real_chunks(tokenizer, prompt)
        ids, weights = ps.encoder_ids(chunk, bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id,
                                      pad=tokenizer.pad_token_id)
        plain = tokenizer(prompt, padding="max_length", max_length=77, truncation=True)["input_ids"]
        assert ids.tolist() == plain and set(weights.tolist()) == {1.0}


def test_real_tokenizer_long_prompt_backtracks_to_a_comma(tokenizers):
    tokenizer, tokenizer_2 = tokenizers
    tags = ["masterpiece", "best quality", "a fox in a snowy forest", "dramatic lighting", "highly detailed fur",
            "cinematic composition", "soft focus background", "volumetric fog", "golden hour"]
    prompt = ", ".join(tags * 3)
    chunk_list = real_chunks(tokenizer, prompt)
    assert len(chunk_list) == 2
    first = chunk_list[0]
    assert first.used < 75 and first.ids[first.used - 1] == 267  # cut just after a comma
    assert 75 - (first.used - 1) <= 20
    all_ids = real_tokenize(tokenizer)([prompt])[0]
    assert prompt_ids(first) + prompt_ids(chunk_list[1]) == all_ids
    # Both SDXL tokenizers chunk alike; only their padding differs.
    chunk_list_2 = real_chunks(tokenizer_2, prompt)
    assert chunk_list_2 == chunk_list
    ids_1, _ = ps.encoder_ids(chunk_list[1], bos=49406, eos=49407, pad=tokenizer.pad_token_id)
    ids_2, _ = ps.encoder_ids(chunk_list_2[1], bos=49406, eos=49407, pad=tokenizer_2.pad_token_id)
    end = 1 + chunk_list[1].used
    assert ids_1[end] == ids_2[end] == 49407
    assert set(ids_1[end + 1:].tolist()) == {49407} and set(ids_2[end + 1:].tolist()) == {0}


def test_real_tokenizer_break_and_length_text(tokenizers):
    tokenizer, _ = tokenizers
    chunk_list = real_chunks(tokenizer, "a red fox BREAK a blue owl")
    assert len(chunk_list) == 2
    assert real_tokenize(tokenizer)(["a blue owl"])[0] == prompt_ids(chunk_list[1])
    assert ps.length_text(chunk_list) == f"{75 + chunk_list[1].used} tokens, 2 chunks"


# --- LoRA tags ---

def test_lora_tags_are_taken_out_of_the_text():
    text, loras = ps.lora_tags("a cat <lora:foxy_v2:0.8>, night <lora:owl>")
    assert text == "a cat , night "
    assert loras == [("foxy_v2", 0.8), ("owl", 1.0)]
    assert ps.lora_tags("no tags (here:1.2)") == ("no tags (here:1.2)", [])
    # Names as written (spaces kept), negative scales, and "lyco" grouped after the kind seen first.
    assert ps.lora_tags("<lora:my lora:-0.5> <lyco:b:2> <lora:c>")[1] == [("my lora", -0.5), ("c", 1.0), ("b", 2.0)]
    # Other kinds are removed as webui removes them; "<lora:>" is no tag.
    assert ps.lora_tags("x <foo:bar:1> y <lora:>") == ("x  y <lora:>", [])
    # The weights are read from what is left.
    text, _ = ps.lora_tags("(<lora:x:1> cat:1.2)")
    assert ps.parse_weights(text) == [(" cat", 1.2)]


@pytest.mark.parametrize(("prompt", "message"), [
    ("<lora:foxy:abc>", "the scale in the LoRA tag <lora:foxy:abc> is not a number"),
    ("<lora:foxy:nan>", "the scale in the LoRA tag <lora:foxy:nan> is not a number"),
    ("<lora:foxy:1:0.5>", "the LoRA tag <lora:foxy:1:0.5> is not of the form <lora:NAME> or <lora:NAME:SCALE>"),
    ("<lora:foxy:te=1>", "the LoRA tag <lora:foxy:te=1> is not of the form <lora:NAME> or <lora:NAME:SCALE>"),
    ("<lora::1>", "the LoRA tag <lora::1> is not of the form <lora:NAME> or <lora:NAME:SCALE>"),
    ("<hypernet:anime:1>", "hypernetwork tags like <hypernet:anime:1> are not supported"),
])
def test_bad_lora_tags_are_refused_with_one_sentence(prompt, message):
    with pytest.raises(ValueError) as error:
        ps.lora_tags(prompt)
    assert str(error.value) == message
