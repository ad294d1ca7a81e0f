"""Option checks shared by strategies and schedules: one helper per kind of option, so every option error reads
the same way and names its owner. The helpers and their shared rules: docs/writing-a-strategy.md, "Checking
options".

    >>> check_int(3, "window", "ssm", low=2)
    3
    >>> check_int(0, "window", "ssm", low=2)
    Traceback (most recent call last):
        ...
    ValueError: ssm: window must be an int >= 2, got 0
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from .context import check_ratio
from .strategy import SUBLAYERS

__all__ = ["check_bool", "check_choice", "check_int", "check_number", "check_ratio_option", "check_sublayers"]


def _fail(what: str, name: str, rule: str, value: Any, note: str = "", optional: bool = False) -> ValueError:
    """The error of every helper: ``"{what}: {name} must be {rule}[ or None][ ({note})], got {value!r}"``."""
    none = " or None" if optional else ""
    why = f" ({note})" if note else ""
    return ValueError(f"{what}: {name} must be {rule}{none}{why}, got {value!r}")


def _bounds(low: float | None, high: float | None, low_open: bool = False) -> str:
    """``" >= 1"``, ``" > 0"``, ``" <= 5"``, ``" in [0, 1]"``, ``" in (0, 1]"`` or ``""`` (numbers as ``:g``)."""
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}]"
    if low is not None:
        return f" {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f" <= {high:g}"
    return ""


def check_int(value: Any, name: str, what: str, *, low: int | None = None, high: int | None = None,
              optional: bool = False, note: str = "") -> int | None:
    """Raises unless ``value`` is an int with ``low <= value <= high`` (either bound may be ``None``: none).

    Args:
        value: the option's value; a ``bool`` is not an int here, nor is a float such as ``2.0``.
        name: the option's name, for the message.
        what: the strategy's or schedule's name, prefixed to the message.
        low, high: inclusive bounds.
        optional: also accept ``None``.
        note: an explanation added to the message in parentheses.

    Returns:
        ``value`` unchanged.

    Example:
        >>> check_int(None, "group_size", "toma", low=1, optional=True) is None
        True
    """
    if value is None and optional:
        return None
    if (isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low)
            or (high is not None and value > high)):
        raise _fail(what, name, "an int" + _bounds(low, high), value, note, optional)
    return value


def check_number(value: Any, name: str, what: str, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, optional: bool = False, note: str = "") -> float | None:
    """Raises unless ``value`` is a finite int or float with ``low <= value <= high``.

    Args:
        value: the option's value; ``bool``, NaN and +-inf are rejected.
        name: the option's name, for the message.
        what: the strategy's or schedule's name, prefixed to the message.
        low, high: inclusive bounds (``None``: none).
        low_open: make the lower bound exclusive (``low < value``).
        optional: also accept ``None``.
        note: an explanation added to the message in parentheses.

    Returns:
        ``value`` as a float (``None`` when it is ``None`` and ``optional``).

    Example:
        >>> check_number(1e-3, "temperature", "facility_location", low=0, low_open=True)
        0.001
    """
    if value is None and optional:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (low is not None and (value <= low if low_open else value < low))
            or (high is not None and value > high)):
        raise _fail(what, name, "a finite number" + _bounds(low, high, low_open), value, note, optional)
    return float(value)


def check_choice(value: Any, name: str, what: str, choices: tuple[Any, ...], *, note: str = "") -> Any:
    """Raises unless ``value`` is one of ``choices`` (compared with ``==``, as ``in`` does).

    Args:
        value: the option's value.
        name: the option's name, for the message.
        what: the strategy's or schedule's name, prefixed to the message.
        choices: the allowed values, listed in the message.
        note: an explanation added to the message in parentheses.

    Returns:
        ``value`` unchanged.
    """
    if value not in choices:
        raise _fail(what, name, f"one of {tuple(choices)}", value, note)
    return value


def check_bool(value: Any, name: str, what: str, *, note: str = "") -> bool:
    """Raises unless ``value`` is ``True`` or ``False`` (``0``, ``1`` and strings such as ``"yes"`` are not).

    Args:
        value: the option's value.
        name: the option's name, for the message.
        what: the strategy's or schedule's name, prefixed to the message.
        note: an explanation added to the message in parentheses.

    Returns:
        ``value`` unchanged.
    """
    if not isinstance(value, bool):
        raise _fail(what, name, "True or False", value, note)
    return value


def check_sublayers(value: Any, name: str, what: str, *, note: str = "") -> tuple[str, ...]:
    """Validates a non-empty collection of sublayer names from :data:`tomerge.strategy.SUBLAYERS`.

    Args:
        value: a tuple, list or set of names from ``("attn", "crossattn", "mlp")`` (a string is not one).
        name: the option's name, for the message.
        what: the strategy's or schedule's name, prefixed to the message.
        note: an explanation added to the message in parentheses.

    Returns:
        The distinct names as a sorted tuple (hashable, stable in logs).

    Raises:
        ValueError: a string, a non-iterable, an empty collection or an unknown name.
        TypeError: entries that cannot be put in a set or sorted (unhashable or mixed types), from ``set`` or
            ``sorted`` itself.
    """
    rule = f"a non-empty tuple of sublayer names from {SUBLAYERS}"
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise _fail(what, name, rule, value, note)
    names = tuple(sorted(set(value)))
    if not names or any(n not in SUBLAYERS for n in names):
        raise _fail(what, name, rule, value, note)
    return names


def check_ratio_option(value: Any, what: str) -> float:
    """:func:`tomerge.context.check_ratio` (a number in ``[0, 1)``) with ``what`` prefixed to its message.

    Example:
        >>> check_ratio_option(1.0, "toma")
        Traceback (most recent call last):
            ...
        ValueError: toma: ratio must be a number in [0, 1), got 1.0
    """
    try:
        return check_ratio(value)
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None
