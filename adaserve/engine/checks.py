"""Number checks the configs and the profiler's pure logic share: numpy scalars count, bools do not.

``True`` is an ``int`` to Python, and a config that took ``budget=True`` as 1 would hide a caller's bug.
"""

from __future__ import annotations

import numpy as np


def is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def is_real(x: object) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool | np.bool_)
