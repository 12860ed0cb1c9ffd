"""Prompts read as AUTOMATIC1111's stable-diffusion-webui reads them, with its default "Original" emphasis.

Host-side only (Python and numpy): the text becomes weighted pieces, the pieces' tokens are packed into
chunks of 75, and each chunk becomes the 77 ids an encoder reads and one weight per position. The
compiled program then weighs each chunk's hidden states (`sdxl.engine.text_encoding.emphasized`).

The reading, as webui 1.10 does it:

- `parse_weights`: `(text)` weighs 1.1, `((text))` 1.21, `[text]` 1/1.1, `(text:1.5)` 1.5; nested
  brackets multiply; `\\(` `\\)` `\\[` `\\]` `\\\\` are literal characters and a lone backslash is dropped;
  a `)` or `]` that closes nothing is literal, brackets left open weigh everything to the end;
  `(fox:abc)` has no weight, so it reads as the text "fox:abc" inside plain parentheses (x1.1).
  `BREAK` (uppercase, a word of its own, outside brackets) ends the current chunk.
- `chunks`: each piece is tokenized on its own; the tokens fill chunks of 75. When a chunk is full and
  the next token is not a comma, a comma at most 20 tokens back moves what follows it to the next chunk.
- Textual-inversion embeddings (`chunks`' `embeddings`): a name's n vectors take n positions in a chunk,
  weighted as its piece; an embedding that does not fit in what is left of a chunk opens the next.
- `encoder_ids`: a chunk is BOS + its 75 tokens (EOS-padded) + EOS; positions after the first EOS take
  the tokenizer's pad id (EOS for SD 1.x and SDXL's first tokenizer, 0 for the OpenCLIP ones).
- Emphasis (in the program): the chunk's hidden states times each position's weight, then rescaled so
  that the mean of the whole chunk tensor is what it was unweighted ("original"); without the rescale
  ("no-norm"); or not at all ("none", where `prompt_pieces` reads the prompt literally: no brackets, no
  BREAK, every weight 1).

LoRA tags (`lora_tags`) come out of the text before any of this, as webui removes them, and only from
the positive prompt: webui reads a tag in the negative prompt as text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

CHUNK_TOKENS = 75  # prompt tokens per chunk; with BOS and EOS an encoder reads 77
MAX_CHUNKS = 8  # longer prompts are refused
WEIGHT_RANGE = (-10.0, 10.0)  # weights outside it are refused
COMMA_BACKTRACK = 20  # webui's "Prompt word wrap length limit" default, in tokens
# How weights apply: as webui's default "Original" emphasis, which keeps each chunk's mean; its "No norm",
# which does not; or not at all, the prompt read as text.
EMPHASIS_MODES = ("original", "no-norm", "none")
# The names webui gives the modes (its "Emphasis" setting and infotext field).
A1111_EMPHASIS_NAMES = {"original": "Original", "no-norm": "No norm", "none": "None"}

# The piece that stands for BREAK. Only this exact pair breaks a chunk: a BREAK inside brackets has its
# weight multiplied away from -1 and is then read as the word "break", as in webui.
BREAK = ("BREAK", -1.0)

_ROUND = 1.1
_SQUARE = 1 / 1.1

# One match per syntax element, tried in this order (webui's order).
_SYNTAX = re.compile(
    r"""
      (?P<escape>\\[()\[\]\\]?)          # \( \) \[ \] \\ stand for the character; a lone \ for nothing
    | (?P<open>[(\[])
    | :\s*(?P<weight>[+-]?[.\d]+)\s*\)   # ":1.5)" closes a round bracket with that weight
    | (?P<close>[)\]])
    | [^\\()\[\]:]+ | :                  # text; a colon that starts no weight is text too
    """,
    re.X,
)
_BREAK_WORD = re.compile(r"\s*\bBREAK\b\s*")
_EXTRA_NETWORK_TAG = re.compile(r"<(\w+):([^>]+)>")  # webui's extra networks: <kind:arg:arg...>
_LORA_KINDS = ("lora", "lyco")  # webui registers "lyco" as another name of its LoRA network


def parse_weights(text: str) -> list[tuple[str, float]]:
    """Splits a prompt into (text, weight) pieces as webui's `parse_prompt_attention` does.

    Weights are multiplied in the same order as webui's (a bracket's factor when it closes, then the
    brackets left open, round before square), so that equal weights compare equal as they do there and
    neighbouring pieces of equal weight merge into one. An empty result is [("", 1.0)].
    """
    pieces: list[list] = []  # [text, weight]; brackets scale the pieces added since they opened
    rounds: list[int] = []
    squares: list[int] = []

    def scale(start: int, factor: float) -> None:
        for piece in pieces[start:]:
            piece[1] *= factor

    for match in _SYNTAX.finditer(text):
        token = match.group(0)
        if match.group("escape") is not None:
            pieces.append([token[1:], 1.0])
        elif match.group("open") == "(":
            rounds.append(len(pieces))
        elif match.group("open") == "[":
            squares.append(len(pieces))
        elif match.group("weight") is not None and rounds:
            scale(rounds.pop(), _weight_number(match.group("weight")))
        elif token == ")" and rounds:
            scale(rounds.pop(), _ROUND)
        elif token == "]" and squares:
            scale(squares.pop(), _SQUARE)
        else:
            _add_text(pieces, token)
    for start in rounds:
        scale(start, _ROUND)
    for start in squares:
        scale(start, _SQUARE)
    if not pieces:
        pieces = [["", 1.0]]

    merged = [pieces[0]]
    for piece in pieces[1:]:
        if piece[1] == merged[-1][1]:
            merged[-1][0] += piece[0]
        else:
            merged.append(piece)
    return [(piece_text, weight) for piece_text, weight in merged]


def _add_text(pieces: list[list], text: str) -> None:
    """Adds plain text, with a BREAK piece wherever the word BREAK stood (it and the space around it go)."""
    for i, part in enumerate(_BREAK_WORD.split(text)):
        if i:
            pieces.append(list(BREAK))
        pieces.append([part, 1.0])


def _weight_number(text: str) -> float:
    """The number in "(text:NUMBER)". webui's pattern also admits "1.2.3" or ".", on which it fails; so do we."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"the prompt weight {text!r} is not a number") from None


def is_break(piece: tuple[str, float]) -> bool:
    return piece[0] == BREAK[0] and piece[1] == BREAK[1]


def prompt_pieces(text: str, emphasis: str = "original") -> list[tuple[str, float]]:
    """The pieces a prompt is read as under an emphasis mode: with "none" the whole text, weight 1."""
    if emphasis not in EMPHASIS_MODES:
        raise ValueError(f"unknown emphasis {emphasis!r}; it is one of {', '.join(EMPHASIS_MODES)}")
    return [(text, 1.0)] if emphasis == "none" else parse_weights(text)


@dataclass(frozen=True)
class Chunk:
    """One chunk of a prompt: CHUNK_TOKENS token ids (padded with EOS) and their weights (1.0 for padding).

    `used` is the number of the prompt's tokens in it. `final` is whether the prompt's end closed it, rather
    than a full chunk, a comma backtrack or a BREAK: webui counts a chunk closed early as a full 75 tokens.
    """

    ids: tuple[int, ...]
    weights: tuple[float, ...]
    used: int
    final: bool


def chunks(
    pieces: Sequence[tuple[str, float]],
    tokenize: Callable[[list[str]], list[list[int]]],
    *,
    comma_id: int,
    eos: int,
    backtrack: int = COMMA_BACKTRACK,
    embeddings: Mapping[tuple[int, ...], tuple[int, ...]] = MappingProxyType({}),
) -> list[Chunk]:
    """Packs the pieces' tokens into chunks as webui's `tokenize_line` does.

    `tokenize` gives each piece's token ids without BOS/EOS; each piece is tokenized on its own, so a word
    split by brackets is two words' tokens. The comma backtrack: when a chunk holds 75 tokens and the next
    token is not a comma, and the chunk's last comma is at most `backtrack` tokens before its end, the
    tokens after that comma move to the next chunk (0 turns this off). The last comma is forgotten when a
    chunk closes, so a comma that opens a chunk is never a backtrack point. A BREAK closes the current
    chunk even when it is empty (a BREAK first gives an empty chunk, two in a row one between them), but
    the prompt's end closes one only if it holds tokens or is the first. An empty prompt is one empty chunk.

    Textual-inversion `embeddings` map a name's token ids to the ids of its vectors (past the vocabulary,
    rows the encoder's token table is extended by). Where a piece's tokens spell a name (the longest, as
    webui matches names on token ids, so a name inside a longer word is not one) its vectors take its
    place, one position each, with the piece's weight; when they do not fit in what is left of the chunk,
    the chunk closes and they open the next.
    """
    token_lists = tokenize([text for text, _ in pieces])
    name_lengths = sorted({len(name) for name in embeddings}, reverse=True)
    done: list[Chunk] = []
    ids: list[int] = []
    weights: list[float] = []
    last_comma = -1  # index in `ids` of the current chunk's last comma

    def close(final: bool = False) -> None:
        nonlocal ids, weights, last_comma
        padding = CHUNK_TOKENS - len(ids)
        done.append(Chunk(tuple(ids) + (eos,) * padding, tuple(weights) + (1.0,) * padding, len(ids), final))
        ids, weights, last_comma = [], [], -1

    for piece, tokens in zip(pieces, token_lists, strict=True):
        if is_break(piece):
            close()
            continue
        weight = piece[1]
        position = 0
        while position < len(tokens):
            token = tokens[position]
            if token == comma_id:
                last_comma = len(ids)
            elif backtrack and len(ids) == CHUNK_TOKENS and last_comma != -1 and CHUNK_TOKENS - last_comma <= backtrack:
                cut = last_comma + 1
                moved_ids, moved_weights = ids[cut:], weights[cut:]
                ids, weights = ids[:cut], weights[:cut]
                close()
                ids, weights = moved_ids, moved_weights
            if len(ids) == CHUNK_TOKENS:
                close()
            name = next((tuple(tokens[position:position + n]) for n in name_lengths
                         if tuple(tokens[position:position + n]) in embeddings), None)
            if name is None:
                ids.append(token)
                weights.append(weight)
                position += 1
                continue
            vectors = embeddings[name]
            if len(ids) + len(vectors) > CHUNK_TOKENS:  # an embedding is never split between chunks
                close()
            ids.extend(vectors)
            weights.extend([weight] * len(vectors))
            position += len(name)
    if ids or not done:
        close(final=True)
    return done


def encoder_ids(chunk: Chunk, *, bos: int, eos: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """The 77 ids an encoder reads for a chunk, and the 77 weights: BOS + the chunk + EOS, every position
    after the first EOS set to `pad`; BOS and the closing EOS weigh 1.

    Returns ids [77] int32 and weights [77] float32.
    """
    ids = np.array([bos, *chunk.ids, eos], dtype=np.int32)
    first_end = int(np.argmax(ids == eos))  # there is one: the last position
    ids[first_end + 1:] = pad
    return ids, np.array([1.0, *chunk.weights, 1.0], dtype=np.float32)


def prompt_chunks(
    text: str,
    tokenize: Callable[[list[str]], list[list[int]]],
    *,
    comma_id: int,
    eos: int,
    emphasis: str = "original",
    what: str = "prompt",
    embeddings: Mapping[tuple[int, ...], tuple[int, ...]] = MappingProxyType({}),
) -> list[Chunk]:
    """A prompt's chunks under an emphasis mode, checked by `check` (`what` names the prompt in its error)."""
    pieces = prompt_pieces(text, emphasis)
    result = chunks(pieces, tokenize, comma_id=comma_id, eos=eos, embeddings=embeddings)
    check(pieces, result, what=what)
    return result


def check(pieces: Sequence[tuple[str, float]], chunk_list: Sequence[Chunk], *, what: str = "prompt") -> None:
    """Refuses, with one sentence, a weight outside WEIGHT_RANGE (on text that has any) or more than
    MAX_CHUNKS chunks."""
    low, high = WEIGHT_RANGE
    for text, weight in pieces:
        if not is_break((text, weight)) and text.strip() and not low <= weight <= high:
            raise ValueError(
                f"the weight {weight:.4g} on {text.strip()!r} in the {what} is outside {low:g} to {high:g}"
            )
    if len(chunk_list) > MAX_CHUNKS:
        raise ValueError(
            f"the {what} is {token_count(chunk_list)} tokens in {len(chunk_list)} chunks of {CHUNK_TOKENS}, over "
            f"the limit of {MAX_CHUNKS} chunks ({MAX_CHUNKS * CHUNK_TOKENS} tokens)"
        )


def token_count(chunk_list: Sequence[Chunk]) -> int:
    """The prompt's length in tokens as webui counts it: 75 for each chunk that closed before the end."""
    return sum(chunk.used if chunk.final else CHUNK_TOKENS for chunk in chunk_list)


def length_text(chunk_list: Sequence[Chunk]) -> str:
    """A prompt's length for a UI, e.g. "84 tokens, 2 chunks" (webui shows the same as "84/150")."""
    tokens, count = token_count(chunk_list), len(chunk_list)
    return f"{tokens} token{'' if tokens == 1 else 's'}, {count} chunk{'' if count == 1 else 's'}"


def lora_tags(text: str) -> tuple[str, list[tuple[str, float]]]:
    """Takes webui's LoRA tags, `<lora:NAME:SCALE>` and `<lora:NAME>` (scale 1), out of a prompt.

    As webui does, every extra-network tag `<kind:...>` is removed from the text the encoders read, and
    the LoRAs are listed grouped by tag kind ("lora", or its other name "lyco") in the order each kind
    first appears. A name is used exactly as written. Tags of kinds webui does not know are dropped, as
    there; hypernetworks, which it does know, and its other LoRA arguments (te=, unet=, dyn=) are refused.

    Returns the text without tags and (name, scale) pairs.
    """
    found: dict[str, list[tuple[str, str]]] = {}  # kind: [(tag, its arguments)]

    def take(match: re.Match) -> str:
        found.setdefault(match.group(1), []).append((match.group(0), match.group(2)))
        return ""

    stripped = _EXTRA_NETWORK_TAG.sub(take, text)
    if "hypernet" in found:
        raise ValueError(f"hypernetwork tags like {found['hypernet'][0][0]} are not supported")
    return stripped, [_lora(*tag) for kind in found if kind in _LORA_KINDS for tag in found[kind]]


def without_loras(text: str, keep) -> tuple[str, list[str]]:
    """A prompt without its LoRA tags whose name is not in `keep`, and those names in order: what a demo
    draws when a pasted prompt names a LoRA it has not loaded (webui draws it too, and says "Failed to
    find networks"). Other tags stay as written."""
    removed = []

    def take(match: re.Match) -> str:
        name = match.group(2).split(":")[0]
        if match.group(1) in _LORA_KINDS and name not in keep:
            removed.append(name)
            return ""
        return match.group(0)

    return _EXTRA_NETWORK_TAG.sub(take, text), removed


def _lora(tag: str, arguments: str) -> tuple[str, float]:
    args = arguments.split(":")
    if len(args) > 2 or any("=" in arg for arg in args) or not args[0]:
        raise ValueError(f"the LoRA tag {tag} is not of the form <lora:NAME> or <lora:NAME:SCALE>")
    if len(args) == 1:
        return args[0], 1.0
    try:
        scale = float(args[1])
    except ValueError:
        scale = math.nan
    if not math.isfinite(scale):
        raise ValueError(f"the scale in the LoRA tag {tag} is not a number")
    return args[0], scale
