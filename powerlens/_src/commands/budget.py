"""The memory a command will need, estimated from the shapes before anything is allocated.

    estimate = run_estimate(**shapes_of(layers), steps=T, batch=B, tokens=n, save_states=...)
    check(estimate)       MemoryBudgetError (a ValueError: exit 2, one line) when it exceeds
                          available_bytes(), naming the estimate and its largest parts

The estimate itself (its parts, the memory available) is :mod:`powerlens._src.analysis.budget`,
which the sweeps share; this module is the commands' view of it.
"""
from __future__ import annotations

from ..analysis import budget as _budget
from ..analysis.budget import (ROW_BYTES, Estimate, MemoryBudgetError, available_bytes, format_bytes,  # noqa: F401
                               run_estimate, shapes_of, spectra_estimate)


def check(estimate: Estimate) -> Estimate:
    """Refuse (MemoryBudgetError, naming the estimate) when it exceeds :func:`available_bytes`
    (looked up here, so that a test may replace it)."""
    return _budget.check(estimate, available_bytes())
