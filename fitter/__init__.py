"""The fitter: telemetry -> throughput surface -> draft table envelope.

Exports resolve lazily (PEP 562): `import fitter.ingest` must not pay for scikit-learn and
scipy, which only the surface fit needs.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS: dict[str, str] = {
    "AcceptanceModel": "fitter.surface.acceptance",
    "GoodputSurface": "fitter.surface.goodput",
    "NotFittedError": "fitter.surface.validation",
    "StepLatencyModel": "fitter.surface.latency",
    "SurfaceFit": "fitter.surface.fit",
    "fit_surface": "fitter.surface.fit",
    "choose_k": "fitter.derive",
    "derive_envelope": "fitter.derive",
    "exploration_plan": "fitter.derive",
    "fit_table": "fitter.derive",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fitter' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
