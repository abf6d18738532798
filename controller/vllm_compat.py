"""vLLM's own table validator, when vLLM is importable.

TableTune validates with its stricter rules everywhere; engines additionally run vLLM's
function, because an invalid table passes vLLM's config check and then kills the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable

from schemas import DraftTable, TableError

_Validator = Callable[[object], list[tuple[int, int, int]]]


def vllm_validator() -> _Validator | None:
    try:
        from vllm.v1.spec_decode.dynamic.utils import (
            validate_and_normalize_dynamic_sd_schedule,
        )
    except ImportError:
        return None
    return validate_and_normalize_dynamic_sd_schedule


def check_with_vllm(table: DraftTable) -> bool:
    """Raise TableError if vLLM rejects the table; False when vLLM is not installed."""
    validator = vllm_validator()
    if validator is None:
        return False
    try:
        validator(table.to_vllm())
    except ValueError as exc:
        raise TableError(f"vLLM rejects the table: {exc}") from None
    return True
