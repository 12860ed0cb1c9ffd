"""Values as callers send them, checked: Python numbers, the command line's text, a browser's JSON.
Each refusal is one sentence that names the value and what is allowed."""

import math
from collections.abc import Sequence

import numpy as np


def integer(value, label: str, low: int, high: int) -> int:
    """`value` as an int in [low, high]; integral floats and numeric text (as JSON clients send) pass.

    Raises:
      ValueError: naming `label` and the range.
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not number.is_integer() or not low <= number <= high:
        raise ValueError(f"{label} must be an integer from {low} to {high}, got {value!r}")
    return int(number)


def number(value, label: str, low: float, high: float) -> float:
    """`value` as a finite float in [low, high]; numeric text passes. Raises ValueError naming `label`."""
    try:
        result = float(value)
    except (TypeError, ValueError):
        result = float("nan")
    if isinstance(value, bool) or not (math.isfinite(result) and low <= result <= high):
        raise ValueError(f"{label} must be a number from {low:g} to {high:g}, got {value!r}")
    return result


def fraction(value, label: str) -> float:
    """`value` as a float above 0 and below 1 (where a schedule is split). Raises ValueError."""
    if not (isinstance(value, float | int) and not isinstance(value, bool) and 0 < value < 1):
        raise ValueError(f"{label} must be a fraction above 0 and below 1, got {value!r}")
    return float(value)


def flag(value, label: str) -> bool:
    """`value`, which must be True or False (not text such as "false", which is truthy). Raises ValueError."""
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{label} must be true or false, got {value!r}")
    return bool(value)


def choice(value, label: str, choices: Sequence[str]) -> str:
    """`value`, which must be one of `choices`. Raises ValueError listing them."""
    if value not in choices:
        raise ValueError(f"{label} must be one of {', '.join(choices)}, got {value!r}")
    return value


def text(value, label: str, max_characters: int) -> str:
    """`value`, which must be a string of at most `max_characters`. Raises ValueError."""
    if not isinstance(value, str):
        raise ValueError(f"{label} must be text, got {type(value).__name__} {value!r:.80}")
    if len(value) > max_characters:
        raise ValueError(
            f"{label} is {len(value)} characters long; at most {max_characters} are taken "
            "(a prompt may have 8 chunks of 75 tokens)"
        )
    return value
