"""Number checks the configs and the profiler's pure logic share: numpy scalars count, bools do not.

``True`` is an ``int`` to Python, and a config that took ``budget=True`` as 1 would hide a caller's bug.
"""

from __future__ import annotations

import math

import numpy as np


def is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def is_real(x: object) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool | np.bool_)


def at_least(owner: str, name: str, value: object, low: int) -> None:
    if not is_int(value) or value < low:  # type: ignore[operator]
        raise ValueError(f"{owner}.{name} must be an int >= {low}, got {value!r}")


def positive(owner: str, name: str, value: object) -> None:
    if not is_real(value) or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type, operator]
        raise ValueError(f"{owner}.{name} must be a finite number > 0, got {value!r}")
