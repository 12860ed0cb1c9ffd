"""Prompt editing and alternation, read as AUTOMATIC1111's webui (1.10, modules/prompt_parser.py) reads them.

A prompt becomes its schedule: the texts the encoders read, each with the last sampling step it serves.

- `[from:to:when]` reads "from" up to step `when`, then "to"; `[to:when]` reads nothing, then "to";
  `[from::when]` reads "from", then nothing. `when` with a "." in it (`0.5`, `1.`, `.25`) is a fraction of
  the steps, else a step number; either is truncated to a whole step and capped at the step count.
- `[a|b|c]` reads "a" at step 1, "b" at step 2, "c" at step 3, "a" again at step 4...; an alternative may be
  empty (`[fe|]male`).
- Both nest, inside each other and inside weight brackets, and the weight brackets of the chosen texts
  stay in them for `sdxl.prompts.syntax.parse_weights`.
- A hires pass counts its own steps: a fraction there is of the hires steps after subtracting 1 (`1.5`
  is half-way through the second pass) and a step number counts on from the first pass's steps.
- A prompt that does not parse as webui's grammar (a `|` outside brackets, a lone `\\` at the end) is
  read as plain text, whole, as webui reads it. Brackets that form no edit, alternation or weight are
  text: at the top level a `[`, `]`, `(`, `)` or `:` that closes or opens nothing stays as written.

The step a denoiser call reads is webui's `CFGDenoiser.step`: it counts model evaluations from 0, and
the schedule entry it takes is the first whose last step is at least that count (`conditioning_index`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# webui's grammar's terminals: text (anything but brackets, colons and bars; a backslash escapes the next
# character, which the weight parser reads later) and lark's SIGNED_NUMBER.
_PLAIN = re.compile(r"(?:[^\\\[\]():|]|\\.)+")
_WHEN = re.compile(r"\s*([+-]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)\s*\]")
_TOP_LEVEL_LITERALS = "[]():"  # characters the grammar lets stand alone outside brackets


@dataclass(frozen=True)
class _Edit:
    """`[before:after:when]`; `before` is None in the `[after:when]` form."""

    before: tuple | None
    after: tuple
    when: str  # the number as written: a "." in it makes it a fraction


@dataclass(frozen=True)
class _Alternation:
    options: tuple  # one sequence per alternative


class _NoParse(Exception):
    """The prompt is not in webui's grammar: it is read as plain text."""


class _Parser:
    """A recursive-descent reader of webui's grammar. A sequence is a tuple of strings, `_Edit`s and
    `_Alternation`s; weight brackets stay text, as webui's schedule parser gives them back."""

    def __init__(self, text: str):
        self.text = text

    def char(self, pos: int) -> str:
        return self.text[pos] if pos < len(self.text) else ""

    def top(self) -> tuple:
        """The whole prompt: sequences, and at this level alone, lone brackets and colons as text."""
        items, pos = [], 0
        while pos < len(self.text):
            inner, pos = self.sequence(pos)
            items.extend(inner)
            c = self.char(pos)  # where `sequence` stopped: a bracket that closes nothing, or no text at all
            if c and c in _TOP_LEVEL_LITERALS:
                items.append(c)
                pos += 1
            elif c:  # a "|" outside brackets, or a backslash with nothing it escapes
                raise _NoParse
        return tuple(items)

    def sequence(self, pos: int) -> tuple[tuple, int]:
        """Text and complete bracket constructs from `pos` to the first character that is neither."""
        items = []
        while True:
            plain = _PLAIN.match(self.text, pos)
            if plain:
                items.append(plain.group(0))
                pos = plain.end()
                continue
            found = self.bracket(pos) if self.char(pos) and self.char(pos) in "([" else None
            if found is None:
                return tuple(items), pos
            items.append(found[0])
            pos = found[1]

    def bracket(self, pos: int):
        """The construct opening at `pos` and where it ends, or None where none closes there."""
        opening = self.text[pos]
        first, pos = self.sequence(pos + 1)
        c = self.char(pos)
        if opening == "(":
            if c == ")":
                return ("(", *first, ")"), pos + 1
            if c == ":":
                second, end = self.sequence(pos + 1)
                if self.char(end) == ")":
                    return ("(", *first, ":", *second, ")"), end + 1
            return None
        if c == "]":
            return ("[", *first, "]"), pos + 1
        if c == "|":
            options = [first]
            while self.char(pos) == "|":
                option, pos = self.sequence(pos + 1)
                options.append(option)
            return (_Alternation(tuple(options)), pos + 1) if self.char(pos) == "]" else None
        if c == ":":
            when = _WHEN.match(self.text, pos + 1)
            if when:
                return _Edit(None, first, when.group(1)), when.end()
            second, end = self.sequence(pos + 1)
            when = _WHEN.match(self.text, end + 1) if self.char(end) == ":" else None
            if when:
                return _Edit(first, second, when.group(1)), when.end()
        return None


def _flatten(items) -> tuple:
    """The nested tuples of a construct as one sequence."""
    out = []
    for item in items:
        out.extend(_flatten(item) if isinstance(item, tuple) else [item])
    return tuple(out)


def _switch_step(when: str, steps: int, hires_steps: int | None) -> int:
    """The last step an edit reads its first text, as webui computes it."""
    value = float(when)
    if hires_steps is not None:  # a hires pass: its own steps, counted on from the first pass's
        value = (value - 1) * hires_steps if "." in when else value - steps
        steps = hires_steps
    elif "." in when:
        value *= steps
    if abs(value) > 1e9:  # webui fails on an infinite step (int(inf)); a huge one is as good as no switch
        return steps if value > 0 else -1
    return min(steps, int(value))


def prompt_schedule(text: str, steps: int, hires_steps: int | None = None) -> list[tuple[int, str]]:
    """A prompt's schedule, as webui's `get_learned_conditioning_prompt_schedules`: (last step, text) pairs
    in order of their steps, the last at the pass's step count.

    Args:
      text: the prompt, with webui's editing and alternation syntax.
      steps: the first pass's sampling steps.
      hires_steps: a hires pass's steps, where the schedule is that pass's; None for the first pass.
    """
    try:
        items = _flatten(_Parser(text).top())
    except (_NoParse, RecursionError):  # brackets nested past Python's stack are read as text
        items = None
    total = steps if hires_steps is None else hires_steps
    if items is None:
        return [(total, text)]

    switch = {}  # when, as written: its step
    alternates = False

    def collect(sequence):
        nonlocal alternates
        for item in sequence:
            if isinstance(item, _Edit):
                switch[item.when] = _switch_step(item.when, steps, hires_steps)
                for part in (item.before or (), item.after):
                    collect(_flatten(part))
            elif isinstance(item, _Alternation):
                alternates = True
                for option in item.options:
                    collect(_flatten(option))

    collect(items)
    ends = {total, *(step for step in switch.values() if step >= 1)}
    if alternates:
        ends.update(range(1, total + 1))

    def render(sequence, step: int) -> str:
        out = []
        for item in sequence:
            if isinstance(item, _Edit):
                chosen = item.before or () if step <= switch[item.when] else item.after
                out.append(render(_flatten(chosen), step))
            elif isinstance(item, _Alternation):
                out.append(render(_flatten(item.options[(step - 1) % len(item.options)]), step))
            else:
                out.append(item)
        return "".join(out)

    return [(end, render(items, end)) for end in sorted(ends)]


def conditioning_index(schedule: list[tuple[int, str]], step: int) -> int:
    """Which entry of a schedule a denoiser call at `step` (webui's `CFGDenoiser.step`, model evaluations
    counted from 0) reads: the first whose last step is at least `step`, else the first."""
    return next((i for i, (end, _) in enumerate(schedule) if step <= end), 0)
