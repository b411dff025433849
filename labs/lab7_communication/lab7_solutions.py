"""Reference solutions of Lab 7's exercises (used when ``LABS_SOLUTIONS=1``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """α (seconds) and β (seconds per byte) of the line t = α + β·bytes through the
    points (``nbytes[i]``, ``seconds[i]``), by ordinary least squares: the α and β that
    make the sum of (α + β·bytes − t)² smallest."""
    x = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    design = np.stack([np.ones_like(x), x], axis=1)  # columns: 1 (for α), bytes (for β)
    (alpha, beta), *_ = np.linalg.lstsq(design, t, rcond=None)
    return float(alpha), float(beta)
