"""Small validators for the fitter's estimators (our own, not scikit-learn's private helpers).

Estimators validate in `fit` and refuse to predict before it; these helpers keep the error
messages uniform so a caller can match on them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from sklearn.exceptions import NotFittedError

__all__ = ["NotFittedError", "check_is_fitted", "check_matrix", "check_param", "check_vector"]


def check_is_fitted(estimator: Any, attribute: str) -> None:
    """Raise `NotFittedError` unless `fit` has set `attribute` (a name ending in `_`)."""
    if not hasattr(estimator, attribute):
        raise NotFittedError(
            f"this {type(estimator).__name__} is not fitted yet; call fit before using it"
        )


def check_matrix(X: ArrayLike, *, n_columns: int, name: str = "X",
                 allow_nan: bool = False) -> NDArray[np.float64]:
    """A 2-D float copy of `X` with `n_columns` columns and at least one row."""
    array = np.asarray(X, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] != n_columns:
        raise ValueError(f"{name} must have shape (n, {n_columns}), got {array.shape}")
    if array.shape[0] == 0:
        raise ValueError(f"{name} has no rows")
    finite = np.isfinite(array) | (np.isnan(array) if allow_nan else False)
    if not finite.all():
        raise ValueError(f"{name} contains non-finite values")
    return array


def check_vector(values: ArrayLike | None, n_rows: int, *, name: str,
                 default: float | None = None, positive: bool = False) -> NDArray[np.float64]:
    """A 1-D float copy of length `n_rows`; `None` becomes `default` everywhere."""
    if values is None:
        if default is None:
            raise ValueError(f"{name} is required")
        return np.full(n_rows, default, dtype=np.float64)
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if array.shape[0] != n_rows:
        raise ValueError(f"{name} has {array.shape[0]} values, expected {n_rows}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} contains non-finite values")
    if positive and (array <= 0).any():
        raise ValueError(f"{name} must be > 0 everywhere")
    if not positive and (array < 0).any():
        raise ValueError(f"{name} must be >= 0 everywhere")
    return array


def check_param(name: str, value: float | int | None, *, low: float, high: float = np.inf,
                inclusive_low: bool = True, allow_none: bool = False) -> None:
    """Hyper-parameter range check with the value quoted in the message."""
    if value is None:
        if allow_none:
            return
        raise ValueError(f"{name} must be set")
    ok_low = value >= low if inclusive_low else value > low
    if not (ok_low and value <= high) or not np.isfinite(float(value)):
        bound = "[" if inclusive_low else "("
        raise ValueError(f"{name}={value!r} is outside {bound}{low}, {high}]")
