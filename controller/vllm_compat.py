"""vLLM's own table validator, when vLLM is installed.

TableTune validates with its stricter rules everywhere; engines additionally run vLLM's
function, because an invalid table passes vLLM's config check and then kills the scheduler.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from schemas import DraftTable, TableError

_Validator = Callable[[object], list[tuple[int, int, int]]]
_MODULE = "vllm.v1.spec_decode.dynamic.utils"
_FUNCTION = "validate_and_normalize_dynamic_sd_schedule"


@functools.cache
def vllm_validator() -> _Validator | None:
    """vLLM's function, or None without vLLM. Outside an engine it is loaded from its own
    file: the module imports nothing, while `import vllm` costs a service 8-10 s of start-up."""
    loaded = sys.modules.get(_MODULE)
    if loaded is not None:
        return getattr(loaded, _FUNCTION)
    package = importlib.util.find_spec("vllm")  # finds the package without running it
    if package is None or not package.submodule_search_locations:
        return None
    for root in package.submodule_search_locations:
        path = Path(root, *_MODULE.split(".")[1:]).with_suffix(".py")
        spec = importlib.util.spec_from_file_location(f"_tabletune_{_FUNCTION}", path)
        if path.is_file() and spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            validator = getattr(module, _FUNCTION, None)
            if validator is not None:
                return validator
    return _imported_validator()  # a vLLM laid out otherwise: the slow, ordinary way


def _imported_validator() -> _Validator | None:
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
