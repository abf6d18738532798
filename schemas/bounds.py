"""Bounds on a config's fields, declared in one place, with errors that name field and bound.

`check_bounds(config, window_s=above(0), share=in_range(0, 0.5))` raises
`ValueError("DriftConfig.window_s=-1 must be > 0")` for the first field out of its bound.
A one-sided bound refuses a value past it, so NaN (past no bound) passes; a range admits only
a value inside it, so NaN fails. `positive()` is the range (0, inf]: > 0, NaN refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bound:
    """What a value must be (`text`, read after "must be") and the test that refuses it."""

    text: str
    refuses: Callable[[float], bool]

    def because(self, reason: str) -> Bound:
        """The same bound, its text followed by why it is where it is."""
        return Bound(f"{self.text} ({reason})", self.refuses)

    def or_none(self) -> Bound:
        """The same bound on a field that may also be None (unset)."""
        refuses = self.refuses
        return Bound(self.text, lambda value: value is not None and refuses(value))


def at_least(low: float) -> Bound:
    """>= low: refuses a value below it."""
    return Bound(f">= {_number(low)}", lambda value: value < low)


def above(low: float) -> Bound:
    """> low: refuses a value at or below it."""
    return Bound(f"> {_number(low)}", lambda value: value <= low)


def in_range(low: float, high: float, *, low_open: bool = False,
             high_open: bool = False) -> Bound:
    """Between `low` and `high`, each end included unless `*_open`; admits only a value
    inside, so NaN is refused."""
    if high == math.inf and not high_open:
        text = f"> {_number(low)}" if low_open else f">= {_number(low)}"
    else:
        text = (f"in {'(' if low_open else '['}{_number(low)}, {_number(high)}"
                f"{')' if high_open else ']'}")

    def refuses(value: float) -> bool:
        above_low = low < value if low_open else low <= value
        below_high = value < high if high_open else value <= high
        return not (above_low and below_high)

    return Bound(text, refuses)


def positive() -> Bound:
    """> 0 with NaN refused (a range up to and including infinity)."""
    return in_range(0.0, math.inf, low_open=True)


def check_bounds(config: object, error: Callable[[str], Exception] = ValueError,
                 **bounds: Bound) -> None:
    """Raise `error("Config.field=value must be BOUND")` for the first field of `config` whose
    value its bound refuses."""
    for name, bound in bounds.items():
        value = getattr(config, name)
        if bound.refuses(value):
            raise error(f"{type(config).__name__}.{name}={value} must be {bound.text}")


def _number(value: float) -> str:
    """An integer as written, a float in its shortest form (3594.0 -> 3594)."""
    return str(value) if isinstance(value, int) else f"{value:g}"
