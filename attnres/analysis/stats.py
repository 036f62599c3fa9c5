"""The one statistical verdict of the project: is a loss gap bigger than the seed noise? A two-sided 95% t interval.

Why t and not "two standard errors": the seed spread is itself estimated from a handful of runs (2 or 3 seeds a
setting here), and the t quantile accounts for that; with 1, 2 or 6 degrees of freedom it is 12.7, 4.3 or 2.4
standard errors, not 2. A gap whose interval spans 0 is within seed noise. `attnres compare` and the experiments
(experiments/study.py) both judge with `t_interval` and `verdict`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# t_{0.975, dof} for dof 1..30 (scipy.stats.t.ppf(0.975, dof), to 3 decimals); beyond, the normal quantile
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = 1.960


def t975(dof: int) -> float:
    """The 0.975 quantile of Student's t with `dof` degrees of freedom (the normal one past 30, within 4%)."""
    if dof < 1:
        raise ValueError(f"dof: expected at least 1 degree of freedom, got {dof}")
    return _T975[dof - 1] if dof <= len(_T975) else _Z975


def t_interval(estimate: float, standard_error: float, dof: int) -> tuple[float, float]:
    """The two-sided 95% t interval around `estimate`."""
    half = t975(dof) * standard_error
    return estimate - half, estimate + half


def verdict(interval: tuple[float, float] | None) -> str:
    """What a gap's interval says: "below" (0 above it), "above" (0 below it), "noise" (it spans 0), or "unknown"
    (no interval: one seed and no spread measured elsewhere)."""
    if interval is None:
        return "unknown"
    low, high = interval
    if high < 0:
        return "below"
    if low > 0:
        return "above"
    return "noise"


def paired_gaps(gaps: Sequence[float]) -> dict:
    """Mean, sample standard deviation and 95% t interval of per-seed paired gaps (None where undefined)."""
    n = len(gaps)
    mean = statistics.mean(gaps) if gaps else None
    std = statistics.stdev(gaps) if n > 1 else None
    ci = None if std is None else list(t_interval(mean, std / math.sqrt(n), n - 1))
    return {"n": n, "mean": mean, "std": std, "ci95": ci, "gaps": list(gaps)}


def seeds_to_resolve(std: float, half_width: float, most: int = 1000) -> int | None:
    """The fewest seeds whose 95% t interval is at most +-`half_width` wide, for per-seed gaps spread by `std`
    (None past `most`)."""
    for n in range(2, most + 1):
        if t975(n - 1) * std / math.sqrt(n) <= half_width:
            return n
    return None
