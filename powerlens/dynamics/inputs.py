"""Validation of initial tokens at the API boundary (host-side NumPy): clear errors,
never a silent NaN inside the scan."""
from __future__ import annotations

from typing import Optional

import numpy as np


def check_tokens(x0, d: Optional[int] = None, name: str = "x0") -> np.ndarray:
    """Validate initial tokens "float[n d]" or "float[B n d]": finite, non-zero rows, right width."""
    x = np.asarray(x0)
    if x.ndim not in (2, 3):
        raise ValueError(f"{name} must have shape (n, d) or (B, n, d), got {x.shape}")
    if x.shape[-2] == 0:
        raise ValueError(f"{name} has no tokens (shape {x.shape})")
    if d is not None and x.shape[-1] != d:
        raise ValueError(f"{name} has width {x.shape[-1]} but the system has d={d}")
    # the squared norms in one pass, with no temporary of x's size: non-finite wherever x is
    # (or where a finite row overflows: only then is x itself checked), 0 exactly where
    # np.linalg.norm is. Measured on 32 x 128 x 384 float32 tokens: 2.4 ms with np.isfinite(x)
    # and np.linalg.norm, ~0.5 ms this way, of a ~300 ms MiniLM run_states call.
    sq = np.einsum("...i,...i->...", x, x)
    if not np.all(np.isfinite(sq)) and not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contains non-finite values (NaN or inf)")
    if np.any(sq == 0):
        bad = np.argwhere(sq == 0)[0].tolist()
        raise ValueError(f"{name} has a zero-norm token at index {bad}")
    return x


def check_batch(X0, valid, d: int):
    """Validated prompts X0 "float[B n d]" (a single "float[n d]" prompt gets B = 1) and
    mask valid "bool[B n]"."""
    X0 = check_tokens(X0, d)
    if X0.ndim == 2:
        X0 = X0[None]
    if valid is None:
        valid = np.ones(X0.shape[:2], bool)
    valid = np.asarray(valid, bool)
    if valid.ndim == 1:
        valid = valid[None]
    if valid.shape != X0.shape[:2]:
        raise ValueError(f"valid mask has shape {valid.shape}, expected {X0.shape[:2]}")
    if not valid.any(axis=1).all():
        raise ValueError("a prompt has no valid token (empty prompt)")
    return X0, valid
