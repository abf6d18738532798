"""The throughput surface: step latency x acceptance -> goodput, each a fitted estimator."""

from fitter.surface.acceptance import AcceptanceModel
from fitter.surface.composition import CompositionModel
from fitter.surface.fit import SurfaceFit, fit_surface
from fitter.surface.goodput import GoodputSurface, evaluate_surface
from fitter.surface.latency import LATENCY_COLUMNS, StepLatencyModel, decode_matrix
from fitter.surface.share import DraftShareModel
from fitter.surface.spread import RequestSpreadTest
from fitter.surface.validation import NotFittedError

__all__ = [
    "LATENCY_COLUMNS",
    "AcceptanceModel",
    "CompositionModel",
    "DraftShareModel",
    "GoodputSurface",
    "NotFittedError",
    "RequestSpreadTest",
    "StepLatencyModel",
    "SurfaceFit",
    "decode_matrix",
    "evaluate_surface",
    "fit_surface",
]
