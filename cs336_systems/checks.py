"""Argument checks that refuse bad input at the call, naming the argument and what it was given.

    check_positive_int(batch_size=batch_size, seq_len=seq_len)
    check_choice("strategy", strategy, STRATEGIES)

Keyword arguments carry the names the messages use, so a caller checks several values in one line.
The predicates beneath them (is_number, is_finite and its signed forms) serve code that judges values without
raising, such as a benchmark row's measurements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def is_number(value: Any) -> bool:
    """An int or a float; not a bool, which Python counts as an int."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    """A number that is neither NaN nor infinite (compared, not converted, so that any int is one)."""
    return is_number(value) and -math.inf < value < math.inf


def is_positive_finite(value: Any) -> bool:
    """A finite number above zero."""
    return is_finite(value) and value > 0


def is_non_negative_finite(value: Any) -> bool:
    """A finite number of zero or above."""
    return is_finite(value) and value >= 0


def check_positive_int(**values: int) -> None:
    """Each value an int (not a bool, which Python counts as one) of at least 1."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def check_positive(**values: float) -> None:
    """Each value above zero (NaN is not)."""
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")


def check_positive_finite(**values: float) -> None:
    """Each value a number (an int or a float, not a bool), above zero and finite."""
    _check_numbers(values, is_positive_finite, "positive and finite")


def check_non_negative_finite(**values: float) -> None:
    """Each value a number (an int or a float, not a bool), zero or above and finite."""
    _check_numbers(values, is_non_negative_finite, ">= 0 and finite")


def _check_numbers(values: dict[str, Any], good: Callable[[Any], bool], wanted: str) -> None:
    """A TypeError for a value that is no number, a ValueError for one that is not `good` ("must be `wanted`")."""
    for name, value in values.items():
        if not is_number(value):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if not good(value):
            raise ValueError(f"{name} must be {wanted}, got {value}")


def check_non_negative(**values: float) -> None:
    """Each value zero or above (NaN is not)."""
    for name, value in values.items():
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def repeated(values: Sequence[Any]) -> list[Any]:
    """The values given more than once, each named once, sorted: a list option's values that would run twice."""
    return sorted({value for value in values if values.count(value) > 1})


def check_choice(name: str, value: str, choices: Iterable[str]) -> None:
    """`value` one of `choices`; the message lists them."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")
