"""What every `tabletune` command line shares: its exit statuses, and argparse types for
every numeric flag, so that a value out of bounds is a usage error (EXIT_USAGE) that names
the flag and the bound, before any work starts.

`--window-records -5`, `--until-idle -1` or `twin run --duration -5` were accepted and ran:
some failed later with a traceback, some printed nonsense (`table convert --max-batch -3`
printed `[]`) and exited 0. argparse puts the flag in front of the message:
`argument --window-records: must be an integer >= 1, got '-5'`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from schemas import EnvelopeError, TableKey

EXIT_FAILED = 1
"""The command ran and failed: a file, a table, a dataset, the broker (the error says which)."""
EXIT_USAGE = 2
"""The command line is wrong: a flag or argument, named in the error with what it must be."""


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (no upper bound when `high` is None)."""
    bound = f">= {low}" if high is None else f"in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer {bound}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return value

    return parse


def number(low: float, high: float = math.inf, *, low_open: bool = False,
           high_open: bool = False) -> Callable[[str], float]:
    """A finite number between `low` and `high`, each bound included unless `*_open`."""
    if high == math.inf:
        bound = f"> {low:g}" if low_open else f">= {low:g}"
    else:
        bound = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}") from None
        below = value <= low if low_open else value < low
        above = value >= high if high_open else value > high
        if not math.isfinite(value) or below or above:
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}")
        return value

    return parse


def integers(low: int) -> Callable[[str], tuple[int, ...]]:
    """Comma-separated integers, each >= `low` (`--k-values 0,1,3`)."""
    one = integer(low)

    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(one(part) for part in text.split(","))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"must be integers >= {low} separated by commas, got {text!r}") from None

    return parse


def table_key(text: str) -> str:
    """A `model|drafter|hardware` key, checked here so that a malformed one is a usage
    error like any other argument; the commands parse it again into a TableKey."""
    try:
        TableKey.parse(text)
    except EnvelopeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


POSITIVE = number(0.0, low_open=True)
"""Seconds, rates and sizes that must be > 0."""
NON_NEGATIVE = number(0.0)
"""Seconds that may be 0 (nothing to wait for, nothing to look back on)."""
SHARE = number(0.0, 1.0)
"""A share or probability, 0 to 1."""
PORT = integer(1, 65535)
"""A TCP port."""
